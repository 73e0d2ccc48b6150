#include "tools/eval_command.h"

#include <omp.h>
#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <optional>
#include <sstream>

#include "engine/core/error.h"
#include "engine/data/batch_sampler.h"
#include "engine/data/corpus.h"
#include "engine/data/token_dataset.h"
#include "engine/text/tokenizer.h"
#include "engine/text/vocab_tokenizer.h"
#include "engine/train/checkpoint_file.h"
#include "engine/train/trainer.h"
#include "engine/train/weights_file.h"
#include "models/decoder.h"
#include "tools/finetune_command.h"
#include "tools/flag_checks.h"
#include "tools/model_source.h"
#include "tools/run/progress.h"
#include "tools/run/run_config.h"
#include "tools/run/run_dir.h"
#include "tools/train_command.h"

namespace cputrain {
namespace {

namespace fs = std::filesystem;

std::string read_text(const std::string& path) {
  if (fs::is_directory(path)) throw UserError("--text " + path + ": a folder, not a text file");
  std::ifstream in(path, std::ios::binary);
  if (!in) throw UserError("--text " + path + ": cannot be read");
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

// --text: the file's tokens (BOS first where the tokenizer adds one) in consecutive windows of
// `ctx`, each position after a window's first scored by the logits before it.
int eval_text(const EvalArgs& a) {
  const auto [path, flag] = model_source(a.run, a.model);
  LoadedModel m =
      load_model(path, flag, a.weights, a.ctx > 0 ? a.ctx : kDefaultImportCtx, false, a.adapter);
  check_finite_weights(m, path, flag, a.adapter);
  const int64_t ctx = a.ctx > 0 ? std::min(a.ctx, m.config.ctx) : m.config.ctx;
  std::vector<int32_t> tokens;
  if (m.tokenizer->adds_bos()) tokens.push_back(m.tokenizer->bos_id());
  for (int32_t id : m.tokenizer->encode(read_text(a.text))) tokens.push_back(id);
  if (tokens.size() < 2)
    throw UserError("--text " + a.text + ": " + std::to_string(tokens.size()) +
                    " tokens, too few to score one");
  const int64_t V = m.config.vocab;
  std::vector<double> nll(tokens.size(), 0.0);  // nll[i]: of token i; 0 for each window's first
  std::vector<bool> scored(tokens.size(), false);
  for (size_t start = 0; start + 1 < tokens.size(); start += static_cast<size_t>(ctx)) {
    const size_t n = std::min(tokens.size() - start, static_cast<size_t>(ctx));
    if (n < 2) break;
    Tensor input =
        Tensor::empty(Shape{1, static_cast<int64_t>(n)}, DType::I32, MemoryCategory::Workspace);
    std::copy_n(tokens.begin() + static_cast<std::ptrdiff_t>(start), n, input.i32());
    const Tensor logits = m.model->logits(input);
    for (size_t i = 0; i + 1 < n; ++i) {
      const float* row = logits.f32() + i * static_cast<size_t>(V);
      double max = row[0], sum = 0.0;
      for (int64_t v = 1; v < V; ++v) max = std::max<double>(max, row[v]);
      for (int64_t v = 0; v < V; ++v) sum += std::exp(row[v] - max);
      const int32_t next = tokens[start + i + 1];
      nll[start + i + 1] = max + std::log(sum) - row[next];
      scored[start + i + 1] = true;
    }
  }
  double total = 0.0;
  int64_t count = 0;
  for (size_t i = 0; i < tokens.size(); ++i)
    if (scored[i]) {
      total += nll[i];
      ++count;
    }
  const double mean = total / static_cast<double>(count);
  if (!std::isfinite(mean))
    throw UserError(flag + " " + path + ": the loss of --text " + a.text + " is " +
                    std::to_string(mean) + " (the model's logits are not finite)");
  if (a.json) {
    nlohmann::json j = {{"loss", mean},
                        {"perplexity", std::exp(mean)},
                        {"tokens", tokens.size()},
                        {"scored", count},
                        {"ctx", ctx},
                        {"model", m.source}};
    if (a.per_token) {
      j["per_token"] = nlohmann::json::array();
      for (size_t i = 0; i < tokens.size(); ++i)
        j["per_token"].push_back(
            {{"id", tokens[i]}, {"nll", scored[i] ? nlohmann::json(nll[i]) : nlohmann::json()}});
    }
    std::printf("%s\n", j.dump(a.per_token ? -1 : 2).c_str());
    return 0;
  }
  if (a.per_token) {
    std::printf("position\tid\tnll\n");
    for (size_t i = 0; i < tokens.size(); ++i) {
      if (scored[i])
        std::printf("%zu\t%d\t%.6f\n", i, tokens[i], nll[i]);
      else
        std::printf("%zu\t%d\t-\n", i, tokens[i]);
    }
  }
  std::printf("%s: loss %.4f, perplexity %.3f over %lld tokens of %s (windows of %lld)\n",
              m.source.c_str(), mean, std::exp(mean), static_cast<long long>(count), a.text.c_str(),
              static_cast<long long>(ctx));
  return 0;
}

}  // namespace

void add_eval_flags(CLI::App& app, EvalArgs& a) {
  add_model_source_flags(app, a.run, a.model);
  app.add_option("--adapter", a.adapter,
                 "A LoRA adapter (llama.cpp's GGUF, as cputrain finetune writes it) applied to "
                 "the model");
  app.add_option("--text", a.text, "Perplexity of this text file (each token after BOS scored)");
  app.add_option("--ctx", a.ctx, "Tokens per window with --text (default: the model's context)")
      ->check(positive_whole());
  app.add_flag("--per-token", a.per_token,
               "With --text: each token's id and negative log-likelihood");
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
  const auto [path, flag] = model_source(a.run, a.model);  // one of them, and --run a directory
  omp_set_num_threads(a.threads > 0 ? a.threads : omp_get_num_procs());
  select_kernels(a.kernels);
  if (!a.text.empty()) return eval_text(a);
  if (a.per_token) throw UserError("--per-token: only with --text");
  if (!a.adapter.empty()) throw UserError("--adapter: only with --text");
  if (!a.corpus.empty() && !a.model.empty() && !fs::is_directory(a.model))
    throw UserError("--corpus: only for a run directory; for " + a.model + " give --text FILE");
  if (a.run.empty() && !fs::is_directory(a.model))
    throw UserError("--model " + a.model + ": give --text FILE to evaluate a model file");
  if (describe_finetune_run(path)) {
    if (!a.corpus.empty())
      throw UserError("--corpus " + a.corpus +
                      ": a fine-tune is evaluated on the examples it held out; for other text "
                      "give --text FILE");
    return eval_finetune(path, flag, a.weights, a.batch, a.json);
  }
  if (a.run.empty()) {
    EvalArgs as_run = a;
    as_run.run = a.model;
    as_run.model.clear();
    return run_eval(as_run);
  }
  const RunConfig config = read_run_config(a.run + "/config.json");
  const Tokenizer tokenizer = Tokenizer::load_run(a.run);
  if (tokenizer.vocab_size() != config.model.vocab)
    throw UserError(a.run + "/tokenizer.model: vocabulary " +
                    std::to_string(tokenizer.vocab_size()) + " does not match the model's " +
                    std::to_string(config.model.vocab));
  DecoderModel model(config.model);
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
  if (!std::isfinite(loss))
    throw UserError("--run " + a.run + ": the loss is " + std::to_string(loss) +
                    " (the model's logits are not finite)");
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
