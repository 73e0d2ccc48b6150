#include "tools/eval_command.h"

#include <omp.h>
#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <optional>

#include "engine/batch_sampler.h"
#include "engine/checkpoint_file.h"
#include "engine/corpus.h"
#include "engine/error.h"
#include "engine/token_dataset.h"
#include "engine/tokenizer.h"
#include "engine/trainer.h"
#include "engine/weights_file.h"
#include "models/llama.h"
#include "tools/flag_checks.h"
#include "tools/progress.h"
#include "tools/run_config.h"
#include "tools/run_dir.h"
#include "tools/train_command.h"

namespace cputrain {
namespace {

namespace fs = std::filesystem;

}  // namespace

void add_eval_flags(CLI::App& app, EvalArgs& a) {
  app.add_option("--run", a.run, "Run directory written by `cputrain train`")->required();
  app.add_option("--corpus", a.corpus,
                 "Evaluate on every document of this corpus (default: the run's validation split)");
  app.add_option(
      "--weights", a.weights,
      "model.bin or a checkpoint (default: <run>/model.bin, else the newest checkpoint)");
  app.add_option("--windows", a.windows, "Windows of ctx tokens to evaluate (0: all)")
      ->capture_default_str()
      ->check(non_negative());
  app.add_option("--batch", a.batch, "Windows per forward pass")
      ->capture_default_str()
      ->check(positive_whole());
  app.add_option("--threads", a.threads, "OpenMP threads (default: all cores)")
      ->check(threads_limit());
  add_kernel_flags(app, a.kernels);
  app.add_flag("--json", a.json, "Print {loss, perplexity, windows, tokens} as JSON");
}

int run_eval(const EvalArgs& a) {
  if (!fs::is_directory(a.run)) throw UserError("--run " + a.run + ": no such run directory");
  omp_set_num_threads(a.threads > 0 ? a.threads : omp_get_num_procs());
  select_kernels(a.kernels);
  const RunConfig config = read_run_config(a.run + "/config.json");
  const Tokenizer tokenizer = Tokenizer::load(a.run + "/tokenizer.model");
  if (tokenizer.vocab_size() != config.model.vocab)
    throw UserError(a.run + "/tokenizer.model: vocabulary " +
                    std::to_string(tokenizer.vocab_size()) + " does not match the model's " +
                    std::to_string(config.model.vocab));
  LlamaModel model(config.model);
  const std::string weights = load_run_weights(a.run, a.weights, model.parameters());

  std::vector<int32_t> owned;
  std::span<const int32_t> tokens;
  std::optional<TokenDataset> dataset;
  std::string source;
  if (a.corpus.empty()) {
    dataset.emplace(TokenDataset::open(a.run + "/tokens.bin"));
    tokens = dataset->val_tokens();
    source = "the validation split of " + config.corpus;
  } else {
    for (const std::string& doc : read_documents(a.corpus)) {
      owned.push_back(tokenizer.bos_id());
      const std::vector<int32_t> ids = tokenizer.encode(doc);
      owned.insert(owned.end(), ids.begin(), ids.end());
    }
    tokens = owned;
    source = a.corpus;
  }
  const int64_t ctx = config.train.ctx;
  const int64_t available = eval_window_count(tokens, ctx);
  if (available == 0)
    throw UserError((a.corpus.empty() ? a.run + "/tokens.bin" : "--corpus " + a.corpus) + ": " +
                    std::to_string(tokens.size()) + " tokens, fewer than one window of ctx " +
                    std::to_string(ctx) + " + 1");
  const int64_t windows = a.windows > 0 ? std::min(a.windows, available) : available;
  // On a terminal, a progress line with the time left while the windows are evaluated.
  ProgressSink status(!a.json && ::isatty(::fileno(stdout)) == 1);
  const Stopwatch time;
  const double loss = evaluate_loss(
      [&model](const Tensor& in, const Tensor& tgt) { return model.loss(in, tgt); }, tokens, ctx,
      a.batch, windows,
      [&](int64_t done, int64_t total) {
        status.set_status("evaluating " +
                          progress_line(done, total, 0, time.seconds(), "windows", ""));
      });
  status.set_status("");
  const double ppl = std::exp(loss);
  if (a.json) {
    const nlohmann::json j = {{"loss", loss},
                              {"perplexity", ppl},
                              {"windows", windows},
                              {"tokens", windows * ctx},
                              {"weights", weights}};
    std::printf("%s\n", j.dump(2).c_str());
  } else {
    std::printf("%s: loss %.4f, perplexity %.2f over %lld windows of %lld tokens of %s\n",
                weights.c_str(), loss, ppl, static_cast<long long>(windows),
                static_cast<long long>(ctx), source.c_str());
  }
  return 0;
}

}  // namespace cputrain
