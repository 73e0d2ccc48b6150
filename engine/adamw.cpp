#include "engine/adamw.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "engine/offload.h"
#include "kernels/adamw.h"
#include "kernels/vector_add.h"

namespace cputrain {
namespace {

// Chunks in flight: one read ahead, one updated, one written back.
constexpr int64_t kSlots = 3;

int64_t padded16(int64_t n) {
  return (n + 15) / 16 * 16;
}

}  // namespace

AdamW::AdamW(const ParameterSet& params, const AdamWConfig& config)
    : params_(params), config_(config) {
  if (!params.offloaded()) {
    m_ = Tensor::zeros(Shape{params.trainable_numel()}, DType::F32, MemoryCategory::OptimizerState);
    v_ = Tensor::zeros(Shape{params.trainable_numel()}, DType::F32, MemoryCategory::OptimizerState);
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
  return step(lr, gradient_norm(params_));
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
  for (const ParameterInfo& p : params_.infos()) {
    if (!p.trainable) continue;
    update(p, 0, p.shape.numel(), params_.weights().f32() + p.offset, m_.f32() + p.grad_offset,
           v_.f32() + p.grad_offset, lr, scale);
  }
  return static_cast<float>(norm);
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
  if (m_file_)
    (second ? v_file_ : m_file_)->read(offset, n, dst);
  else
    std::memcpy(dst, (second ? v_ : m_).f32() + offset, static_cast<size_t>(n) * 4);
}

void AdamW::write_state(bool second, int64_t offset, int64_t n, const float* src) {
  if (m_file_)
    (second ? v_file_ : m_file_)->write(offset, n, src);
  else
    std::memcpy((second ? v_ : m_).f32() + offset, src, static_cast<size_t>(n) * 4);
}

}  // namespace cputrain
