#include "tools/train_command.h"

#include <omp.h>
#include <pthread.h>
#include <spdlog/sinks/basic_file_sink.h>
#include <spdlog/spdlog.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <functional>
#include <nlohmann/json.hpp>
#include <optional>
#include <string_view>
#include <thread>

#include "engine/core/error.h"
#include "engine/core/memory.h"
#include "engine/core/profiler.h"
#include "engine/core/threads.h"
#include "engine/data/data_pipeline.h"
#include "engine/io/atomic_file.h"
#include "engine/io/offload.h"
#include "engine/text/tokenizer.h"
#include "engine/train/checkpoint_file.h"
#include "engine/train/trainer.h"
#include "engine/train/weights_file.h"
#include "kernels/attention/attention.h"
#include "kernels/cpu/cpu_features.h"
#include "kernels/cpu/dispatch.h"
#include "kernels/cpu/peak.h"
#include "kernels/gemm/gemm.h"
#include "models/architecture.h"
#include "models/config_json.h"
#include "models/decoder.h"
#include "models/generate.h"
#include "models/memory_budget.h"
#include "tools/budget_command.h"
#include "tools/flag_checks.h"
#include "tools/model_source.h"
#include "tools/run/job.h"
#include "tools/run/loop.h"
#include "tools/run/mfu_peak.h"
#include "tools/run/progress.h"
#include "tools/run/run_config.h"
#include "tools/run/run_dir.h"
#include "tools/run/session.h"
#include "tools/run/stop_signals.h"
#include "tools/run/train_stages.h"

