// GRPO's loss (DeepSeekMath; as TRL's GRPOTrainer computes it): advantages normalised within each
// group of completions of one prompt, and per completion token the clipped surrogate objective
// with the KL to a reference,
//   r = exp(logp - old_logp)
//   loss_t = -min(r A, clip(r, 1 - epsilon, 1 + epsilon_high) A) + beta KL_t
//   KL_t = exp(ref_logp - logp) - (ref_logp - logp) - 1        (k3, always >= 0)
// weighted by the loss type's normalisation (TRL's loss_type):
//   dapo     every completion token of the step alike: over the count of the step's tokens
//   grpo     each completion's mean over its tokens, then the mean over the completions
//   dr_grpo  over completions x max_completion_length (Dr. GRPO: no length bias)
#pragma once

#include <array>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

namespace cputrain {

enum class GrpoLossType { Dapo, Grpo, DrGrpo };
// "dapo", "grpo", "dr_grpo".
const char* grpo_loss_type_name(GrpoLossType type);

struct GrpoLossOptions {
  double beta = 0.0;  // the KL's weight (0: no reference pass)
  double epsilon = 0.2, epsilon_high = 0.2;
  GrpoLossType type = GrpoLossType::Dapo;
};

// One completion token's term and its derivative by logp. `old_logp`: the log-probability under
// the policy that generated the completion (on policy: logp itself, r = 1); `ref_logp` is read
// where beta > 0.
struct GrpoTokenTerm {
  double loss = 0.0;
  double d_logp = 0.0;
  double kl = 0.0;
  bool clipped_low = false;   // r < 1 - epsilon with A < 0: the clipped term is taken
  bool clipped_high = false;  // r > 1 + epsilon_high with A > 0
};
GrpoTokenTerm grpo_token(double logp, double old_logp, double ref_logp, double advantage,
                         const GrpoLossOptions& options);

// The advantages of `rewards`, groups of `group` consecutive completions of one prompt: each
// reward less its group's mean, over (the group's standard deviation (Bessel's) + 1e-4) where
// `scale` (TRL's scale_rewards "group"). A group of one has the advantage 0.
std::vector<double> group_advantages(std::span<const double> rewards, int64_t group, bool scale);
// The mean over the groups of their rewards' standard deviation (Bessel's; 0 for a group of
// one), and the fraction of groups whose rewards are all alike (TRL's reward_std and
// frac_reward_zero_std).
double mean_group_std(std::span<const double> rewards, int64_t group);
double zero_std_fraction(std::span<const double> rewards, int64_t group);

// The figures of a step's completion tokens, as TRL logs them: sums to be divided by `tokens`.
struct GrpoStats {
  static constexpr int kFields = 4;
  double tokens = 0.0;
  double kl = 0.0;
  double clipped_low = 0.0, clipped_high = 0.0;
  void add(const GrpoTokenTerm& t);
  std::array<double, kFields> values() const;
  void set(const std::array<double, kFields>& v);
};

}  // namespace cputrain
