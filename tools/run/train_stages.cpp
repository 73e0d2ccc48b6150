#include "tools/run/train_stages.h"

#include <spdlog/sinks/basic_file_sink.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "engine/core/error.h"
#include "engine/core/profiler.h"
#include "engine/io/atomic_file.h"
#include "engine/text/tokenizer.h"
#include "engine/train/adamw.h"
#include "engine/train/parameters.h"
#include "tools/run/budget_report.h"
#include "tools/run/run_dir.h"

namespace cputrain {
namespace {

namespace fs = std::filesystem;

std::string fit_message(const RunConfig& config, int64_t bytes, int64_t available,
                        const std::string& what) {
  return "the memory budget of " + config.preset + what + ", " + format_bytes(bytes) +
         ", exceeds the available " + format_bytes(available);
}

// The splits against one window of ctx: a UserError where training has less, a warning where
// validation has.
PreparedData check_splits(const RunConfig& config, PreparedData& data, const std::string& name) {
  spdlog::logger& log = *spdlog::default_logger();
  const auto train_tokens = data.dataset.train_tokens();
  if (static_cast<int64_t>(train_tokens.size()) < config.train.ctx + 1)
    throw UserError(name + ": the training split has " + std::to_string(train_tokens.size()) +
                    " tokens, fewer than one window of --ctx " + std::to_string(config.train.ctx) +
                    " + 1");
  if (static_cast<int64_t>(data.dataset.val_tokens().size()) < config.train.ctx + 1)
    log.warn(
        "the validation split has {} tokens, fewer than one window of ctx {} + 1: no "
        "validation loss",
        data.dataset.val_tokens().size(), config.train.ctx);
  return std::move(data);
}

}  // namespace

std::shared_ptr<spdlog::logger> open_run_log(const std::string& dir,
                                             std::shared_ptr<ProgressSink> console) {
  auto file = std::make_shared<spdlog::sinks::basic_file_sink_mt>(dir + "/train.log", false);
  auto log = std::make_shared<spdlog::logger>("cputrain",
                                              spdlog::sinks_init_list{std::move(console), file});
  log->set_pattern("[%H:%M:%S] %v");
  log->flush_on(spdlog::level::info);
  spdlog::drop("cputrain");
  spdlog::register_logger(log);
  spdlog::set_default_logger(log);
  return log;
}

PreparedData prepare_run_data(RunConfig& config, const std::string& dir, ProgressSink& console,
                              std::optional<uint64_t> expect, const std::string& name) {
  spdlog::logger& log = *spdlog::default_logger();
  DataOptions options;
  options.expect = expect;
  options.name = name;
  // This run's directory, and any other run's, inside a corpus folder: outputs, not text.
  options.skip_folder = [&dir](const std::string& folder) {
    std::error_code ec;
    if (fs::equivalent(folder, dir, ec)) return true;
    const DirKind kind = survey_dir(folder).kind;
    return kind == DirKind::Run || kind == DirKind::Parity;
  };
  if (console.terminal()) {
    options.progress = [&console, phase_seen = std::string(), phase_time = Stopwatch()](
                           const std::string& phase, int64_t done, int64_t total) mutable {
      if (phase != phase_seen) {
        phase_seen = phase;
        phase_time.restart();
      }
      console.set_status(
          total > 0
              ? phase + " " + progress_line(done, total, 0, phase_time.seconds(), "documents", "")
              : phase + " ...");
    };
  }
  const int asked = static_cast<int>(config.model.vocab);
  options.fixed_tokenizer = !config.init.empty();
  PreparedData data = prepare_data(config.corpus, asked, dir, options);
  console.set_status("");
  for (const std::string& folder : data.files.skipped)
    log.info("corpus: passed over {}, a run directory", folder);
  if (!data.files.binary.empty())
    log.info("corpus: passed over {} binary files (such as {})", data.files.binary.size(),
             data.files.binary.front());
  if (options.fixed_tokenizer) {
    // A model's embedding may have rows past its tokenizer's last id (padding), never fewer.
    if (data.tokenizer.vocab_size() > config.model.vocab)
      throw UserError(config.init + ": the tokenizer has " +
                      std::to_string(data.tokenizer.vocab_size()) + " tokens, the model " +
                      std::to_string(config.model.vocab));
    return check_splits(config, data, name);
  }
  config.model.vocab = data.tokenizer.vocab_size();
  if (!expect && data.tokenizer.vocab_size() < asked)
    log.warn(
        "the corpus gives {} tokenizer pieces, fewer than the {} asked (--vocab): the model's "
        "vocabulary is {}",
        data.tokenizer.vocab_size(), asked, data.tokenizer.vocab_size());
  return check_splits(config, data, name);
}

void check_memory_floor(const RunConfig& config, bool vocab_known,
                        const std::string& checkpoint_flag, int64_t available,
                        spdlog::logger& log) {
  if (available <= 0) return;
  RunConfig floor = config;
  if (!vocab_known) floor.model.vocab = std::min<int64_t>(floor.model.vocab, Tokenizer::kMinVocab);
  if (checkpoint_flag == "auto") floor.checkpoint = Checkpointing::Layer;
  const MemoryBudget budget = memory_budget(floor.model, budget_options(floor, 0, 0));
  if (budget.total_bytes() <= available) return;
  log.info(
      "memory budget before any data (a vocabulary of {}{}, no token cache; {}, batch {}, ctx {}, "
      "checkpointing {}):\n{}",
      floor.model.vocab, vocab_known ? "" : " (the least a corpus gives)",
      floor.dtype == DType::BF16 ? "bf16" : "fp32", floor.train.batch, floor.train.ctx,
      checkpointing_words(floor.checkpoint), budget_table(budget, available));
  log.info("levers:\n{}", budget_levers(floor, 0, 0, available));
  throw UserError(fit_message(config, budget.total_bytes(), available, " before any data") +
                  " (table and levers above)");
}

MemoryBudget plan_memory(RunConfig& config, const std::string& checkpoint_flag,
                         int64_t corpus_tokens, int64_t eval_windows, int64_t available,
                         spdlog::logger& log) {
  MemoryBudget budget =
      memory_budget(config.model, budget_options(config, corpus_tokens, eval_windows));
  // auto: the least recomputation that fits, mlp before layer.
  if (checkpoint_flag == "auto" && config.checkpoint == Checkpointing::None && available > 0 &&
      budget.total_bytes() > available) {
    const int64_t without = budget.total_bytes();
    for (const Checkpointing level : {Checkpointing::Mlp, Checkpointing::Layer}) {
      config.checkpoint = level;
      budget = memory_budget(config.model, budget_options(config, corpus_tokens, eval_windows));
      if (budget.total_bytes() <= available) break;
    }
    log.info("checkpointing {}: without it the budget, {}, exceeds the available {}",
             checkpointing_words(config.checkpoint), format_bytes(without),
             format_bytes(available));
  }
  log.info("memory budget ({}, batch {}, ctx {}, checkpointing {}):\n{}",
           config.dtype == DType::BF16 ? "bf16" : "fp32", config.train.batch, config.train.ctx,
           checkpointing_words(config.checkpoint), budget_table(budget, available));
  if (available > 0 && budget.total_bytes() > available) {
    log.info("levers:\n{}", budget_levers(config, corpus_tokens, eval_windows, available));
    throw UserError(fit_message(config, budget.total_bytes(), available, "") +
                    " (table and levers above)");
  }
  return budget;
}

double step_seconds_at_peak(const RunConfig& config, double peak_gflops) {
  if (peak_gflops <= 0) return 0.0;
  const double tokens =
      static_cast<double>(config.train.batch * config.train.accum * config.train.ctx);
  return training_flops_per_token(config.model, config.train.ctx) * tokens / (peak_gflops * 1e9);
}

void warn_of_slow_steps(const RunConfig& config, double peak_gflops, spdlog::logger& log) {
  const double seconds = step_seconds_at_peak(config, peak_gflops);
  const double total = training_flops_per_token(config.model, config.train.ctx);
  const double attention = total - training_flops_per_token(config.model, 0);
  if (seconds <= 30.0 && (attention <= 0.75 * total || seconds <= 2.0)) return;
  log.warn(
      "--ctx {}: attention is {:.0f}% of a step's FLOPs (its cost grows with the square of the "
      "context); one step of {} x {} sequences needs at least {} at this machine's peak, {} "
      "for the {} steps, and in practice several times that",
      config.train.ctx, 100.0 * attention / total, config.train.batch, config.train.accum,
      format_duration(seconds), format_duration(seconds * static_cast<double>(config.steps)),
      config.steps);
}

ResumePoint find_resume_point(const std::string& dir, const std::string& config_json,
                              spdlog::logger& log) {
  const auto all = list_checkpoints(dir);
  if (all.empty())
    throw UserError("--resume " + dir + ": no checkpoint in " + checkpoint_dir(dir) +
                    " (it stopped before its first): start it again with the flags it began with "
                    "and --out " +
                    dir + " --overwrite");
  ResumePoint point;
  for (auto it = all.rbegin(); it != all.rend() && point.path.empty(); ++it) {
    try {
      point.info = read_checkpoint_info(it->second);
      point.path = it->second;
    } catch (const UserError& e) {
      log.warn("skipping {}", e.what());
    }
  }
  if (point.path.empty())
    throw UserError("--resume " + dir + ": no readable checkpoint in " + checkpoint_dir(dir) +
                    " (" + std::to_string(all.size()) + " damaged)");
  if (run_identity(point.info.config_json) != run_identity(config_json))
    throw UserError(point.path + ": made by another configuration than " + dir + "/config.json");
  return point;
}

std::string save_training_checkpoint(const std::string& dir, int64_t step,
                                     const ParameterSet& params, const AdamW& adamw,
                                     uint64_t data_fingerprint, const std::string& config_json,
                                     int64_t keep, spdlog::logger& log) {
  std::error_code ec;
  fs::create_directories(checkpoint_dir(dir), ec);
  if (ec) throw UserError(checkpoint_dir(dir) + ": cannot create (" + ec.message() + ")");
  const std::string path = checkpoint_path(dir, step);
  save_checkpoint(path, params, adamw,
                  CheckpointInfo{step, adamw.step_count(), data_fingerprint, config_json});
  // A checkpoint past this step is one a resume passed over as unreadable (it takes the newest
  // it can read, and the run saves in order): it is set aside, never counted among the kept.
  std::vector<std::pair<int64_t, std::string>> kept;
  for (const auto& [n, file] : list_checkpoints(dir)) {
    if (n <= step) {
      kept.emplace_back(n, file);
      continue;
    }
    fs::rename(file, file + ".damaged", ec);
    if (!ec) log.warn("{} was passed over as unreadable: set aside as {}.damaged", file, file);
  }
  for (size_t i = 0; i + static_cast<size_t>(keep) < kept.size(); ++i)
    fs::remove(kept[i].second, ec);
  return path;
}

bool BadStepFilter::accept(const StepResult& r) {
  reason_.clear();
  if (!std::isfinite(r.loss)) {
    reason_ = fmt::format("loss is {}", r.loss);
  } else if (!std::isfinite(r.grad_norm)) {
    reason_ = fmt::format("gradient norm is {}", r.grad_norm);
  } else if (spike_ > 0.0 && !recent_.empty()) {
    double mean = 0.0;
    for (double l : recent_) mean += l;
    mean /= static_cast<double>(recent_.size());
    if (r.loss > spike_ * mean)
      reason_ =
          fmt::format("loss {:.4f} is a spike (over {:g} x the mean {:.4f} of the last {} steps)",
                      r.loss, spike_, mean, recent_.size());
  }
  if (!reason_.empty()) return false;
  recent_.push_back(r.loss);
  if (recent_.size() > 20) recent_.erase(recent_.begin());
  return true;
}

nlohmann::json step_record(int64_t step, const StepResult& r, const ProcessMemory& mem,
                           const MemoryBudget& budget, double model_gflops,
                           std::optional<double> mfu) {
  nlohmann::json m = {{"step", step},
                      {"loss", r.loss},
                      {"lr", r.lr},
                      {"grad_norm", r.grad_norm},
                      {"tokens_per_s", r.tokens_per_s},
                      {"ms", r.ms},
                      {"rss_bytes", mem.rss_bytes},
                      {"peak_rss_bytes", mem.peak_rss_bytes},
                      {"rss_anon_bytes", mem.rss_anon_bytes},
                      {"rss_file_bytes", mem.rss_file_bytes},
                      {"budget_bytes", budget.total_bytes()},
                      {"skipped", r.skipped},
                      {"model_gflops_per_s", model_gflops}};
  if (mfu) m["mfu"] = *mfu;
  if (!r.expert_spread.empty()) {
    m["expert_spread"] = r.expert_spread;
    if (r.router_losses) {
      m["moe_balance_loss"] = r.moe_balance;
      m["moe_z_loss"] = r.moe_z;
    }
  }
  const MemoryStats stats = memory_stats();
  for (int i = 0; i < kMemoryCategoryCount; ++i) {
    const std::string name(memory_category_name(static_cast<MemoryCategory>(i)));
    m[name + "_bytes"] = stats.live_bytes[i];
    m[name + "_peak_bytes"] = stats.peak_bytes[i];
    m[name + "_budget_bytes"] = budget.peak_bytes[i];
  }
  return m;
}

void write_profile(const std::string& dir, int64_t steps, double seconds, spdlog::logger& log) {
  if (steps == 0) return;
  const auto entries = profiler::entries();
  const double per = 1.0 / static_cast<double>(steps);
  log.info(
      "profile of the last {} steps ({:.0f} ms per step; each scope's own time, the scopes "
      "inside it excluded):",
      steps, 1e3 * seconds * per);
  for (const std::string& line : profiler::report(entries, steps, seconds)) log.info("  {}", line);
  nlohmann::json j = {
      {"steps", steps}, {"ms_per_step", 1e3 * seconds * per}, {"scopes", nlohmann::json::array()}};
  for (const profiler::Entry& e : entries) {
    j["scopes"].push_back({{"name", e.name},
                           {"pass", std::string(profiler::pass_name(e.pass))},
                           {"calls_per_step", static_cast<double>(e.calls) * per},
                           {"ms_per_step", 1e3 * e.seconds * per},
                           {"gflop_per_step", e.flops * per / 1e9}});
  }
  write_file_atomic(dir + "/profile.json", j.dump(1) + "\n");
  log.info("wrote {}/profile.json", dir);
}

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

}  // namespace cputrain
