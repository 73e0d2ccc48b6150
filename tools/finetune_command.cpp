#include "tools/finetune_command.h"

#include <omp.h>
#include <spdlog/sinks/stdout_sinks.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <memory>
#include <nlohmann/json.hpp>
#include <numeric>
#include <random>
#include <sstream>
#include <string_view>

#include "engine/core/autograd.h"
#include "engine/core/error.h"
#include "engine/core/hash.h"
#include "engine/core/memory.h"
#include "engine/core/profiler.h"
#include "engine/data/batch_sampler.h"
#include "engine/data/preference_data.h"
#include "engine/io/atomic_file.h"
#include "engine/io/offload.h"
#include "engine/text/chat_template.h"
#include "engine/text/tokenizer.h"
#include "engine/text/vocab_tokenizer.h"
#include "engine/train/checkpoint_file.h"
#include "engine/train/trainer.h"
#include "kernels/cpu/cpu_features.h"
#include "kernels/cpu/dispatch.h"
#include "kernels/gemm/gemm.h"
#include "models/architecture.h"
#include "models/decoder.h"
#include "models/finetune_step.h"
#include "models/gguf_model.h"
#include "models/hf_writer.h"
#include "models/lora.h"
#include "models/memory_budget.h"
#include "models/preference_step.h"
#include "tools/budget_command.h"
#include "tools/flag_checks.h"
#include "tools/grpo_source.h"
#include "tools/model_source.h"
#include "tools/preference_rows.h"
#include "tools/run/job.h"
#include "tools/run/loop.h"
#include "tools/run/progress.h"
#include "tools/run/run_dir.h"
#include "tools/run/session.h"
#include "tools/run/train_stages.h"

