#include "tools/parity_command.h"

#include <omp.h>
#include <spdlog/sinks/basic_file_sink.h>
#include <spdlog/sinks/stdout_sinks.h>
#include <spdlog/spdlog.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <nlohmann/json.hpp>

#include "engine/core/error.h"
#include "engine/core/memory.h"
#include "engine/data/data_pipeline.h"
#include "engine/io/atomic_file.h"
#include "engine/train/trainer.h"
#include "models/decoder.h"
#include "tools/flag_checks.h"
#include "tools/run/run_dir.h"

namespace cputrain {
namespace {

struct Variant {
  ParityCurve curve;
  double median_ms = 0.0;
  int64_t activation_peak_bytes = 0;
};

double median(std::vector<double> v) {
  if (v.empty()) return 0.0;
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 == 1 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

double final_delta(const ParityCurve& c, const ParityCurve& base) {
  return c.loss.back() - base.loss.back();
}

double max_step_delta(const ParityCurve& c, const ParityCurve& base) {
  double m = 0.0;
  for (size_t i = 0; i < c.loss.size(); ++i) m = std::max(m, std::abs(c.loss[i] - base.loss[i]));
  return m;
}

// bf16 / fp32 gradient norm, the mean over steps of the per-step ratio.
double mean_grad_norm_ratio(const ParityCurve& c, const ParityCurve& base) {
  double sum = 0.0;
  for (size_t i = 0; i < c.grad_norm.size(); ++i) sum += c.grad_norm[i] / base.grad_norm[i];
  return sum / static_cast<double>(c.grad_norm.size());
}

Variant train_variant(const RunConfig& base, const std::string& name, DType dtype, int64_t batch,
                      int64_t accum, std::span<const int32_t> tokens, spdlog::logger& log) {
  Variant v;
  v.curve.name = name;
  v.curve.dtype = dtype;
  v.curve.batch = batch;
  v.curve.accum = accum;
  DecoderModel model(base.model);
  model.init_weights(base.train.seed);
  model.set_compute_dtype(dtype);
  TrainOptions options = base.train;
  options.batch = batch;
  options.accum = accum;
  Trainer trainer(
      model.parameters(),
      [&model](const Tensor& in, const Tensor& tgt) { return model.loss(in, tgt); }, options);
  memory_reset_peaks();
  std::vector<double> ms;
  for (int64_t step = 1; step <= base.steps; ++step) {
    const StepResult r = trainer.step(tokens, step);
    v.curve.loss.push_back(r.loss);
    v.curve.grad_norm.push_back(r.grad_norm);
    ms.push_back(r.ms);
    if (!std::isfinite(r.loss))
      throw UserError(name + ": step " + std::to_string(step) + ": loss is " +
                      std::to_string(r.loss) + " (try a lower --lr)");
    if (step % 10 == 0 || step == base.steps)
      log.info("{:<10} step {:>4}/{} | loss {:.6f} | grad norm {:.4f} | {:.0f} ms", name, step,
               base.steps, r.loss, r.grad_norm, r.ms);
  }
  // The first steps warm caches and grow buffers; time the rest.
  v.median_ms =
      median(std::vector<double>(ms.begin() + std::min<size_t>(ms.size() - 1, 2), ms.end()));
  v.activation_peak_bytes =
      memory_stats().peak_bytes[static_cast<int>(MemoryCategory::Activations)];
  return v;
}

std::string curves_csv(const std::vector<Variant>& variants) {
  auto column = [](const std::string& name) {
    std::string c = name;
    std::replace(c.begin(), c.end(), ' ', '_');
    return c;
  };
  std::string csv = "step";
  for (const Variant& v : variants) csv += "," + column(v.curve.name) + "_loss";
  for (const Variant& v : variants) csv += "," + column(v.curve.name) + "_grad_norm";
  csv += "\n";
  const size_t steps = variants.front().curve.loss.size();
  char buf[64];
  for (size_t s = 0; s < steps; ++s) {
    csv += std::to_string(s + 1);
    for (const Variant& v : variants) {
      std::snprintf(buf, sizeof(buf), ",%.9g", v.curve.loss[s]);
      csv += buf;
    }
    for (const Variant& v : variants) {
      std::snprintf(buf, sizeof(buf), ",%.9g", v.curve.grad_norm[s]);
      csv += buf;
    }
    csv += "\n";
  }
  return csv;
}

double mib(int64_t bytes) {
  return static_cast<double>(bytes) / (1024.0 * 1024.0);
}

}  // namespace

void add_parity_flags(CLI::App& app, ParityArgs& a) {
  TrainArgs& t = a.train;
  app.add_option("--preset", t.preset, "Model preset")->capture_default_str();
  app.add_option("--corpus", t.corpus, "Text file or folder of text files")->capture_default_str();
  app.add_option("--out", t.out,
                 "Directory for the data cache, parity.csv and parity.json "
                 "(default runs/parity-<preset>)");
  t.steps = 100;
  app.add_option("--steps", t.steps, "Optimizer steps of each run")
      ->capture_default_str()
      ->check(positive_whole());
  app.add_option("--batch", t.batch, "Global batch in sequences (default: the preset's)")
      ->check(positive_whole());
  app.add_option("--accum", a.accum,
                 "Accumulation counts to compare against the single batch: each a runs "
                 "batch/a sequences x a micro-batches")
      ->capture_default_str()
      ->delimiter(',')
      ->check(positive_whole());
  app.add_option("--ctx", t.ctx, "Tokens per sequence (default: the preset's)")
      ->check(positive_whole());
  app.add_option("--vocab", t.vocab, "Tokenizer vocabulary size (default: the preset's)")
      ->check(positive_whole());
  app.add_option("--lr", t.lr, "Peak learning rate (default: by model width)")->check(positive());
  app.add_option("--warmup", t.warmup, "Warm-up steps (default: min(100, steps / 10))")
      ->check(non_negative());
  app.add_option("--seed", t.seed, "Seed for init and batch sampling")
      ->capture_default_str()
      ->check(non_negative());
  add_threads_flag(app, t.threads);
  add_kernel_flags(app, t.kernels);
  app.add_option("--tol-bf16", a.tol_bf16,
                 "Largest accepted |bf16 - fp32| final loss difference, in nats")
      ->capture_default_str()
      ->check(non_negative());
  app.add_option("--tol-accum", a.tol_accum,
                 "Largest accepted |split - single batch| final loss difference, in nats")
      ->capture_default_str()
      ->check(non_negative());
  app.add_flag("--json", a.json, "Print a JSON summary on stdout (the log goes to stderr)");
}

int run_parity(const ParityArgs& a) {
  TrainArgs targs = a.train;
  if (targs.steps == -1) targs.steps = 100;
  targs.accum = 1;
  RunConfig config = resolve_run_config(targs);
  if (targs.batch == -1) {
    const auto preset = find_preset(config.preset);
    config.train.batch = preset->batch * preset->accum;
  }
  const int64_t batch = config.train.batch;
  for (int64_t n : a.accum) {
    if (n < 2 || batch % n != 0)
      throw UserError("--accum " + std::to_string(n) +
                      ": must be at least 2 and divide the batch " + std::to_string(batch));
  }
  select_kernels(targs.kernels);
  const std::string out = targs.out.empty() ? "runs/parity-" + config.preset : targs.out;
  const RunDirectory run = open_run_directory(out, RunDirUse::Parity);
  omp_set_num_threads(config.threads);

  spdlog::sink_ptr console;
  if (a.json)
    console = std::make_shared<spdlog::sinks::stderr_sink_mt>();
  else
    console = std::make_shared<spdlog::sinks::stdout_sink_mt>();
  auto file = std::make_shared<spdlog::sinks::basic_file_sink_mt>(out + "/parity.log", true);
  auto log = std::make_shared<spdlog::logger>("parity", spdlog::sinks_init_list{console, file});
  log->set_pattern("[%H:%M:%S] %v");
  log->flush_on(spdlog::level::info);
  spdlog::set_default_logger(log);

  PreparedData data = prepare_data(config.corpus, static_cast<int>(config.model.vocab), out);
  config.model.vocab = data.tokenizer.vocab_size();
  const auto tokens = data.dataset.train_tokens();
  if (static_cast<int64_t>(tokens.size()) < config.train.ctx + 1)
    throw UserError("--corpus " + config.corpus + ": the training split has " +
                    std::to_string(tokens.size()) + " tokens, fewer than one window of --ctx " +
                    std::to_string(config.train.ctx) + " + 1");
  log->info(
      "parity: preset {} ({} parameters), {} steps of {} sequences of {} tokens, lr {:g}, "
      "seed {}, {} threads",
      config.preset, parameter_count(config.model), config.steps, batch, config.train.ctx,
      config.train.lr.peak, config.train.seed, config.threads);
  log->info("{}", describe_compute());

  std::vector<Variant> variants;
  variants.push_back(train_variant(config, "fp32", DType::F32, batch, 1, tokens, *log));
  variants.push_back(train_variant(config, "bf16", DType::BF16, batch, 1, tokens, *log));
  for (int64_t n : a.accum) {
    const std::string name = "fp32 " + std::to_string(batch / n) + "x" + std::to_string(n);
    variants.push_back(train_variant(config, name, DType::F32, batch / n, n, tokens, *log));
  }

  const ParityCurve& fp32 = variants[0].curve;
  const ParityCurve& bf16 = variants[1].curve;
  bool pass = true;
  nlohmann::json accum = nlohmann::json::array();
  std::string table =
      fmt::format("{:<12} {:>13} {:>12} {:>13} {:>15} {:>15} {:>10} {:>15}  {}\n", "run",
                  "batch x accum", "final loss", "delta (nats)", "max |step delta|",
                  "grad-norm ratio", "ms/step", "activations MiB", "tolerance");
  for (size_t i = 0; i < variants.size(); ++i) {
    const Variant& v = variants[i];
    const ParityCurve& c = v.curve;
    std::string delta = "-", max_delta = "-", ratio = "-", verdict;
    if (i > 0) {
      const double d = final_delta(c, fp32);
      const double tol = i == 1 ? a.tol_bf16 : a.tol_accum;
      const bool ok = std::abs(d) <= tol;
      pass = pass && ok;
      delta = fmt::format("{:+.6f}", d);
      max_delta = fmt::format("{:.6f}", max_step_delta(c, fp32));
      ratio = fmt::format("{:.5f}", mean_grad_norm_ratio(c, fp32));
      verdict = fmt::format("{:g} {}", tol, ok ? "ok" : "EXCEEDED");
      if (i > 1)
        accum.push_back({{"batch", c.batch},
                         {"accum", c.accum},
                         {"final_loss", c.loss.back()},
                         {"delta_nats", d},
                         {"max_step_delta_nats", max_step_delta(c, fp32)}});
    }
    table += fmt::format("{:<12} {:>13} {:>12.6f} {:>13} {:>15} {:>15} {:>10.0f} {:>15.1f}  {}\n",
                         c.name, fmt::format("{} x {}", c.batch, c.accum), c.loss.back(), delta,
                         max_delta, ratio, v.median_ms, mib(v.activation_peak_bytes), verdict);
  }

  const nlohmann::json summary = {{"preset", config.preset},
                                  {"steps", config.steps},
                                  {"batch", batch},
                                  {"ctx", config.train.ctx},
                                  {"fp32_final_loss", fp32.loss.back()},
                                  {"bf16_final_loss", bf16.loss.back()},
                                  {"bf16_delta_nats", final_delta(bf16, fp32)},
                                  {"bf16_max_step_delta_nats", max_step_delta(bf16, fp32)},
                                  {"bf16_grad_norm_ratio", mean_grad_norm_ratio(bf16, fp32)},
                                  {"fp32_activation_peak_bytes", variants[0].activation_peak_bytes},
                                  {"bf16_activation_peak_bytes", variants[1].activation_peak_bytes},
                                  {"fp32_median_ms", variants[0].median_ms},
                                  {"bf16_median_ms", variants[1].median_ms},
                                  {"accum", accum},
                                  {"tol_bf16", a.tol_bf16},
                                  {"tol_accum", a.tol_accum},
                                  {"pass", pass}};
  write_file_atomic(out + "/parity.csv", curves_csv(variants));
  write_file_atomic(out + "/parity.json", summary.dump(2) + "\n");

  log->info(
      "final losses after {} steps (delta: against fp32 {} x 1; grad-norm ratio: mean over "
      "steps of run / fp32; ms/step: median after 2 warm-up steps):\n{}",
      config.steps, batch, table);
  log->info("per-step losses: {}/parity.csv; summary: {}/parity.json", out, out);
  if (a.json) std::printf("%s\n", summary.dump(2).c_str());
  if (!pass) {
    std::fprintf(stderr,
                 "cputrain: parity: a loss difference exceeds its tolerance (see the "
                 "table above)\n");
    return 3;
  }
  return 0;
}

}  // namespace cputrain
