#include "engine/train/parameters.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <stdexcept>
#include <utility>

#include "engine/core/error.h"
#include "engine/core/hash.h"
#include "engine/dist/communicator.h"
#include "engine/io/offload.h"
#include "kernels/cpu/bf16.h"

namespace cputrain {
namespace {

// FP32 elements of one parameter's slice: each starts on a 64-byte boundary.
int64_t padded_f32(int64_t numel) {
  return (numel + 15) / 16 * 16;
}
// bf16 elements of one copy: each starts on a 64-byte boundary, as the weights do.
int64_t padded_bf16(int64_t numel) {
  return (numel + 31) / 32 * 32;
}

}  // namespace

int ParameterSet::add(const std::string& name, const Shape& shape, bool decay, bool bf16_copy) {
  if (weights_.defined()) throw std::logic_error("ParameterSet::add after allocate");
  ParameterInfo info;
  info.name = name;
  info.shape = shape;
  info.decay = decay;
  info.bf16_copy = bf16_copy;
  infos_.push_back(info);
  return static_cast<int>(infos_.size()) - 1;
}

void ParameterSet::set_trainable(int index, bool trainable) {
  if (weights_.defined()) throw std::logic_error("ParameterSet::set_trainable after allocate");
  infos_.at(static_cast<size_t>(index)).trainable = trainable;
}

void ParameterSet::set_master_read(int index) {
  if (weights_.defined()) throw std::logic_error("ParameterSet::set_master_read after allocate");
  infos_.at(static_cast<size_t>(index)).master_read = true;
}

void ParameterSet::set_offload(std::shared_ptr<const OffloadDir> dir) {
  if (weights_.defined()) throw std::logic_error("ParameterSet::set_offload after allocate");
  offload_ = true;
  offload_dir_ = std::move(dir);
}

void ParameterSet::map_in_place(int index, const void* data, DType dtype,
                                std::shared_ptr<const void> owner) {
  if (weights_.defined()) throw std::logic_error("ParameterSet::map_in_place after allocate");
  if ((!data || !owner) && !measuring())
    throw std::logic_error("ParameterSet::map_in_place without data or owner");
  if (dtype != DType::BF16 && !dtype_quantized(dtype))
    throw std::logic_error("ParameterSet::map_in_place of " + std::string(dtype_name(dtype)));
  ParameterInfo& p = infos_.at(static_cast<size_t>(index));
  p.mapped = true;
  p.mapped_dtype = dtype;
  mapped_.resize(infos_.size());
  mapped_[static_cast<size_t>(index)] = {data, std::move(owner)};
}

namespace {

// Parameter p's elements [begin, end) held by rank r's shard.
std::pair<int64_t, int64_t> part_of(const ParameterInfo& p, const std::vector<int64_t>& shards,
                                    size_t r) {
  const int64_t n = p.shape.numel();
  return {std::clamp<int64_t>(shards[r] - p.grad_offset, 0, n),
          std::clamp<int64_t>(shards[r + 1] - p.grad_offset, 0, n)};
}

}  // namespace

std::vector<int64_t> shard_bounds(int64_t n, int ranks) {
  std::vector<int64_t> b(static_cast<size_t>(ranks) + 1, n);
  for (int r = 0; r < ranks; ++r) b[static_cast<size_t>(r)] = n / 16 * r / ranks * 16;
  return b;
}

void ParameterSet::set_shard(const Communicator* comm) {
  if (weights_.defined()) throw std::logic_error("ParameterSet::set_shard after allocate");
  comm_ = comm && comm->size() > 1 ? comm : nullptr;
}

void ParameterSet::allocate(DType compute) {
  if (weights_.defined()) throw std::logic_error("ParameterSet::allocate twice");
  const bool bf16 = compute == DType::BF16;
  numel_ = 0;
  trainable_numel_ = 0;
  offloaded_numel_ = 0;
  for (ParameterInfo& p : infos_) {
    const bool quantized = p.mapped && dtype_quantized(p.mapped_dtype);
    // A frozen table read row by row (master_read, no GEMM copy), held as the file's BF16 in a
    // set of either precision.
    const bool bf16_table = p.mapped && p.mapped_dtype == DType::BF16 && !p.trainable &&
                            p.master_read && !p.bf16_copy && p.shape.ndim() == 2;
    const bool bf16_only = (bf16 && !p.trainable && p.bf16_copy) || quantized || bf16_table;
    if (p.mapped && (p.trainable || (!quantized && !bf16_only) ||
                     (quantized && p.shape.ndim() != 2 && p.shape.ndim() != 3)))
      throw std::logic_error("ParameterSet: " + p.name +
                             " is mapped but not a frozen bf16 weight of a bf16 set, a frozen "
                             "bf16 table, nor a frozen quantised matrix (or experts' matrices)");
    const bool offloaded = offload_ && bf16 && p.trainable && p.bf16_copy && !p.master_read;
    p.master_sharded = comm_ && !offload_ && bf16 && p.trainable && p.bf16_copy && !p.master_read;
    if (p.master_sharded) sharded_numel_ += p.shape.numel();
    p.offset = bf16_only || offloaded || p.master_sharded ? -1 : numel_;
    if (p.offset >= 0) numel_ += padded_f32(p.shape.numel());
    p.file_offset = offloaded ? offloaded_numel_ : -1;
    if (offloaded) offloaded_numel_ += padded_f32(p.shape.numel());
    p.grad_offset = p.trainable ? trainable_numel_ : -1;
    if (p.trainable) trainable_numel_ += padded_f32(p.shape.numel());
  }
  weights_ = Tensor::zeros(Shape{numel_}, DType::F32, MemoryCategory::Weights);
  if (offloaded_numel_ > 0 && !weights_.measured()) {
    if (!offload_dir_) throw std::logic_error("ParameterSet: offloaded without a folder");
    master_file_ = offload_dir_->file("masters.f32", offloaded_numel_);
  }
  if (trainable_numel_ > 0)
    gradients_ = Tensor::zeros(Shape{trainable_numel_}, DType::F32, MemoryCategory::Gradients);
  if (comm_) {
    shards_ = shard_bounds(trainable_numel_, comm_->size());
    // This rank's part of each sharded master, one after another.
    const auto r = static_cast<size_t>(comm_->rank());
    int64_t held = 0;
    for (ParameterInfo& p : infos_) {
      if (!p.master_sharded) continue;
      const auto [begin, end] = part_of(p, shards_, r);
      if (begin >= end) continue;
      p.shard_offset = held - begin;
      held += padded_f32(end - begin);
    }
    if (sharded_numel_ > 0)
      shard_masters_ = Tensor::zeros(Shape{held}, DType::F32, MemoryCategory::Weights);
  }
  vars_.clear();
  mapped_.resize(infos_.size());
  for (size_t i = 0; i < infos_.size(); ++i) {
    const ParameterInfo& p = infos_[i];
    if (p.mapped) {  // the file's tensor, or while measuring one of its size
      const auto& [data, owner] = mapped_[i];
      vars_.emplace_back(
          data ? Tensor::external(data, p.shape, p.mapped_dtype, MemoryCategory::Bf16Weights, owner)
               : Tensor::empty(p.shape, p.mapped_dtype, MemoryCategory::Bf16Weights),
          false);
      continue;
    }
    if (p.offset < 0) {  // its value comes with the bf16 copies, below
      vars_.emplace_back();
      continue;
    }
    Variable v(weights_.view(p.offset, p.shape), p.trainable);
    if (p.trainable) v.grad_ref()->bind(gradients_.view(p.grad_offset, p.shape));
    vars_.push_back(v);
  }
  mapped_.clear();
  if (bf16) enable_bf16_copies();
}

int64_t ParameterSet::bf16_copy_numel() const {
  int64_t total = 0;
  for (const ParameterInfo& p : infos_)
    if (p.bf16_copy) total += padded_bf16(p.shape.numel());
  return total;
}

void ParameterSet::enable_bf16_copies() {
  if (!weights_.defined())
    throw std::logic_error("ParameterSet::enable_bf16_copies before allocate");
  if (has_bf16_copies()) return;
  int64_t offset = 0;
  for (ParameterInfo& p : infos_) {
    if (!p.bf16_copy || p.mapped) continue;
    p.bf16_offset = offset;
    offset += padded_bf16(p.shape.numel());
  }
  bf16_weights_ = Tensor::zeros(Shape{offset}, DType::BF16, MemoryCategory::Bf16Weights);
  for (size_t i = 0; i < infos_.size(); ++i) {
    const ParameterInfo& p = infos_[i];
    if (p.bf16_offset < 0) continue;
    const Tensor copy = bf16_weights_.view(p.bf16_offset, p.shape);
    if (p.file_offset >= 0 || p.master_sharded) {
      // computing takes the copy; the master is in the state file, or sharded
      vars_[i] = Variable(copy, true);
      vars_[i].grad_ref()->bind(gradients_.view(p.grad_offset, p.shape));
    } else if (p.offset < 0) {
      vars_[i] = Variable(copy, false);  // a frozen weight that lives as bf16 alone
    } else {
      vars_[i].set_bf16_copy(copy);
    }
  }
  sync_bf16_copies();
}

void ParameterSet::sync_bf16_copies() const {
  if (!has_bf16_copies() || weights_.measured()) return;
  for (const ParameterInfo& p : infos_) {
    if (p.bf16_offset < 0 || p.offset < 0) continue;
    kernels::fp32_to_bf16_array(bf16_weights_.bf16() + p.bf16_offset, weights_.f32() + p.offset,
                                p.shape.numel());
  }
}

float* ParameterSet::master(const ParameterInfo& p, int64_t begin) const {
  if (!p.master_sharded) return weights_.f32() + p.offset + begin;
  return shard_masters_.f32() + p.shard_offset + begin;
}

void ParameterSet::gather_master(const ParameterInfo& p, float* values) const {
  if (weights_.measured()) return;
  comm_->gather_to_root(
      p.grad_offset, p.shape.numel(), shards_,
      [this, &p](int64_t at) { return master(p, at - p.grad_offset); }, values);
}

void ParameterSet::share_master(const ParameterInfo& p, const float* values) const {
  if (weights_.measured()) return;
  // In chunks through a buffer of the chunk's size: no rank holds the whole but rank 0.
  constexpr int64_t kChunk = int64_t{1} << 20;
  const int64_t n = p.shape.numel();
  std::vector<float> chunk(static_cast<size_t>(std::min(n, kChunk)));
  const auto [mine_begin, mine_end] = part_of(p, shards_, static_cast<size_t>(comm_->rank()));
  for (int64_t at = 0; at < n; at += kChunk) {
    const int64_t k = std::min(kChunk, n - at);
    if (comm_->rank() == 0) std::copy_n(values + at, k, chunk.data());
    comm_->broadcast(chunk.data(), k * 4, 0);
    const int64_t a = std::max(at, mine_begin), b = std::min(at + k, mine_end);
    if (a < b) std::copy_n(chunk.data() + (a - at), b - a, master(p, a));
    if (has_bf16_copies() && p.bf16_offset >= 0)
      kernels::fp32_to_bf16_array(bf16_weights_.bf16() + p.bf16_offset + at, chunk.data(), k);
  }
}

void ParameterSet::read_values(int index, float* values) const {
  const ParameterInfo& p = infos_.at(static_cast<size_t>(index));
  const int64_t n = p.shape.numel();
  if (p.master_sharded) {
    gather_master(p, values);
  } else if (p.offset >= 0) {
    std::copy_n(weights_.f32() + p.offset, n, values);
  } else if (p.file_offset >= 0) {
    master_file_->read(p.file_offset, n, values);
  } else if (const Tensor& v = vars_.at(static_cast<size_t>(index)).value();
             dtype_quantized(v.dtype())) {
    kernels::dequantize_rows(v.quant(), 0, v.dim(0), values);
  } else {
    kernels::bf16_to_fp32_array(values, v.bf16(), n);
  }
}

void ParameterSet::share_values(int index, const float* values) const {
  const ParameterInfo& p = infos_.at(static_cast<size_t>(index));
  if (p.master_sharded)
    share_master(p, values);
  else
    write_values(index, values);
}

void ParameterSet::serve_sharded_masters(bool gathering) const {
  for (const ParameterInfo& p : infos_) {
    if (!p.master_sharded) continue;
    if (gathering)
      gather_master(p, nullptr);
    else
      share_master(p, nullptr);
  }
}

void ParameterSet::write_values(int index, const float* values) const {
  const ParameterInfo& p = infos_.at(static_cast<size_t>(index));
  const int64_t n = p.shape.numel();
  if (p.mapped) throw std::logic_error("ParameterSet: " + p.name + " is mapped, read-only");
  if (p.master_sharded) {
    const auto [begin, end] = part_of(p, shards_, static_cast<size_t>(comm_->rank()));
    if (begin < end && !weights_.measured())
      std::copy_n(values + begin, end - begin, master(p, begin));
  }
  if (p.offset >= 0) std::copy_n(values, n, weights_.f32() + p.offset);
  if (p.file_offset >= 0) master_file_->write(p.file_offset, n, values);
  if (has_bf16_copies() && p.bf16_offset >= 0)
    kernels::fp32_to_bf16_array(bf16_weights_.bf16() + p.bf16_offset, values, n);
}

bool ParameterSet::bf16_only(int index) const {
  const ParameterInfo& p = infos_.at(static_cast<size_t>(index));
  return p.offset < 0 && p.file_offset < 0 && !p.master_sharded && has_bf16_copies() &&
         (p.bf16_offset >= 0 || (p.mapped && p.mapped_dtype == DType::BF16));
}

void ParameterSet::write_bf16_values(int index, const void* values) const {
  if (!bf16_only(index) || mapped(index))
    throw std::logic_error("write_bf16_values: the parameter has an FP32 master or is mapped");
  const ParameterInfo& p = infos_.at(static_cast<size_t>(index));
  std::memcpy(bf16_weights_.bf16() + p.bf16_offset, values,
              static_cast<size_t>(p.shape.numel()) * sizeof(uint16_t));
}

uint64_t ParameterSet::frozen_fingerprint() const {
  uint64_t h = kFnvOffset;
  bool any = false;
  for (const ParameterInfo& p : infos_) {
    if (p.trainable) continue;
    any = true;
    h = fnv1a(p.name, h);
    const int64_t n = p.shape.numel();
    if (p.offset >= 0) {
      h = fnv1a(weights_.f32() + p.offset, static_cast<size_t>(n) * 4, h);
    } else {  // bf16 or quantised, as held
      const Tensor& v = vars_[static_cast<size_t>(&p - infos_.data())].value();
      h = fnv1a(v.raw(), v.bytes(), h);
    }
  }
  return any ? h : 0;
}

int ParameterSet::find(const std::string& name) const {
  for (size_t i = 0; i < infos_.size(); ++i)
    if (infos_[i].name == name) return static_cast<int>(i);
  return -1;
}

namespace {

// The first of n values that is a NaN or an infinity (by its bits: all-ones exponent), or -1.
int64_t first_non_finite_f32(const float* values, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    uint32_t bits;
    std::memcpy(&bits, values + i, 4);
    if ((bits & 0x7f800000u) == 0x7f800000u) return i;
  }
  return -1;
}

int64_t first_non_finite_bf16(const uint16_t* values, int64_t n) {
  for (int64_t i = 0; i < n; ++i)
    if ((values[i] & 0x7f80u) == 0x7f80u) return i;
  return -1;
}

}  // namespace

