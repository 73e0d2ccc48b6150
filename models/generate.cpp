#include "models/generate.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <random>
#include <stdexcept>

namespace cputrain {

int32_t sample_token(const float* logits, int64_t V, float temperature, int64_t top_k,
                     double uniform) {
  if (temperature <= 0.0f) return static_cast<int32_t>(std::max_element(logits, logits + V) - logits);
  std::vector<int32_t> order(static_cast<size_t>(V));
  std::iota(order.begin(), order.end(), 0);
  const int64_t k = (top_k > 0 && top_k < V) ? top_k : V;
  std::partial_sort(order.begin(), order.begin() + k, order.end(),
                    [logits](int32_t a, int32_t b) { return logits[a] > logits[b]; });
  const double top = logits[order[0]];
  std::vector<double> weights(static_cast<size_t>(k));
  double sum = 0.0;
  for (int64_t i = 0; i < k; ++i) {
    weights[i] = std::exp((logits[order[i]] - top) / temperature);
    sum += weights[i];
  }
  double target = uniform * sum;
  for (int64_t i = 0; i < k; ++i) {
    target -= weights[i];
    if (target < 0.0) return order[i];
  }
  return order[k - 1];
}

std::vector<int32_t> generate(LlamaModel& model, const std::vector<int32_t>& prompt,
                              const SampleOptions& options,
                              const std::function<void(int32_t)>& on_token) {
  if (prompt.empty()) throw std::invalid_argument("generate: empty prompt");
  const int64_t ctx = model.config().ctx;
  const int64_t V = model.config().vocab;
  std::mt19937_64 rng(options.seed);
  std::vector<int32_t> tokens = prompt;
  for (int64_t n = 0; n < options.max_new_tokens; ++n) {
    const int64_t T = std::min<int64_t>(static_cast<int64_t>(tokens.size()), ctx);
    Tensor input = Tensor::empty(Shape{1, T}, DType::I32, MemoryCategory::Workspace);
    std::copy(tokens.end() - T, tokens.end(), input.i32());
    const Tensor logits = model.last_logits(input);
    const double uniform = static_cast<double>(rng() >> 11) * 0x1.0p-53;
    const int32_t next = sample_token(logits.f32(), V, options.temperature,
                                      options.top_k, uniform);
    tokens.push_back(next);
    if (on_token) on_token(next);
    if (next == options.stop_token) break;
  }
  return tokens;
}

}  // namespace cputrain
