#include "engine/train/adamw.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <stdexcept>
#include <vector>

#include "engine/dist/communicator.h"
#include "engine/io/offload.h"
#include "kernels/cpu/bf16.h"
#include "kernels/ops/adamw.h"
#include "kernels/ops/vector_add.h"

namespace cputrain {
namespace {

// Chunks in flight: one read ahead, one updated, one written back.
constexpr int64_t kSlots = 3;

int64_t padded16(int64_t n) {
  return (n + 15) / 16 * 16;
}

}  // namespace

AdamW::AdamW(const ParameterSet& params, const AdamWConfig& config, const Communicator* comm)
    : params_(params), config_(config) {
  if (comm && comm->size() > 1) {
    if (params.offloaded()) throw std::logic_error("AdamW: a sharded state is not offloaded");
    comm_ = comm;
    shards_ = shard_bounds(params.trainable_numel(), comm->size());
  } else if (params.masters_sharded()) {
    throw std::logic_error("AdamW: a set whose masters are sharded needs a sharded AdamW");
  }
  if (!params.offloaded()) {
    const int64_t n = shards_.empty() ? params.trainable_numel()
                                      : shards_[static_cast<size_t>(comm->rank()) + 1] -
                                            shards_[static_cast<size_t>(comm->rank())];
    m_ = Tensor::zeros(Shape{n}, DType::F32, MemoryCategory::OptimizerState);
    v_ = Tensor::zeros(Shape{n}, DType::F32, MemoryCategory::OptimizerState);
    return;
  }
  int64_t largest = 0;
  for (const ParameterInfo& p : params.infos())
    if (p.trainable) largest = std::max(largest, padded16(p.shape.numel()));
  chunk_ = std::min(std::max<int64_t>(16, config.offload_chunk / 16 * 16), largest);
  staging_ = Tensor::empty(Shape{kSlots * 3 * chunk_}, DType::F32, MemoryCategory::OptimizerState);
  if (staging_.measured() || params.trainable_numel() == 0) return;
  // Zeroed files: a new run's m and v.
  m_file_ = params.offload_dir()->file("adamw_m.f32", params.trainable_numel());
  v_file_ = params.offload_dir()->file("adamw_v.f32", params.trainable_numel());
  io_ = std::make_unique<IoQueue>();
}

AdamW::~AdamW() = default;

double gradient_norm(const ParameterSet& params) {
  if (params.gradients().defined() && params.gradients().measured()) return 0.0;
  double sum = 0.0;
  for (const ParameterInfo& p : params.infos())
    if (p.trainable)
      sum += kernels::vector_sum_squares(params.gradients().f32() + p.grad_offset, p.shape.numel());
  return std::sqrt(sum);
}

float AdamW::step(float lr) {
  return step(lr, gradient_norm());
}

void AdamW::update(const ParameterInfo& p, int64_t start, int64_t n, float* weights, float* m,
                   float* v, float lr, float scale) const {
  kernels::AdamWHyper h;
  h.lr = lr;
  h.beta1 = config_.beta1;
  h.beta2 = config_.beta2;
  h.eps = config_.eps;
  h.weight_decay = p.decay ? config_.weight_decay : 0.0f;
  h.step = step_;
  kernels::adamw_update(weights, params_.gradients().f32() + p.grad_offset + start, m, v, n, h,
                        scale,
                        params_.has_bf16_copies() && p.bf16_offset >= 0
                            ? params_.bf16_weights().bf16() + p.bf16_offset + start
                            : nullptr);
}

float AdamW::step(float lr, double norm) {
  ++step_;
  // torch: clip_coef = max_norm / (norm + 1e-6), clamped to at most 1.
  float scale = 1.0f;
  if (config_.grad_clip > 0.0f) {
    const float coef = config_.grad_clip / (static_cast<float>(norm) + 1e-6f);
    scale = coef < 1.0f ? coef : 1.0f;
  }
  if (params_.offloaded()) {
    if (io_) step_offloaded(lr, scale);  // none while measuring or where nothing trains
    return static_cast<float>(norm);
  }
  if (m_.measured()) return static_cast<float>(norm);
  const int64_t first = shards_.empty() ? 0 : shards_[static_cast<size_t>(comm_->rank())];
  for (const ParameterInfo& p : params_.infos()) {
    if (!p.trainable) continue;
    const auto [begin, end] = shard_of(p);
    if (begin >= end) continue;
    const int64_t at = p.grad_offset + begin - first;  // into this rank's m and v
    update(p, begin, end - begin, params_.master(p, begin), m_.f32() + at, v_.f32() + at, lr,
           scale);
  }
  if (!shards_.empty()) gather_masters();
  return static_cast<float>(norm);
}

std::pair<int64_t, int64_t> AdamW::shard_of(const ParameterInfo& p) const {
  const int64_t n = p.shape.numel();
  if (shards_.empty()) return {0, n};
  const size_t r = static_cast<size_t>(comm_->rank());
  return {std::clamp<int64_t>(shards_[r] - p.grad_offset, 0, n),
          std::clamp<int64_t>(shards_[r + 1] - p.grad_offset, 0, n)};
}

void AdamW::gather_masters() const {
  // The gradients are spent: their buffer carries the masters, laid out as the gradients, each
  // rank's shard in place, to every rank.
  float* g = params_.gradients().f32();
  for (const ParameterInfo& p : params_.infos()) {
    if (!p.trainable) continue;
    const auto [begin, end] = shard_of(p);
    if (begin < end)
      std::memcpy(g + p.grad_offset + begin, params_.master(p, begin),
                  static_cast<size_t>(end - begin) * 4);
  }
  const auto start = std::chrono::steady_clock::now();
  comm_->all_gather(g, shards_);
  gather_ms_ =
      std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
  for (const ParameterInfo& p : params_.infos()) {
    if (!p.trainable) continue;
    const auto [begin, end] = shard_of(p);
    const int64_t n = p.shape.numel();
    // The rest of the parameter: before this rank's shard, and after it.
    for (const auto& [from, to] :
         {std::pair{int64_t{0}, begin < end ? begin : n}, std::pair{begin < end ? end : n, n}}) {
      if (from >= to) continue;
      // A master held for its shard alone keeps none of the rest: its copy is all.
      if (!p.master_sharded)
        std::memcpy(params_.weights().f32() + p.offset + from, g + p.grad_offset + from,
                    static_cast<size_t>(to - from) * 4);
      if (params_.has_bf16_copies() && p.bf16_offset >= 0)
        kernels::fp32_to_bf16_array(params_.bf16_weights().bf16() + p.bf16_offset + from,
                                    g + p.grad_offset + from, to - from);
    }
  }
}

double AdamW::gradient_norm() const {
  if (shards_.empty()) return cputrain::gradient_norm(params_);
  if (params_.gradients().measured()) return 0.0;
  double sum = 0.0;
  for (const ParameterInfo& p : params_.infos()) {
    if (!p.trainable) continue;
    const auto [begin, end] = shard_of(p);
    if (begin < end)
      sum += kernels::vector_sum_squares(params_.gradients().f32() + p.grad_offset + begin,
                                         end - begin);
  }
  comm_->all_reduce_sum(&sum, 1);
  return std::sqrt(sum);
}

void AdamW::step_offloaded(float lr, float scale) {
  struct Chunk {
    const ParameterInfo* p;
    int64_t start, n;
  };
  std::vector<Chunk> chunks;
  for (const ParameterInfo& p : params_.infos()) {
    if (!p.trainable) continue;
    for (int64_t start = 0; start < p.shape.numel(); start += chunk_)
      chunks.push_back({&p, start, std::min(chunk_, p.shape.numel() - start)});
  }
  // Slot s holds a chunk's master (where offloaded), m and v.
  const auto buffer = [&](size_t i, int array) {
    return staging_.f32() + ((static_cast<int64_t>(i) % kSlots) * 3 + array) * chunk_;
  };
  const StateFile* masters = params_.master_file();
  const auto read = [&](size_t i) {
    return io_->submit([&, i] {
      const Chunk& c = chunks[i];
      if (c.p->file_offset >= 0) masters->read(c.p->file_offset + c.start, c.n, buffer(i, 0));
      m_file_->read(c.p->grad_offset + c.start, c.n, buffer(i, 1));
      v_file_->read(c.p->grad_offset + c.start, c.n, buffer(i, 2));
    });
  };
  std::vector<int64_t> read_ticket(chunks.size());
  if (!chunks.empty()) read_ticket[0] = read(0);
  for (size_t i = 0; i < chunks.size(); ++i) {
    // The slot of chunk i + 1 was chunk i - 2's, whose write the queue runs first.
    if (i + 1 < chunks.size()) read_ticket[i + 1] = read(i + 1);
    io_->wait(read_ticket[i]);
    const Chunk& c = chunks[i];
    float* w =
        c.p->file_offset >= 0 ? buffer(i, 0) : params_.weights().f32() + c.p->offset + c.start;
    update(*c.p, c.start, c.n, w, buffer(i, 1), buffer(i, 2), lr, scale);
    io_->submit([&, i] {
      const Chunk& c = chunks[i];
      if (c.p->file_offset >= 0) masters->write(c.p->file_offset + c.start, c.n, buffer(i, 0));
      m_file_->write(c.p->grad_offset + c.start, c.n, buffer(i, 1));
      v_file_->write(c.p->grad_offset + c.start, c.n, buffer(i, 2));
    });
  }
  io_->drain();
}

void AdamW::read_state(bool second, int64_t offset, int64_t n, float* dst) const {
  if (!shards_.empty()) {
    const float* mine = (second ? v_ : m_).f32();
    const int64_t first = shards_[static_cast<size_t>(comm_->rank())];
    comm_->gather_to_root(
        offset, n, shards_, [mine, first](int64_t at) { return mine + (at - first); }, dst);
    return;
  }
  if (m_file_)
    (second ? v_file_ : m_file_)->read(offset, n, dst);
  else
    std::memcpy(dst, (second ? v_ : m_).f32() + offset, static_cast<size_t>(n) * 4);
}

void AdamW::write_state(bool second, int64_t offset, int64_t n, float* src) {
  if (!shards_.empty()) {
    comm_->broadcast(src, n * 4, 0);
    const size_t me = static_cast<size_t>(comm_->rank());
    const int64_t a = std::max(offset, shards_[me]), b = std::min(offset + n, shards_[me + 1]);
    if (a < b)
      std::memcpy((second ? v_ : m_).f32() + (a - shards_[me]), src + (a - offset),
                  static_cast<size_t>(b - a) * 4);
    return;
  }
  if (m_file_)
    (second ? v_file_ : m_file_)->write(offset, n, src);
  else
    std::memcpy((second ? v_ : m_).f32() + offset, src, static_cast<size_t>(n) * 4);
}

}  // namespace cputrain
