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
#include "engine/profiler.h"
#include "engine/threads.h"
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
#include "tools/mfu_peak.h"
#include "tools/progress.h"
#include "tools/run_config.h"
#include "tools/run_dir.h"

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
  c.threads = a.threads > 0 ? a.threads : omp_get_num_procs();
  return c;
}

void prepare_run_dir(const std::string& dir) {
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec) throw UserError("--out " + dir + ": cannot create directory (" + ec.message() + ")");
  const std::string probe = dir + "/.write-test";
  std::ofstream out(probe);
  if (!out || !(out << "ok") || (out.close(), !out))
    throw UserError("--out " + dir + ": directory is not writable");
  fs::remove(probe, ec);
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
  return available_memory_bytes();
}

std::string describe_compute() {
  return fmt::format("cpu: {}; kernels: {} (gemm available: {})", kernels::cpu_features_string(),
                     kernels::kernel_choices(), kernels::gemm_available_backends());
}

namespace {

std::shared_ptr<spdlog::logger> make_logger(const std::string& log_path,
                                            std::shared_ptr<ProgressSink> console) {
  auto file = std::make_shared<spdlog::sinks::basic_file_sink_mt>(log_path, false);
  auto logger =
      std::make_shared<spdlog::logger>("cputrain", spdlog::sinks_init_list{console, file});
  logger->set_pattern("[%H:%M:%S] %v");
  logger->flush_on(spdlog::level::info);
  return logger;
}

double gib(int64_t bytes) {
  return static_cast<double>(bytes) / (1024.0 * 1024.0 * 1024.0);
}

// SIGINT and SIGTERM ask the loop to finish its step, save and stop; a second one is fatal.
std::atomic<int> g_stop_signal{0};

// Takes SIGINT and SIGTERM for its scope on a thread of its own, which calls `first` with the
// first of them; both are blocked in every other thread (the caller's and OpenMP's team, and
// threads started later, which inherit the mask), so that no handler runs on a thread in the
// middle of a step. (With a handler, runs with the oneDNN GEMM interrupted on a loaded machine
// aborted now and then on a corrupted heap, found in a free inside oneDNN's sgemm: 7 in 195,
// and once in CI; with this, none in 300.) The default actions are back afterwards, however
// the scope is left.
class StopSignals {
 public:
  explicit StopSignals(std::function<void(int)> first) : first_(std::move(first)) {
    g_stop_signal = 0;
    sigemptyset(&signals_);
    sigaddset(&signals_, SIGINT);
    sigaddset(&signals_, SIGTERM);
    mask_everywhere(SIG_BLOCK);
    watcher_ = std::thread([this] { watch(); });
  }
  ~StopSignals() {
    quit_ = true;
    watcher_.join();
    mask_everywhere(SIG_UNBLOCK);
  }
  StopSignals(const StopSignals&) = delete;
  StopSignals& operator=(const StopSignals&) = delete;

