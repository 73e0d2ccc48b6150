// `cputrain finetune`: LoRA (or full) fine-tuning of a model file on JSON Lines examples, packed
// into rows, the loss on the replies (or with --method dpo or orpo, on preference pairs; with
// --method grpo, on completions it generates, scored by rewards); the adapter written as
// llama.cpp's LoRA GGUF and PEFT's folder.
#pragma once

#include <CLI/CLI.hpp>
#include <cstdint>
#include <string>

#include "tools/run/run_flags.h"

namespace cputrain {

struct FinetuneArgs : RunFlags {
  FinetuneArgs() {
    steps = 0;  // from --epochs
    batch = 4;
    accum = 4;
    ctx = 512;
    lr = 2e-4;
    weight_decay = 0.0;
    eval_every = 0;  // before the first step and after the last only
    save_every = 0;  // at the end only
  }
  std::string model;  // a GGUF file or a Hugging Face folder
  std::string data;   // JSON Lines
  std::string val;    // JSON Lines held out (--val), else --val-fraction of --data
  double val_fraction = 0.0;
  int64_t lora_rank = 16;
  double lora_alpha = 0.0;  // 0: twice the rank
  std::string lora_targets = "q,k,v,o,gate,up,down";
  double lora_dropout = 0.0;
  bool full = false;  // every parameter trains, no adapters
  double epochs = 1.0;
  double warmup = 0.03;       // of the steps
  std::string chat_template;  // a family name; empty: the model's, recognised
  bool train_on_prompt = false;
  // sft (examples with targets), or dpo or orpo (preference pairs).
  std::string method = "sft";
  double beta = 0.1;         // DPO's
  double orpo_lambda = 0.1;  // ORPO's
  // A mixture of experts' router losses' coefficients (TrainOptions::moe_balance, moe_z): off
  // by default, as Transformers' output_router_logits is.
  double moe_balance = 0.0;
  double moe_z = 0.0;
  // GRPO (--method grpo), by TRL's names: completions of each prompt (num_generations), their
  // sampling, the clipped surrogate's epsilons, updates of each generation (num_iterations), the
  // loss's normalisation (loss_type) and the rewards (tools/grpo_rewards.h). beta is 0 unless
  // given (no reference pass).
  int64_t generations = 8;
  int64_t max_completion = 256;
  double temperature = 1.0;
  double top_p = 1.0;
  int64_t top_k = 0;
  double epsilon = 0.2;
  double epsilon_high = 0.0;  // 0: epsilon
  int64_t iterations = 1;
  std::string loss_type = "dapo";
  std::string scale_rewards = "group";
  std::string rewards;
  std::string answer_pattern;
  std::string answer_field = "answer";
  std::string reward_pattern;
  std::string reward_command;
  double reward_timeout = 60.0;
};

void add_finetune_flags(CLI::App& app, FinetuneArgs& args);
int run_finetune(const FinetuneArgs& args);

// `eval` of the fine-tune in the run directory `dir` (named by `flag`): the loss of the examples
// (or pairs) it held out, as its validation computes it, with its result or the checkpoint
// `weights`, `batch` rows at a time; printed as a line, or as JSON. A UserError where it held
// none out or its data changed since.
int eval_finetune(const std::string& dir, const std::string& flag, const std::string& weights,
                  int64_t batch, bool as_json);

}  // namespace cputrain