namespace cputrain {
namespace {

// Qwen3-MoE's router_aux_loss_coef: the load-balancing loss's coefficient a mixture trains with
// unless --moe-balance says otherwise.
constexpr double kMoeBalanceDefault = 0.001;

namespace fs = std::filesystem;

int64_t default_steps(const std::string& preset) {
  if (preset == "tiny") return 200;
  if (preset == "mini") return 600;
  return 2000;
}

double default_lr(const ModelConfig& c) {
  return c.d_model <= 256 ? 1e-3 : (c.d_model <= 512 ? 6e-4 : 3e-4);
}

void require_positive(int64_t value, const char* flag) {
  if (value <= 0)
    throw UserError(std::string(flag) + " must be positive (got " + std::to_string(value) + ")");
}

}  // namespace

std::string flag_message(const ConfigProblem& problem) {
  static const std::pair<const char*, const char*> flags[] = {{"vocab", "--vocab"},
                                                              {"d_model", "--d-model"},
                                                              {"n_layers", "--layers"},
                                                              {"n_heads", "--heads"},
                                                              {"n_kv_heads", "--kv-heads"},
                                                              {"head_dim", "--head-dim"},
                                                              {"ffn", "--ffn"},
                                                              {"n_experts", "--experts"},
                                                              {"experts_used", "--experts-used"},
                                                              {"expert_ffn", "--expert-ffn"},
                                                              {"ctx", "--ctx"},
                                                              {"rope_theta", "--rope-theta"}};
  const auto flag = [](const std::string& field) {
    for (const auto& [f, name] : flags)
      if (field == f) return std::string(name);
    return field;
  };
  ConfigProblem p = problem;
  p.field = flag(p.field);
  if (!p.other.empty()) p.other = flag(p.other);
  return p.str();
}

namespace {

// --experts, --experts-used, --expert-ffn over the architecture's mixture (with_architecture's):
// a mixture's experts in the MLP's place (qwen3moe, qwen35moe, gpt-oss: at least 2), or Gemma 4's
// beside it (0: none, the default).
void apply_expert_flags(ModelConfig& c, const Architecture& arch, const TrainArgs& a) {
  const bool given = a.experts != -1 || a.experts_used != -1 || a.expert_ffn != -1;
  if (!given) return;
  const char* flag = a.experts != -1        ? "--experts"
                     : a.experts_used != -1 ? "--experts-used"
                                            : "--expert-ffn";
  if (!arch.moe && !arch.experts_beside_mlp)
    throw UserError(std::string(flag) + ": a " + std::string(arch.name) +
                    " model has no experts (" + expert_architecture_names() + " have)");
  if (a.experts != -1) {
    if (a.experts < (arch.moe ? 2 : 0) || a.experts > 4096)
      throw UserError("--experts " + std::to_string(a.experts) + ": a " + std::string(arch.name) +
                      " model takes " + (arch.moe ? "2" : "0") + " to 4096 experts");
    c.n_experts = a.experts;
    if (arch.experts_beside_mlp && c.n_experts > 0 && c.experts_used == 0)
      c.experts_used = std::min<int64_t>(2, c.n_experts);
  }
  if (a.experts_used != -1) {
    if (c.n_experts == 0)
      throw UserError("--experts-used: a " + std::string(arch.name) +
                      " model has no experts unless --experts says how many");
    if (a.experts_used > c.n_experts)
      throw UserError("--experts-used " + std::to_string(a.experts_used) +
                      " is more than the experts (--experts " + std::to_string(c.n_experts) + ")");
    c.experts_used = a.experts_used;
  }
  c.experts_used = std::min(c.experts_used, c.n_experts);
  // The experts' width: in the MLP's place, the MLP's own (--ffn); beside it, an eighth of it
  // (at least 16) unless --expert-ffn says.
  if (a.expert_ffn != -1) {
    require_positive(a.expert_ffn, "--expert-ffn");
    if (c.n_experts == 0)
      throw UserError("--expert-ffn: a " + std::string(arch.name) +
                      " model has no experts unless --experts says how many");
    if (arch.moe) c.ffn = a.expert_ffn;
  }
  if (arch.experts_beside_mlp)
    c.expert_ffn = c.n_experts == 0     ? 0
                   : a.expert_ffn != -1 ? a.expert_ffn
                                        : std::max<int64_t>(16, c.ffn / 8);
}

// --offload DIR as config.json records it: absolute; "none" (or nothing) holds the state in RAM.
std::string offload_folder(const std::string& flag) {
  if (flag.empty() || flag == "none") return "";
  return fs::absolute(flag).lexically_normal().string();
}

}  // namespace

RunConfig resolve_run_config(const TrainArgs& a) {
  const Preset preset = preset_flag(a.preset);
  RunConfig c;
  c.preset = a.preset;
  // Absolute, so that --resume works from any folder.
  c.corpus = a.corpus.empty() ? a.corpus : fs::absolute(a.corpus).lexically_normal().string();
  c.model = preset.config;
  auto take = [](int64_t flag, int64_t preset_value, const char* name) {
    if (flag == -1) return preset_value;
    require_positive(flag, name);
    return flag;
  };
  c.model.vocab = take(a.vocab, c.model.vocab, "--vocab");
  Tokenizer::check_vocab_size(static_cast<int>(std::min<int64_t>(c.model.vocab, INT32_MAX)));
  c.model.d_model = take(a.d_model, c.model.d_model, "--d-model");
  c.model.n_layers = take(a.layers, c.model.n_layers, "--layers");
  c.model.n_heads = take(a.heads, c.model.n_heads, "--heads");
  c.model.ffn = take(a.ffn, c.model.ffn, "--ffn");
  c.model.ctx = take(a.ctx, c.model.ctx, "--ctx");
  c.model.n_kv_heads = a.kv_heads == -1 ? c.model.n_heads : take(a.kv_heads, 0, "--kv-heads");
  c.model.head_dim = a.head_dim == -1 ? 0 : take(a.head_dim, 0, "--head-dim");
  if (a.rope_theta != -1.0) c.model.rope_theta = a.rope_theta;
  const Architecture* arch = find_architecture(a.arch);
  if (!arch)
    throw UserError("--arch " + a.arch + ": not an architecture cputrain computes (" +
                    architecture_names() + ")");
  c.model = with_architecture(c.model, *arch);
  apply_expert_flags(c.model, *arch, a);
  if (a.rope_pairs == "half-split")
    c.model.rope_pairs = RopePairs::HalfSplit;
  else if (a.rope_pairs == "adjacent")
    c.model.rope_pairs = RopePairs::Adjacent;
  else if (!a.rope_pairs.empty())
    throw UserError("--rope-pairs " + a.rope_pairs + ": not a pairing (adjacent or half-split)");
  if (a.qkv_bias) {
    if (arch->qkv_bias == Presence::Never)
      throw UserError("--qkv-bias: a " + a.arch + " model has no q/k/v biases");
    c.model.qkv_bias = true;
  }
  c.model.tie_embeddings = a.tie_embeddings || arch->always_tied;
  if (a.sliding_window != -1 && arch->swa_pattern == 0)
    throw UserError("--sliding-window: a " + a.arch + " model has no sliding-window layers");
  if (arch->swa_pattern > 0)
    c.model.sliding_window = take(a.sliding_window, arch->default_window, "--sliding-window");
  if (const auto problem = validate(c.model)) throw UserError(flag_message(*problem));
  c.steps = take(a.steps, default_steps(a.preset), "--steps");
  c.train.batch = take(a.batch, preset.batch, "--batch");
  c.train.accum = take(a.accum, preset.accum, "--accum");
  c.train.ctx = c.model.ctx;
  c.train.seed = a.seed;
  c.train.lr.peak = a.lr < 0 ? default_lr(c.model) : a.lr;
  if (!(c.train.lr.peak > 0.0) || !std::isfinite(c.train.lr.peak))
    throw UserError("--lr must be a positive number (got " + std::to_string(a.lr) + ")");
  c.train.lr.warmup_steps = a.warmup >= 0 ? a.warmup : std::min<int64_t>(100, c.steps / 10);
  c.train.lr.total_steps = c.steps;
  c.train.lr.min_ratio = 0.1;
  c.train.adamw.weight_decay = static_cast<float>(a.weight_decay);
  c.train.adamw.grad_clip = static_cast<float>(a.grad_clip);
  const std::string refusal = router_losses_refusal(c.model);
  if (!refusal.empty() && (a.moe_balance >= 0 || a.moe_z >= 0))
    throw UserError(std::string(a.moe_balance >= 0 ? "--moe-balance" : "--moe-z-loss") + ": " +
                    refusal);
  c.train.moe_balance = static_cast<float>(a.moe_balance >= 0 ? a.moe_balance
                                           : refusal.empty()  ? kMoeBalanceDefault
                                                              : 0.0);
  c.train.moe_z = static_cast<float>(std::max(a.moe_z, 0.0));
  if (a.eval_windows <= 0) throw UserError("--eval-windows must be positive");
  c.save_every = a.save_every >= 0 ? a.save_every : std::max<int64_t>(1, c.steps / 10);
  c.keep = a.keep;
  c.offload = offload_folder(a.offload);
  c.threads = a.threads > 0 ? a.threads : omp_get_num_procs();
  return c;
}

std::string describe_compute() {
  const std::string note = kernels::isa_default_note();
  return fmt::format("cpu: {}; kernels: {} (gemm available: {}); gemm blocking: {}{}{}",
                     kernels::cpu_features_string(), kernels::kernel_choices(),
                     kernels::gemm_available_backends(), gemm_blocking(), note.empty() ? "" : "; ",
                     note);
}

namespace {

std::string sample_text(DecoderModel& model, const Tokenizer& tokenizer, int64_t tokens,
                        uint64_t seed) {
  SampleOptions options;
  options.max_new_tokens = tokens;
  options.seed = seed;
  options.stop_token = tokenizer.bos_id();
  std::vector<int32_t> out = generate(model, {tokenizer.bos_id()}, options);
  std::vector<int32_t> body;
  for (size_t i = 1; i < out.size(); ++i)
    if (out[i] != tokenizer.bos_id()) body.push_back(out[i]);
  return tokenizer.decode(body);
}

}  // namespace

void add_model_flags(CLI::App& app, TrainArgs& a) {
  app.add_option("--vocab", a.vocab, "Tokenizer vocabulary size (default: per preset)")
      ->check(positive_whole());
  app.add_option("--d-model", a.d_model, "Model width")->check(positive_whole());
  app.add_option("--layers", a.layers, "Number of blocks")->check(positive_whole());
  app.add_option("--heads", a.heads, "Attention (query) heads")->check(positive_whole());
  app.add_option("--kv-heads", a.kv_heads,
                 "Key/value heads: fewer than --heads is grouped-query attention, 1 multi-query "
                 "(default: --heads)")
      ->check(positive_whole());
  app.add_option("--head-dim", a.head_dim, "Width of one head (default: --d-model / --heads)")
      ->check(positive_whole());
  app.add_option("--ffn", a.ffn, "SwiGLU hidden width")->check(positive_whole());
  app.add_option("--experts", a.experts,
                 "A mixture of experts' count (qwen3moe, qwen35moe, gpt-oss: default 8; gemma4: "
                 "experts beside the MLP, default 0, as its dense sizes)")
      ->check(non_negative());
  app.add_option("--experts-used", a.experts_used,
                 "The experts each token takes (default 2, at most --experts)")
      ->check(positive_whole());
  app.add_option("--expert-ffn", a.expert_ffn,
                 "Each expert's hidden width (default --ffn / 8, at least 16)")
      ->check(positive_whole());
  app.add_option("--rope-theta", a.rope_theta, "RoPE base (default 10000)")->check(positive());
  app.add_option("--arch", a.arch,
                 "The architecture, whose parts the model has (" + architecture_names() +
                     "; default llama; `cputrain inspect` describes a model's)");
  app.add_option("--rope-pairs", a.rope_pairs,
                 "Elements RoPE rotates together: adjacent (llama) or half-split (neox, Qwen2) "
                 "(default: the architecture's in llama.cpp)")
      ->check(CLI::IsMember({"adjacent", "half-split"}));
  app.add_flag("--qkv-bias", a.qkv_bias, "Biases on the q, k and v projections (as Qwen2)");
  app.add_flag("--tie-embeddings", a.tie_embeddings,
               "The LM head is the token embedding matrix (as SmolLM2; always for gemma)");
  app.add_option("--sliding-window", a.sliding_window,
                 "Keys a sliding-window layer attends (gemma2, gemma3; default 4096, as "
                 "Hugging Face's configurations)")
      ->check(positive_whole());
}

void add_train_flags(CLI::App& app, TrainArgs& a) {
  app.add_option("--preset", a.preset, "Model preset: tiny, mini, mega, behemoth, titan")
      ->capture_default_str();
  app.add_option("--corpus", a.corpus, "Text file or folder of text files")->capture_default_str();
  app.add_option("--model", a.model,
                 "Start from this model: a GGUF file, a Hugging Face folder or a run (its shape, "
                 "tokenizer and weights; --ctx defaults to at most 512)");
  add_run_flags(app, a, RunCommand::Train);
  add_model_flags(app, a);
  app.add_option("--warmup", a.warmup, "Warm-up steps (default: min(100, steps / 10))")
      ->check(non_negative());
  app.add_option("--grad-clip", a.grad_clip, "Global gradient-norm clip (0: off)")
      ->capture_default_str()
      ->check(non_negative());
  app.add_option("--moe-balance", a.moe_balance,
                 "A mixture of experts' load-balancing loss coefficient (Switch Transformer; "
                 "Qwen's router_aux_loss_coef), on each MoE layer's loss averaged over the layers "
                 "(default 0.001)")
      ->check(non_negative());
  app.add_option("--moe-z-loss", a.moe_z,
                 "A mixture of experts' router z-loss coefficient (ST-MoE: the mean squared "
                 "log-sum-exp of the router's logits, averaged over the layers; default 0)")
      ->check(non_negative());
  app.add_flag("--pin-threads", a.pin_threads,
               "Bind each OpenMP thread to one CPU of those the process may use");
  app.add_option("--eval-windows", a.eval_windows, "Validation windows of ctx tokens per eval")
      ->capture_default_str()
      ->check(positive());
  app.add_option("--sample-every", a.sample_every,
                 "Print a sample every N steps (0: only at the end)")
      ->capture_default_str()
      ->check(non_negative());
  app.add_option("--sample-tokens", a.sample_tokens, "Tokens per printed sample")
      ->capture_default_str()
      ->check(non_negative());
}

namespace {

// The flags that are a run's configuration. A resumed run keeps its own: giving one is refused.
constexpr const char* kRunFlags[] = {"--preset",     "--corpus",         "--out",
                                     "--vocab",      "--d-model",        "--layers",
                                     "--heads",      "--kv-heads",       "--head-dim",
                                     "--ffn",        "--rope-theta",     "--rope-pairs",
                                     "--experts",    "--experts-used",   "--expert-ffn",
                                     "--qkv-bias",   "--tie-embeddings", "--sliding-window",
                                     "--batch",      "--accum",          "--ctx",
                                     "--lr",         "--warmup",         "--weight-decay",
                                     "--grad-clip",  "--seed",           "--dtype",
                                     "--checkpoint", "--overwrite",      "--moe-balance",
                                     "--moe-z-loss"};

// --resume: the run's own configuration (DIR/config.json) and what a resumed run may change:
// where it ends (--steps), how it saves (--save-every, --keep) and how it executes.
RunConfig resume_config(const TrainArgs& a) {
  const std::string dir = a.run_dir();
  if (dir.empty()) throw UserError("--resume: give the run directory to continue (--resume RUN)");
  if (!fs::is_directory(dir)) throw UserError("--resume " + dir + ": no such run directory");
  std::string refused;
  for (const char* flag : kRunFlags)
    if (a.was_given(flag) && !(std::string_view(flag) == "--out" && a.resume.empty()))
      refused += (refused.empty() ? "" : ", ") + std::string(flag);
  if (!refused.empty())
    throw UserError("--resume " + dir + ": " + refused +
                    " would change the run, which keeps the configuration it began with (" + dir +
                    "/config.json); to change it, start a new run with --out");
  RunConfig config = read_run_config(dir + "/config.json");
  config.threads = a.threads > 0 ? a.threads : omp_get_num_procs();
  if (a.was_given("--steps")) config.steps = a.steps;
  if (a.was_given("--save-every")) config.save_every = a.save_every;
  if (a.was_given("--keep")) config.keep = a.keep;
  if (a.was_given("--offload")) config.offload = offload_folder(a.offload);
  return config;
}

// The flags that shape the model: with --model the shape is the model's.
constexpr const char* kShapeFlags[] = {
    "--vocab",        "--d-model",    "--layers",     "--heads",          "--kv-heads",
    "--head-dim",     "--ffn",        "--rope-theta", "--rope-pairs",     "--experts",
    "--experts-used", "--expert-ffn", "--qkv-bias",   "--tie-embeddings", "--sliding-window"};

// --model: the run takes the model's shape (its context at most --ctx, else 512) and records
// where it began; its tokenizer and weights are taken when the run directory is open.
void begin_from_model(RunConfig& config, const TrainArgs& a) {
  std::string refused;
  for (const char* flag : kShapeFlags)
    if (a.was_given(flag)) refused += (refused.empty() ? "" : ", ") + std::string(flag);
  if (!refused.empty())
    throw UserError(refused + ": the model's shape comes from --model " + a.model);
  config.model = load_model_config(a.model, "--model", a.ctx > 0 ? a.ctx : 512);
  config.train.ctx = config.model.ctx;
  config.init = fs::absolute(a.model).lexically_normal().string();
  config.preset = fs::path(config.init).filename().string();
  if (a.lr < 0) config.train.lr.peak = default_lr(config.model);
}

// How a resumed run's end relates to where it stopped: a UserError where there is nothing left
// to train; the rule for the learning rate logged where --steps extends the run.
void check_resumed_steps(const RunConfig& config, const RunConfig& began, int64_t reached,
                         const std::string& dir, spdlog::logger& log) {
  if (config.steps < reached)
    throw UserError("--steps " + std::to_string(config.steps) + ": the run in " + dir +
                    " has already trained " + std::to_string(reached) + " steps");
  if (config.steps == reached)
    throw UserError("--resume " + dir + ": the run has trained all its " + std::to_string(reached) +
                    " steps; give --steps above " + std::to_string(reached) +
                    " to train it further");
  if (config.steps != began.steps)
    log.info(
        "the run now ends at step {} (it was to end at {}); the learning rate keeps the schedule "
        "it began with (warm-up {}, cosine decay to {:.3g} at step {}), the steps past that at "
        "its final rate",
        config.steps, began.steps, config.train.lr.warmup_steps,
        config.train.lr.peak * config.train.lr.min_ratio, config.train.lr.total_steps);
}

// The loop's cadences and limits, which every rank of a job takes alike from the flags and the
// run's configuration.
LoopPlan loop_plan(const TrainArgs& args, const RunConfig& config, int64_t first_step) {
  LoopPlan plan;
  plan.command = "train";
  plan.first_step = first_step;
  plan.steps = config.steps;
  plan.save_every = config.save_every;
  plan.keep = config.keep;
  plan.eval_every = args.eval_every > 0 ? args.eval_every : std::max<int64_t>(1, config.steps / 10);
  plan.log_every = args.log_every;
  plan.spike = args.spike;
  plan.on_bad_step = args.on_bad_step;
  plan.profile = args.profile;
  plan.sample_every = args.sample_every;
  plan.positions =
      config.train.batch * config.train.accum * config.train.ctx * Communicator::world().size();
  return plan;
}

// Windows of ctx + 1 tokens of the corpus, sampled by (seed, step, row); validation on the first
// windows of the held-out split, where it has one.
class TokenWindows final : public BatchSource {
 public:
  TokenWindows(std::span<const int32_t> train, std::span<const int32_t> val, int64_t ctx,
               int64_t eval_windows)
      : train_(train), val_(val), ctx_(ctx), eval_windows_(eval_windows) {}
  StepResult step(Trainer& trainer, int64_t step) override { return trainer.step(train_, step); }
  bool validates() const override { return static_cast<int64_t>(val_.size()) >= ctx_ + 1; }
  double validate(Trainer& trainer) override { return trainer.evaluate(val_, eval_windows_); }