namespace cputrain {

namespace {

// --method grpo's flags, by TRL's names where it has them.
void add_grpo_flags(CLI::App& app, FinetuneArgs& a) {
  app.add_option("--generations", a.generations,
                 "GRPO: completions of each prompt, a group (num_generations); --batch x --accum "
                 "completions make a step")
      ->capture_default_str()
      ->check(positive_whole());
  app.add_option("--max-completion-length", a.max_completion, "GRPO: tokens a completion may have")
      ->capture_default_str()
      ->check(positive_whole());
  app.add_option("--temperature", a.temperature, "GRPO: the sampling temperature")
      ->capture_default_str()
      ->check(CLI::Range(0.0, 100.0));
  app.add_option("--top-p", a.top_p, "GRPO: nucleus sampling's probability")
      ->capture_default_str()
      ->check(CLI::Range(0.0, 1.0));
  app.add_option("--top-k", a.top_k, "GRPO: sample among the k most likely tokens (0: all)")
      ->capture_default_str()
      ->check(non_negative());
  app.add_option("--epsilon", a.epsilon, "GRPO: the clipping of the probability ratio")
      ->capture_default_str()
      ->check(CLI::Range(0.0, 1.0));
  app.add_option("--epsilon-high", a.epsilon_high,
                 "GRPO: the clipping above (DAPO's clip-higher; default --epsilon)")
      ->check(CLI::Range(0.0, 10.0));
  app.add_option("--iterations", a.iterations,
                 "GRPO: updates on each generation's completions (num_iterations)")
      ->capture_default_str()
      ->check(positive_whole());
  app.add_option("--loss-type", a.loss_type,
                 "GRPO: dapo (over the step's completion tokens), grpo (each completion's mean) or "
                 "dr_grpo (over completions x --max-completion-length)")
      ->capture_default_str()
      ->check(CLI::IsMember({"dapo", "grpo", "dr_grpo"}));
  app.add_option("--scale-rewards", a.scale_rewards,
                 "GRPO: group (advantages over each group's standard deviation) or none")
      ->capture_default_str()
      ->check(CLI::IsMember({"group", "none"}));
  app.add_option("--reward", a.rewards,
                 "GRPO: rewards, NAME[:WEIGHT],...: exact (the answer field), regex "
                 "(--reward-pattern), length (a penalty), command (--reward-command)");
  app.add_option("--answer-pattern", a.answer_pattern,
                 "exact reward: the completion's answer, the pattern's first group (default: the "
                 "last number)");
  app.add_option("--answer-field", a.answer_field, "exact reward: the prompt's field to match")
      ->capture_default_str();
  app.add_option("--reward-pattern", a.reward_pattern,
                 "regex reward: 1 where a completion matches it ({FIELD}: the prompt's field)");
  app.add_option("--reward-command", a.reward_command,
                 "A program that scores: JSON Lines of {prompt, completion, fields} on its stdin, "
                 "one number a line on its stdout (flushed), one process for the run");
  app.add_option("--reward-timeout", a.reward_timeout,
                 "Seconds the reward command may take for a score before the run stops")
      ->capture_default_str()
      ->check(positive());
}

}  // namespace

void add_finetune_flags(CLI::App& app, FinetuneArgs& a) {
  app.add_option("--model", a.model,
                 "The model to fine-tune: a GGUF file, a Hugging Face folder or a cputrain run");
  app.add_option("--data", a.data,
                 "JSON Lines of examples: {text}, {prompt, completion}, Alpaca's {instruction, "
                 "input, output} or chat {messages}");
  app.add_option("--val", a.val, "JSON Lines held out for validation");
  app.add_option("--val-fraction", a.val_fraction,
                 "Hold out this fraction of --data for validation (without --val)")
      ->check(CLI::Range(0.0, 0.5));
  add_run_flags(app, a, RunCommand::Finetune);
  app.add_option("--lora-rank", a.lora_rank, "LoRA rank")
      ->capture_default_str()
      ->check(positive_whole());
  app.add_option("--lora-alpha", a.lora_alpha,
                 "LoRA alpha; the update is scaled alpha / rank (default: twice the rank)")
      ->check(positive());
  app.add_option("--lora-targets", a.lora_targets,
                 "Projections that get adapters: q,k,v,o,gate,up,down or all (a mixture's "
                 "experts through gate,up,down; its router only where named: router)")
      ->capture_default_str();
  app.add_option("--lora-dropout", a.lora_dropout,
                 "Dropout on the adapters' input in training (PEFT's lora_dropout)")
      ->capture_default_str()
      ->check(CLI::Range(0.0, 0.9));
  app.add_flag("--full", a.full, "Train every parameter instead of adapters");
  app.add_option("--epochs", a.epochs, "Passes over the data (without --steps)")
      ->capture_default_str()
      ->check(positive());
  app.add_option("--warmup", a.warmup, "Warm-up, as a fraction of the steps")
      ->capture_default_str()
      ->check(CLI::Range(0.0, 1.0));
  app.add_option("--chat-template", a.chat_template,
                 "chatml, llama3, llama2, mistral, zephyr, phi3, gemma or gemma4 (default: the "
                 "model's, recognised)");
  app.add_flag("--train-on-prompt", a.train_on_prompt,
               "The loss on every token, not only on completions and replies");
  app.add_option("--method", a.method,
                 "sft: examples with targets; dpo or orpo: preference pairs, {prompt, chosen, "
                 "rejected} (strings or messages) or {chosen, rejected}; grpo: prompts, {prompt} "
                 "or {messages} with any other fields, each given completions scored by --reward")
      ->capture_default_str()
      ->check(CLI::IsMember({"sft", "dpo", "orpo", "grpo"}));
  app.add_option("--beta", a.beta,
                 "DPO's beta: the scale of the log-ratios to the reference; GRPO's: the weight "
                 "of the KL to the reference (default 0: none)")
      ->capture_default_str()
      ->check(positive())
      ->check(at_most(1000, "a margin of a nat would already decide every pair"));
  app.add_option("--moe-balance", a.moe_balance,
                 "A mixture of experts' load-balancing loss coefficient (Switch Transformer; "
                 "Qwen's router_aux_loss_coef, 0.001 in its pretraining), averaged over the MoE "
                 "layers; with dpo and orpo too, added to their loss")
      ->capture_default_str()
      ->check(non_negative());
  app.add_option("--moe-z-loss", a.moe_z,
                 "A mixture of experts' router z-loss coefficient (ST-MoE), averaged over the "
                 "MoE layers")
      ->capture_default_str()
      ->check(non_negative());
  add_grpo_flags(app, a);
  app.add_option("--orpo-lambda", a.orpo_lambda,
                 "ORPO's lambda: the weight of the odds-ratio term beside the chosen's NLL")
      ->capture_default_str()
      ->check(positive())
      ->check(at_most(1000, "the chosen's NLL would weigh nothing beside it"));
}

namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;

// The learning rate of a fine-tune's steps past the schedule it began with (extended by --steps
// or --epochs on a resume), as a fraction of the peak: its schedule decays to 0.
constexpr double kExtendedLrRatio = 0.1;

// The keys of a fine-tune's config.json, each with the flag that sets it.
constexpr std::pair<const char*, const char*> kRunKeys[] = {
    {"model", "--model"},
    {"data", "--data"},
    {"val", "--val"},
    {"val_fraction", "--val-fraction"},
    {"full", "--full"},
    {"lora_rank", "--lora-rank"},
    {"lora_alpha", "--lora-alpha"},
    {"lora_targets", "--lora-targets"},
    {"lora_dropout", "--lora-dropout"},
    {"steps", "--steps"},
    {"batch", "--batch"},
    {"accum", "--accum"},
    {"ctx", "--ctx"},
    {"lr", "--lr"},
    {"warmup", "--warmup"},
    {"weight_decay", "--weight-decay"},
    {"dtype", "--dtype"},
    {"checkpoint", "--checkpoint"},
    {"chat_template", "--chat-template"},
    {"train_on_prompt", "--train-on-prompt"},
    {"method", "--method"},
    {"beta", "--beta"},
    {"orpo_lambda", "--orpo-lambda"},
    {"moe_balance", "--moe-balance"},
    {"moe_z_loss", "--moe-z-loss"},
    {"generations", "--generations"},
    {"max_completion_length", "--max-completion-length"},
    {"temperature", "--temperature"},
    {"top_p", "--top-p"},
    {"top_k", "--top-k"},
    {"epsilon", "--epsilon"},
    {"epsilon_high", "--epsilon-high"},
    {"iterations", "--iterations"},
    {"loss_type", "--loss-type"},
    {"scale_rewards", "--scale-rewards"},
    {"rewards", "--reward"},
    {"answer_pattern", "--answer-pattern"},
    {"answer_field", "--answer-field"},
    {"reward_pattern", "--reward-pattern"},
    {"reward_command", "--reward-command"},
    {"seed", "--seed"}};

// --method grpo's flags: given with another method, refused.
constexpr const char* kGrpoFlags[] = {"--generations",    "--max-completion-length",
                                      "--temperature",    "--top-p",
                                      "--top-k",          "--epsilon",
                                      "--epsilon-high",   "--iterations",
                                      "--loss-type",      "--scale-rewards",
                                      "--reward",         "--answer-pattern",
                                      "--answer-field",   "--reward-pattern",
                                      "--reward-command", "--reward-timeout"};

// A fine-tune's config.json, parsed; a UserError naming it where it is missing, malformed or a
// training run's.
json read_finetune_config(const std::string& dir) {
  const std::string path = dir + "/config.json";
  if (!fs::is_directory(dir)) throw UserError("--resume " + dir + ": no such run directory");
  std::ifstream in(path);
  if (!in) throw UserError("--resume " + dir + ": no config.json (not a fine-tune's run)");
  std::stringstream text;
  text << in.rdbuf();
  json j;
  try {
    j = json::parse(text.str());
  } catch (const json::exception&) {
    throw UserError(path + ": not valid JSON");
  }
  if (!j.is_object() || !j.contains("data") || !j.contains("model"))
    throw UserError("--resume " + dir + ": " + path +
                    (j.is_object() && j.contains("preset")
                         ? " is a training run's: continue it with cputrain train --resume " + dir
                         : " is not a fine-tune's configuration"));
  return j;
}

// --resume: the flags the run began with, from its config.json, where the command line gives
// none. What the command line gives is compared with the run once resolved (check_resumed).
FinetuneArgs resumed_args(const FinetuneArgs& a, const json& run) {
  FinetuneArgs r = a;
  try {
    const auto take = [&](const char* flag, auto& field, const char* key) {
      using T = std::decay_t<decltype(field)>;
      if (!a.was_given(flag) && run.contains(key)) field = run.at(key).get<T>();
    };
    take("--model", r.model, "model");
    take("--data", r.data, "data");
    take("--val", r.val, "val");
    take("--val-fraction", r.val_fraction, "val_fraction");
    take("--full", r.full, "full");
    if (!r.full) {
      take("--lora-rank", r.lora_rank, "lora_rank");
      take("--lora-alpha", r.lora_alpha, "lora_alpha");
      take("--lora-targets", r.lora_targets, "lora_targets");
      take("--lora-dropout", r.lora_dropout, "lora_dropout");
    }
    // --epochs on a resume sets where it ends, as --steps does.
    if (!a.was_given("--epochs")) take("--steps", r.steps, "steps");
    take("--batch", r.batch, "batch");
    take("--accum", r.accum, "accum");
    take("--ctx", r.ctx, "ctx");
    take("--lr", r.lr, "lr");
    take("--weight-decay", r.weight_decay, "weight_decay");
    take("--dtype", r.dtype, "dtype");
    take("--checkpoint", r.checkpoint, "checkpoint");
    take("--train-on-prompt", r.train_on_prompt, "train_on_prompt");
    take("--method", r.method, "method");
    take("--beta", r.beta, "beta");
    take("--orpo-lambda", r.orpo_lambda, "orpo_lambda");
    take("--moe-balance", r.moe_balance, "moe_balance");
    take("--moe-z-loss", r.moe_z, "moe_z_loss");
    if (r.method == "grpo") {
      take("--generations", r.generations, "generations");
      take("--max-completion-length", r.max_completion, "max_completion_length");
      take("--temperature", r.temperature, "temperature");
      take("--top-p", r.top_p, "top_p");
      take("--top-k", r.top_k, "top_k");
      take("--epsilon", r.epsilon, "epsilon");
      take("--epsilon-high", r.epsilon_high, "epsilon_high");
      take("--iterations", r.iterations, "iterations");
      take("--loss-type", r.loss_type, "loss_type");
      take("--scale-rewards", r.scale_rewards, "scale_rewards");
      take("--reward", r.rewards, "rewards");
      take("--answer-pattern", r.answer_pattern, "answer_pattern");
      take("--answer-field", r.answer_field, "answer_field");
      take("--reward-pattern", r.reward_pattern, "reward_pattern");
      take("--reward-command", r.reward_command, "reward_command");
      take("--reward-timeout", r.reward_timeout, "reward_timeout");
    }
    take("--seed", r.seed, "seed");
    if (!a.was_given("--chat-template"))
      r.chat_template = run.value("chat_template_flag", run.value("chat_template", std::string()));
    // The fraction it began with (of the steps it began with, where it predates the key).
    const auto began_steps = run.value("steps", int64_t{0});
    if (!a.was_given("--warmup") && began_steps > 0)
      r.warmup = run.value("warmup", static_cast<double>(run.value("warmup_steps", int64_t{0})) /
                                         static_cast<double>(began_steps));
  } catch (const json::exception&) {
    throw UserError(a.run_dir() + "/config.json: malformed fine-tune configuration");
  }
  return r;
}

// A resumed fine-tune's configuration, resolved from the flags given and the model and data, is
// the one it began with: a UserError naming what differs.
void check_resumed(const std::string& dir, const json& run, const json& now) {
  std::string changed;
  for (const auto& [key, flag] : kRunKeys) {
    // Where the run ends may change (--steps, --epochs): resume_from and the log say how.
    if (std::string_view(key) == "steps") continue;
    if (!run.contains(key) || !now.contains(key) || run[key] == now[key]) continue;
    changed += std::string(changed.empty() ? "" : ", ") + flag + " " + now[key].dump() +
               " (the run's: " + run[key].dump() + ")";
  }
  if (!changed.empty())
    throw UserError("--resume " + dir + ": " + changed +
                    " would change the fine-tune, which keeps the configuration it began with (" +
                    dir + "/config.json); to change it, start a new run with --out");
}

// The model to fine-tune as the flags ask: adapters or every parameter, the precision, offload.
ModelOptions model_options(const FinetuneArgs& a, std::string* dtype_reason) {
  if (!a.val.empty() && a.val_fraction > 0.0) throw UserError("--val and --val-fraction: give one");
  if (a.was_given("--beta") && a.method != "dpo" && a.method != "grpo")
    throw UserError("--beta is DPO's and GRPO's: give --method dpo or grpo (the method is " +
                    a.method + ")");
  if (a.method != "grpo")
    for (const char* flag : kGrpoFlags)
      if (a.was_given(flag))
        throw UserError(std::string(flag) + " is GRPO's: give --method grpo (the method is " +
                        a.method + ")");
  if (a.method == "grpo") {
    if ((a.batch * a.accum) % a.generations != 0)
      throw UserError(fmt::format(
          "--batch {} x --accum {} = {} completions a step: not whole groups of --generations {}",
          a.batch, a.accum, a.batch * a.accum, a.generations));
    if (a.max_completion >= a.ctx)
      throw UserError(fmt::format(
          "--max-completion-length {} leaves no room for a prompt within --ctx {}: a prompt and "
          "its completion share a row",
          a.max_completion, a.ctx));
    if (a.epsilon_high > 0.0 && a.epsilon_high < a.epsilon)
      throw UserError(
          fmt::format("--epsilon-high {:g} is below --epsilon {:g}", a.epsilon_high, a.epsilon));
  }
  if (a.was_given("--orpo-lambda") && a.method != "orpo")
    throw UserError("--orpo-lambda is ORPO's: give --method orpo (the method is " + a.method + ")");
  if (a.train_on_prompt && a.method != "sft")
    throw UserError("--train-on-prompt and --method " + a.method +
                    ": a preference pair's loss falls on its two completions");
  if (a.full &&
      (a.lora_alpha > 0.0 || a.lora_targets != "q,k,v,o,gate,up,down" || a.lora_dropout > 0.0))
    throw UserError(
        "--full trains every parameter: no --lora-alpha, --lora-targets or --lora-dropout");
  ModelOptions options;
  options.compute_dtype = choose_dtype(a.dtype == "auto" ? "" : a.dtype, dtype_reason);
  if (!a.full) {
    options.lora.rank = a.lora_rank;
    options.lora.alpha = a.lora_alpha > 0.0 ? a.lora_alpha : 2.0 * static_cast<double>(a.lora_rank);
    options.lora.targets = parse_lora_targets(a.lora_targets, "--lora-targets");
    options.lora.dropout = a.lora_dropout;
  }
  if (!a.offload.empty()) {
    options.offload = true;
    options.offload_dir = std::make_shared<OffloadDir>(a.offload);
  }
  return options;
}

// The examples to train and validate on, tokenized with the chat template chosen.
struct Examples {
  FinetuneData data;
  std::vector<FinetuneExample> val;
  std::string chat_template;  // the family rendered with ("" none)
  uint64_t fingerprint = 0;   // every example's tokens and targets, training and validation
  bool pairs = false;         // preference pairs (--method dpo, orpo): two examples a pair
  // --method grpo: prompts, not examples (data and val are empty).
  bool grpo = false;
  GrpoPrompts prompts, val_prompts;
  std::optional<ChatTemplate> chat;
};

// The chat template: --chat-template, else the model's, where it is a known family.
std::optional<ChatTemplate> choose_chat_template(const FinetuneArgs& a, const Tokenizer& tokenizer,
                                                 spdlog::logger& log) {
  const Vocabulary* vocabulary =
      tokenizer.vocabulary() ? &tokenizer.vocabulary()->vocabulary() : nullptr;
  const std::string eos = vocabulary && vocabulary->eos >= 0
                              ? vocabulary->tokens[static_cast<size_t>(vocabulary->eos)]
                              : std::string("</s>");
  if (!a.chat_template.empty()) {
    log.info("chat template: {} (--chat-template)", a.chat_template);
    return chat_template_named(a.chat_template, "--chat-template", eos);
  }
  if (!vocabulary || vocabulary->chat_template.empty()) {
    log.info("chat template: none (the model has none; --chat-template names one)");
    return std::nullopt;
  }
  std::optional<ChatTemplate> chat = detect_chat_template(vocabulary->chat_template, eos);
  if (chat)
    log.info("chat template: {} (the model's)", std::string(chat_family_name(chat->family)));
  else
    log.info(
        "chat template: the model's is none cputrain recognises ({}); --chat-template names one",
        chat_family_names());
  return chat;
}

// --val-fraction: a seeded choice of `per` consecutive examples at a time (an example, or a
// pair's two; a prompt), taken out of `all` into `val`.
template <typename Item>
void hold_out(const FinetuneArgs& a, std::vector<Item>& all, std::vector<Item>& val, size_t per,
              const char* what) {
  std::vector<size_t> order(all.size() / per);
  for (size_t i = 0; i < order.size(); ++i) order[i] = i;
  seeded_shuffle(order, a.seed + 17);
  const auto n = static_cast<size_t>(
      std::max(1.0, std::round(a.val_fraction * static_cast<double>(order.size()))));
  if (n >= order.size())
    throw UserError("--val-fraction " + std::to_string(a.val_fraction) + ": " +
                    std::to_string(order.size()) + " " + what + " leave none to train on");
  std::vector<Item> kept;
  for (size_t k = 0; k < order.size(); ++k)
    for (size_t j = 0; j < per; ++j)
      (k + n < order.size() ? kept : val).push_back(std::move(all[order[k] * per + j]));
  all = std::move(kept);
}

// Preference pairs (--method dpo or orpo) as the examples of a fine-tune: two a pair.
void read_pairs(const FinetuneArgs& a, const Tokenizer& tokenizer, int64_t ctx,
                const FinetuneDataOptions& options, Examples& e, spdlog::logger& log) {
  PreferenceDataOptions po;
  po.chat = options.chat;
  po.ctx = ctx;
  po.max_line_bytes = options.max_line_bytes;
  po.max_data_bytes = options.max_data_bytes;
  PreferenceData d = read_preference_jsonl(a.data, tokenizer, po);
  const int64_t pairs = d.pairs();
  e.data.examples = std::move(d.examples);
  e.data.tokens = d.tokens;
  e.data.targets = d.targets;
  if (!a.val.empty())
    e.val = read_preference_jsonl(a.val, tokenizer, po).examples;
  else if (a.val_fraction > 0.0)
    hold_out(a, e.data.examples, e.val, 2, "pairs");
  std::string shapes;
  for (int s = 0; s < kPairShapes; ++s) {
    if (d.shapes[static_cast<size_t>(s)] == 0) continue;
    shapes += fmt::format("{}{} {}", shapes.empty() ? "" : ", ", d.shapes[static_cast<size_t>(s)],
                          pair_shape_name(static_cast<PairShape>(s)));
  }
  log.info(
      "data: {} preference pairs ({}), {} tokens, {} of them targets; {} cut to share a row of {} "
      "positions, {} dropped with no target left on a side, {} dropped with both sides the same "
      "once cut",
      pairs, shapes, d.tokens, d.targets, d.cut, ctx, d.dropped, d.same);
  if (d.cut > 0)
    log.warn("{} pairs are longer together than --ctx {} and were cut (a pair shares one row)",
             d.cut, ctx);
  if (d.same > 0)
    log.warn("{} pairs differ only past --ctx {} and were dropped: a longer --ctx keeps them",
             d.same, ctx);
}

// Prompts (--method grpo), each with room for --max-completion-length tokens after it.
void read_prompts(const FinetuneArgs& a, const Tokenizer& tokenizer, int64_t ctx,
                  const FinetuneDataOptions& options, Examples& e, spdlog::logger& log) {
  const int64_t room = ctx - a.max_completion;
  e.prompts = read_grpo_prompts(a.data, tokenizer, options.chat, room, options.max_line_bytes);
  if (!a.val.empty()) {
    e.val_prompts = read_grpo_prompts(a.val, tokenizer, options.chat, room, options.max_line_bytes);
  } else if (a.val_fraction > 0.0) {
    hold_out(a, e.prompts.prompts, e.val_prompts.prompts, 1, "prompts");
  }
  log.info(
      "data: {} prompts ({} text, {} chat), {} held out; {} dropped, longer than --ctx {} less "
      "--max-completion-length {}",
      e.prompts.prompts.size(), e.prompts.text, e.prompts.chat, e.val_prompts.prompts.size(),
      e.prompts.dropped + e.val_prompts.dropped, ctx, a.max_completion);
  if (e.prompts.dropped + e.val_prompts.dropped > 0)
    log.warn(
        "{} prompts are longer than {} tokens (--ctx {} less --max-completion-length {}) and "
        "were dropped",
        e.prompts.dropped + e.val_prompts.dropped, room, ctx, a.max_completion);
}

Examples read_examples(const FinetuneArgs& a, const Tokenizer& tokenizer, int64_t ctx,
                       int64_t available, spdlog::logger& log) {
  FinetuneDataOptions options;
  options.train_on_prompt = a.train_on_prompt;
  options.max_tokens = ctx + 1;
  // A line's text, its JSON and its tokens are held at once: an eighth of the memory limit.
  options.max_line_bytes = available / 8;
  // The examples stay for the run, beside its budget: at most a quarter of the limit.
  options.max_data_bytes = available / 4;
  options.chat = choose_chat_template(a, tokenizer, log);
  Examples e;
  e.chat_template = options.chat ? std::string(chat_family_name(options.chat->family)) : "";
  e.pairs = a.method == "dpo" || a.method == "orpo";
  e.grpo = a.method == "grpo";
  e.chat = options.chat;
  if (e.grpo) {
    read_prompts(a, tokenizer, ctx, options, e, log);
  } else if (e.pairs) {
    read_pairs(a, tokenizer, ctx, options, e, log);
  } else {
    e.data = read_finetune_jsonl(a.data, tokenizer, options);
    FinetuneData& data = e.data;
    if (!a.val.empty())
      e.val = read_finetune_jsonl(a.val, tokenizer, options).examples;
    else if (a.val_fraction > 0.0)
      hold_out(a, data.examples, e.val, 1, "examples");
    std::string shapes;
    for (int s = 0; s < kExampleShapes; ++s) {
      if (data.shapes[static_cast<size_t>(s)] == 0) continue;
      shapes +=
          fmt::format("{}{} {}", shapes.empty() ? "" : ", ", data.shapes[static_cast<size_t>(s)],
                      example_shape_name(static_cast<ExampleShape>(s)));
    }
    log.info(
        "data: {} examples ({}), {} tokens, {} of them targets; {} cut to {} tokens, {} dropped "
        "with no target left",
        data.examples.size() + (a.val.empty() ? e.val.size() : 0), shapes, data.tokens,
        data.targets, data.truncated, ctx + 1, data.dropped);
    if (data.truncated > 0)
      log.warn("{} examples are longer than --ctx {} and were cut", data.truncated, ctx);
  }
  e.fingerprint = kFnvOffset;
  for (const auto* set : {&e.prompts, &e.val_prompts})
    for (const GrpoPrompt& p : set->prompts) {
      e.fingerprint = fnv1a(p.tokens.data(), p.tokens.size() * sizeof(int32_t), e.fingerprint);
      e.fingerprint = fnv1a(p.fields.dump(), e.fingerprint);
    }
  for (const auto* set : {&e.data.examples, &e.val})
    for (const FinetuneExample& x : *set) {
      e.fingerprint = fnv1a(x.tokens.data(), x.tokens.size() * sizeof(int32_t), e.fingerprint);
      e.fingerprint = fnv1a(x.target.data(), x.target.size(), e.fingerprint);
    }
  return e;
}

// config.json of a fine-tune: what makes it the run it is.
json finetune_config(const FinetuneArgs& a, const ModelOptions& options, const Examples& e,
                     int64_t ctx, int64_t steps, const LrSchedule& lr, int ranks) {
  json config = {{"command", "finetune"},
                 {"model", fs::absolute(a.model).string()},
                 {"data", fs::absolute(a.data).string()},
                 {"val", a.val.empty() ? "" : fs::absolute(a.val).string()},
                 {"val_fraction", a.val_fraction},
                 {"full", a.full},
                 {"lora_rank", a.full ? 0 : options.lora.rank},
                 {"lora_alpha", a.full ? 0.0 : options.lora.alpha},
                 {"lora_targets", a.full ? "" : lora_targets_text(options.lora.targets)},
                 {"lora_dropout", a.full ? 0.0 : a.lora_dropout},
                 {"steps", steps},
                 {"batch", a.batch},
                 {"accum", a.accum},
                 {"ctx", ctx},
                 {"lr", a.lr},
                 {"warmup", a.warmup},
                 {"warmup_steps", lr.warmup_steps},
                 {"lr_schedule_steps", lr.total_steps},
                 {"rows_by_epoch", true},
                 {"weight_decay", a.weight_decay},
                 {"dtype", options.compute_dtype == DType::BF16 ? "bf16" : "fp32"},
                 {"checkpoint", a.checkpoint},
                 {"chat_template", e.chat_template},
                 {"chat_template_flag", a.chat_template},
                 {"train_on_prompt", a.train_on_prompt},
                 {"method", a.method},
                 {"beta", a.method == "dpo" ? a.beta : 0.0},
                 {"orpo_lambda", a.method == "orpo" ? a.orpo_lambda : 0.0},
                 {"moe_balance", a.moe_balance},
                 {"moe_z_loss", a.moe_z},
                 {"seed", a.seed}};
  if (a.method == "grpo") {
    config["beta"] = a.beta;
    config["generations"] = a.generations;
    config["max_completion_length"] = a.max_completion;
    config["temperature"] = a.temperature;
    config["top_p"] = a.top_p;
    config["top_k"] = a.top_k;
    config["epsilon"] = a.epsilon;
    config["epsilon_high"] = a.epsilon_high > 0.0 ? a.epsilon_high : a.epsilon;
    config["iterations"] = a.iterations;
    config["loss_type"] = a.loss_type;
    config["scale_rewards"] = a.scale_rewards;
    config["rewards"] = a.rewards;
    config["answer_pattern"] = a.answer_pattern;
    config["answer_field"] = a.answer_field;
    config["reward_pattern"] = a.reward_pattern;
    config["reward_command"] = a.reward_command;
    config["reward_timeout"] = a.reward_timeout;
  }
  // A job's batch is each rank's: the ranks are part of the run.
  if (ranks > 1) config["ranks"] = ranks;
  return config;
}

// GRPO's rewards, each prompt's fields checked against what they read.
std::vector<WeightedReward> make_grpo_rewards(const FinetuneArgs& a, const Examples& e) {
  RewardOptions ro;
  ro.rewards = a.rewards;
  ro.answer_pattern = a.answer_pattern;
  ro.answer_field = a.answer_field;
  ro.reward_pattern = a.reward_pattern;
  ro.command = a.reward_command;
  ro.timeout_s = a.reward_timeout;
  ro.command_log = a.out + "/reward_command.log";
  ro.max_completion = a.max_completion;
  std::vector<WeightedReward> rewards = make_rewards(ro);
  for (const auto& [set, path] :
       {std::pair{&e.prompts, a.data}, std::pair{&e.val_prompts, a.val.empty() ? a.data : a.val}})
    for (const GrpoPrompt& p : set->prompts)
      for (const WeightedReward& r : rewards)
        r.function->check_fields(p.fields, path + ":" + std::to_string(p.line));
  return rewards;
}

GrpoOptions grpo_options(const FinetuneArgs& a, int64_t ctx) {
  GrpoOptions o;
  o.generations = a.generations;
  o.max_completion = a.max_completion;
  o.temperature = static_cast<float>(a.temperature);
  o.top_p = static_cast<float>(a.top_p);
  o.top_k = a.top_k;
  o.iterations = a.iterations;
  o.scale_rewards = a.scale_rewards == "group";
  o.loss.beta = a.beta;
  o.loss.epsilon = a.epsilon;
  o.loss.epsilon_high = a.epsilon_high > 0.0 ? a.epsilon_high : a.epsilon;
  o.loss.type = a.loss_type == "grpo"      ? GrpoLossType::Grpo
                : a.loss_type == "dr_grpo" ? GrpoLossType::DrGrpo
                                           : GrpoLossType::Dapo;
  o.batch = a.batch;
  o.accum = a.accum;
  o.ctx = ctx;
  o.seed = a.seed;
  return o;
}

// What ends a completion: the vocabulary's EOS (a SentencePiece model of llama2.c's, BOS), and
// the chat template's end of a reply where it is one token.
std::vector<int32_t> stop_tokens(const Tokenizer& tokenizer,
                                 const std::optional<ChatTemplate>& chat) {
  std::vector<int32_t> stop = {tokenizer.vocabulary() ? tokenizer.eos_id() : tokenizer.bos_id()};
  if (chat) {
    const std::vector<ChatMessage> messages = {{"user", "x"}, {"assistant", "y"}};
    for (const ChatPiece& piece : render_chat(*chat, messages, false)) {
      if (!piece.reply || !piece.markers) continue;
      const std::vector<int32_t> ids = tokenizer.encode_piece(piece.text, true, false);
      if (!ids.empty() && tokenizer.is_special(ids[0]) &&
          std::find(stop.begin(), stop.end(), ids[0]) == stop.end())
        stop.push_back(ids[0]);
    }
  }
  return stop;
}

// Packed rows of the training examples, a step's rows in an order shuffled anew each epoch;
// validation over every target of the held-out examples.
class PackedRows final : public BatchSource {
 public:
  PackedRows(DecoderModel& model, const Examples& examples, std::vector<PackedRow> rows,
             int64_t ctx, int64_t batch, const RowPlan& plan, uint64_t seed, int32_t pad,
             const Communicator& comm)
      : model_(model),
        examples_(examples),
        rows_(std::move(rows), ctx, batch, plan, seed),
        ctx_(ctx),
        batch_(batch),
        pad_(pad),
        comm_(comm) {}
  StepResult step(Trainer& trainer, int64_t step) override {
    return finetune_step(trainer, model_, step, rows_.take(step), examples_.data.examples, pad_,
                         rows_.inputs(), rows_.targets());
  }
  bool validates() const override { return !examples_.val.empty(); }
  double validate(Trainer&) override {
    return packed_validation_loss(model_, examples_.val, ctx_, batch_, pad_, 0, &comm_);
  }
  void describe(int64_t, json& line) const override {
    line["targets"] = count_targets(rows_.last(), examples_.data.examples);
  }

