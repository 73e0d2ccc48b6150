// The preference losses of a chosen and a rejected completion of one prompt, from the sums of
// their tokens' log-probabilities: DPO (Rafailov et al. 2023, the sigmoid loss) against a frozen
// reference's sums, and ORPO's odds-ratio term (Hong et al. 2024) on the per-token means, which
// needs no reference. Each gives its value, its derivatives by the two sums and the figures TRL
// logs under the same names (rewards/chosen, ...), in double precision.
#pragma once

#include <array>
#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>

namespace cputrain {

enum class PreferenceMethod { Dpo, Orpo };

struct PreferenceLossOptions {
  PreferenceMethod method = PreferenceMethod::Dpo;
  double beta = 0.1;    // DPO: the scale of the log-ratios (the KL penalty's strength)
  double lambda = 0.1;  // ORPO: the weight of the odds-ratio term beside the chosen's NLL
};

// One pair as the policy scores it: the sums of its completions' token log-probabilities and
// their token counts, and (DPO) the reference's sums.
struct PairScores {
  double chosen = 0.0, rejected = 0.0;
  int64_t chosen_tokens = 1, rejected_tokens = 1;
  double ref_chosen = 0.0, ref_rejected = 0.0;
};

// The pair's preference term and its derivatives by `chosen` and `rejected` (the sums):
//   DPO   -log sigmoid(beta ((chosen - ref_chosen) - (rejected - ref_rejected)))
//   ORPO  -lambda log sigmoid(log odds(c) - log odds(r)), odds(a) = e^a / (1 - e^a), a the
//         per-token mean log-probability (ORPO's supervised term, the chosen tokens' mean
//         negative log-likelihood, is the caller's: it is per token, not per pair)
// and the figures of the pair: rewards (DPO: beta times the log-ratio; ORPO: lambda times the
// mean log-probability, as TRL's ORPOTrainer logs them), the log-probabilities (DPO: sums;
// ORPO: means) and ORPO's log odds ratio.
struct PairTerm {
  double loss = 0.0;
  double d_chosen = 0.0, d_rejected = 0.0;
  double reward_chosen = 0.0, reward_rejected = 0.0;
  double logp_chosen = 0.0, logp_rejected = 0.0;
  double log_odds = 0.0;  // ORPO: log odds(c) - log odds(r)
};
PairTerm preference_pair(const PairScores& pair, const PreferenceLossOptions& options);

// The figures of a step's (or a validation pass's) pairs, summed; `line` gets their means under
// TRL's names (with `prefix`, e.g. "val_").
struct PreferenceStats {
  double pairs = 0.0;
  double loss = 0.0;  // the preference terms' sum (ORPO: without the NLL)
  double reward_chosen = 0.0, reward_rejected = 0.0, correct = 0.0;
  double logp_chosen = 0.0, logp_rejected = 0.0;
  double log_odds = 0.0, log_sigmoid_odds = 0.0;  // ORPO
  double nll = 0.0, nll_tokens = 0.0;             // ORPO: the chosen tokens' NLL and count
  void add(const PairTerm& t);
  // The fields in order, as an array (to sum over the ranks of a job), and back.
  static constexpr size_t kFields = 11;
  std::array<double, kFields> values() const;
  void set(const std::array<double, kFields>& v);
  void describe(PreferenceMethod method, nlohmann::json& line, const std::string& prefix) const;
  // The step line's words: "rewards chosen 0.412, rejected -0.108, accuracy 0.75, margin 0.520;
  // logps chosen -40.70, rejected -201.54" (the means of TRL's figures).
  std::string summary() const;
};

}  // namespace cputrain