 private:
  std::span<const int32_t> train_, val_;
  int64_t ctx_, eval_windows_;
};

// model.bin, with the run's configuration; of a job with sharded masters every rank gives its
// shard.
class ModelFile final : public RunOutput {
 public:
  ModelFile(std::string path, const ParameterSet& params, std::string config_json)
      : path_(std::move(path)), params_(params), config_json_(std::move(config_json)) {}
  void write(bool lead) override {
    if (lead)
      save_weights(path_, params_, config_json_);
    else
      params_.serve_sharded_masters(true);
  }

 private:
  std::string path_;
  const ParameterSet& params_;
  std::string config_json_;
};

int train_in(const RunDirectory& run, RunConfig& config, const TrainArgs& args,
             const std::string& dtype_reason, const TestHold& hold, JobStart& start);
int follow_train(const TrainArgs& args, const Communicator& comm, JobStart& start);
int lead_train(const TrainArgs& args, JobStart& start);

}  // namespace

int run_train(const TrainArgs& args) {
  // Of a data-parallel job, rank 0 runs the command and the others follow it.
  const Communicator& comm = Communicator::world();
  JobStart start(comm);
  if (comm.rank() > 0) return follow_train(args, comm, start);
  try {
    return lead_train(args, start);
  } catch (...) {
    start.failed();
    throw;
  }
}

namespace {

int lead_train(const TrainArgs& args, JobStart& start) {
  if (args.log_every <= 0) throw UserError("--log-every must be positive");
  if (args.keep <= 0) throw UserError("--keep must be positive");
  const bool resuming = args.resuming();
  RunConfig config;
  std::string dtype_reason = "as the run began";
  if (resuming) {
    config = resume_config(args);
    select_kernels(args.kernels);
  } else {
    config = resolve_run_config(args);
    select_kernels(args.kernels);
    config.dtype = choose_dtype(args.dtype, &dtype_reason);
    config.checkpoint = parse_checkpointing(args.checkpoint).value_or(Checkpointing::None);
    if (!args.model.empty()) begin_from_model(config, args);
  }
  const int ranks = Communicator::world().size();
  if (resuming && config.ranks != ranks)
    throw UserError("--resume " + args.run_dir() + ": the run trains as " +
                    std::to_string(config.ranks) + " rank" + (config.ranks == 1 ? "" : "s") +
                    " (its batch is each rank's), and this job has " + std::to_string(ranks) +
                    ": resume it with mpirun -np " + std::to_string(config.ranks) +
                    (config.ranks == 1 ? " or without mpirun" : ""));
  config.ranks = ranks;
  if (Communicator::world().size() > 1 && !config.offload.empty())
    throw UserError("--offload " + config.offload + ": a data-parallel job of " +
                    std::to_string(Communicator::world().size()) +
                    " ranks holds its state in RAM (give --offload none)");
  const TestHold hold = test_hold();
  const std::string out =
      resuming ? args.run_dir() : (args.out.empty() ? "runs/" + config.preset : args.out);
  const RunDirectory run = open_run_directory(
      out,
      resuming ? RunDirUse::Resume : (args.overwrite ? RunDirUse::Overwrite : RunDirUse::NewRun));
  try {
    return train_in(run, config, args, dtype_reason, hold, start);
  } catch (...) {
    run.discard_if_unused();
    throw;
  }
}

// MFU: the model's FLOPs per second over this machine's peak for the dtype, measured here
// (about 0.1 s). In bf16 the peak is the machine's best BF16 instruction (AMX where present),
// whichever GEMM runs.
struct TrainingPeak {
  explicit TrainingPeak(DType dtype)
      : peak(kernels::measure_peak(2'000'000, 3)),
        bf16(dtype == DType::BF16 && peak.bf16_best_all_threads() > 0),
        gflops(of(peak)) {}
  double of(const kernels::Peak& p) const {
    return bf16 ? p.bf16_best_all_threads() : p.f32_all_threads;
  }
  // A longer measurement, for a step that ran close to the first.
  double measure_again() const { return of(kernels::measure_peak(2'000'000, 10)); }
  kernels::Peak peak;
  bool bf16;
  double gflops;
};

// The model as the run's configuration says, its state offloaded where it asks, initialised
// from the seed or, for a run that begins from one, the model file.
std::unique_ptr<DecoderModel> build_model(const RunConfig& config, const MemoryBudget& budget,
                                          bool resuming, spdlog::logger& log) {
  const Communicator& comm = Communicator::world();
  process_memory_reset_peak();  // from here on the peak RSS is training's
  log.info("resident before the model: {} (the budget's runtime estimate: {})",
           format_bytes(process_memory().rss_bytes), format_bytes(budget.runtime_bytes));
  // --offload: the state files' folder, held for the run.
  ModelOptions options;
  options.compute_dtype = config.dtype;
  if (comm.size() > 1) options.shard = &comm;
  if (!config.offload.empty()) {
    options.offload = true;
    options.offload_dir = std::make_shared<OffloadDir>(config.offload);
  }
  auto model = std::make_unique<DecoderModel>(config.model, options);
  if (options.offload)
    log.info("offloaded to {}: {} on disk (masters, AdamW's m and v)", config.offload,
             format_bytes(budget.disk_bytes));
  model->init_weights(config.train.seed);
  if (!resuming && !config.init.empty()) {
    load_model_weights(config.init, "--model", model->parameters());
    log.info("weights from {}", config.init);
  }
  model->set_compute_dtype(config.dtype);
  model->set_checkpointing(config.checkpoint);
  return model;
}

// The log's account of what the run trains, how and on what.
void describe_run(const RunConfig& config, const TrainArgs& args, const TrainingPeak& peak,
                  double flops_per_token, const std::string& dtype_reason, spdlog::logger& log) {
  const ModelConfig& m = config.model;
  log.info(
      "model {} ({}): {} parameters (d_model {}, layers {}, heads {}, kv heads {}, head dim {}, "
      "ffn {}, vocab {}, ctx {}; {})",
      config.preset, m.architecture, parameter_count(m), m.d_model, m.n_layers, m.n_heads,
      m.kv_heads(), m.head_size(), m.ffn, m.vocab, m.ctx, describe_parts(m));
  log.info("training {} steps of {} x {} sequences of {} tokens, lr {:g}, warm-up {}, {} threads",
           config.steps, config.train.batch, config.train.accum, config.train.ctx,
           config.train.lr.peak, config.train.lr.warmup_steps, config.threads);
  log.info("{}", describe_compute());
  if (args.pin_threads) {
    std::string cpus;
    for (int cpu : pin_threads()) cpus += (cpus.empty() ? "" : ",") + std::to_string(cpu);
    log.info("threads pinned to CPUs {}", cpus);
  }
  if (peak.gflops > 0)
    log.info("peak (measured, {} threads): {:.0f} GFLOP/s {}{}; training FLOPs per token: {:.3g}",
             config.threads, peak.gflops, peak.bf16 ? "bf16 " : "fp32 (FMA)",
             peak.bf16 ? std::string("(") + peak.peak.bf16_best_instruction() + ")" : std::string(),
             flops_per_token);
  log.info("dtype: {} ({}); gradient checkpointing: {}",
           config.dtype == DType::BF16 ? "bf16" : "fp32", dtype_reason,
           checkpointing_words(config.checkpoint));
}

// The run in its opened directory: log, signals, data, memory, model, loop, final weights.
int train_in(const RunDirectory& run, RunConfig& config, const TrainArgs& args,
             const std::string& dtype_reason, const TestHold& hold, JobStart& start) {
  const Communicator& comm = Communicator::world();
  const std::string& out = run.path;
  const bool resuming = args.resuming();
  omp_set_num_threads(config.threads);
  // A tokenizer trains in one library call: a stop signal then ends the process.
  RunSession session(run, true, "preparing the data");
  spdlog::logger& log = session.log();

  // What can be refused is refused before the data is prepared.
  const std::string config_path = out + "/config.json";
  const RunConfig began = resuming ? read_run_config(config_path) : config;
  std::optional<ResumePoint> resume;
  if (resuming) {
    resume = find_resume_point(out, run_config_to_json(began), log);
    check_resumed_steps(config, began, resume->info.step, out, log);
  }
  const TrainingPeak peak(config.dtype);
  warn_of_slow_steps(config, peak.gflops, log);
  const int64_t available = memory_limit_bytes(args.mem_limit_gib);
  check_memory_floor(config, resuming || !config.init.empty(), resuming ? "none" : args.checkpoint,
                     available, log);

  if (hold.step == 0) wait_for_stop_signal(0, hold.forever);
  // A run begun from a model keeps that model's tokenizer, saved beside its data.
  if (!resuming && !config.init.empty())
    log.info("tokenizer of {}: saved as {}", config.init,
             load_tokenizer(config.init, "--model").save_to_run(out));
  PreparedData data = prepare_run_data(
      config, out, session.console(),
      resume ? std::optional<uint64_t>(resume->info.data_fingerprint) : std::nullopt,
      resuming ? config_path + ": corpus " + config.corpus : "--corpus " + config.corpus);
  session.prepared();
  const auto train_tokens = data.dataset.train_tokens();
  const auto val_tokens = data.dataset.val_tokens();
  TokenWindows windows(train_tokens, val_tokens, config.train.ctx, args.eval_windows);
  const MemoryBudget budget =
      plan_memory(config, resuming ? "none" : args.checkpoint,
                  static_cast<int64_t>(train_tokens.size() + val_tokens.size()),
                  windows.validates() ? args.eval_windows : 0, available, log);

  const std::unique_ptr<DecoderModel> model = build_model(config, budget, resuming, log);
  const std::string config_json = run_config_to_json(config);
  // A resumed run records what it changed (its end, its saving) once it is sure to go on.
  RunConfig as_began = config;
  as_began.threads = began.threads;
  if (!resuming || run_config_to_json(as_began) != run_config_to_json(began))
    write_file_atomic(config_path, config_json);
  const double flops_per_token = training_flops_per_token(config.model, config.train.ctx);
  describe_run(config, args, peak, flops_per_token, dtype_reason, log);

  config.train.comm = &comm;
  Trainer trainer(
      model->parameters(),
      [&model](const Tensor& in, const Tensor& tgt) { return model->loss(in, tgt); }, config.train);
  const int64_t first_step = resume ? resume->info.step + 1 : 1;
  if (resume) log.info("resuming from {} at step {}", resume->path, first_step);
  if (comm.size() > 1) {
    // The other ranks start from what this one has: the configuration, the data, the weights
    // and, resumed, the optimizer's state (follow_train takes them in this order).
    start.ready();
    comm.set_timeout(args.rank_timeout);
    std::string text = config_json;
    broadcast_text(comm, text);
    share_value(comm, first_step);
    share_tokens(comm, train_tokens);
    share_tokens(comm, val_tokens);
  }
  // Of a job with its optimizer sharded, every rank takes its shard as this one reads the file.
  if (resume) load_checkpoint(resume->path, model->parameters(), &trainer.optimizer());
  if (comm.size() > 1) {
    broadcast_training_state(comm, model->parameters(), trainer.optimizer());
    log.info(
        "data parallel: {} ranks, each of {} x {} sequences a step (the job's batch is {} x {})",
        comm.size(), config.train.batch, config.train.accum, config.train.batch * comm.size(),
        config.train.accum);
  }
  LoopPlan plan = loop_plan(args, config, first_step);
  plan.dir = out;
  plan.hold = hold;
  plan.config_json = config_json;
  plan.data_fingerprint = data.dataset.fingerprint();
  plan.budget = budget;
  plan.last_checkpoint = resume ? resume->path : "";
  plan.replacing = run.replacing;
  plan.flops_per_token = flops_per_token;
  plan.peak_gflops = peak.gflops;
  plan.measure_peak = [&peak] { return peak.measure_again(); };
  plan.sample = [&](int64_t step) {
    log.info("sample: {}", sample_text(*model, data.tokenizer, args.sample_tokens, step));
  };
  ModelFile model_file(out + "/model.bin", model->parameters(), config_json);
  const int status =
      run_loop(plan, trainer, model->parameters(), windows, model_file, comm, session.io());
  if (status != 0) return status;
  log.info("saved {}/model.bin", out);
  for (uint64_t i = 1; i <= 3; ++i)
    log.info("sample {}: {}", i, sample_text(*model, data.tokenizer, args.sample_tokens, i));
  return 0;
}

// A rank other than 0 of a data-parallel job: it trains the model rank 0 describes on the data
// rank 0 sends, in step with it, and writes nothing; rank 0 logs, evaluates with it, and saves.
int follow_train(const TrainArgs& args, const Communicator& comm, JobStart& start) {
  try {
    select_kernels(args.kernels);
  } catch (...) {
    if (start.failed()) throw QuietExit{1};
    throw;
  }
  start.ready();
  comm.set_timeout(args.rank_timeout);
  // A stop signal here stops the job after its step, as one to rank 0 does (taken before the
  // trainer's threads start, so that they inherit it blocked).
  const StopSignals signals([](int) {});
  std::string text;
  broadcast_text(comm, text);
  RunConfig config = parse_run_config(text, "rank 0's configuration");
  omp_set_num_threads(args.threads > 0 ? args.threads : omp_get_num_procs());
  if (args.pin_threads) pin_threads();
  const int64_t first_step = share_value(comm, 0);
  const std::vector<int32_t> train_tokens = share_tokens(comm, {});
  const std::vector<int32_t> val_tokens = share_tokens(comm, {});
  ModelOptions model_options;
  model_options.compute_dtype = config.dtype;
  model_options.shard = &comm;
  DecoderModel model(config.model, model_options);
  // Each rank's masters of its shard: the init every rank computes alike, or the model file,
  // which each rank reads (rank 0's weights reach the others below, but of the masters it holds
  // its shard alone).
  model.init_weights(config.train.seed);
  if (first_step == 1 && !config.init.empty())
    load_model_weights(config.init, "--model", model.parameters());
  model.set_compute_dtype(config.dtype);
  model.set_checkpointing(config.checkpoint);
  config.train.comm = &comm;
  Trainer trainer(
      model.parameters(),
      [&model](const Tensor& in, const Tensor& tgt) { return model.loss(in, tgt); }, config.train);
  const bool sharded = !trainer.optimizer().shards().empty();
  if (first_step > 1 && sharded)
    share_checkpoint_state(model.parameters(), trainer.optimizer(), false);
  broadcast_training_state(comm, model.parameters(), trainer.optimizer());
  TokenWindows windows(train_tokens, val_tokens, config.train.ctx, args.eval_windows);
  ModelFile model_file("", model.parameters(), "");
  return run_loop(loop_plan(args, config, first_step), trainer, model.parameters(), windows,
                  model_file, comm, {});
}

}  // namespace
}  // namespace cputrain