 private:
  DecoderModel& model_;
  const Examples& examples_;
  StepRows rows_;
  int64_t ctx_, batch_;
  int32_t pad_;
  const Communicator& comm_;
};

// The result: the adapter as llama.cpp loads it and PEFT's folder, or the whole model.
class AdapterFiles final : public RunOutput {
 public:
  AdapterFiles(const FinetuneArgs& a, const LoadedModel& m, const ModelOptions& options,
               spdlog::logger& log)
      : a_(a), m_(m), options_(options), log_(log) {}
  void write(bool lead) override {
    if (!lead) return;
    // The base's name, as llama.cpp's converter gives it (LoadedModel::name), and what this made
    // of it.
    const std::string& base_name = m_.name;
    const auto name = [&base_name](const char* what) {
      return base_name.empty() ? std::string() : base_name + " " + what;
    };
    const ParameterSet& params = m_.model->parameters();
    if (a_.full) {
      GgufExport e;
      e.type = GgmlType::F32;
      e.name = name("Fine-tuned");
      // The model's own context, not the rows' it was tuned on (--ctx).
      ModelConfig config = m_.config;
      config.ctx = m_.declared_ctx;
      write_gguf(a_.out + "/model.gguf", config, params, m_.tokenizer->to_vocabulary(), e);
      log_.info("wrote {}/model.gguf", a_.out);
      return;
    }
    write_lora_gguf(a_.out + "/adapter.gguf", m_.config, params, options_.lora.alpha, name("LoRA"));
    // PEFT's adapter where the architecture's Hugging Face names are known (gpt-oss's and Gemma
    // 4's experts are one parameter of all experts there, not modules, which PEFT adapts
    // otherwise).
    const Architecture& arch = architecture_of(m_.config);
    const bool experts_as_parameters =
        m_.config.moe() && (arch.hf_gpt_oss_experts || m_.config.experts_beside_mlp());
    const bool peft =
        arch.files && !(experts_as_parameters &&
                        (options_.lora.on(Projection::Gate) || options_.lora.on(Projection::Up) ||
                         options_.lora.on(Projection::Down)));
    if (peft)
      write_peft_adapter(a_.out + "/peft", m_.config, params, options_.lora,
                         fs::absolute(a_.model).string());
    // llama.cpp takes the base as a GGUF file: a run's is written by export.
    const bool gguf_base = !fs::is_directory(a_.model);
    log_.info(
        "wrote {0}/adapter.gguf (llama.cpp: --model {1} --lora {0}/adapter.gguf{2}){3}", a_.out,
        gguf_base ? a_.model : "BASE.gguf",
        gguf_base ? ""
                  : ", BASE.gguf from cputrain export --model " + a_.model + " --out BASE.gguf",
        peft ? " and " + a_.out + "/peft (PEFT's adapter_config.json and adapter_model.safetensors)"
        : arch.files ? "; no PEFT adapter: the experts are one parameter of all experts in " +
                           std::string(arch.hf_class) + ", not modules PEFT adapts by name"
                     : "");
  }

