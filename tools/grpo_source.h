// GRPO as a batch source of the run loop (`cputrain finetune --method grpo`): each step's prompts
// (a share of them on each rank) each get G completions, generated together
// (models/generate.h generate_batch) from the model as it is; the rewards score them, the
// advantages are normalised within each group, and the completions, packed into rows, make the
// step's loss (models/grpo_step.h). --iterations N reuses a generation for N updates. Validation
// generates G completions of each held-out prompt with seeds of their own (the same at every
// validation) and reports their mean reward, with a few of them in train.log.
#pragma once

#include <spdlog/spdlog.h>

#include <cstdint>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "engine/data/batch_sampler.h"
#include "engine/data/finetune_data.h"
#include "engine/text/chat_template.h"
#include "engine/train/grpo_loss.h"
#include "tools/grpo_rewards.h"
#include "tools/run/loop.h"

namespace cputrain {

class Communicator;
class DecoderModel;
class Tokenizer;

// A prompt of the data: its tokens (rendered with the chat template where it is messages), the
// prompt as the data gives it, and its other fields (what the rewards read).
struct GrpoPrompt {
  std::vector<int32_t> tokens;
  nlohmann::json prompt;
  nlohmann::json fields;
  int64_t line = 0;
};

struct GrpoPrompts {
  std::vector<GrpoPrompt> prompts;
  int64_t text = 0, chat = 0;  // prompts of each shape
  int64_t dropped = 0;         // longer than max_tokens
};

// JSON Lines of prompts: {"prompt": "..."} (text, as it is), {"prompt": [messages]} or
// {"messages": [...]} (rendered with `chat` and the assistant's turn begun); every other field
// is passed to the rewards. Prompts of more than `max_tokens` tokens are dropped (counted). A
// UserError naming the file and line for a line of no prompt, or a chat without a template; and
// for a file of no prompt that fits.
GrpoPrompts read_grpo_prompts(const std::string& path, const Tokenizer& tokenizer,
                              const std::optional<ChatTemplate>& chat, int64_t max_tokens,
                              int64_t max_line_bytes);

struct GrpoOptions {
  int64_t generations = 8;  // G: completions of each prompt
  int64_t max_completion = 256;
  float temperature = 1.0f, top_p = 1.0f;
  int64_t top_k = 0;
  int64_t iterations = 1;  // updates of each generation
  bool scale_rewards = true;
  GrpoLossOptions loss;
  int64_t batch = 1, accum = 1, ctx = 0;  // completions a micro-batch, micro-batches, row width
  uint64_t seed = 0;
  // With --iterations above 1, the run directory where each generation is kept
  // (generation-RANK.cbor) for a run resumed within its iterations, and the run's identity it is
  // kept under (the data's fingerprint and the seed).
  std::string dir;
  uint64_t identity = 0;
};

class GrpoSource final : public BatchSource {
 public:
  GrpoSource(DecoderModel& model, const Tokenizer& tokenizer, const GrpoPrompts& train,
             const GrpoPrompts& val, std::vector<WeightedReward>& rewards,
             const GrpoOptions& options, std::vector<int32_t> stop_tokens, DecoderModel* reference,
             const Communicator& comm, std::shared_ptr<spdlog::logger> log);
  ~GrpoSource() override;
  StepResult step(Trainer& trainer, int64_t step) override;
  bool validates() const override { return !val_.prompts.empty(); }
  double validate(Trainer& trainer) override;
  void describe(int64_t step, nlohmann::json& line) const override;
  std::string note() const override;
  void describe_validation(nlohmann::json& line) const override;
  std::string validation_note() const override;
  const char* validation_label() const override { return "val reward"; }
  const char* validation_key() const override { return "val_reward"; }

  // Prompts a step takes on each rank.
  int64_t prompts_per_rank() const;

 private:
  struct Generation;
  // The completions of `prompts` (indices into `set`), G each, their rewards and advantages;
  // prompt j's completions drawn from seeds of (seed_base, keys[j]).
  void generate(const GrpoPrompts& set, const std::vector<size_t>& prompts,
                const std::vector<uint64_t>& keys, uint64_t seed_base, Generation& g);
  void make_generation(int64_t cycle);
  // The generation kept for `cycle` (nullptr where there is none of it, with why not in `why`).
  std::unique_ptr<Generation> kept_generation(int64_t cycle, std::string* why) const;
  void keep_generation() const;
  std::string kept_path() const;

  DecoderModel& model_;
  const Tokenizer& tokenizer_;
  const GrpoPrompts& train_;
  const GrpoPrompts& val_;
  std::vector<WeightedReward>& rewards_;
  GrpoOptions o_;
  std::vector<int32_t> stop_;
  DecoderModel* reference_;  // the KL's (nullptr: the model with its adapters switched off)
  const Communicator& comm_;
  std::shared_ptr<spdlog::logger> log_;
  RowOrder order_;
  std::unique_ptr<Generation> gen_;
  int64_t cycle_ = -1;  // the generation held
  Tensor inputs_, targets_;
  // The last step's figures (the job's).
  GrpoStats stats_;
  double generation_ms_ = 0.0, update_ms_ = 0.0;
  std::vector<double> step_figures_;  // reward, per function, reward_std, zero std, lengths...
  std::vector<double> val_figures_;
};

}  // namespace cputrain