void check_finite(const ParameterSet& params, const std::string& source,
                  const std::function<bool(const std::string& name)>& which,
                  const std::function<std::string(const std::string& name)>& shown) {
  std::vector<float> copy;
  for (size_t i = 0; i < params.infos().size(); ++i) {
    const ParameterInfo& p = params.infos()[i];
    if (which && !which(p.name)) continue;
    const int64_t n = p.shape.numel();
    int64_t bad = -1;
    float value = 0.0f;
    if (p.master_sharded) {
      continue;  // a rank holds a part of it; the rank holding the rest checks that
    } else if (p.offset >= 0) {
      const float* values = params.weights().f32() + p.offset;
      bad = first_non_finite_f32(values, n);
      if (bad >= 0) value = values[bad];
    } else if (p.file_offset >= 0) {
      copy.resize(static_cast<size_t>(n));
      params.read_values(static_cast<int>(i), copy.data());
      bad = first_non_finite_f32(copy.data(), n);
      if (bad >= 0) value = copy[static_cast<size_t>(bad)];
    } else if (const Tensor& v = params.var(static_cast<int>(i)).value();
               dtype_quantized(v.dtype())) {
      // Dequantised a panel of rows at a time.
      const kernels::QuantMatrix w = v.quant();
      const int64_t rows = kernels::quant_panel_rows(w.cols);
      copy.resize(static_cast<size_t>(std::min(rows, w.rows) * w.cols));
      for (int64_t r0 = 0; r0 < w.rows && bad < 0; r0 += rows) {
        const int64_t m = std::min(rows, w.rows - r0);
        kernels::dequantize_rows(w, r0, m, copy.data());
        bad = first_non_finite_f32(copy.data(), m * w.cols);
        if (bad >= 0) value = copy[static_cast<size_t>(bad)], bad += r0 * w.cols;
      }
    } else {
      const uint16_t* values = params.var(static_cast<int>(i)).value().bf16();
      bad = first_non_finite_bf16(values, n);
      if (bad >= 0) value = kernels::bf16_to_fp32(values[bad]);
    }
    if (bad < 0) continue;
    const std::string what = std::isnan(value) ? "nan" : value > 0 ? "inf" : "-inf";
    throw UserError(source + ": " + (shown ? shown(p.name) : p.name) + " holds " + what +
                    " (element " + std::to_string(bad) +
                    "), and cputrain computes with finite weights only");
  }
}

}  // namespace cputrain
