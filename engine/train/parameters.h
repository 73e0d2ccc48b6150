// The parameters of a model: one contiguous FP32 allocation for the master weights and one for
// the gradients of the trainable ones (llm.c's layout), described by a table of names, shapes and
// offsets. Each parameter is a Variable viewing its slice; a trainable one has its gradient bound
// to its slice of the gradient buffer.
//
// A frozen parameter (set_trainable(index, false) before allocate) has no gradient and takes no
// part in the optimizer. Where the set is allocated for bf16 compute, a frozen parameter with a
// bf16 copy (a GEMM weight) has no FP32 master at all: its value is its bf16 copy.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "engine/core/autograd.h"

namespace cputrain {

struct ParameterInfo {
  std::string name;
  Shape shape;
  int64_t offset = -1;       // in elements into weights(); -1: no FP32 master (bf16 only)
  bool decay = false;        // takes weight decay (matrices do, norm gains do not)
  bool bf16_copy = false;    // gets a bf16 copy in bf16 training (it feeds GEMMs)
  int64_t bf16_offset = -1;  // in elements, into bf16_weights(), once the copies exist
  bool trainable = true;
  bool mapped = false;               // its values are read in place (map_in_place), not allocated
  DType mapped_dtype = DType::BF16;  // of a mapped one: BF16 or a quantised format
  int64_t grad_offset = -1;     // in elements into gradients() (and AdamW's m and v); -1: frozen
  bool master_read = false;     // computing reads its FP32 master (an embedding table): in RAM
  bool master_sharded = false;  // its FP32 master is held for this rank's shard alone (set_shard)
  int64_t shard_offset = 0;     // of element 0 (whether held or not) in this rank's held masters
  int64_t file_offset = -1;     // in elements into the masters' state file; -1: not offloaded
};

// A parameter's values as a model file holds them: `dtype` BF16 or a quantised format at `data`,
// or dtype F32 where the file's tensor cannot be read in place (another type, or another layout).
struct InPlaceWeight {
  const void* data = nullptr;
  DType dtype = DType::F32;
};

class Communicator;
class OffloadDir;
class StateFile;

// ZeRO-1's shards of n elements (of the gradients' layout) over `ranks`: rank r holds
// [bounds[r], bounds[r + 1]), each bound but the last a multiple of 16 (parameters start at one,
// and AdamW's runs of 16 lanes split them there anyway).
std::vector<int64_t> shard_bounds(int64_t n, int ranks);

class ParameterSet {
 public:
  // Declares a parameter; returns its index. Only before allocate().
  int add(const std::string& name, const Shape& shape, bool decay, bool bf16_copy = false);
  // Marks a declared parameter frozen (or trainable again). Only before allocate().
  void set_trainable(int index, bool trainable);
  // Before allocate: the parameter, frozen, takes as its value the `dtype` values at `data` in
  // place (row-major, as the parameter is shaped; any alignment), which `owner` keeps alive: a
  // model file's tensor, mapped. Nothing is allocated for it, and its values cannot be written.
  // BF16: a parameter with a bf16 copy, in a set allocated for bf16 compute, or a table read row
  // by row (set_master_read, no bf16 copy: the embedding widens each row), in either. A quantised
  // format (engine/core/tensor.h): a matrix that only the ops taking frozen weights read
  // (linear's products, the embedding), in either compute precision. While measuring, `data` and
  // `owner` may be null: the value is a measured tensor of the file's bytes.
  void map_in_place(int index, const void* data, DType dtype, std::shared_ptr<const void> owner);
  // Before allocate: computing reads the parameter's FP32 master, so offloading keeps it in RAM.
  void set_master_read(int index);
  // Before allocate (--offload): in a set allocated for bf16 compute, the FP32 master of each
  // trainable parameter that has a bf16 copy, and whose master computing does not read, lives in
  // the state file masters.f32 in `dir` instead of RAM: computing takes the bf16 copy, AdamW
  // streams the master with its m and v (which it keeps in `dir` too), and read_values and
  // write_values reach it there. While measuring, `dir` may be null: no file is made.
  void set_offload(std::shared_ptr<const OffloadDir> dir);
  // Before allocate (ZeRO-1, a rank of a data-parallel job of more than one): in a set allocated
  // for bf16 compute, the FP32 master of each trainable parameter that has a bf16 copy, and whose
  // master computing does not read, is held for this rank's shard of the gradients' layout alone
  // (shard_bounds over the ranks); computing takes the bf16 copy, and AdamW (sharded alike)
  // updates the shard. Then read_values of such a parameter is a collective every rank calls
  // alike, and share_values gives every rank its part of rank 0's values. While measuring,
  // `comm` may be a Communicator::shape_of.
  void set_shard(const Communicator* comm);
  // Allocates the weights (zeroed) and the gradients of the trainable parameters (zeroed). With
  // compute BF16 the bf16 copies are made at once, and frozen parameters that have one get no
  // FP32 master.
  void allocate(DType compute = DType::F32);

  const std::vector<ParameterInfo>& infos() const { return infos_; }
  const Variable& var(int index) const { return vars_[index]; }
  // Elements of the FP32 masters, padding included.
  int64_t numel() const { return numel_; }
  // Elements of the gradients (and of each of AdamW's m and v), padding included.
  int64_t trainable_numel() const { return trainable_numel_; }
  const Tensor& weights() const { return weights_; }
  const Tensor& gradients() const { return gradients_; }
  // Index of the parameter called `name`, or -1.
  int find(const std::string& name) const;
  void zero_grad() const {
    if (gradients_.defined()) gradients_.fill_zero();
  }

