#include "engine/train/grpo_loss.h"

#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <utility>

namespace cputrain {

const char* grpo_loss_type_name(GrpoLossType type) {
  switch (type) {
    case GrpoLossType::Grpo:
      return "grpo";
    case GrpoLossType::DrGrpo:
      return "dr_grpo";
    case GrpoLossType::Dapo:
      break;
  }
  return "dapo";
}

GrpoTokenTerm grpo_token(double logp, double old_logp, double ref_logp, double advantage,
                         const GrpoLossOptions& o) {
  GrpoTokenTerm t;
  const double r = std::exp(logp - old_logp);
  const double clipped = std::clamp(r, 1.0 - o.epsilon, 1.0 + o.epsilon_high);
  const double unclipped_term = r * advantage, clipped_term = clipped * advantage;
  // The smaller term is taken: where it is the clipped one and the clamp holds, no gradient.
  t.clipped_low = r < 1.0 - o.epsilon && advantage < 0.0;
  t.clipped_high = r > 1.0 + o.epsilon_high && advantage > 0.0;
  t.loss = -std::min(unclipped_term, clipped_term);
  t.d_logp = t.clipped_low || t.clipped_high ? 0.0 : -advantage * r;
  if (o.beta > 0.0) {
    const double d = ref_logp - logp;
    t.kl = std::exp(d) - d - 1.0;
    t.loss += o.beta * t.kl;
    t.d_logp += o.beta * (1.0 - std::exp(d));
  }
  return t;
}

namespace {

// Each group's mean and standard deviation (Bessel's; 0 for one).
void group_moments(std::span<const double> rewards, int64_t group, size_t g, double* mean,
                   double* std) {
  const auto n = static_cast<size_t>(group);
  double sum = 0.0;
  for (size_t i = 0; i < n; ++i) sum += rewards[g * n + i];
  *mean = sum / static_cast<double>(n);
  double sq = 0.0;
  for (size_t i = 0; i < n; ++i) sq += (rewards[g * n + i] - *mean) * (rewards[g * n + i] - *mean);
  *std = n > 1 ? std::sqrt(sq / static_cast<double>(n - 1)) : 0.0;
}

size_t groups_of(std::span<const double> rewards, int64_t group) {
  if (group < 1 || rewards.size() % static_cast<size_t>(group) != 0)
    throw std::invalid_argument("GRPO: the rewards are whole groups");
  return rewards.size() / static_cast<size_t>(group);
}

// The mean of the groups' deviations, and the share of groups whose rewards are all alike.
std::pair<double, double> group_spread(std::span<const double> rewards, int64_t group) {
  const size_t groups = groups_of(rewards, group);
  double sum = 0.0, zero = 0.0;
  for (size_t g = 0; g < groups; ++g) {
    double mean = 0.0, std = 0.0;
    group_moments(rewards, group, g, &mean, &std);
    sum += std;
    zero += std == 0.0 ? 1.0 : 0.0;
  }
  const auto n = static_cast<double>(std::max<size_t>(groups, 1));
  return {sum / n, zero / n};
}

}  // namespace

std::vector<double> group_advantages(std::span<const double> rewards, int64_t group, bool scale) {
  const size_t groups = groups_of(rewards, group);
  std::vector<double> a(rewards.size(), 0.0);
  const auto n = static_cast<size_t>(group);
  for (size_t g = 0; g < groups; ++g) {
    double mean = 0.0, std = 0.0;
    group_moments(rewards, group, g, &mean, &std);
    for (size_t i = 0; i < n; ++i) {
      a[g * n + i] = rewards[g * n + i] - mean;
      if (scale) a[g * n + i] /= std + 1e-4;
    }
  }
  return a;
}

double mean_group_std(std::span<const double> rewards, int64_t group) {
  return group_spread(rewards, group).first;
}

double zero_std_fraction(std::span<const double> rewards, int64_t group) {
  return group_spread(rewards, group).second;
}

void GrpoStats::add(const GrpoTokenTerm& t) {
  tokens += 1.0;
  kl += t.kl;
  clipped_low += t.clipped_low ? 1.0 : 0.0;
  clipped_high += t.clipped_high ? 1.0 : 0.0;
}

std::array<double, GrpoStats::kFields> GrpoStats::values() const {
  return {tokens, kl, clipped_low, clipped_high};
}

void GrpoStats::set(const std::array<double, kFields>& v) {
  tokens = v[0];
  kl = v[1];
  clipped_low = v[2];
  clipped_high = v[3];
}

}  // namespace cputrain
