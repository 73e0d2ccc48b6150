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

#include "engine/atomic_file.h"
#include "engine/checkpoint_file.h"
#include "engine/data_pipeline.h"
#include "engine/error.h"
#include "engine/memory.h"
#include "engine/offload.h"
#include "engine/profiler.h"
#include "engine/threads.h"
#include "engine/tokenizer.h"
#include "engine/trainer.h"
#include "engine/weights_file.h"
#include "kernels/attention.h"
#include "kernels/cpu_features.h"
#include "kernels/dispatch.h"
#include "kernels/gemm.h"
#include "kernels/peak.h"
#include "models/generate.h"
#include "models/llama.h"
#include "models/memory_budget.h"
#include "tools/budget_command.h"
#include "tools/flag_checks.h"
#include "tools/job.h"
#include "tools/mfu_peak.h"
#include "tools/model_source.h"
#include "tools/progress.h"
#include "tools/run_config.h"
#include "tools/run_dir.h"
#include "tools/stop_signals.h"
#include "tools/train_stages.h"

namespace cputrain {
namespace {

namespace fs = std::filesystem;

int64_t default_steps(const std::string& preset) {
  if (preset == "tiny") return 200;
  if (preset == "mini") return 600;
  return 2000;
}

double default_lr(const LlamaConfig& c) {
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

// --offload DIR as config.json records it: absolute; "none" (or nothing) holds the state in RAM.
std::string offload_folder(const std::string& flag) {
  if (flag.empty() || flag == "none") return "";
  return fs::absolute(flag).lexically_normal().string();
}

}  // namespace

RunConfig resolve_run_config(const TrainArgs& a) {
  const auto preset = find_preset(a.preset);
  if (!preset) {
    std::string names;
    for (const std::string& n : preset_names()) names += (names.empty() ? "" : ", ") + n;
    throw UserError("--preset " + a.preset + ": unknown preset (choose one of " + names + ")");
  }
  RunConfig c;
  c.preset = a.preset;
  // Absolute, so that --resume works from any folder.
  c.corpus = a.corpus.empty() ? a.corpus : fs::absolute(a.corpus).lexically_normal().string();
  c.model = preset->config;
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
  if (a.rope_pairs == "half-split")
    c.model.rope_pairs = RopePairs::HalfSplit;
  else if (a.rope_pairs == "adjacent")
    c.model.rope_pairs = RopePairs::Adjacent;
  else if (!a.rope_pairs.empty())
    throw UserError("--rope-pairs " + a.rope_pairs + ": not a pairing (adjacent or half-split)");
  c.model.qkv_bias = a.qkv_bias;
  c.model.tie_embeddings = a.tie_embeddings;
  if (const auto problem = validate(c.model)) throw UserError(flag_message(*problem));
  c.steps = take(a.steps, default_steps(a.preset), "--steps");
  c.train.batch = take(a.batch, preset->batch, "--batch");
  c.train.accum = take(a.accum, preset->accum, "--accum");
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
  if (a.eval_windows <= 0) throw UserError("--eval-windows must be positive");
  c.save_every = a.save_every >= 0 ? a.save_every : std::max<int64_t>(1, c.steps / 10);
  c.keep = a.keep;
  c.offload = offload_folder(a.offload);
  c.threads = a.threads > 0 ? a.threads : omp_get_num_procs();
  return c;
}

DType choose_dtype(const std::string& flag, std::string* why) {
  if (flag == "bf16" || flag == "fp32") {
    *why = "--dtype " + flag;
    return flag == "bf16" ? DType::BF16 : DType::F32;
  }
  if (!flag.empty()) throw UserError("--dtype " + flag + ": must be bf16 or fp32");
  const kernels::GemmBackend backend = kernels::gemm_backend();
  const std::string name(kernels::gemm_backend_name(backend));
  if (kernels::gemm_bf16_native(backend)) {
    *why = "the " + name + " GEMM has bf16 instructions on this CPU";
    return DType::BF16;
  }
  *why = "the " + name +
         " GEMM has no bf16 instructions on this CPU, where bf16 would be emulated and slower "
         "than fp32 (--dtype bf16 forces it)";
  return DType::F32;
}

int64_t memory_limit_bytes(double gib) {
  if (gib > 0.0) return static_cast<int64_t>(gib * 1024.0 * 1024.0 * 1024.0);
  return available_memory_bytes() / Communicator::launched_local_ranks();
}

std::string describe_compute() {
  return fmt::format("cpu: {}; kernels: {} (gemm available: {})", kernels::cpu_features_string(),
                     kernels::kernel_choices(), kernels::gemm_available_backends());
}

namespace {

double gib(int64_t bytes) {
  return static_cast<double>(bytes) / (1024.0 * 1024.0 * 1024.0);
}

std::string sample_text(LlamaModel& model, const Tokenizer& tokenizer, int64_t tokens,
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
  app.add_option("--rope-theta", a.rope_theta, "RoPE base (default 10000)")->check(positive());
  app.add_option("--rope-pairs", a.rope_pairs,
                 "Elements RoPE rotates together: adjacent (llama) or half-split (neox, Qwen2) "
                 "(default adjacent)")
      ->check(CLI::IsMember({"adjacent", "half-split"}));
  app.add_flag("--qkv-bias", a.qkv_bias, "Biases on the q, k and v projections (as Qwen2)");
  app.add_flag("--tie-embeddings", a.tie_embeddings,
               "The LM head is the token embedding matrix (as SmolLM2)");
}

void add_train_flags(CLI::App& app, TrainArgs& a) {
  app.add_option("--preset", a.preset, "Model preset: tiny, mini, mega, behemoth, titan")
      ->capture_default_str();
  app.add_option("--corpus", a.corpus, "Text file or folder of text files")->capture_default_str();
  app.add_option("--out", a.out, "Run directory (default runs/<preset>)");
  app.add_option("--model", a.model,
                 "Start from this model: a GGUF file, a Hugging Face folder or a run (its shape, "
                 "tokenizer and weights; --ctx defaults to at most 512)");
  app.add_option("--steps", a.steps, "Optimizer steps (default: per preset)")
      ->check(positive_whole());
  app.add_option("--batch", a.batch, "Sequences per micro-batch (default: per preset)")
      ->check(positive_whole());
  app.add_option("--accum", a.accum, "Micro-batches per optimizer step (default: per preset)")
      ->check(positive_whole());
  app.add_option("--ctx", a.ctx, "Tokens per sequence (default: per preset)")
      ->check(positive_whole());
  add_model_flags(app, a);
  app.add_option("--lr", a.lr, "Peak learning rate (default: by model width)")->check(positive());
  app.add_option("--warmup", a.warmup, "Warm-up steps (default: min(100, steps / 10))")
      ->check(non_negative());
  app.add_option("--weight-decay", a.weight_decay, "AdamW weight decay on matrices")
      ->capture_default_str()
      ->check(non_negative());
  app.add_option("--grad-clip", a.grad_clip, "Global gradient-norm clip (0: off)")
      ->capture_default_str()
      ->check(non_negative());
  app.add_option("--seed", a.seed, "Seed for init and batch sampling")
      ->capture_default_str()
      ->check(non_negative());
  app.add_option("--threads", a.threads, "OpenMP threads (default: all cores)")
      ->check(threads_limit());
  app.add_flag("--pin-threads", a.pin_threads,
               "Bind each OpenMP thread to one CPU of those the process may use");
  app.add_flag("--profile", a.profile,
               "Time every op (forward and backward), the optimizer and the GEMMs over the steps "
               "after the first; print the table at the end and write <out>/profile.json");
  app.add_option("--eval-every", a.eval_every,
                 "Validation loss every N steps (default: steps / 10)")
      ->check(positive());
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
  app.add_option("--log-every", a.log_every, "Log a line every N steps")
      ->capture_default_str()
      ->check(positive());
  add_kernel_flags(app, a.kernels);
  app.add_option("--dtype", a.dtype,
                 "Training precision: bf16 (bf16 GEMMs and saved activations, FP32 master weights) "
                 "or fp32 (default: bf16 where the GEMM has bf16 instructions, else fp32)")
      ->check(CLI::IsMember({"bf16", "fp32"}));
  app.add_option("--checkpoint", a.checkpoint,
                 "Gradient checkpointing: layer (keep only each block's input, recompute the block "
                 "in backward), none, or auto (layer when the budget without it does not fit)")
      ->capture_default_str()
      ->check(CLI::IsMember({"layer", "none", "auto"}));
  app.add_option("--resume", a.resume,
                 "Continue the run in this directory from its latest checkpoint, with its own "
                 "configuration (bitwise as if it had not stopped); --steps moves its end, and "
                 "--save-every and --keep change its saving");
  app.add_flag("--overwrite", a.overwrite,
               "Replace the run already in --out: it is moved to <out>/.replaced and deleted once "
               "the new run has completed its first step");
  app.add_option("--save-every", a.save_every,
                 "Save a checkpoint every N steps (default: steps / 10; 0: only at the end); also "
                 "at the end and on SIGINT or SIGTERM")
      ->check(non_negative());
  app.add_option("--keep", a.keep, "Checkpoints kept in <out>/checkpoints")
      ->capture_default_str()
      ->check(positive());
  app.add_option("--spike", a.spike,
                 "Treat a loss above this many times the mean of the last 20 steps as a bad step "
                 "(0: off)")
      ->capture_default_str()
      ->check(non_negative());
  app.add_option("--on-bad-step", a.on_bad_step,
                 "On a non-finite loss or gradient norm, or a spike: stop (naming the last good "
                 "checkpoint) or skip the update and go on")
      ->capture_default_str()
      ->check(CLI::IsMember({"stop", "skip"}));
  app.add_option("--mem-limit", a.mem_limit_gib,
                 "GiB the run (each rank of a job) may use (default: the available memory at "
                 "start, shared among a job's ranks on this machine); training refuses to start "
                 "when its budget exceeds it")
      ->check(positive());
  app.add_option("--rank-timeout", a.rank_timeout,
                 "Of a job of several ranks (mpirun): seconds a rank waits for the others in a "
                 "step before it ends the job, saying so (0: forever)")
      ->capture_default_str()
      ->check(non_negative());
  app.add_option("--offload", a.offload,
                 "Keep the FP32 master weights (bf16) and AdamW's m and v in files in this folder, "
                 "streamed through RAM in the optimizer step: bitwise the same run in less RAM "
                 "(with --resume: another folder, or none to hold them in RAM again)");
  app.parse_complete_callback([&app, &a] {
    a.given.clear();
    for (const CLI::Option* option : app.get_options())
      if (option->count() > 0) a.given.push_back(option->get_name());
  });
}

void add_kernel_flags(CLI::App& app, KernelArgs& a) {
  app.add_option("--gemm", a.gemm,
                 "GEMM implementation: amx, avx512, eigen, onednn or reference (default: the "
                 "fastest this CPU runs; as --kernel gemm=NAME or CPUTRAIN_GEMM=NAME)");
  app.add_option("--kernel", a.kernel,
                 "FAMILY=NAME: force one kernel family's implementation (families: " +
                     kernels::kernel_families() + "; also CPUTRAIN_<FAMILY>=NAME); repeatable");
  app.add_option("--isa", a.isa,
                 "Highest instruction set any kernel may use: avx2, avx512, avx512_bf16 or amx "
                 "(default: all this CPU has; also CPUTRAIN_ISA)");
}

void select_kernels(const KernelArgs& a) {
  try {
    if (!a.isa.empty()) kernels::set_isa_ceiling(kernels::isa_level(a.isa, "--isa " + a.isa));
    for (const std::string& k : a.kernel) {
      const size_t eq = k.find('=');
      if (eq == std::string::npos || eq == 0 || eq + 1 == k.size())
        throw UserError("--kernel " + k +
                        ": must be FAMILY=NAME (families: " + kernels::kernel_families() + ")");
      kernels::force_kernel(k.substr(0, eq), k.substr(eq + 1));
    }
    if (!a.gemm.empty()) kernels::force_kernel("gemm", a.gemm, "--gemm " + a.gemm);
    kernels::kernel_choices();
  } catch (const std::invalid_argument& e) {
    throw UserError(e.what());
  }
}

namespace {

// The flags that are a run's configuration. A resumed run keeps its own: giving one is refused.
constexpr const char* kRunFlags[] = {
    "--preset",     "--corpus",     "--out",      "--vocab",          "--d-model",
    "--layers",     "--heads",      "--kv-heads", "--head-dim",       "--ffn",
    "--rope-theta", "--rope-pairs", "--qkv-bias", "--tie-embeddings", "--batch",
    "--accum",      "--ctx",        "--lr",       "--warmup",         "--weight-decay",
    "--grad-clip",  "--seed",       "--dtype",    "--checkpoint",     "--overwrite"};

bool given(const TrainArgs& a, std::string_view flag) {
  return std::find(a.given.begin(), a.given.end(), flag) != a.given.end();
}

// --resume: the run's own configuration (DIR/config.json) and what a resumed run may change:
// where it ends (--steps), how it saves (--save-every, --keep) and how it executes.
RunConfig resume_config(const TrainArgs& a) {
  const std::string& dir = a.resume;
  if (!fs::is_directory(dir)) throw UserError("--resume " + dir + ": no such run directory");
  std::string refused;
  for (const char* flag : kRunFlags)
    if (given(a, flag)) refused += (refused.empty() ? "" : ", ") + std::string(flag);
  if (!refused.empty())
    throw UserError("--resume " + dir + ": " + refused +
                    " would change the run, which keeps the configuration it began with (" + dir +
                    "/config.json); to change it, start a new run with --out");
  RunConfig config = read_run_config(dir + "/config.json");
  config.threads = a.threads > 0 ? a.threads : omp_get_num_procs();
  if (given(a, "--steps")) config.steps = a.steps;
  if (given(a, "--save-every")) config.save_every = a.save_every;
  if (given(a, "--keep")) config.keep = a.keep;
  if (given(a, "--offload")) config.offload = offload_folder(a.offload);
  return config;
}

// The flags that shape the model: with --model the shape is the model's.
constexpr const char* kShapeFlags[] = {
    "--vocab", "--d-model",    "--layers",     "--heads",    "--kv-heads",      "--head-dim",
    "--ffn",   "--rope-theta", "--rope-pairs", "--qkv-bias", "--tie-embeddings"};

// --model: the run takes the model's shape (its context at most --ctx, else 512) and records
// where it began; its tokenizer and weights are taken when the run directory is open.
void begin_from_model(RunConfig& config, const TrainArgs& a) {
  std::string refused;
  for (const char* flag : kShapeFlags)
    if (given(a, flag)) refused += (refused.empty() ? "" : ", ") + std::string(flag);
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

// The steps after which a run evaluates and saves a checkpoint: every rank of a job decides
// alike, since each takes part in both.
bool evaluates_after(const TrainArgs& args, const RunConfig& config, int64_t step) {
  const int64_t every =
      args.eval_every > 0 ? args.eval_every : std::max<int64_t>(1, config.steps / 10);
  return step % every == 0 || step == config.steps;
}
bool saves_after(const RunConfig& config, int64_t step, int stop) {
  return (config.save_every > 0 && step % config.save_every == 0) || step == config.steps ||
         stop != 0;
}

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
  const bool resuming = !args.resume.empty();
  RunConfig config;
  std::string dtype_reason = "as the run began";
  if (resuming) {
    config = resume_config(args);
    select_kernels(args.kernels);
  } else {
    config = resolve_run_config(args);
    select_kernels(args.kernels);
    config.dtype = choose_dtype(args.dtype, &dtype_reason);
    config.checkpoint = args.checkpoint == "layer";
    if (!args.model.empty()) begin_from_model(config, args);
  }
  const int ranks = Communicator::world().size();
  if (resuming && config.ranks != ranks)
    throw UserError("--resume " + args.resume + ": the run trains as " +
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
      resuming ? args.resume : (args.out.empty() ? "runs/" + config.preset : args.out);
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

// The run in its opened directory: log, signals, data, memory, model, loop, final weights.
int train_in(const RunDirectory& run, RunConfig& config, const TrainArgs& args,
             const std::string& dtype_reason, const TestHold& hold, JobStart& start) {
  const Communicator& comm = Communicator::world();
  const std::string& out = run.path;
  const bool resuming = !args.resume.empty();
  omp_set_num_threads(config.threads);
  // On a terminal a progress line with the time left stays under the log.
  // (Not under an MPI launcher, whose pseudo-terminal is a terminal to the ranks wherever
  // mpirun's own output goes.)
  auto console = std::make_shared<ProgressSink>(::isatty(::fileno(stdout)) == 1 &&
                                                Communicator::launched_ranks() == 1);
  auto log = open_run_log(out, console);
  for (const std::string& path : run.stale)
    log->info("removed {}, left by a process that stopped while writing it", path);
  // Whatever way the run ends, the progress line is gone before the last words.
  struct ClearStatus {
    ProgressSink& sink;
    ~ClearStatus() { sink.set_status(""); }
  } clear_status{*console};

  // A stop signal while the data is prepared (a tokenizer trains in one library call) ends the
  // process at once: nothing of the run exists yet to save. Later ones stop the loop after its
  // step.
  std::atomic<bool> preparing{true};
  const StopSignals signals([&](int sig) {
    const char* name = sig == SIGINT ? "SIGINT" : "SIGTERM";
    if (preparing) {
      log->warn("{} while preparing the data: stopped; nothing of the run is saved", name);
      log->flush();
      run.discard_if_unused();
      std::_Exit(128 + sig);
    }
    log->warn("{}: the run stops after this step, with a checkpoint (again to stop at once)", name);
  });

  // What can be refused is refused before the data is prepared.
  const std::string config_path = out + "/config.json";
  const RunConfig began = resuming ? read_run_config(config_path) : config;
  std::optional<ResumePoint> resume;
  if (resuming) {
    resume = find_resume_point(out, run_config_to_json(began), *log);
    check_resumed_steps(config, began, resume->info.step, out, *log);
  }
  // MFU: the model's FLOPs per second over this machine's peak for the dtype, measured here
  // (about 0.1 s). In bf16 the peak is the machine's best BF16 instruction (AMX where present),
  // whichever GEMM runs.
  const kernels::Peak peak = kernels::measure_peak(2'000'000, 3);
  const bool bf16_peak = config.dtype == DType::BF16 && peak.bf16_best_all_threads() > 0;
  const auto peak_of = [bf16_peak](const kernels::Peak& p) {
    return bf16_peak ? p.bf16_best_all_threads() : p.f32_all_threads;
  };
  const double peak_gflops = peak_of(peak);
  warn_of_slow_steps(config, peak_gflops, *log);
  const int64_t available = memory_limit_bytes(args.mem_limit_gib);
  check_memory_floor(config, resuming ? "none" : args.checkpoint, available, *log);

  if (hold.step == 0) wait_for_stop_signal(0, hold.forever);
  // A run begun from a model keeps that model's tokenizer, saved beside its data.
  if (!resuming && !config.init.empty())
    log->info("tokenizer of {}: saved as {}", config.init,
              load_tokenizer(config.init, "--model").save_to_run(out));
  PreparedData data = prepare_run_data(
      config, out, *console,
      resume ? std::optional<uint64_t>(resume->info.data_fingerprint) : std::nullopt,
      resuming ? config_path + ": corpus " + config.corpus : "--corpus " + config.corpus);
  preparing = false;
  const auto train_tokens = data.dataset.train_tokens();
  const auto val_tokens = data.dataset.val_tokens();
  const bool can_eval = static_cast<int64_t>(val_tokens.size()) >= config.train.ctx + 1;
  const int64_t corpus_tokens = static_cast<int64_t>(train_tokens.size() + val_tokens.size());
  const int64_t eval_windows = can_eval ? args.eval_windows : 0;
  const MemoryBudget budget = plan_memory(config, resuming ? "none" : args.checkpoint,
                                          corpus_tokens, eval_windows, available, *log);

  process_memory_reset_peak();  // from here on the peak RSS is training's
  log->info("resident before the model: {} (the budget's runtime estimate: {})",
            format_bytes(process_memory().rss_bytes), format_bytes(budget.runtime_bytes));
  // --offload: the state files' folder, held for the run.
  ModelOptions model_options;
  model_options.compute_dtype = config.dtype;
  if (comm.size() > 1) model_options.shard = &comm;
  if (!config.offload.empty()) {
    model_options.offload = true;
    model_options.offload_dir = std::make_shared<OffloadDir>(config.offload);
  }
  LlamaModel model(config.model, model_options);
  if (model_options.offload)
    log->info("offloaded to {}: {} on disk (masters, AdamW's m and v)", config.offload,
              format_bytes(budget.disk_bytes));
  model.init_weights(config.train.seed);
  if (!resuming && !config.init.empty()) {
    load_model_weights(config.init, "--model", model.parameters());
    log->info("weights from {}", config.init);
  }
  model.set_compute_dtype(config.dtype);
  model.set_checkpointing(config.checkpoint);
  const std::string config_json = run_config_to_json(config);
  // A resumed run records what it changed (its end, its saving) once it is sure to go on.
  RunConfig as_began = config;
  as_began.threads = began.threads;
  if (!resuming || run_config_to_json(as_began) != run_config_to_json(began))
    write_file_atomic(config_path, config_json);
  const LlamaConfig& m = config.model;
  log->info(
      "model {}: {} parameters (d_model {}, layers {}, heads {}, kv heads {}, head dim {}, "
      "ffn {}, vocab {}, ctx {}; RoPE {} pairs, theta {:g}{}{})",
      config.preset, parameter_count(m), m.d_model, m.n_layers, m.n_heads, m.kv_heads(),
      m.head_size(), m.ffn, m.vocab, m.ctx, rope_pairs_name(m.rope_pairs), m.rope_theta,
      m.qkv_bias ? "; q/k/v biases" : "", m.tie_embeddings ? "; tied embeddings" : "");
  log->info("training {} steps of {} x {} sequences of {} tokens, lr {:g}, warm-up {}, {} threads",
            config.steps, config.train.batch, config.train.accum, config.train.ctx,
            config.train.lr.peak, config.train.lr.warmup_steps, config.threads);
  log->info("{}", describe_compute());
  if (args.pin_threads) {
    std::string cpus;
    for (int cpu : pin_threads()) cpus += (cpus.empty() ? "" : ",") + std::to_string(cpu);
    log->info("threads pinned to CPUs {}", cpus);
  }
  MfuPeak mfu_peak(peak_gflops, [&] { return peak_of(kernels::measure_peak(2'000'000, 10)); });
  const double flops_per_token = training_flops_per_token(config.model, config.train.ctx);
  if (peak_gflops > 0)
    log->info("peak (measured, {} threads): {:.0f} GFLOP/s {}{}; training FLOPs per token: {:.3g}",
              config.threads, peak_gflops, bf16_peak ? "bf16 " : "fp32 (FMA)",
              bf16_peak ? std::string("(") + peak.bf16_best_instruction() + ")" : std::string(),
              flops_per_token);
  log->info("dtype: {} ({}); gradient checkpointing: {}",
            config.dtype == DType::BF16 ? "bf16" : "fp32", dtype_reason,
            config.checkpoint ? "per layer" : "none");

  config.train.comm = &comm;
  Trainer trainer(
      model.parameters(),
      [&model](const Tensor& in, const Tensor& tgt) { return model.loss(in, tgt); }, config.train);
  int64_t first_step = 1;
  std::string last_checkpoint;
  if (resume) {
    last_checkpoint = resume->path;
    first_step = resume->info.step + 1;
    truncate_metrics(out + "/metrics.jsonl", resume->info.step);
    log->info("resuming from {} at step {}", last_checkpoint, first_step);
  }
  std::ofstream metrics(out + "/metrics.jsonl", resuming ? std::ios::app : std::ios::trunc);
  if (!metrics) throw UserError(out + "/metrics.jsonl: cannot open for writing");
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
  if (resume) load_checkpoint(resume->path, model.parameters(), &trainer.optimizer());
  if (comm.size() > 1) {
    broadcast_training_state(comm, model.parameters(), trainer.optimizer());
    log->info(
        "data parallel: {} ranks, each of {} x {} sequences a step (the job's batch is {} x {})",
        comm.size(), config.train.batch, config.train.accum, config.train.batch * comm.size(),
        config.train.accum);
  }
  bool replacing = run.replacing;
  // A bad step (non-finite loss or gradient norm, or a spike) is never applied; it stops the run
  // or, with --on-bad-step skip, is passed over.
  BadStepFilter bad_steps(args.spike);
  trainer.set_step_filter([&bad_steps](const StepResult& r) { return bad_steps.accept(r); });
  // --profile: every step but the first (page faults of first touch, block cache filling),
  // unless it is the only one.
  int64_t profiled_steps = 0;
  double profiled_seconds = 0.0;
  auto report_profile = [&] { write_profile(out, profiled_steps, profiled_seconds, *log); };
  {
    const Stopwatch loop_time;
    for (int64_t step = first_step; step <= config.steps; ++step) {
      if (step == hold.step) wait_for_stop_signal(step, hold.forever);
      const bool profile_step = args.profile && (step > first_step || first_step == config.steps);
      profiler::set_enabled(profile_step);
      const StepResult r = trainer.step(train_tokens, step);
      profiler::set_enabled(false);
      if (profile_step) {
        ++profiled_steps;
        profiled_seconds += r.ms / 1e3;
      }
      const ProcessMemory mem = process_memory();
      // Every rank's step, and a stop signal any of them received (the job stops together).
      const std::vector<RankStep> ranks =
          gather_step(comm, {r.ms, r.comm_ms, r.reducing_ms, r.gather_ms, mem.rss_bytes,
                             mem.peak_rss_bytes, stop_signal()});
      int64_t peak_rss = 0;
      int stop = 0;
      for (const RankStep& rs : ranks) {
        peak_rss = std::max(peak_rss, rs.peak_rss);
        if (stop == 0) stop = rs.stop_signal;
      }
      if (r.skipped && args.on_bad_step == "stop") {
        job_ended();  // every rank stops here
        throw UserError(
            "step " + std::to_string(step) + ": " + bad_steps.reason() +
            "; not applied, training stopped (try a lower --lr, or --on-bad-step skip); "
            "the last good checkpoint is " +
            (last_checkpoint.empty() ? std::string("none") : last_checkpoint));
      }
      if (r.skipped)
        log->warn("step {}: {}; skipped (the weights are as before it)", step, bad_steps.reason());
      // A rank's share: the peak MFU is measured against is one rank's.
      const double model_gflops =
          flops_per_token * r.tokens_per_s / static_cast<double>(comm.size()) / 1e9;
      const double peak_before = mfu_peak.gflops();
      if (mfu_peak.update(model_gflops))
        log->info(
            "peak measured again after step {} ran at {:.0f} GFLOP/s: {:.0f} GFLOP/s "
            "(was {:.0f})",
            step, model_gflops, mfu_peak.gflops(), peak_before);
      const std::optional<double> mfu = mfu_peak.mfu(model_gflops);
      nlohmann::json m = step_record(step, r, mem, budget, model_gflops, mfu);
      if (comm.size() > 1)
        m["ranks"] = rank_records(
            ranks, config.train.batch * config.train.accum * config.train.ctx * comm.size());
      std::string val;
      if (can_eval && evaluates_after(args, config, step)) {
        const double v = trainer.evaluate(val_tokens, args.eval_windows);
        m["val_loss"] = v;
        val = fmt::format(" | val {:.4f}", v);
      }
      metrics << m.dump() << "\n" << std::flush;
      if (replacing) {
        replacing = false;
        if (remove_replaced_run(out))
          log->info("the run this one replaces (--overwrite) is deleted: this one has started");
      }
      if (step % args.log_every == 0 || step == config.steps || !val.empty()) {
        log->info(
            "step {:>5}/{} | loss {:.4f}{} | lr {:.2e} | grad norm {:.3f} | {:.0f} tok/s | "
            "{:.0f} ms{} | mem {:.2f} GiB / budget {:.2f} GiB ({:+.1f}%){}",
            step, config.steps, r.loss, val, r.lr, r.grad_norm, r.tokens_per_s, r.ms,
            comm.size() > 1
                ? fmt::format(" (summing gradients {:.0f}, {:.0f} of it after the backward "
                              "pass; gathering weights {:.0f})",
                              r.reducing_ms, r.comm_ms, r.gather_ms)
                : std::string(),
            gib(peak_rss), gib(budget.total_bytes()),
            100.0 *
                (static_cast<double>(peak_rss) / static_cast<double>(budget.total_bytes()) - 1.0),
            comm.size() > 1 ? fmt::format(" (the largest of {} ranks)", comm.size())
                            : std::string());
      }
      if (console->terminal()) {
        const std::string mfu_text = mfu ? fmt::format(" | MFU {:.0f}%", 100.0 * *mfu) : "";
        console->set_status(progress_line(
            step, config.steps, first_step - 1, loop_time.seconds(), "steps",
            fmt::format("loss {:.3f} | {:.0f} tok/s{}", r.loss, r.tokens_per_s, mfu_text)));
      }
      if (args.sample_every > 0 && step % args.sample_every == 0 && step != config.steps)
        log->info("sample: {}", sample_text(model, data.tokenizer, args.sample_tokens, step));
      if (saves_after(config, step, stop)) {
        last_checkpoint =
            save_training_checkpoint(out, step, model.parameters(), trainer.optimizer(),
                                     data.dataset.fingerprint(), config_json, config.keep);
        if (stop == 0) log->info("saved {}", last_checkpoint);
      }
      if (stop != 0) {
        job_ended();
        report_profile();
        log->warn("{} after step {}: saved {}; continue with: cputrain train --resume {}",
                  stop == SIGINT ? "interrupted (SIGINT)" : "terminated (SIGTERM)", step,
                  last_checkpoint, out);
        return 128 + stop;
      }
    }
  }
  console->set_status("");
  report_profile();
  const std::string weights_path = out + "/model.bin";
  save_weights(weights_path, model.parameters(), config_json);  // with the ranks' shards
  job_ended();
  log->info("saved {}", weights_path);
  for (uint64_t i = 1; i <= 3; ++i)
    log->info("sample {}: {}", i, sample_text(model, data.tokenizer, args.sample_tokens, i));
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
  LlamaModel model(config.model, model_options);
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
  BadStepFilter bad_steps(args.spike);
  trainer.set_step_filter([&bad_steps](const StepResult& r) { return bad_steps.accept(r); });
  const bool can_eval = static_cast<int64_t>(val_tokens.size()) >= config.train.ctx + 1;
  for (int64_t step = first_step; step <= config.steps; ++step) {
    profiler::set_enabled(args.profile && (step > first_step || first_step == config.steps));
    const StepResult r = trainer.step(train_tokens, step);
    profiler::set_enabled(false);
    const ProcessMemory mem = process_memory();
    int stop = 0;
    for (const RankStep& rs : gather_step(comm, {r.ms, r.comm_ms, r.reducing_ms, r.gather_ms,
                                                 mem.rss_bytes, mem.peak_rss_bytes, stop_signal()}))
      if (stop == 0) stop = rs.stop_signal;
    if (r.skipped && args.on_bad_step == "stop") {
      job_ended();
      throw QuietExit{1};  // rank 0 says why
    }
    if (can_eval && evaluates_after(args, config, step))
      trainer.evaluate(val_tokens, args.eval_windows);
    // Rank 0 saves a checkpoint now: the shards of m and v go to it.
    if (sharded && saves_after(config, step, stop))
      share_checkpoint_state(model.parameters(), trainer.optimizer(), true);
    if (stop != 0) {
      job_ended();
      return 128 + stop;
    }
  }
  model.parameters().serve_sharded_masters(true);  // rank 0 saves model.bin
  job_ended();
  return 0;
}

}  // namespace
}  // namespace cputrain
