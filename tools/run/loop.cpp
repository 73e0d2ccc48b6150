#include "tools/run/loop.h"

#include <algorithm>
#include <cmath>
#include <csignal>
#include <fstream>
#include <optional>
#include <string>
#include <vector>

#include "engine/core/error.h"
#include "engine/core/memory.h"
#include "engine/core/profiler.h"
#include "engine/train/checkpoint_file.h"
#include "tools/run/budget_report.h"
#include "tools/run/job.h"
#include "tools/run/mfu_peak.h"
#include "tools/run/run_dir.h"
#include "tools/run/train_stages.h"

namespace cputrain {
namespace {

double gib(int64_t bytes) {
  return static_cast<double>(bytes) / (1024.0 * 1024.0 * 1024.0);
}

// A mixture of experts' load on the step line: the most uneven layer's busiest expert against
// the mean of its experts (StepResult::expert_spread) and, where its routers have one, the
// load-balancing loss (k, the experts a token takes, for an even load); nothing for a dense
// model.
std::string expert_spread_text(const StepResult& r) {
  if (r.expert_spread.empty()) return {};
  const auto most = std::max_element(r.expert_spread.begin(), r.expert_spread.end());
  return fmt::format(" | experts: busiest {:.2f}x the mean (layer {}){}", *most,
                     most - r.expert_spread.begin(),
                     r.router_losses ? fmt::format(", balance loss {:.3f}", r.moe_balance) : "");
}

// What every rank decides alike after a step.
bool evaluates_after(const LoopPlan& plan, int64_t step) {
  const int64_t every = plan.eval_every > 0 ? plan.eval_every : plan.steps;
  return step % every == 0 || step == plan.steps;
}
bool saves_after(const LoopPlan& plan, int64_t step, int stop) {
  return (plan.save_every > 0 && step % plan.save_every == 0) || step == plan.steps || stop != 0;
}

// The state of the steps run so far, and what rank 0 writes of them.
class Steps {
 public:
  Steps(const LoopPlan& plan, Trainer& trainer, const ParameterSet& params, BatchSource& source,
        const Communicator& comm, const LoopIo& io)
      : plan_(plan),
        trainer_(trainer),
        params_(params),
        source_(source),
        comm_(comm),
        io_(io),
        lead_(comm.rank() == 0),
        bad_steps_(plan.spike),
        mfu_peak_(plan.peak_gflops, plan.measure_peak),
        last_checkpoint_(plan.last_checkpoint),
        replacing_(plan.replacing) {
    trainer_.set_step_filter([this](const StepResult& r) { return bad_steps_.accept(r); });
    if (!lead_) return;
    const std::string path = plan.dir + "/metrics.jsonl";
    // A resumed run's metrics keep what its checkpoint had reached.
    if (plan.first_step > 1) truncate_metrics(path, plan.first_step - 1);
    metrics_.open(path, plan.first_step > 1 ? std::ios::app : std::ios::trunc);
    if (!metrics_) throw UserError(path + ": cannot open for writing");
  }

  void validate_first() {
    if (!plan_.validate_first || plan_.first_step != 1 || !source_.validates()) return;
    double v = 0.0;
    try {
      v = source_.validate(trainer_);
    } catch (const StepFailure& failure) {
      fail(0, failure, true);
    }
    if (!lead_) return;
    io_.log->info("step {:>5}/{} | {} {:.4f}{} (before the first step)", 0, plan_.steps,
                  source_.validation_label(), v, source_.validation_note());
    nlohmann::json line{{"step", 0}, {source_.validation_key(), v}};
    source_.describe_validation(line);
    metrics_ << line.dump() << "\n" << std::flush;
  }