 private:
  const FinetuneArgs& a_;
  const LoadedModel& m_;
  const ModelOptions& options_;
  spdlog::logger& log_;
};

int finetune(const FinetuneArgs& given, const Communicator& comm, JobStart& start);

}  // namespace

int run_finetune(const FinetuneArgs& a) {
  // Of a data-parallel job every rank reads the model and the data; rank 0 alone prints and
  // writes the run directory.
  const Communicator& comm = Communicator::world();
  if (comm.rank() > 0 && std::freopen("/dev/null", "w", stdout) == nullptr)
    throw UserError("/dev/null: cannot open for writing");
  JobStart start(comm);
  try {
    return finetune(a, comm, start);
  } catch (...) {
    if (start.failed()) throw QuietExit{1};
    throw;
  }
}

namespace {

// What the fine-tune's memory needs, logged; a UserError where it does not fit.
MemoryBudget plan_finetune_memory(const FinetuneArgs& a, const LoadedModel& m,
                                  const ModelOptions& options, const Examples& e,
                                  const std::vector<PackedRow>& packed, int64_t ctx,
                                  int64_t available, const Communicator& comm,
                                  spdlog::logger& log) {
  BudgetOptions bo;
  bo.dtype = options.compute_dtype;
  bo.batch = a.batch;
  bo.ctx = ctx;
  bo.accum = a.accum;
  bo.checkpoint = *parse_checkpointing(a.checkpoint);
  bo.threads = omp_get_max_threads();
  bo.lora = options.lora;
  bo.packed = true;
  bo.offload = options.offload;
  bo.ranks = comm.size();
  const std::vector<PackedRow> val = e.pairs ? pack_pairs(e.val, ctx) : pack_examples(e.val, ctx);
  bo.preference = e.pairs;
  bo.eval_windows = static_cast<int64_t>(val.size());
  // The LM head runs on the positions with a target: its memory is that of the batch with most.
  bo.packed_targets =
      std::max(most_targets(packed, e.data.examples, a.batch), most_targets(val, e.val, a.batch));
  if (e.grpo) {
    // The generation's caches of G sequences; a pass without gradients over a micro-batch's rows
    // for the reference's (or the generating policy's) log-probabilities; every position may be a
    // completion's; a full fine-tune's reference, a frozen copy of the base.
    bo.generations = a.generations;
    if (a.full && a.beta > 0.0)
      bo.reference_in_place = in_place_weights(a.model, "--model", m.config);
    bo.reference_copy = a.full && a.beta > 0.0;
    bo.eval_windows = a.beta > 0.0 || a.iterations > 1 ? a.batch : 0;
    bo.packed_targets = 0;
  }
  // The model file's index and the tokenizer (the examples are held within a quarter of the
  // memory limit, read_examples).
  bo.host_bytes = m.host_bytes;
  // A base read in place is the model file's pages: resident as the steps read them, dropped
  // and read again under pressure, so the limit covers the rest. Measured as the model holds it.
  const ParameterSet& params = m.model->parameters();
  bo.in_place = [&params](const ParameterInfo& p) {
    const int i = params.find(p.name);
    return i >= 0 && params.mapped(i)
               ? InPlaceWeight{nullptr, params.infos()[static_cast<size_t>(i)].mapped_dtype}
               : InPlaceWeight{};
  };
  MemoryBudget budget = memory_budget(m.config, bo);
  const int64_t mapped = budget.mapped_bytes;
  const int64_t total = budget.total_bytes();
  const auto peak = [&budget](MemoryCategory c) { return budget.peak_bytes[static_cast<int>(c)]; };
  log.info(
      "memory budget: {} (weights {}, {} gradients and AdamW {}, activations {}, workspace "
      "{}); {} available{}",
      format_bytes(total),
      format_bytes(peak(MemoryCategory::Weights) + peak(MemoryCategory::Bf16Weights) - mapped),
      a.full ? "the weights'" : "adapters'",
      format_bytes(peak(MemoryCategory::Gradients) + peak(MemoryCategory::OptimizerState)),
      format_bytes(peak(MemoryCategory::Activations)),
      format_bytes(peak(MemoryCategory::Workspace)), format_bytes(available),
      mapped > 0
          ? "; besides it, " + format_bytes(mapped) +
                " of base weights read in place from the model file (page cache" +
                (budget.per_layer_table_mapped ? "; " + format_bytes(budget.per_layer_table_bytes) +
                                                     " of them the per-layer embeddings)"
                                               : std::string(")"))
          : std::string());
  if (budget.disk_bytes > 0)
    log.info("offloaded to {}: {} on disk (masters, AdamW's m and v)", a.offload,
             format_bytes(budget.disk_bytes));
  if (available > 0 && total > available)
    throw UserError("the fine-tune needs " + format_bytes(total) + " and " +
                    format_bytes(available) +
                    " is available: lower --batch (raising --accum keeps the step), lower --ctx" +
                    (bo.checkpoint == Checkpointing::Layer ? ""
                     : bo.checkpoint == Checkpointing::Mlp ? ", give --checkpoint layer"
                                                           : ", give --checkpoint mlp or layer") +
                    (a.full ? "" : ", or lower --lora-rank"));
  // A base that does not fit beside the budget is read from the disk every pass: its blocks
  // are read ahead of the compute.
  if (mapped > 0 && available > 0 && total + mapped > available) {
    m.model->set_read_ahead(true);
    log.info("the base does not fit beside the budget in {}: each block is read ahead",
             format_bytes(available));
  }
  return budget;
}

// The model loaded with its adapters, described in the log.
LoadedModel load_finetune_model(const FinetuneArgs& a, const ModelOptions& options,
                                const std::string& dtype_reason, spdlog::logger& log) {
  const Stopwatch load_time;
  // An adapter wider than a projection, or router losses without a router, are refused before
  // anything is allocated.
  const ModelConfig config = load_model_config(a.model, "--model", a.ctx);
  if (!a.full) {
    check_lora_targets(config, options.lora, "--lora-targets");
    check_lora_rank(config, options.lora, "--lora-rank");
  }
  if (const std::string refusal = router_losses_refusal(config);
      !refusal.empty() && (a.moe_balance > 0.0 || a.moe_z > 0.0))
    throw UserError(std::string(a.moe_balance > 0.0 ? "--moe-balance" : "--moe-z-loss") + " " +
                    a.model + ": " + refusal);
  LoadedModel m = load_model_to_train(a.model, "--model", a.ctx, options);
  // A NaN or an infinity in the base makes every step's loss so: named here, not blamed on --lr.
  check_finite_weights(m, a.model, "--model");
  if (!a.full) m.model->init_adapters(a.seed);
  m.model->set_checkpointing(*parse_checkpointing(a.checkpoint));
  log.info("model: {}, {:.2f} s", m.source, load_time.seconds());
  const std::string isa_note = kernels::isa_default_note();
  log.info("cpu: {}; gemm {}, blocking: {}{}{}", kernels::cpu_features_string(),
           kernels::gemm_backend_name(kernels::gemm_backend()), gemm_blocking(),
           isa_note.empty() ? "" : "; ", isa_note);
  int64_t trained = 0, total = 0;
  for (const ParameterInfo& p : m.model->parameters().infos()) {
    total += p.shape.numel();
    if (p.trainable) trained += p.shape.numel();
  }
  const bool bf16 = options.compute_dtype == DType::BF16;
  if (a.full)
    log.info("training: every parameter ({}), {} ({})", trained, bf16 ? "bf16" : "fp32",
             dtype_reason);
  else
    log.info(
        "training: LoRA rank {}, alpha {:g} on {}: {} parameters ({:.2f}% of {}), the base "
        "frozen{}, {} ({})",
        options.lora.rank, options.lora.alpha, lora_targets_held(m.config, options.lora), trained,
        100.0 * static_cast<double>(trained) / static_cast<double>(total), total,
        bf16 ? " in bf16" : "", bf16 ? "bf16" : "fp32", dtype_reason);
  return m;
}

// Rank 0's resume point (after the configuration is checked), shared with the job's ranks;
// the steps before it are done.
int64_t resume_from(const FinetuneArgs& a, const json& run, const std::string& config_text,
                    uint64_t fingerprint, int64_t steps, const Communicator& comm,
                    spdlog::logger& log, std::string* checkpoint) {
  const std::string& dir = a.out;
  const int ranks = run.value("ranks", 1);
  if (ranks != comm.size())
    throw UserError("--resume " + dir + ": the fine-tune runs as " + std::to_string(ranks) +
                    " rank" + (ranks == 1 ? "" : "s") +
                    " (its batch is each rank's), and this job has " + std::to_string(comm.size()) +
                    ": resume it with mpirun -np " + std::to_string(ranks) +
                    (ranks == 1 ? " or without mpirun" : ""));
  const ResumePoint point = find_resume_point(dir, config_text, log);
  if (point.info.data_fingerprint != fingerprint)
    throw UserError(point.path + ": trained on other data than " + a.data);
  if (point.info.step > steps)
    throw UserError((a.was_given("--epochs") ? "--epochs " + fmt::format("{:g}", a.epochs) + " (" +
                                                   std::to_string(steps) + " steps)"
                                             : "--steps " + std::to_string(steps)) +
                    ": the fine-tune in " + dir + " has already trained " +
                    std::to_string(point.info.step) + " steps");
  *checkpoint = point.path;
  if (point.info.step == steps) {
    // Stopped between its last checkpoint and its result: the result is written from it.
    const std::string result = dir + (a.full ? "/model.gguf" : "/adapter.gguf");
    if (fs::exists(result))
      throw UserError("--resume " + dir + ": the fine-tune has trained all its " +
                      std::to_string(steps) + " steps; give --steps above " +
                      std::to_string(steps) + " (or --epochs) to train it further");
    log.info("{} has trained all its {} steps, and {} is missing: written from it", point.path,
             steps, result);
    return steps + 1;
  }
  log.info("resumed from {} (step {} of {})", point.path, point.info.step, steps);
  return point.info.step + 1;
}

// The flags of the fine-tune to run: as given, or a resumed run's own (`run`, its config.json)
// where the command line gives none; its directory in a.out.
FinetuneArgs resolve_args(FinetuneArgs a, json* run) {
  const bool resuming = a.resuming();
  a.out = a.run_dir();
  if (a.out.empty())
    throw UserError(resuming ? "--resume: give the run directory to continue (--resume RUN)"
                             : "--out: give the run directory to write (or --resume RUN)");
  if (a.was_given("--steps") && a.was_given("--epochs"))
    throw UserError("--steps and --epochs: give one (the steps of --epochs E are E passes)");
  // Every rank of a job reads the run's flags from its directory.
  if (resuming) {
    *run = read_finetune_config(a.out);
    a = resumed_args(a, *run);
  }
  // GRPO's KL is off unless asked for (TRL's beta 0).
  if (!resuming && a.method == "grpo" && !a.was_given("--beta")) a.beta = 0.0;
  for (const auto& [value, flag] : {std::pair{&a.model, "--model"}, std::pair{&a.data, "--data"}})
    if (value->empty())
      throw UserError(std::string(flag) + " is required (or --resume RUN, which has its own)");
  return a;
}

// The step a job starts at, the same on every rank: rank 0's resume point, whose state every
// rank takes (sharded: each its shard, as rank 0 reads the file); all start from rank 0's
// adapters (or weights). `checkpoint`: what rank 0 resumes from.
int64_t start_job(const FinetuneArgs& a, const json& run, const std::string& config_text,
                  uint64_t fingerprint, int64_t steps, const ParameterSet& params, Trainer& trainer,
                  JobStart& start, spdlog::logger& log, std::string* checkpoint) {
  const Communicator& comm = *trainer.options().comm;
  int64_t first_step = 1;
  // A resumed run's config.json records where it now ends, once it is sure to go on.
  if (comm.rank() == 0 && a.resuming())
    first_step = resume_from(a, run, config_text, fingerprint, steps, comm, log, checkpoint);
  if (comm.rank() == 0) write_file_atomic(a.out + "/config.json", config_text);
  if (comm.size() > 1) {
    start.ready();
    comm.set_timeout(a.rank_timeout);
    first_step = share_value(comm, first_step);
  }
  if (!checkpoint->empty())
    load_checkpoint(*checkpoint, params, &trainer.optimizer());
  else if (first_step > 1 && !trainer.optimizer().shards().empty())
    share_checkpoint_state(params, trainer.optimizer(), false);
  if (comm.size() > 1) {
    broadcast_training_state(comm, params, trainer.optimizer());
    log.info("data parallel: {} ranks, each of {} x {} rows a step", comm.size(), a.batch, a.accum);
  }
  return first_step;
}

// The loop's plan of a fine-tune: validation before the first step and after the last (and every
// --eval-every), checkpoints every --save-every.
LoopPlan finetune_plan(const FinetuneArgs& a, int64_t steps, int64_t ctx,
                       const Communicator& comm) {
  LoopPlan plan;
  plan.dir = a.out;
  plan.command = "finetune";
  plan.steps = steps;
  plan.save_every = a.save_every;
  plan.keep = a.keep;
  plan.eval_every = a.eval_every;
  plan.validate_first = true;
  plan.log_every = a.log_every;
  plan.spike = a.spike;
  plan.on_bad_step = a.on_bad_step;
  plan.profile = a.profile;
  plan.positions = a.batch * a.accum * ctx * comm.size();
  return plan;
}

int finetune(const FinetuneArgs& given, const Communicator& comm, JobStart& start) {
  const bool lead = comm.rank() == 0;
  select_kernels(given.kernels);
  json run;
  const FinetuneArgs a = resolve_args(given, &run);
  omp_set_num_threads(a.threads > 0 ? a.threads : omp_get_num_procs());
  const RunDirectory dir = lead ? open_run_directory(a.out, a.resuming()  ? RunDirUse::Resume
                                                            : a.overwrite ? RunDirUse::Overwrite
                                                                          : RunDirUse::NewRun)
                                : RunDirectory{};
  try {
    RunSession session(dir, lead, "reading the model and data");
    spdlog::logger& log = session.log();
    const TestHold hold = lead ? test_hold() : TestHold{};
    if (comm.size() > 1 && !a.offload.empty())
      throw UserError("--offload " + a.offload + ": a data-parallel job of " +
                      std::to_string(comm.size()) + " ranks holds its state in RAM");
    std::string dtype_reason;
    const ModelOptions options = model_options(a, &dtype_reason);
    if (hold.step == 0) wait_for_stop_signal(0, hold.forever);
    LoadedModel m = load_finetune_model(a, options, dtype_reason, log);
    DecoderModel& model = *m.model;
    const int64_t ctx = std::min(a.ctx, m.config.ctx);
    // The memory available, read once: the data and the budget are held to the same figure.
    const int64_t available = memory_limit_bytes(a.mem_limit_gib);
    const Examples examples = read_examples(a, *m.tokenizer, ctx, available, log);
    // GRPO's rewards, their flags and what they read of each prompt checked before the run
    // directory holds anything.
    std::vector<WeightedReward> rewards;
    if (examples.grpo) rewards = make_grpo_rewards(a, examples);
    // GRPO's reference in a full fine-tune with --beta: the base as its file holds it, frozen
    // (its quantised and BF16 matrices read in place where the precision allows), beside the
    // model that trains.
    std::optional<LoadedModel> grpo_reference;
    if (examples.grpo && a.full && a.beta > 0.0) {
      ModelOptions frozen;
      frozen.compute_dtype = options.compute_dtype;
      frozen.trainable = [](const std::string&) { return false; };
      grpo_reference = load_model_to_train(a.model, "--model", a.ctx, frozen);
      int64_t held = 0, mapped = 0;
      const ParameterSet& rp = grpo_reference->model->parameters();
      for (size_t i = 0; i < rp.infos().size(); ++i) {
        const auto bytes = static_cast<int64_t>(rp.var(static_cast<int>(i)).value().bytes());
        (rp.mapped(static_cast<int>(i)) ? mapped : held) += bytes;
      }
      log.info(
          "reference (--beta with --full): the base from {}, frozen: {} held, {} read in place",
          a.model, format_bytes(held), format_bytes(mapped));
    }
    session.prepared();

    const int64_t per_step = a.batch * a.accum * comm.size();
    std::vector<PackedRow> packed = examples.pairs ? pack_pairs(examples.data.examples, ctx)
                                                   : pack_examples(examples.data.examples, ctx);
    const size_t rows = packed.size();
    // The steps by epoch: each epoch's last step takes the rows left of it (RowPlan), so that
    // --epochs 1 is one pass. (A run begun before steps kept to epochs draws as it began.)
    const RowPlan plan_rows{static_cast<int64_t>(std::max<size_t>(rows, 1)), per_step,
                            !a.resuming() || run.value("rows_by_epoch", false)};
    // GRPO: a step's prompts are its completions over --generations; each generation trains
    // --iterations steps.
    const int64_t grpo_prompts = per_step / a.generations;
    const int64_t steps =
        a.steps > 0 ? a.steps
        : examples.grpo
            ? a.iterations * static_cast<int64_t>(std::ceil(
                                 a.epochs * static_cast<double>(examples.prompts.prompts.size()) /
                                 static_cast<double>(grpo_prompts)))
            : plan_rows.steps_for(a.epochs);
    // A resumed run keeps the schedule it began with, wherever it now ends; the steps past it
    // run at a tenth of the peak (the schedule decays to 0).
    LrSchedule lr{a.lr, static_cast<int64_t>(std::round(a.warmup * static_cast<double>(steps))),
                  steps, 0.0, kExtendedLrRatio};
    if (a.resuming()) {
      lr.total_steps = run.value("lr_schedule_steps", run.value("steps", steps));
      lr.warmup_steps = run.value("warmup_steps", lr.warmup_steps);
      if (steps > lr.total_steps)
        log.info(
            "the fine-tune now ends at step {} (its schedule ends at {}); the learning rate keeps "
            "that schedule (warm-up {}, cosine decay to 0 at step {}), the steps past it at {:.3g} "
            "(a tenth of the peak)",
            steps, lr.total_steps, lr.warmup_steps, lr.total_steps, a.lr * kExtendedLrRatio);
    }
    const MemoryBudget budget =
        plan_finetune_memory(a, m, options, examples, packed, ctx, available, comm, log);

    TrainOptions train;
    train.batch = a.batch;
    train.accum = a.accum;
    train.ctx = ctx;
    train.seed = a.seed;
    train.lr = lr;
    train.adamw.weight_decay = static_cast<float>(a.weight_decay);
    train.moe_balance = static_cast<float>(a.moe_balance);
    train.moe_z = static_cast<float>(a.moe_z);
    train.comm = &comm;
    Trainer trainer(
        model.parameters(),
        [&model](const Tensor& in, const Tensor& tg) { return model.loss(in, tg); }, train);
    int64_t used = 0;
    for (const PackedRow& r : packed) used += r.positions;
    if (examples.grpo)
      log.info(
          "GRPO: {} steps of {} prompts x {} completions ({:.2f} epochs), each generation "
          "trained {} time{}; at most {} tokens a completion; validation: {} prompts",
          steps, grpo_prompts, a.generations,
          static_cast<double>(steps / a.iterations * grpo_prompts) /
              static_cast<double>(examples.prompts.prompts.size()),
          a.iterations, a.iterations == 1 ? "" : "s", a.max_completion,
          examples.val_prompts.prompts.size());
    else
      log.info(
          "packed: {} rows of {} positions, {:.1f}% filled; {} steps of {} rows ({:.2f} epochs); "
          "validation: {} {}",
          rows, ctx,
          100.0 * static_cast<double>(used) / static_cast<double>(std::ssize(packed) * ctx), steps,
          per_step, plan_rows.epochs_of(steps), examples.val.size() / (examples.pairs ? 2 : 1),
          examples.pairs ? "pairs" : "examples");

    const json config = finetune_config(a, options, examples, ctx, steps, lr, comm.size());
    if (a.resuming()) check_resumed(a.out, run, config);
    // A resumed run keeps the text it began with, which its checkpoints record, but for where it
    // ends (which a checkpoint's identity leaves out, run_identity).
    json kept = run;
    if (a.resuming() && run.value("steps", steps) != steps) {
      kept["lr_schedule_steps"] = lr.total_steps;
      kept["steps"] = steps;
    }
    const std::string config_text = (a.resuming() ? kept : config).dump(2) + "\n";
    LoopPlan plan = finetune_plan(a, steps, ctx, comm);
    plan.first_step = start_job(a, run, config_text, examples.fingerprint, steps,
                                model.parameters(), trainer, start, log, &plan.last_checkpoint);
    plan.hold = hold;
    plan.config_json = config_text;
    plan.data_fingerprint = examples.fingerprint;
    plan.budget = budget;
    plan.replacing = dir.replacing;
    // From here on the peak RSS is training's, and the heap holds no freed pages of reading the
    // model and its vocabulary (a 262k-token vocabulary's leaves some 0.1 GiB of them between
    // blocks still in use, which no budget counts).
    process_memory_reset_peak();
    AdapterFiles output(a, m, options, log);
    const int32_t pad = m.tokenizer->eos_id();
    if (examples.grpo) {
      GrpoOptions go = grpo_options(a, ctx);
      go.dir = a.out;
      go.identity = fnv1a_u64(a.seed, examples.fingerprint);
      GrpoSource source(model, *m.tokenizer, examples.prompts, examples.val_prompts, rewards, go,
                        stop_tokens(*m.tokenizer, examples.chat),
                        grpo_reference ? grpo_reference->model.get() : nullptr, comm,
                        lead ? session.io().log : nullptr);
      return run_loop(plan, trainer, model.parameters(), source, output, comm, session.io());
    }
    if (!examples.pairs) {
      PackedRows batches(model, examples, std::move(packed), ctx, a.batch, plan_rows, a.seed, pad,
                         comm);
      return run_loop(plan, trainer, model.parameters(), batches, output, comm, session.io());
    }
    PreferenceLossOptions loss;
    loss.method = a.method == "dpo" ? PreferenceMethod::Dpo : PreferenceMethod::Orpo;
    loss.beta = a.beta;
    loss.lambda = a.orpo_lambda;
    std::vector<PackedRow> val_rows = pack_pairs(examples.val, ctx);
    ReferenceLogProbs reference;
    if (loss.method == PreferenceMethod::Dpo) {
      const ReferencePass pass{
          &examples.data.examples, &packed, &examples.val, &val_rows, ctx, a.batch, pad};
      // A pass over every pair before the first step: a stop signal ends it at once.
      session.preparing("computing the reference's log-probabilities");
      if (hold.reference) wait_for_stop_signal(0, true, "the reference pass");
      reference = reference_log_probs(model, !a.full, pass, a.out, plan.first_step > 1,
                                      examples.fingerprint, comm, log);
      session.prepared();
    }
    PreferenceRows batches(model, examples.data.examples, std::move(packed), examples.val,
                           std::move(val_rows), std::move(reference), loss, ctx, a.batch, plan_rows,
                           a.seed, pad, comm);
    return run_loop(plan, trainer, model.parameters(), batches, output, comm, session.io());
  } catch (...) {
    dir.discard_if_unused();
    throw;
  }
}

}  // namespace