 private:
  void mask_everywhere(int how) const {
    pthread_sigmask(how, &signals_, nullptr);
#pragma omp parallel
    pthread_sigmask(how, &signals_, nullptr);
  }
  // The first signal sets g_stop_signal; a second takes its default action.
  void watch() const {
    const timespec poll{0, 50'000'000};
    while (!quit_) {
      const int sig = sigtimedwait(&signals_, nullptr, &poll);
      if (sig <= 0) continue;
      if (g_stop_signal.load() == 0) {
        g_stop_signal = sig;
        first_(sig);
        continue;
      }
      if (auto log = spdlog::default_logger()) {
        log->warn("{} again: stopping at once, without a checkpoint of this step",
                  sig == SIGINT ? "SIGINT" : "SIGTERM");
        log->flush();
      }
      std::signal(sig, SIG_DFL);
      pthread_sigmask(SIG_UNBLOCK, &signals_, nullptr);
      raise(sig);
    }
  }
  std::function<void(int)> first_;
  sigset_t signals_;
  std::atomic<bool> quit_{false};
  std::thread watcher_;
};

// For tests that interrupt a run at a known step, whatever the machine's speed:
// CPUTRAIN_TEST_HOLD_STEP=N holds the loop before step N, saying so on stderr, until a stop signal
// has arrived (then step N runs and the run stops after it); "N+" holds it for good, so that only
// a second signal ends the run, in the middle of step N.
struct TestHold {
  int64_t step = -1;
  bool forever = false;
};
TestHold test_hold() {
  TestHold h;
  const char* env = std::getenv("CPUTRAIN_TEST_HOLD_STEP");
  if (env == nullptr || *env == '\0') return h;
  char* end = nullptr;
  h.step = std::strtoll(env, &end, 10);
  h.forever = std::string_view(end) == "+";
  if (end == env || h.step < 1 || (*end != '\0' && !h.forever))
    throw UserError(std::string("CPUTRAIN_TEST_HOLD_STEP=") + env +
                    ": must be a step, or a step and +");
  return h;
}
void wait_for_stop_signal(int64_t step, bool forever) {
  std::fprintf(stderr, "CPUTRAIN_TEST_HOLD_STEP: holding before step %lld\n",
               static_cast<long long>(step));
  std::fflush(stderr);
  while (forever || g_stop_signal.load() == 0)
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
}

std::string save_training_checkpoint(const std::string& out, int64_t step,
                                     const ParameterSet& params, const AdamW& adamw,
                                     uint64_t data_fingerprint, const std::string& config_json,
                                     int64_t keep) {
  std::error_code ec;
  fs::create_directories(checkpoint_dir(out), ec);
  if (ec) throw UserError(checkpoint_dir(out) + ": cannot create (" + ec.message() + ")");
  const std::string path = checkpoint_path(out, step);
  save_checkpoint(path, params, adamw,
                  CheckpointInfo{step, adamw.step_count(), data_fingerprint, config_json});
  auto all = list_checkpoints(out);
  for (size_t i = 0; i + static_cast<size_t>(keep) < all.size(); ++i) fs::remove(all[i].second, ec);
  return path;
}

// The model and training options of a run's configuration, for comparing two of them.
nlohmann::json run_identity(const std::string& config_json) {
  nlohmann::json j = nlohmann::json::parse(config_json);
  j["train"].erase("threads");
  return {j["model"], j["train"], j["corpus"]};
}

// Keeps the lines of metrics.jsonl up to `step`.
void truncate_metrics(const std::string& path, int64_t step) {
  std::ifstream in(path);
  std::string kept, line;
  while (std::getline(in, line)) {
    try {
      if (nlohmann::json::parse(line).at("step").get<int64_t>() <= step) kept += line + "\n";
    } catch (const std::exception&) {
      // a line cut short by the interruption
    }
  }
  write_file_atomic(path, kept);
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
                 "configuration (bitwise as if it had not stopped)");
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
                 "GiB the run may use (default: the available memory at start); training refuses "
                 "to start when its budget exceeds it")
      ->check(positive());
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

