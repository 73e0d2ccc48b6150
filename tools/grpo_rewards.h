// GRPO's rewards (`cputrain finetune --method grpo --reward ...`): functions a program checks,
// each completion scored by each, the scores weighed and summed.
//   exact    1 where the completion's answer is the prompt's answer field, else 0: the last
//            number in each (numerically), or --answer-pattern's first group (else its match) in
//            the completion against the field as text (numerically where both are numbers)
//   regex    1 where --reward-pattern matches somewhere in the completion, else 0; {FIELD} in the
//            pattern stands for the prompt's field FIELD, matched literally
//   length   -(completion tokens) / --max-completion-length: a penalty for length
//   command  --reward-command CMD: one process for the run, reading JSON Lines of {"prompt",
//            "completion", "fields"} on its stdin and writing one number a line on its stdout,
//            a line for each completion, in order
#pragma once

#include <cstdint>
#include <memory>
#include <nlohmann/json.hpp>
#include <span>
#include <string>
#include <vector>

#include "engine/core/error.h"

namespace cputrain {

// What a reward function scores: the prompt as the data gives it (a string or messages), the
// completion's text and tokens, and the prompt's other fields.
struct RewardInput {
  const nlohmann::json* prompt = nullptr;
  const std::string* completion = nullptr;
  int64_t tokens = 0;
  const nlohmann::json* fields = nullptr;
};

// A reward that could not be computed (the command crashed, hung, printed something else): the
// run stops with its message and a checkpoint of the weights as the step found them.
struct RewardFailure : UserError {
  using UserError::UserError;
};

struct RewardOptions {
  std::string rewards;  // --reward: NAME[:WEIGHT],... ("": command where one is given)
  std::string answer_pattern, answer_field = "answer";
  std::string reward_pattern;
  std::string command;
  double timeout_s = 60.0;
  std::string command_log;  // where the command's stderr goes ("": the process's own)
  int64_t max_completion = 0;
};

class RewardFunction {
 public:
  virtual ~RewardFunction() = default;
  // Each input's score into `out`; a RewardFailure where it cannot give them.
  virtual void score(std::span<const RewardInput> inputs, std::span<double> out) = 0;
  // A UserError naming `where` where a prompt's fields lack what it reads.
  virtual void check_fields(const nlohmann::json& /*fields*/, const std::string& /*where*/) const {}
};

struct WeightedReward {
  std::string name;
  double weight = 1.0;
  std::unique_ptr<RewardFunction> function;
};

// The rewards `options` names, with their flags checked: a UserError naming the flag for an
// unknown name, a bad weight, a pattern that does not compile, a flag that no reward named reads.
std::vector<WeightedReward> make_rewards(const RewardOptions& options);
// The rewards' names and weights as --reward writes them ("exact:1,regex:0.5").
std::string rewards_text(const std::vector<WeightedReward>& rewards);

}  // namespace cputrain