  // Runs `step`; returns the stop signal any rank received during it (0: none).
  int run(int64_t step) {
    if (step == plan_.hold.step) wait_for_stop_signal(step, plan_.hold.forever);
    const bool profile_step =
        plan_.profile && (step > plan_.first_step || plan_.first_step == plan_.steps);
    profiler::set_enabled(profile_step);
    StepResult r;
    try {
      r = source_.step(trainer_, step);
    } catch (const StepFailure& failure) {
      profiler::set_enabled(false);
      fail(step - 1, failure, step - 1 < plan_.first_step || saves_after(plan_, step - 1, 0));
    }
    profiler::set_enabled(false);
    if (profile_step) {
      ++profiled_steps_;
      profiled_seconds_ += r.ms / 1e3;
    }
    // With the base read in place, the budget stands for the anonymous part of the RSS.
    const ProcessMemory mem = process_memory();
    const bool mapped = plan_.budget.mapped_bytes > 0;
    const int64_t resident = mapped ? mem.rss_anon_bytes : mem.rss_bytes;
    const int64_t budgeted = mapped ? mem.rss_anon_bytes : mem.peak_rss_bytes;
    // Every rank's step, and a stop signal any of them received: the job stops together.
    const std::vector<RankStep> ranks = gather_step(
        comm_, {r.ms, r.comm_ms, r.reducing_ms, r.gather_ms, resident, budgeted, stop_signal()});
    int64_t largest = 0;
    int stop = 0;
    for (const RankStep& rs : ranks) {
      largest = std::max(largest, rs.peak_rss);
      if (stop == 0) stop = rs.stop_signal;
    }
    if (r.skipped && plan_.on_bad_step == "stop") {
      job_ended();                     // every rank stops here
      if (!lead_) throw QuietExit{1};  // rank 0 says why
      throw UserError(
          "step " + std::to_string(step) + ": " + bad_steps_.reason() +
          "; not applied, training stopped (try a lower --lr, or --on-bad-step skip); the last "
          "good checkpoint is " +
          (last_checkpoint_.empty() ? std::string("none") : last_checkpoint_));
    }
    // A step skipped for a loss or gradient norm that is not finite leaves weights that give one.
    last_not_finite_ =
        r.skipped && !(std::isfinite(r.loss) && std::isfinite(r.grad_norm)) ? step : 0;
    std::optional<double> val;
    if (source_.validates() && evaluates_after(plan_, step)) {
      try {
        val = source_.validate(trainer_);
      } catch (const StepFailure& failure) {
        fail(step, failure, false);
      }
    }
    if (val) last_val_ = val;
    if (lead_) record(step, r, mem, ranks, largest, val);
    if (plan_.sample && plan_.sample_every > 0 && step % plan_.sample_every == 0 &&
        step != plan_.steps)
      plan_.sample(step);
    if (saves_after(plan_, step, stop)) save(step, stop);
    return stop;
  }

  // After the last step, or a stop.
  void report_profile() const {
    if (lead_) write_profile(plan_.dir, profiled_steps_, profiled_seconds_, *io_.log);
  }
  const std::string& last_checkpoint() const { return last_checkpoint_; }

  // After the last step: a UserError where the weights give a loss that is not finite (the last
  // step was skipped for one, or the held-out loss after it is one), so that no such result is
  // written as a good one. Every rank decides alike (the loss and validation are the job's).
  void check_result() const {
    std::string why;
    if (last_not_finite_ > 0)
      why = "the last step (" + std::to_string(last_not_finite_) + ") was skipped: its " +
            bad_steps_.reason();
    else if (last_val_ && !std::isfinite(*last_val_))
      why = "the held-out loss after the last step is " + std::to_string(*last_val_);
    if (why.empty()) return;
    job_ended();
    if (!lead_) throw QuietExit{1};
    throw UserError(why + ": no result written (try a lower --lr); the last checkpoint is " +
                    (last_checkpoint_.empty() ? std::string("none") : last_checkpoint_));
  }

 private:
  // Rank 0: the step's metrics.jsonl line, log line and progress line.
  void record(int64_t step, const StepResult& r, const ProcessMemory& mem,
              const std::vector<RankStep>& ranks, int64_t largest, std::optional<double> val) {
    spdlog::logger& log = *io_.log;
    if (r.skipped)
      log.warn("step {}: {}; skipped (the weights are as before it)", step, bad_steps_.reason());
    // A rank's share: the peak MFU is measured against is one rank's.
    const double model_gflops =
        plan_.flops_per_token * r.tokens_per_s / static_cast<double>(comm_.size()) / 1e9;
    const double peak_before = mfu_peak_.gflops();
    if (plan_.flops_per_token > 0 && mfu_peak_.update(model_gflops))
      log.info(
          "peak measured again after step {} ran at {:.0f} GFLOP/s: {:.0f} GFLOP/s (was {:.0f})",
          step, model_gflops, mfu_peak_.gflops(), peak_before);
    const std::optional<double> mfu =
        plan_.flops_per_token > 0 ? mfu_peak_.mfu(model_gflops) : std::nullopt;
    nlohmann::json m = step_record(step, r, mem, plan_.budget, model_gflops, mfu);
    m["mapped_bytes"] = plan_.budget.mapped_bytes;
    m["elapsed_s"] = loop_time_.seconds();
    source_.describe(step, m);
    if (comm_.size() > 1) m["ranks"] = rank_records(ranks, plan_.positions);
    if (val) {
      m[source_.validation_key()] = *val;
      source_.describe_validation(m);
    }
    metrics_ << m.dump() << "\n" << std::flush;
    if (replacing_) {
      replacing_ = false;
      if (remove_replaced_run(plan_.dir))
        log.info("the run this one replaces (--overwrite) is deleted: this one has started");
    }
    if (step % plan_.log_every == 0 || step == plan_.steps || val) {
      const int64_t budget = plan_.budget.total_bytes();
      log.info(
          "step {:>5}/{} | loss {:.4f}{}{} | lr {:.2e} | grad norm {:.3f}{} | {:.0f} tok/s | "
          "{:.0f} ms{} | mem {:.2f} GiB / budget {:.2f} GiB ({:+.1f}%){}{}",
          step, plan_.steps, r.loss, source_.note(),
          val ? fmt::format(" | {} {:.4f}{}", source_.validation_label(), *val,
                            source_.validation_note())
              : std::string(),
          r.lr, r.grad_norm, expert_spread_text(r), r.tokens_per_s, r.ms,
          comm_.size() > 1 ? fmt::format(" (summing gradients {:.0f}, {:.0f} of it after the "
                                         "backward pass; gathering weights {:.0f})",
                                         r.reducing_ms, r.comm_ms, r.gather_ms)
                           : std::string(),
          gib(largest), gib(budget),
          100.0 * (static_cast<double>(largest) / static_cast<double>(budget) - 1.0),
          plan_.budget.mapped_bytes > 0
              ? fmt::format(" + {:.2f} GiB of mapped files (base, code)", gib(mem.rss_file_bytes))
              : std::string(),
          comm_.size() > 1 ? fmt::format(" (the largest of {} ranks)", comm_.size())
                           : std::string());
    }
    if (io_.console->terminal()) {
      const std::string mfu_text = mfu ? fmt::format(" | MFU {:.0f}%", 100.0 * *mfu) : "";
      io_.console->set_status(progress_line(
          step, plan_.steps, plan_.first_step - 1, loop_time_.seconds(), "steps",
          fmt::format("loss {:.3f} | {:.0f} tok/s{}", r.loss, r.tokens_per_s, mfu_text)));
    }
  }