int eval_finetune(const std::string& dir, const std::string& flag, const std::string& weights,
                  int64_t batch, bool as_json) {
  const json run = read_finetune_config(dir);
  FinetuneArgs given;
  given.out = dir;
  const FinetuneArgs a = resumed_args(given, run);
  if (a.method == "grpo")
    throw UserError(flag + " " + dir +
                    ": a GRPO fine-tune is validated by generating completions and scoring them: "
                    "its held-out mean reward is val_reward in " +
                    dir + "/metrics.jsonl");
  if (a.val.empty() && !(a.val_fraction > 0.0))
    throw UserError(flag + " " + dir +
                    ": the fine-tune held out no examples (it ran without --val or "
                    "--val-fraction): give --text FILE");
  spdlog::logger log("eval", std::make_shared<spdlog::sinks::stderr_sink_mt>());
  log.set_level(spdlog::level::warn);
  log.set_pattern("cputrain: warning: %v");
  LoadedModel m = load_model(dir, flag, weights, a.ctx);
  check_finite_weights(m, dir, flag);
  const int64_t ctx = std::min(a.ctx, m.config.ctx);
  const Examples examples = read_examples(a, *m.tokenizer, ctx, memory_limit_bytes(0.0), log);
  // The held-out examples are the run's only where the data is what it trained on.
  if (const auto checkpoints = list_checkpoints(dir); !checkpoints.empty()) {
    const CheckpointInfo info = read_checkpoint_info(checkpoints.back().second);
    if (info.data_fingerprint != examples.fingerprint)
      throw UserError(flag + " " + dir + ": " + a.data +
                      " is not the data the fine-tune trained on (it changed since; " +
                      checkpoints.back().second + " was made from other examples)");
  }
  DecoderModel& model = *m.model;
  const int32_t pad = m.tokenizer->eos_id();
  double loss = 0.0;
  std::string note;
  if (!examples.pairs) {
    loss = packed_validation_loss(model, examples.val, ctx, batch, pad);
  } else {
    PreferenceLossOptions options;
    options.method = a.method == "dpo" ? PreferenceMethod::Dpo : PreferenceMethod::Orpo;
    options.beta = a.beta;
    options.lambda = a.orpo_lambda;
    const std::vector<PackedRow> val_rows = pack_pairs(examples.val, ctx);
    ReferenceLogProbs reference;
    if (options.method == PreferenceMethod::Dpo) {
      const std::vector<PackedRow> rows = pack_pairs(examples.data.examples, ctx);
      const ReferencePass pass{
          &examples.data.examples, &rows, &examples.val, &val_rows, ctx, batch, pad};
      reference = reference_log_probs(model, !a.full, pass, dir, true, examples.fingerprint,
                                      Communicator::world(), log);
    }
    PreferenceStats stats;
    const PreferenceBatches b{&examples.val, reference.val, options, &stats};
    loss = preference_validation_loss(model, val_rows, b, ctx, batch, pad);
    note = " (" + stats.summary() + ")";
  }
  if (!std::isfinite(loss))
    throw UserError(flag + " " + dir + ": the held-out loss is " + std::to_string(loss) +
                    " (the model's logits are not finite)");
  const int64_t held = std::ssize(examples.val) / (examples.pairs ? 2 : 1);
  const char* what = examples.pairs ? "pairs" : "examples";
  const std::string data = a.val.empty() ? a.data : a.val;
  if (as_json) {
    json j = {{"loss", loss}, {"weights", m.source}, {what, held}};
    if (!examples.pairs) j["perplexity"] = std::exp(loss);
    std::printf("%s\n", j.dump(2).c_str());
  } else {
    if (!examples.pairs) note = fmt::format(", perplexity {:.2f}", std::exp(loss));
    std::printf("%s: loss %.4f%s over %lld held-out %s of %s\n", m.source.c_str(), loss,
                note.c_str(), static_cast<long long>(held), what, data.c_str());
  }
  return 0;
}

}  // namespace cputrain
