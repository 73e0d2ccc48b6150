#include "models/generate.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <random>
#include <stdexcept>

namespace cputrain {

int32_t sample_token(const float* logits, int64_t V, float temperature, int64_t top_k, float top_p,
                     double uniform) {
  if (temperature <= 0.0f)
    return static_cast<int32_t>(std::max_element(logits, logits + V) - logits);
  std::vector<int32_t> order(static_cast<size_t>(V));
  std::iota(order.begin(), order.end(), 0);
  int64_t k = (top_k > 0 && top_k < V) ? top_k : V;
  std::partial_sort(order.begin(), order.begin() + k, order.end(),
                    [logits](int32_t a, int32_t b) { return logits[a] > logits[b]; });
  const double top = logits[order[0]];
  std::vector<double> weights(static_cast<size_t>(k));
  double sum = 0.0;
  for (int64_t i = 0; i < k; ++i) {
    weights[i] = std::exp((logits[order[i]] - top) / temperature);
    sum += weights[i];
  }
  if (top_p < 1.0f) {  // keep the most likely tokens until their mass reaches top_p
    int64_t kept = 0;
    double mass = 0.0;
    while (kept < k && (kept == 0 || mass < static_cast<double>(top_p) * sum))
      mass += weights[kept++];
    k = kept;
    sum = mass;
  }
  double target = uniform * sum;
  for (int64_t i = 0; i < k; ++i) {
    target -= weights[i];
    if (target < 0.0) return order[i];
  }
  return order[k - 1];
}

std::vector<int32_t> generate(DecoderModel& model, const std::vector<int32_t>& prompt,
                              const SampleOptions& options,
                              const std::function<void(int32_t)>& on_token) {
  if (prompt.empty()) throw std::invalid_argument("generate: empty prompt");
  const int64_t ctx = model.config().ctx;
  const int64_t V = model.config().vocab;
  std::mt19937_64 rng(options.seed);
  std::vector<int32_t> tokens = prompt;
  if (options.max_new_tokens <= 0) return tokens;
  DecoderModel::KvCache cache = model.new_kv_cache();
  // Fills the cache afresh with the last `keep` tokens.
  auto restart = [&](int64_t keep) {
    cache.length = 0;
    return model.decode(std::vector<int32_t>(tokens.end() - keep, tokens.end()), cache);
  };
  Tensor logits = restart(std::min<int64_t>(static_cast<int64_t>(tokens.size()), ctx));
  for (int64_t n = 0; n < options.max_new_tokens; ++n) {
    const double uniform = static_cast<double>(rng() >> 11) * 0x1.0p-53;
    const int32_t next =
        sample_token(logits.f32(), V, options.temperature, options.top_k, options.top_p, uniform);
    tokens.push_back(next);
    if (on_token) on_token(next);
    if (next == options.stop_token || n + 1 == options.max_new_tokens) break;
    logits =
        cache.length < ctx ? model.decode({next}, cache) : restart(std::max<int64_t>(1, ctx / 2));
  }
  return tokens;
}

}  // namespace cputrain
