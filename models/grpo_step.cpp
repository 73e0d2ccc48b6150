#include "models/grpo_step.h"

#include <algorithm>
#include <memory>
#include <stdexcept>

#include "engine/core/autograd.h"
#include "engine/core/memory.h"
#include "engine/core/profiler.h"
#include "engine/train/trainer.h"
#include "models/decoder.h"
#include "models/finetune_step.h"

namespace cputrain {
namespace {

// Per target of a packed batch (in the order target_log_probs gives them): its example, and its
// index among that example's targets.
struct BatchTargets {
  std::vector<int32_t> example;
  std::vector<int32_t> index;
};
BatchTargets targets_of(std::span<const PackedRow* const> rows,
                        const std::vector<FinetuneExample>& examples) {
  BatchTargets t;
  for (const PackedRow* row : rows)
    for (const int32_t i : row->examples) {
      const FinetuneExample& e = examples[static_cast<size_t>(i)];
      int32_t k = 0;
      for (size_t j = 1; j < e.target.size(); ++j)
        if (e.target[j] != 0) {
          t.example.push_back(i);
          t.index.push_back(k++);
        }
    }
  return t;
}

Variable grpo_loss_op(const Variable& logps, const BatchTargets& tg, const GrpoBatches& b) {
  profiler::Scope scope("grpo loss", profiler::Pass::Forward);
  Tensor y = Tensor::empty(Shape{1}, DType::F32, MemoryCategory::Activations);
  auto coef = std::make_shared<std::vector<float>>();
  if (!measuring()) {
    const float* v = logps.value().f32();
    const size_t n = tg.example.size();
    if (static_cast<size_t>(logps.value().numel()) != n)
      throw std::logic_error("grpo_loss: one log-probability a target");
    coef->resize(n);
    double loss = 0.0;
    for (size_t k = 0; k < n; ++k) {
      const auto e = static_cast<size_t>(tg.example[k]);
      const auto i = static_cast<size_t>(tg.index[k]);
      const double logp = v[k];
      const double old = b.old && !b.old->empty() ? (*b.old)[e][i] : logp;
      const double ref = b.loss.beta > 0.0 ? (*b.reference)[e][i] : 0.0;
      const GrpoTokenTerm t = grpo_token(logp, old, ref, b.advantages[e], b.loss);
      loss += t.loss * b.weights[e];
      (*coef)[k] = static_cast<float>(t.d_logp * b.weights[e]);
      if (b.stats) b.stats->add(t);
    }
    y.f32()[0] = static_cast<float>(loss);
  }
  const bool grad = needs_grad({&logps});
  Variable out = Variable::op_output(y, grad);
  if (grad) {
    record_backward("grpo loss",
                    [coef, gx = logps.grad_ref(), gy = out.grad_ref(), n = logps.value().numel()] {
                      const Tensor& dy = gy->tensor();
                      if (!dy.defined()) return;
                      float beta = 0.0f;
                      float* g = gx->get_for_accumulate(&beta).f32();
                      if (measuring()) return;
                      const float scale = dy.f32()[0];
                      for (int64_t k = 0; k < n; ++k) {
                        const float d = scale * (*coef)[static_cast<size_t>(k)];
                        g[k] = beta == 0.0f ? d : g[k] + d;
                      }
                    });
  }
  return out;
}

}  // namespace

Variable grpo_batch_loss(DecoderModel& model, std::span<const PackedRow* const> rows,
                         const GrpoBatches& b, int32_t pad, const Tensor& inputs,
                         const Tensor& targets, int64_t measured_targets) {
  const auto packing = pack_batch(rows, *b.examples, pad, inputs, targets, measured_targets);
  const BatchTargets tg = measuring() ? BatchTargets{} : targets_of(rows, *b.examples);
  const Variable logps = model.target_log_probs(inputs, targets, packing);
  return grpo_loss_op(logps, tg, b);
}

StepResult grpo_step(Trainer& trainer, DecoderModel& model, int64_t step,
                     std::span<const PackedRow* const> rows, const GrpoBatches& b, int32_t pad,
                     const Tensor& inputs, const Tensor& targets, int64_t measured_targets) {
  return packed_rows_step(trainer, model, step, rows, inputs.dim(0), inputs.dim(1),
                          [&](std::span<const PackedRow* const> mine) {
                            return grpo_batch_loss(model, mine, b, pad, inputs, targets,
                                                   measured_targets);
                          });
}

std::vector<std::vector<float>> target_log_probs_of(DecoderModel& model,
                                                    const std::vector<PackedRow>& rows,
                                                    const std::vector<FinetuneExample>& examples,
                                                    int64_t ctx, int64_t batch, int32_t pad,
                                                    int64_t measure_rows,
                                                    int64_t measured_targets) {
  std::vector<std::vector<float>> out(measuring() ? 0 : examples.size());
  for_each_log_prob_batch(model, rows, examples, ctx, batch, pad, 0, 1, measure_rows,
                          measured_targets,
                          [&](std::span<const PackedRow* const> mine, const float* v) {
                            const BatchTargets t = targets_of(mine, examples);
                            for (size_t k = 0; k < t.example.size(); ++k)
                              out[static_cast<size_t>(t.example[k])].push_back(v[k]);
                          });
  return out;
}

}  // namespace cputrain
