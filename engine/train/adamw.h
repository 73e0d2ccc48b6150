// AdamW over the trainable parameters of a ParameterSet, with global gradient-norm clipping (as
// torch.nn.utils.clip_grad_norm_ followed by torch.optim.AdamW). m and v are laid out as the
// gradients are (ParameterInfo::grad_offset).
//
// Where the set offloads (ParameterSet::set_offload), m and v live in the state files adamw_m.f32
// and adamw_v.f32 of its folder, and the step streams them, with the offloaded masters, through
// RAM in chunks: a worker thread reads the next chunk and writes the last one while the update
// runs on the current one. Chunks split a parameter at multiples of 16 elements, where the
// update's runs of 16 lanes split it anyway, so every element takes the same arithmetic as in
// RAM: the weights, m and v are bitwise those of the run without offloading.
#pragma once

#include <memory>
#include <utility>
#include <vector>

#include "engine/train/parameters.h"

namespace cputrain {

struct AdamWConfig {
  float beta1 = 0.9f;
  float beta2 = 0.95f;
  float eps = 1e-8f;
  float weight_decay = 0.1f;  // on parameters with decay set (matrices)
  float grad_clip = 1.0f;     // max global L2 norm; 0 disables clipping
  // Offloaded: elements of master, m and v moved through RAM at a time (rounded down to a
  // multiple of 16; at most the largest parameter's count).
  int64_t offload_chunk = int64_t{1} << 21;
};

class IoQueue;
class Communicator;

class AdamW {
 public:
  // Over the ranks of `comm` (more than one), the state is sharded (ZeRO-1): this rank keeps m
  // and v of its shard of the gradients' layout alone (shard_bounds), and step() updates the
  // masters of that shard from gradients summed there (GradientReducer), then gathers every
  // rank's updated masters, so that each rank ends the step with the bf16 copies of all and the
  // FP32 masters of all but those the set holds for its shard alone (ParameterSet::set_shard).
  // The gradient norm is the whole one, summed over the shards.
  AdamW(const ParameterSet& params, const AdamWConfig& config, const Communicator* comm = nullptr);
  ~AdamW();
  AdamW(const AdamW&) = delete;
  AdamW& operator=(const AdamW&) = delete;
  // One update at learning rate lr from the accumulated gradients; returns the global
  // gradient norm before clipping. Gradients are left as they are.
  float step(float lr);
  // The same with the global gradient norm already computed (gradient_norm).
  float step(float lr, double norm);
  int64_t step_count() const { return step_; }
  // m and v in RAM (undefined where offloaded; this rank's shard where sharded).
  const Tensor& m() const { return m_; }
  const Tensor& v() const { return v_; }
  // n elements of m (second false) or v (second true) from `offset`, wherever they are.
  // Sharded, each is a collective every rank calls alike: read_state gathers them on rank 0
  // (`dst` is unused elsewhere), and write_state gives each rank its part of rank 0's `src`
  // (which it overwrites on the others).
  void read_state(bool second, int64_t offset, int64_t n, float* dst) const;
  void write_state(bool second, int64_t offset, int64_t n, float* src);
  // Sharded: the bounds of every rank's shard (shard_bounds); empty otherwise.
  const std::vector<int64_t>& shards() const { return shards_; }
  // The global L2 norm of the gradients: of the whole buffer, or sharded of each rank's shard
  // (where the summed gradients are) added over the ranks.
  double gradient_norm() const;
  // Sharded: the milliseconds the last step spent gathering the ranks' updated masters.
  double gather_ms() const { return gather_ms_; }
  // Elements of m (and of v), padding included.
  int64_t state_numel() const { return params_.trainable_numel(); }
  // For restoring a saved state.
  void set_step_count(int64_t step) { step_ = step; }

 private:
  // The update of one parameter's elements [start, start + n), from these buffers.
  void update(const ParameterInfo& p, int64_t start, int64_t n, float* weights, float* m, float* v,
              float lr, float scale) const;
  void step_offloaded(float lr, float scale);
  // This rank's shard of parameter p: [begin, end) of its elements; empty where it has none.
  std::pair<int64_t, int64_t> shard_of(const ParameterInfo& p) const;
  // Sharded: every rank's updated masters to every rank, with their bf16 copies.
  void gather_masters() const;

  const ParameterSet& params_;
  AdamWConfig config_;
  Tensor m_;
  Tensor v_;
  int64_t step_ = 0;
  // Offloaded: the state files, and the staging buffers of kSlots chunks of (master, m, v).
  std::unique_ptr<StateFile> m_file_, v_file_;
  Tensor staging_;
  int64_t chunk_ = 0;
  std::unique_ptr<IoQueue> io_;
  // Sharded: the communicator and the shards' bounds.
  const Communicator* comm_ = nullptr;
  std::vector<int64_t> shards_;
  mutable double gather_ms_ = 0.0;
};

// Global L2 norm of the gradients of the set's trainable parameters.
double gradient_norm(const ParameterSet& params);

}  // namespace cputrain
