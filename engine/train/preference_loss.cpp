#include "engine/train/preference_loss.h"

#include <algorithm>
#include <cmath>
#include <cstdio>

namespace cputrain {
namespace {

// log(1 + e^x) without overflow.
double softplus(double x) {
  return std::max(x, 0.0) + std::log1p(std::exp(-std::abs(x)));
}
// 1 / (1 + e^-x) without overflow.
double sigmoid(double x) {
  if (x >= 0.0) return 1.0 / (1.0 + std::exp(-x));
  const double e = std::exp(x);
  return e / (1.0 + e);
}
// A mean log-probability of 0 (a completion certain to the last bit) has no odds: taken just
// below it.
constexpr double kCertain = -1e-9;
// log(e^a / (1 - e^a)) and its derivative by a, 1 / (1 - e^a).
double log_odds(double a) {
  a = std::min(a, kCertain);
  return a - std::log(-std::expm1(a));
}
double log_odds_slope(double a) {
  a = std::min(a, kCertain);
  return -1.0 / std::expm1(a);
}

}  // namespace

PairTerm preference_pair(const PairScores& p, const PreferenceLossOptions& o) {
  PairTerm t;
  if (o.method == PreferenceMethod::Dpo) {
    t.reward_chosen = o.beta * (p.chosen - p.ref_chosen);
    t.reward_rejected = o.beta * (p.rejected - p.ref_rejected);
    const double h = t.reward_chosen - t.reward_rejected;
    t.loss = softplus(-h);
    const double s = o.beta * sigmoid(-h);
    t.d_chosen = -s;
    t.d_rejected = s;
    t.logp_chosen = p.chosen;
    t.logp_rejected = p.rejected;
    return t;
  }
  const double ac = p.chosen / static_cast<double>(std::max<int64_t>(p.chosen_tokens, 1));
  const double ar = p.rejected / static_cast<double>(std::max<int64_t>(p.rejected_tokens, 1));
  t.log_odds = log_odds(ac) - log_odds(ar);
  t.loss = o.lambda * softplus(-t.log_odds);
  const double d = -o.lambda * sigmoid(-t.log_odds);  // by the log odds ratio
  t.d_chosen = d * log_odds_slope(ac) / static_cast<double>(std::max<int64_t>(p.chosen_tokens, 1));
  t.d_rejected =
      -d * log_odds_slope(ar) / static_cast<double>(std::max<int64_t>(p.rejected_tokens, 1));
  t.reward_chosen = o.lambda * ac;
  t.reward_rejected = o.lambda * ar;
  t.logp_chosen = ac;
  t.logp_rejected = ar;
  return t;
}

void PreferenceStats::add(const PairTerm& t) {
  pairs += 1.0;
  loss += t.loss;
  reward_chosen += t.reward_chosen;
  reward_rejected += t.reward_rejected;
  correct += t.reward_chosen > t.reward_rejected ? 1.0 : 0.0;
  logp_chosen += t.logp_chosen;
  logp_rejected += t.logp_rejected;
  log_odds += t.log_odds;
  log_sigmoid_odds += -softplus(-t.log_odds);
}

std::array<double, PreferenceStats::kFields> PreferenceStats::values() const {
  return {pairs,       loss,          reward_chosen, reward_rejected,  correct,
          logp_chosen, logp_rejected, log_odds,      log_sigmoid_odds, nll,
          nll_tokens};
}

void PreferenceStats::set(const std::array<double, kFields>& v) {
  pairs = v[0];
  loss = v[1];
  reward_chosen = v[2];
  reward_rejected = v[3];
  correct = v[4];
  logp_chosen = v[5];
  logp_rejected = v[6];
  log_odds = v[7];
  log_sigmoid_odds = v[8];
  nll = v[9];
  nll_tokens = v[10];
}

void PreferenceStats::describe(PreferenceMethod method, nlohmann::json& line,
                               const std::string& prefix) const {
  if (pairs <= 0.0) return;
  const auto mean = [this](double sum) { return sum / pairs; };
  line[prefix + "rewards/chosen"] = mean(reward_chosen);
  line[prefix + "rewards/rejected"] = mean(reward_rejected);
  line[prefix + "rewards/accuracies"] = mean(correct);
  line[prefix + "rewards/margins"] = mean(reward_chosen - reward_rejected);
  line[prefix + "logps/chosen"] = mean(logp_chosen);
  line[prefix + "logps/rejected"] = mean(logp_rejected);
  if (method == PreferenceMethod::Orpo) {
    line[prefix + "log_odds_ratio"] = mean(log_sigmoid_odds);
    line[prefix + "log_odds_chosen"] = mean(log_odds);
    if (nll_tokens > 0.0) line[prefix + "nll_loss"] = nll / nll_tokens;
  }
}

std::string PreferenceStats::summary() const {
  if (pairs <= 0.0) return "";
  char text[160];
  std::snprintf(text, sizeof text,
                "rewards chosen %.3f, rejected %.3f, accuracy %.2f, margin %.3f; logps chosen "
                "%.2f, rejected %.2f",
                reward_chosen / pairs, reward_rejected / pairs, correct / pairs,
                (reward_chosen - reward_rejected) / pairs, logp_chosen / pairs,
                logp_rejected / pairs);
  return text;
}

}  // namespace cputrain
