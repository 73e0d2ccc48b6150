#include "models/preference_step.h"

#include <algorithm>
#include <memory>
#include <stdexcept>

#include "engine/core/autograd.h"
#include "engine/core/memory.h"
#include "engine/core/profiler.h"
#include "engine/data/preference_data.h"
#include "engine/dist/communicator.h"
#include "engine/train/trainer.h"
#include "models/decoder.h"
#include "models/finetune_step.h"

namespace cputrain {
namespace {

int64_t target_count(const FinetuneExample& e) {
  return std::count(e.target.begin(), e.target.end(), uint8_t{1});
}

// The sequences of a packed batch, in order: each one's example and, per position with a
// target (in the order target_log_probs gives them), the sequence it belongs to.
struct BatchSequences {
  std::vector<int32_t> example;  // per sequence
  std::vector<int32_t> owner;    // per target
};
BatchSequences sequences_of(std::span<const PackedRow* const> rows,
                            const std::vector<FinetuneExample>& examples) {
  BatchSequences s;
  for (const PackedRow* row : rows)
    for (const int32_t i : row->examples) {
      const auto local = static_cast<int32_t>(s.example.size());
      s.example.push_back(i);
      const FinetuneExample& e = examples[static_cast<size_t>(i)];
      for (size_t j = 1; j < e.target.size(); ++j)
        if (e.target[j] != 0) s.owner.push_back(local);
    }
  return s;
}

// The pairs' loss of a micro-batch from its targets' log-probabilities `logps` (n): each pair's
// term over `pair_divisor` (ORPO: and its chosen tokens' NLL over `nll_divisor`), recorded for
// backward, which gives each target the derivative of the loss by its sequence's sum.
Variable pair_loss(const Variable& logps, const BatchSequences& seq, const PreferenceBatches& b,
                   double pair_divisor, double nll_divisor) {
  profiler::Scope scope("preference loss", profiler::Pass::Forward);
  Tensor y = Tensor::empty(Shape{1}, DType::F32, MemoryCategory::Activations);
  const auto S = seq.example.size();
  auto coef = std::make_shared<std::vector<double>>(S, 0.0);
  if (!measuring()) {
    const float* v = logps.value().f32();
    if (static_cast<size_t>(logps.value().numel()) != seq.owner.size())
      throw std::logic_error("pair_loss: one log-probability a target");
    std::vector<double> sums(S, 0.0);
    std::vector<int64_t> counts(S, 0);
    for (size_t k = 0; k < seq.owner.size(); ++k) {
      sums[static_cast<size_t>(seq.owner[k])] += v[k];
      ++counts[static_cast<size_t>(seq.owner[k])];
    }
    const bool orpo = b.loss.method == PreferenceMethod::Orpo;
    double loss = 0.0;
    for (size_t s = 0; s + 1 < S; s += 2) {
      const int32_t e = seq.example[s];
      if (e % 2 != 0 || seq.example[s + 1] != e + 1)
        throw std::logic_error("pair_loss: a row holds whole pairs, chosen then rejected");
      PairScores p{sums[s], sums[s + 1], counts[s], counts[s + 1]};
      if (!b.reference.empty()) {
        p.ref_chosen = b.reference[static_cast<size_t>(e)];
        p.ref_rejected = b.reference[static_cast<size_t>(e) + 1];
      }
      const PairTerm t = preference_pair(p, b.loss);
      loss += t.loss / pair_divisor;
      (*coef)[s] = t.d_chosen / pair_divisor;
      (*coef)[s + 1] = t.d_rejected / pair_divisor;
      if (orpo) {
        loss -= sums[s] / nll_divisor;
        (*coef)[s] -= 1.0 / nll_divisor;
      }
      if (b.stats) {
        b.stats->add(t);
        if (orpo) {
          b.stats->nll -= sums[s];
          b.stats->nll_tokens += static_cast<double>(counts[s]);
        }
      }
    }
    y.f32()[0] = static_cast<float>(loss);
  }
  const bool grad = needs_grad({&logps});
  Variable out = Variable::op_output(y, grad);
  if (grad) {
    record_backward("preference loss", [coef, owner = seq.owner, gx = logps.grad_ref(),
                                        gy = out.grad_ref(), n = logps.value().numel()] {
      const Tensor& dy = gy->tensor();
      if (!dy.defined()) return;
      float beta = 0.0f;
      float* g = gx->get_for_accumulate(&beta).f32();
      if (measuring()) return;
      const double scale = dy.f32()[0];
      for (int64_t k = 0; k < n; ++k) {
        const auto d = static_cast<float>(scale * (*coef)[static_cast<size_t>(owner[k])]);
        g[k] = beta == 0.0f ? d : g[k] + d;
      }
    });
  }
  return out;
}

}  // namespace

Variable preference_batch_loss(DecoderModel& model, std::span<const PackedRow* const> rows,
                               const PreferenceBatches& b, int32_t pad, const Tensor& inputs,
                               const Tensor& targets, double pairs, double chosen_tokens,
                               int64_t measured_targets) {
  const auto packing = pack_batch(rows, *b.examples, pad, inputs, targets, measured_targets);
  const BatchSequences seq = measuring() ? BatchSequences{} : sequences_of(rows, *b.examples);
  const Variable logps = model.target_log_probs(inputs, targets, packing);
  return pair_loss(logps, seq, b, std::max(pairs, 1.0), std::max(chosen_tokens, 1.0));
}

StepResult preference_step(Trainer& trainer, DecoderModel& model, int64_t step,
                           std::span<const PackedRow* const> rows, const PreferenceBatches& b,
                           int32_t pad, const Tensor& inputs, const Tensor& targets,
                           int64_t measured_targets) {
  const Communicator* comm = trainer.options().comm;
  const int64_t ranks = comm ? comm->size() : 1;
  // The step's pairs, and (ORPO) its chosen tokens: the divisors of every micro-batch's loss.
  const auto pairs = static_cast<double>(count_pairs(rows));
  double chosen_tokens = 0.0;
  for (const PackedRow* row : rows)
    for (size_t k = 0; k < row->examples.size(); k += 2)  // each pair's chosen, then rejected
      chosen_tokens +=
          static_cast<double>(target_count((*b.examples)[static_cast<size_t>(row->examples[k])]));
  StepResult r =
      packed_rows_step(trainer, model, step, rows, inputs.dim(0), inputs.dim(1),
                       [&](std::span<const PackedRow* const> mine) {
                         return preference_batch_loss(model, mine, b, pad, inputs, targets, pairs,
                                                      chosen_tokens, measured_targets);
                       });
  if (b.stats && ranks > 1 && !measuring()) {
    std::array<double, PreferenceStats::kFields> v = b.stats->values();
    comm->all_reduce_sum(v.data(), static_cast<int64_t>(v.size()));
    b.stats->set(v);
  }
  return r;
}

std::vector<double> sequence_log_probs(DecoderModel& model, const std::vector<PackedRow>& rows,
                                       const std::vector<FinetuneExample>& examples, int64_t ctx,
                                       int64_t batch, int32_t pad, const Communicator* comm,
                                       int64_t measure_rows, int64_t measured_targets) {
  const size_t ranks = comm ? static_cast<size_t>(comm->size()) : 1;
  const size_t rank = comm ? static_cast<size_t>(comm->rank()) : 0;
  std::vector<double> sums(measuring() ? 0 : examples.size(), 0.0);
  for_each_log_prob_batch(
      model, rows, examples, ctx, batch, pad, rank, ranks, measure_rows, measured_targets,
      [&](std::span<const PackedRow* const> mine, const float* v) {
        const BatchSequences seq = sequences_of(mine, examples);
        for (size_t k = 0; k < seq.owner.size(); ++k)
          sums[static_cast<size_t>(seq.example[static_cast<size_t>(seq.owner[k])])] += v[k];
      });
  // Each sum has one rank's addend and the others' zeros: every rank gets one process's sums.
  if (ranks > 1 && !measuring())
    comm->all_reduce_sum(sums.data(), static_cast<int64_t>(sums.size()));
  return sums;
}

double preference_loss_of(std::span<const double> logps,
                          const std::vector<FinetuneExample>& examples,
                          std::span<const double> reference, const PreferenceLossOptions& options,
                          PreferenceStats* stats) {
  const size_t pairs = examples.size() / 2;
  double loss = 0.0, nll = 0.0, tokens = 0.0;
  for (size_t p = 0; p < pairs; ++p) {
    PairScores s{logps[2 * p], logps[2 * p + 1], target_count(examples[2 * p]),
                 target_count(examples[2 * p + 1])};
    if (!reference.empty()) {
      s.ref_chosen = reference[2 * p];
      s.ref_rejected = reference[2 * p + 1];
    }
    const PairTerm t = preference_pair(s, options);
    loss += t.loss;
    nll -= s.chosen;
    tokens += static_cast<double>(s.chosen_tokens);
    if (stats) stats->add(t);
  }
  if (options.method == PreferenceMethod::Orpo && stats) {
    stats->nll += nll;
    stats->nll_tokens += tokens;
  }
  loss /= static_cast<double>(std::max<size_t>(pairs, 1));
  if (options.method == PreferenceMethod::Orpo) loss += nll / std::max(tokens, 1.0);
  return loss;
}

double preference_validation_loss(DecoderModel& model, const std::vector<PackedRow>& rows,
                                  const PreferenceBatches& b, int64_t ctx, int64_t batch,
                                  int32_t pad, const Communicator* comm, int64_t measure_rows,
                                  int64_t measured_targets) {
  const std::vector<double> logps = sequence_log_probs(model, rows, *b.examples, ctx, batch, pad,
                                                       comm, measure_rows, measured_targets);
  if (measuring()) return 0.0;
  return preference_loss_of(logps, *b.examples, b.reference, b.loss, b.stats);
}

}  // namespace cputrain
