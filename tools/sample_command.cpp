#include "tools/sample_command.h"

#include <omp.h>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <string>
#include <vector>

#include "engine/core/error.h"
#include "engine/text/tokenizer.h"
#include "engine/train/weights_file.h"
#include "models/decoder.h"
#include "models/generate.h"
#include "tools/flag_checks.h"
#include "tools/model_source.h"
#include "tools/run/progress.h"
#include "tools/run/run_config.h"
#include "tools/run/run_dir.h"
#include "tools/train_command.h"

namespace cputrain {

void add_sample_flags(CLI::App& app, SampleArgs& a) {
  add_model_source_flags(app, a.run, a.model);
  app.add_option("--adapter", a.adapter,
                 "A LoRA adapter (llama.cpp's GGUF, as cputrain finetune writes it) applied to "
                 "the model");
  app.add_option("--ctx", a.ctx,
                 "Context of a model file, where it declares a longer one (default: at most 4096)")
      ->check(positive_whole());
  app.add_option("--prompt", a.prompt, "Text to continue (default: start of a document)");
  app.add_option(
      "--weights", a.weights,
      "model.bin or a checkpoint (default: <run>/model.bin, else the newest checkpoint)");
  app.add_option("--max-tokens", a.max_tokens, "Tokens to generate")->capture_default_str();
  app.add_option("--temperature", a.temperature, "Softmax temperature (0: greedy)")
      ->capture_default_str()
      ->check(non_negative());
  app.add_option("--top-k", a.top_k, "Sample among the k most likely tokens (0: all)")
      ->capture_default_str();
  app.add_option(
         "--top-p", a.top_p,
         "Sample among the most likely tokens whose probabilities sum to at least p (1: all)")
      ->capture_default_str();
  app.add_option("--seed", a.seed, "Sampling seed")->capture_default_str()->check(non_negative());
  app.add_option("--n", a.n,
                 "Continuations of the prompt, decoded together (the i-th of them is what --seed "
                 "SEED+i gives alone)")
      ->capture_default_str()
      ->check(positive_whole());
  app.add_option("--stop", a.stop,
                 "A continuation ends before the first place its text holds this string (given "
                 "several times: any of them)");
  app.add_option("--threads", a.threads, "OpenMP threads (default: all cores)")
      ->check(threads_limit());
  app.add_flag("--stats", a.stats,
               "Print the load time, the time to the first token and the decode rate to stderr");
  add_kernel_flags(app, a.kernels);
}

int run_sample(const SampleArgs& a) {
  if (a.max_tokens <= 0) throw UserError("--max-tokens must be positive");
  if (a.n < 1 || a.n > 4096) throw UserError("--n " + std::to_string(a.n) + ": from 1 to 4096");
  for (const std::string& s : a.stop)
    if (s.empty()) throw UserError("--stop: an empty string, which every text holds");
  if (a.top_k < 0) throw UserError("--top-k must not be negative");
  if (!(a.top_p > 0.0 && a.top_p <= 1.0))
    throw UserError("--top-p " + std::to_string(a.top_p) + ": must be in (0, 1]");
  const auto [path, flag] = model_source(a.run, a.model);
  omp_set_num_threads(a.threads > 0 ? a.threads : omp_get_num_procs());
  select_kernels(a.kernels);
  const Stopwatch load_time;
  LoadedModel loaded =
      load_model(path, flag, a.weights, a.ctx > 0 ? a.ctx : kDefaultImportCtx, true, a.adapter);
  check_finite_weights(loaded, path, flag, a.adapter);
  const double load_seconds = load_time.seconds();
  DecoderModel& model = *loaded.model;
  const Tokenizer& tokenizer = *loaded.tokenizer;
  std::vector<int32_t> prompt = {tokenizer.bos_id()};
  const std::vector<int32_t> encoded = tokenizer.encode(a.prompt);
  prompt.insert(prompt.end(), encoded.begin(), encoded.end());
  SampleOptions options;
  options.max_new_tokens = a.max_tokens;
  options.temperature = static_cast<float>(a.temperature);
  options.top_k = a.top_k;
  options.top_p = static_cast<float>(a.top_p);
  options.seed = a.seed;
  // cputrain's own runs separate documents with BOS; model files end a text with EOS.
  options.stop_token = tokenizer.vocabulary() ? tokenizer.eos_id() : tokenizer.bos_id();

  // Each continuation's text: everything generated so far decoded, the prompt's included, and
  // where a --stop string begins in what follows the prompt (npos: nowhere yet).
  const auto n = static_cast<size_t>(a.n);
  std::vector<std::vector<int32_t>> generated(n, encoded);
  const std::string start = tokenizer.decode(encoded);
  std::vector<std::string> texts(n, start);
  size_t longest_stop = 0;
  for (const std::string& s : a.stop) longest_stop = std::max(longest_stop, s.size());
  const auto stop_at = [&](const std::string& text) {
    size_t at = std::string::npos;
    for (const std::string& s : a.stop) at = std::min(at, text.find(s, start.size()));
    return at;
  };
  // One continuation streams: what is new is printed as it comes, less what could begin a stop
  // string. Several are printed when all have ended, one after another.
  std::string printed = start;
  const auto print_new = [&](const std::string& text, size_t upto) {
    if (upto > printed.size() && text.compare(0, printed.size(), printed) == 0) {
      std::fwrite(text.data() + printed.size(), 1, upto - printed.size(), stdout);
      std::fflush(stdout);
      printed = text.substr(0, upto);
    }
  };
  if (n == 1) {
    std::fputs(start.c_str(), stdout);
    std::fflush(stdout);
  }
  const Stopwatch generate_time;
  double first_token_seconds = 0.0;
  int64_t tokens = 0;
  generate_batch(model, std::vector<std::vector<int32_t>>(n, prompt), options,
                 [&](size_t i, int32_t token) {
                   if (tokens++ == 0) first_token_seconds = generate_time.seconds();
                   if (token == tokenizer.bos_id()) return true;
                   generated[i].push_back(token);
                   std::string& text = texts[i];
                   text = tokenizer.decode(generated[i]);
                   const size_t at = stop_at(text);
                   if (at != std::string::npos) text.resize(at);
                   if (n == 1)
                     print_new(text, at != std::string::npos
                                         ? at
                                         : text.size() - std::min(text.size(), longest_stop));
                   return at == std::string::npos;
                 });
  if (n == 1) {
    print_new(texts[0], texts[0].size());
    std::fputs("\n", stdout);
  } else {
    for (size_t i = 0; i < n; ++i)
      std::printf("--- %zu of %zu (seed %llu) ---\n%s\n", i + 1, n,
                  static_cast<unsigned long long>(a.seed + i), texts[i].c_str());
  }
  if (a.stats) {
    const double decode_seconds = generate_time.seconds() - first_token_seconds;
    std::fprintf(stderr,
                 "loaded %s in %.2f s; prompt of %zu tokens and the first token in %.3f s; %lld "
                 "more tokens at %.2f tokens/s (%zu sequence%s, %d threads)\n",
                 loaded.source.c_str(), load_seconds, prompt.size(), first_token_seconds,
                 static_cast<long long>(tokens - 1),
                 tokens > 1 ? static_cast<double>(tokens - 1) / decode_seconds : 0.0, n,
                 n == 1 ? "" : "s", omp_get_max_threads());
  }
  return 0;
}

}  // namespace cputrain