  // The parameter's values, as FP32 (n = its element count), from its master or, where it has
  // none, its bf16 copy widened or its quantised blocks dequantised. Of a sharded master a
  // collective: rank 0 receives the whole (the other ranks send their parts and may pass null).
  void read_values(int index, float* values) const;
  // write_values, but of a sharded master a collective: rank 0's values (the others pass null)
  // reach every rank's part and bf16 copy.
  void share_values(int index, const float* values) const;
  // On a rank other than 0: its part in rank 0's read_values (gathering) or share_values of
  // every parameter whose master is sharded, in their order, as rank 0's save_checkpoint,
  // save_weights (gathering) and load_checkpoint make them.
  void serve_sharded_masters(bool gathering) const;
  // Whether some master is sharded (set_shard); where element `begin` of parameter p's master is
  // (of a sharded one, within this rank's shard).
  bool masters_sharded() const { return !shards_.empty() && sharded_numel_ > 0; }
  float* master(const ParameterInfo& p, int64_t begin) const;
  // Sets the parameter's values: into its FP32 master (and its bf16 copy, where it has one), or
  // rounded into its bf16 copy where that is all it has.
  void write_values(int index, const float* values) const;
  // Whether the parameter is held as bf16 alone (no FP32 master), mapped or not.
  bool bf16_only(int index) const;
  // Whether the set offloads (set_offload); whether the parameter's master is in the state file.
  bool offloaded() const { return offload_; }
  bool master_offloaded(int index) const {
    return infos_.at(static_cast<size_t>(index)).file_offset >= 0;
  }
  // Elements of the masters' state file, padding included.
  int64_t offloaded_numel() const { return offloaded_numel_; }
  const std::shared_ptr<const OffloadDir>& offload_dir() const { return offload_dir_; }
  // The masters' state file; null where nothing is offloaded or while measuring.
  const StateFile* master_file() const { return master_file_.get(); }
  bool mapped(int index) const { return infos_.at(static_cast<size_t>(index)).mapped; }
  // Sets a parameter held as bf16 alone from bf16 values (any alignment), copied as they are.
  void write_bf16_values(int index, const void* values) const;

  // Allocates (once) the bf16 copies of the parameters declared with bf16_copy, as
  // Bf16Weights, attaches each to its Variable (Variable::bf16_value) and fills them. AdamW
  // writes them in its update; whoever writes the weights otherwise calls sync_bf16_copies().
  void enable_bf16_copies();
  // Elements the bf16 copies take, padding included (known once the parameters are declared).
  int64_t bf16_copy_numel() const;
  bool has_bf16_copies() const { return bf16_weights_.defined(); }
  const Tensor& bf16_weights() const { return bf16_weights_; }
  // Rounds the current FP32 masters into the copies; nothing without them.
  void sync_bf16_copies() const;

  // Backward passes say where the gradients have become final: a model calls
  // gradients_final_from(offset) when every gradient from `offset` (into gradients()) to the
  // end has its whole value for the pass, its blocks' backward done from the top down. A
  // watcher (a data-parallel trainer, which reduces them over the ranks meanwhile) hears of it;
  // null: nobody.
  void set_gradient_watcher(std::function<void(int64_t)> watcher) const {
    watcher_ = std::move(watcher);
  }
  void gradients_final_from(int64_t offset) const {
    if (watcher_) watcher_(offset);
  }

  // FNV-1a of the frozen parameters' names and values as stored (FP32 or bf16 bytes): what a
  // checkpoint of the trainable ones records, so that it is resumed on the same frozen base
  // only. 0 where nothing is frozen.
  uint64_t frozen_fingerprint() const;

 private:
  std::vector<ParameterInfo> infos_;
  std::vector<Variable> vars_;
  int64_t numel_ = 0;
  int64_t trainable_numel_ = 0;
  Tensor weights_;
  Tensor gradients_;
  Tensor bf16_weights_;
  bool offload_ = false;
  std::shared_ptr<const OffloadDir> offload_dir_;
  std::shared_ptr<StateFile> master_file_;
  int64_t offloaded_numel_ = 0;
  // Until allocate: where map_in_place put each mapped parameter's values, and their owner (null
  // elsewhere). Their tensors keep the owners after.
  std::vector<std::pair<const void*, std::shared_ptr<const void>>> mapped_;
  mutable std::function<void(int64_t)> watcher_;
  // set_shard: the communicator, the shards' bounds, this rank's parts of the sharded masters
  // (one after another), and how many elements of sharded masters there are.
  const Communicator* comm_ = nullptr;
  std::vector<int64_t> shards_;
  Tensor shard_masters_;
  int64_t sharded_numel_ = 0;
  // Of a sharded master: read_values' collective (rank 0 receives the whole), and share_values'
  // (rank 0's values reach every rank's part).
  void gather_master(const ParameterInfo& p, float* values) const;
  void share_master(const ParameterInfo& p, const float* values) const;
};

// A UserError naming `source` and the parameter where a parameter accepted by `which` (every
// one where null) holds a NaN or an infinity: "SOURCE: layers.0.attention.wq.weight holds nan
// (element 3), and cputrain computes with finite weights only", the parameter as `shown` names
// it (the tensor of the file it came from; as the model names it where null). Reads the values
// where they are held (FP32 masters, bf16 copies, mapped files); copies only an offloaded or
// sharded master.
void check_finite(const ParameterSet& params, const std::string& source,
                  const std::function<bool(const std::string& name)>& which = nullptr,
                  const std::function<std::string(const std::string& name)>& shown = nullptr);

}  // namespace cputrain