  // The step after `done` (the step trained last) failed before changing the weights: they are
  // saved as `done` left them, unless this run trained nothing or `saved` (its checkpoint is
  // written), and the run stops.
  [[noreturn]] void fail(int64_t done, const StepFailure& failure, bool saved) {
    const int64_t step = done + 1;
    if (done >= plan_.first_step && !saved) save(done, 1);
    job_ended();
    // A rank whose own step failed says why; the others' failure is another rank's.
    const std::string why = *failure.what() ? failure.what() : "another rank's step failed";
    if (!lead_) {
      if (*failure.what()) throw UserError(why);
      throw QuietExit{1};
    }
    throw UserError(why + "; step " + std::to_string(step) + " not trained, " +
                    (last_checkpoint_.empty() ? std::string("and no checkpoint")
                                              : "the last checkpoint is " + last_checkpoint_ +
                                                    " (continue with: cputrain " + plan_.command +
                                                    " --resume " + plan_.dir + ")"));
  }

  void save(int64_t step, int stop) {
    if (!lead_) {
      // Rank 0 saves now: the shards of a sharded AdamW go to it.
      if (!trainer_.optimizer().shards().empty())
        share_checkpoint_state(params_, trainer_.optimizer(), true);
      return;
    }
    last_checkpoint_ =
        save_training_checkpoint(plan_.dir, step, params_, trainer_.optimizer(),
                                 plan_.data_fingerprint, plan_.config_json, plan_.keep, *io_.log);
    if (stop == 0) io_.log->info("saved {}", last_checkpoint_);
  }

  const LoopPlan& plan_;
  Trainer& trainer_;
  const ParameterSet& params_;
  BatchSource& source_;
  const Communicator& comm_;
  const LoopIo& io_;
  const bool lead_;
  BadStepFilter bad_steps_;
  MfuPeak mfu_peak_;
  std::string last_checkpoint_;
  bool replacing_;
  std::ofstream metrics_;
  Stopwatch loop_time_;
  int64_t profiled_steps_ = 0;
  double profiled_seconds_ = 0.0;
  int64_t last_not_finite_ = 0;  // the last step, where skipped for a value not finite
  std::optional<double> last_val_;
};

}  // namespace

int run_loop(const LoopPlan& plan, Trainer& trainer, const ParameterSet& params,
             BatchSource& source, RunOutput& output, const Communicator& comm, const LoopIo& io) {
  const bool lead = comm.rank() == 0;
  Steps steps(plan, trainer, params, source, comm, io);
  steps.validate_first();
  for (int64_t step = plan.first_step; step <= plan.steps; ++step) {
    const int stop = steps.run(step);
    if (stop == 0) continue;
    const char* what = stop == SIGINT ? "interrupted (SIGINT)" : "terminated (SIGTERM)";
    // During the last step: the run is done, and its result is written as without the signal.
    if (step == plan.steps) {
      if (lead) io.log->info("{} during the last step: the run is complete", what);
      break;
    }
    job_ended();
    steps.report_profile();
    if (lead) {
      io.console->set_status("");
      // The command that continues it: a job of several ranks resumes as one of as many.
      io.log->warn("{} after step {}: saved {}; continue with: {}cputrain {} --resume {}", what,
                   step, steps.last_checkpoint(),
                   comm.size() > 1 ? fmt::format("mpirun -np {} ", comm.size()) : std::string(),
                   plan.command, plan.dir);
    }
    return 128 + stop;
  }
  if (lead) io.console->set_status("");
  steps.report_profile();
  steps.check_result();
  output.write(lead);
  job_ended();
  return 0;
}

}  // namespace cputrain
