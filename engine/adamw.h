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

#include "engine/parameters.h"

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

class AdamW {
 public:
  AdamW(const ParameterSet& params, const AdamWConfig& config);
  ~AdamW();
  AdamW(const AdamW&) = delete;
  AdamW& operator=(const AdamW&) = delete;
  // One update at learning rate lr from the accumulated gradients; returns the global
  // gradient norm before clipping. Gradients are left as they are.
  float step(float lr);
  // The same with the global gradient norm already computed (gradient_norm).
  float step(float lr, double norm);
  int64_t step_count() const { return step_; }
  // m and v in RAM (undefined where offloaded).
  const Tensor& m() const { return m_; }
  const Tensor& v() const { return v_; }
  // n elements of m (second false) or v (second true) from `offset`, wherever they are.
  void read_state(bool second, int64_t offset, int64_t n, float* dst) const;
  void write_state(bool second, int64_t offset, int64_t n, const float* src);
  // Elements of m (and of v), padding included.
  int64_t state_numel() const { return params_.trainable_numel(); }
  // For restoring a saved state.
  void set_step_count(int64_t step) { step_ = step; }

 private:
  // The update of one parameter's elements [start, start + n), from these buffers.
  void update(const ParameterInfo& p, int64_t start, int64_t n, float* weights, float* m, float* v,
              float lr, float scale) const;
  void step_offloaded(float lr, float scale);

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
};

// Global L2 norm of the gradients of the set's trainable parameters.
double gradient_norm(const ParameterSet& params);

}  // namespace cputrain