int run_train(const TrainArgs& args) {
  if (args.log_every <= 0) throw UserError("--log-every must be positive");
  if (args.keep <= 0) throw UserError("--keep must be positive");
  const bool resuming = !args.resume.empty();
  RunConfig config;
  std::string out, dtype_reason;
  if (resuming) {
    // The run's own configuration; only how it runs (threads, GEMM, logging) comes from flags.
    out = args.resume;
    if (!fs::is_directory(out)) throw UserError("--resume " + out + ": no such run directory");
    config = read_run_config(out + "/config.json");
    config.threads = args.threads > 0 ? args.threads : omp_get_num_procs();
    select_kernels(args.kernels);
    dtype_reason = "as the run began";
    if (list_checkpoints(out).empty())
      throw UserError("--resume " + out + ": no checkpoint in " + checkpoint_dir(out));
  } else {
    config = resolve_run_config(args);
    select_kernels(args.kernels);
    config.dtype = choose_dtype(args.dtype, &dtype_reason);
    out = args.out.empty() ? "runs/" + config.preset : args.out;
  }
  prepare_run_dir(out);
  const RunDirLock lock(out, resuming ? "--resume" : "--out");
  // With the lock held, a temporary file here is one a process that died left behind.
  const std::vector<std::string> stale = remove_stale_temporaries(out);
  bool replacing = false;
  if (!resuming) {
    const DirSurvey survey = survey_dir(out);
    if (survey.kind == DirKind::Run && !args.overwrite)
      throw UserError("--out " + out + " already holds a run (" + survey.evidence +
                      "): continue it with --resume " + out + ", or replace it with --overwrite");
    if (survey.kind == DirKind::Parity || survey.kind == DirKind::Other)
      throw UserError("--out " + out + " holds files that are not a training run (" +
                      survey.evidence + "): choose a new or empty directory");
    if (survey.kind == DirKind::Run) set_run_aside(out);
    // Also a run set aside by an --overwrite that stopped before its first step.
    replacing = args.overwrite && (survey.kind == DirKind::Run || has_replaced_run(out));
  }
  omp_set_num_threads(config.threads);
  // On a terminal a progress line with the time left stays under the log.
  auto console = std::make_shared<ProgressSink>(::isatty(::fileno(stdout)) == 1);
  auto log = make_logger(out + "/train.log", console);
  spdlog::set_default_logger(log);
  for (const std::string& path : stale)
    log->info("removed {}, left by a process that stopped while writing it", path);
  // Whatever way the run ends, the progress line is gone before the last words.
  struct ClearStatus {
    ProgressSink& sink;
    ~ClearStatus() { sink.set_status(""); }
  } clear_status{*console};

  DataProgress data_progress;
  if (console->terminal()) {
    data_progress = [&console, phase_seen = std::string(), phase_time = Stopwatch()](
                        const std::string& phase, int64_t done, int64_t total) mutable {
      if (phase != phase_seen) {
        phase_seen = phase;
        phase_time.restart();
      }
      console->set_status(
          total > 0
              ? phase + " " + progress_line(done, total, 0, phase_time.seconds(), "documents", "")
              : phase + " ...");
    };
  }
  PreparedData data =
      prepare_data(config.corpus, static_cast<int>(config.model.vocab), out, data_progress);
  console->set_status("");
  config.model.vocab = data.tokenizer.vocab_size();
  const auto train_tokens = data.dataset.train_tokens();
  const auto val_tokens = data.dataset.val_tokens();
  if (static_cast<int64_t>(train_tokens.size()) < config.train.ctx + 1)
    throw UserError("--corpus " + config.corpus + ": the training split has " +
                    std::to_string(train_tokens.size()) +
                    " tokens, fewer than one window of --ctx " + std::to_string(config.train.ctx) +
                    " + 1");
  const bool can_eval = static_cast<int64_t>(val_tokens.size()) >= config.train.ctx + 1;
  if (!can_eval)
    log->warn(
        "the validation split has {} tokens, fewer than one window of ctx {} + 1: no "
        "validation loss",
        val_tokens.size(), config.train.ctx);
  // The budget, before anything large is allocated: checkpointing where asked (or where it is
  // needed to fit), and a refusal, with the figures and the levers, where even that does not fit.
  const int64_t corpus_tokens = static_cast<int64_t>(train_tokens.size() + val_tokens.size());
  const int64_t available = memory_limit_bytes(args.mem_limit_gib);
  if (!resuming) config.checkpoint = args.checkpoint == "layer";
  const int64_t eval_windows = can_eval ? args.eval_windows : 0;
  MemoryBudget budget =
      memory_budget(config.model, budget_options(config, corpus_tokens, eval_windows));
  if (!resuming && args.checkpoint == "auto" && available > 0 && budget.total_bytes() > available) {
    RunConfig with = config;
    with.checkpoint = true;
    const MemoryBudget b =
        memory_budget(with.model, budget_options(with, corpus_tokens, eval_windows));
    log->info("checkpointing per layer: without it the budget, {}, exceeds the available {}",
              format_bytes(budget.total_bytes()), format_bytes(available));
    config.checkpoint = true;
    budget = b;
  }
  log->info("memory budget ({}, batch {}, ctx {}, checkpointing {}):\n{}",
            config.dtype == DType::BF16 ? "bf16" : "fp32", config.train.batch, config.train.ctx,
            config.checkpoint ? "per layer" : "none", budget_table(budget, available));
  if (available > 0 && budget.total_bytes() > available) {
    log->error("levers:\n{}", budget_levers(config, corpus_tokens, eval_windows, available));
    throw UserError("--preset " + config.preset + ": the memory budget, " +
                    format_bytes(budget.total_bytes()) + ", exceeds the available " +
                    format_bytes(available) + " (table and levers above)");
  }
  const int64_t eval_every =
      args.eval_every > 0 ? args.eval_every : std::max<int64_t>(1, config.steps / 10);

  process_memory_reset_peak();  // from here on the peak RSS is training's
  log->info("resident before the model: {} (the budget's runtime estimate: {})",
            format_bytes(process_memory().rss_bytes), format_bytes(budget.runtime_bytes));
  LlamaModel model(config.model);
  model.init_weights(config.train.seed);
  model.set_compute_dtype(config.dtype);
  model.set_checkpointing(config.checkpoint);
  const std::string config_json = run_config_to_json(config);
  if (!resuming) write_file_atomic(out + "/config.json", config_json);
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
  // MFU: the model's FLOPs per second over this machine's peak for the dtype, measured here
  // (about 0.1 s).
  const kernels::Peak peak = kernels::measure_peak(2'000'000, 3);
  // In bf16 the peak is the machine's best BF16 instruction (AMX where present), whichever GEMM
  // runs.
  const bool bf16_peak = config.dtype == DType::BF16 && peak.bf16_best_all_threads() > 0;
  const auto peak_of = [bf16_peak](const kernels::Peak& p) {
    return bf16_peak ? p.bf16_best_all_threads() : p.f32_all_threads;
  };
  const double peak_gflops = peak_of(peak);
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

  Trainer trainer(
      model.parameters(),
      [&model](const Tensor& in, const Tensor& tgt) { return model.loss(in, tgt); }, config.train);
  int64_t first_step = 1;
  std::string last_checkpoint;
  if (resuming) {
    // The newest checkpoint that reads back whole; a damaged one is skipped, not deleted.
    CheckpointInfo info;
    const auto all = list_checkpoints(out);
    for (auto it = all.rbegin(); it != all.rend() && last_checkpoint.empty(); ++it) {
      try {
        info = read_checkpoint_info(it->second);
        last_checkpoint = it->second;
      } catch (const UserError& e) {
        log->warn("skipping {}", e.what());
      }
    }
    if (last_checkpoint.empty())
      throw UserError("--resume " + out + ": no readable checkpoint in " + checkpoint_dir(out));
    if (run_identity(info.config_json) != run_identity(config_json))
      throw UserError(last_checkpoint + ": made by another configuration than " + out +
                      "/config.json");
    if (info.data_fingerprint != data.dataset.fingerprint())
      throw UserError(last_checkpoint + ": made on other data than " + out +
                      " holds now (the corpus, tokenizer or token cache changed)");
    load_checkpoint(last_checkpoint, model.parameters(), &trainer.optimizer());
    first_step = info.step + 1;
    truncate_metrics(out + "/metrics.jsonl", info.step);
    log->info("resuming from {} at step {}", last_checkpoint, first_step);
  }
  std::ofstream metrics(out + "/metrics.jsonl", resuming ? std::ios::app : std::ios::trunc);
  if (!metrics) throw UserError(out + "/metrics.jsonl: cannot open for writing");
  const int64_t save_every =
      args.save_every >= 0 ? args.save_every : std::max<int64_t>(1, config.steps / 10);
  // A bad step (non-finite loss or gradient norm, or a spike) is never applied; it stops the run
  // or, with --on-bad-step skip, is passed over.
  std::vector<double> recent;  // losses of the last accepted steps
  std::string bad_reason;
  trainer.set_step_filter([&](const StepResult& r) {
    bad_reason.clear();
    if (!std::isfinite(r.loss)) {
      bad_reason = fmt::format("loss is {}", r.loss);
    } else if (!std::isfinite(r.grad_norm)) {
      bad_reason = fmt::format("gradient norm is {}", r.grad_norm);
    } else if (args.spike > 0.0 && !recent.empty()) {
      double mean = 0.0;
      for (double l : recent) mean += l;
      mean /= static_cast<double>(recent.size());
      if (r.loss > args.spike * mean)
        bad_reason = fmt::format(
            "loss {:.4f} is a spike (over {:g} x the mean {:.4f} of the last {} "
            "steps)",
            r.loss, args.spike, mean, recent.size());
    }
    if (!bad_reason.empty()) return false;
    recent.push_back(r.loss);
    if (recent.size() > 20) recent.erase(recent.begin());
    return true;
  });
  // --profile: every step but the first (page faults of first touch, block cache filling),
  // unless it is the only one.
  int64_t profiled_steps = 0;
  double profiled_seconds = 0.0;
  auto report_profile = [&] {
    if (profiled_steps == 0) return;
    const auto entries = profiler::entries();
    log->info(
        "profile of the last {} steps ({:.0f} ms per step; each scope's own time, the "
        "scopes inside it excluded):",
        profiled_steps, 1e3 * profiled_seconds / static_cast<double>(profiled_steps));
    for (const std::string& line : profiler::report(entries, profiled_steps, profiled_seconds))
      log->info("  {}", line);
    nlohmann::json j = {
        {"steps", profiled_steps},
        {"ms_per_step", 1e3 * profiled_seconds / static_cast<double>(profiled_steps)},
        {"scopes", nlohmann::json::array()}};
    const double per = 1.0 / static_cast<double>(profiled_steps);
    for (const profiler::Entry& e : entries) {
      j["scopes"].push_back({{"name", e.name},
                             {"pass", std::string(profiler::pass_name(e.pass))},
                             {"calls_per_step", static_cast<double>(e.calls) * per},
                             {"ms_per_step", 1e3 * e.seconds * per},
                             {"gflop_per_step", e.flops * per / 1e9}});
    }
    write_file_atomic(out + "/profile.json", j.dump(1) + "\n");
    log->info("wrote {}/profile.json", out);
  };
  {  // signals: a stop request ends the loop after its step
    const StopSignals signals([&](int sig) {
      log->warn("{}: the run stops after this step, with a checkpoint (again to stop at once)",
                sig == SIGINT ? "SIGINT" : "SIGTERM");
    });
    const Stopwatch loop_time;
    const TestHold hold = test_hold();
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
      if (r.skipped && args.on_bad_step == "stop") {
        throw UserError(
            "step " + std::to_string(step) + ": " + bad_reason +
            "; not applied, training stopped (try a lower --lr, or --on-bad-step skip); "
            "the last good checkpoint is " +
            (last_checkpoint.empty() ? std::string("none") : last_checkpoint));
      }
      if (r.skipped)
        log->warn("step {}: {}; skipped (the weights are as before it)", step, bad_reason);
      const ProcessMemory mem = process_memory();
      const double model_gflops = flops_per_token * r.tokens_per_s / 1e9;
      const double peak_before = mfu_peak.gflops();
      if (mfu_peak.update(model_gflops))
        log->info(
            "peak measured again after step {} ran at {:.0f} GFLOP/s: {:.0f} GFLOP/s "
            "(was {:.0f})",
            step, model_gflops, mfu_peak.gflops(), peak_before);
      const std::optional<double> mfu = mfu_peak.mfu(model_gflops);
      const MemoryStats stats = memory_stats();
      nlohmann::json m = {{"step", step},
                          {"loss", r.loss},
                          {"lr", r.lr},
                          {"grad_norm", r.grad_norm},
                          {"tokens_per_s", r.tokens_per_s},
                          {"ms", r.ms},
                          {"rss_bytes", mem.rss_bytes},
                          {"peak_rss_bytes", mem.peak_rss_bytes},
                          {"budget_bytes", budget.total_bytes()},
                          {"skipped", r.skipped},
                          {"model_gflops_per_s", model_gflops}};
      if (mfu) m["mfu"] = *mfu;
      for (int i = 0; i < kMemoryCategoryCount; ++i) {
        const std::string name(memory_category_name(static_cast<MemoryCategory>(i)));
        m[name + "_bytes"] = stats.live_bytes[i];
        m[name + "_peak_bytes"] = stats.peak_bytes[i];
        m[name + "_budget_bytes"] = budget.peak_bytes[i];
      }
      std::string val;
      if (can_eval && (step % eval_every == 0 || step == config.steps)) {
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
            "{:.0f} ms | mem {:.2f} GiB / budget {:.2f} GiB ({:+.1f}%)",
            step, config.steps, r.loss, val, r.lr, r.grad_norm, r.tokens_per_s, r.ms,
            gib(mem.peak_rss_bytes), gib(budget.total_bytes()),
            100.0 * (static_cast<double>(mem.peak_rss_bytes) /
                         static_cast<double>(budget.total_bytes()) -
                     1.0));
      }
      if (console->terminal()) {
        const std::string mfu_text = mfu ? fmt::format(" | MFU {:.0f}%", 100.0 * *mfu) : "";
        console->set_status(progress_line(
            step, config.steps, first_step - 1, loop_time.seconds(), "steps",
            fmt::format("loss {:.3f} | {:.0f} tok/s{}", r.loss, r.tokens_per_s, mfu_text)));
      }
      if (args.sample_every > 0 && step % args.sample_every == 0 && step != config.steps)
        log->info("sample: {}", sample_text(model, data.tokenizer, args.sample_tokens, step));
      const int stop = g_stop_signal.load();
      if ((save_every > 0 && step % save_every == 0) || step == config.steps || stop != 0) {
        last_checkpoint =
            save_training_checkpoint(out, step, model.parameters(), trainer.optimizer(),
                                     data.dataset.fingerprint(), config_json, args.keep);
        if (stop == 0) log->info("saved {}", last_checkpoint);
      }
      if (stop != 0) {
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
  save_weights(weights_path, model.parameters(), config_json);
  log->info("saved {}", weights_path);
  for (uint64_t i = 1; i <= 3; ++i)
    log->info("sample {}: {}", i, sample_text(model, data.tokenizer, args.sample_tokens, i));
  return 0;
}

}  // namespace cputrain
