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
  std::function<bool(size_t, int32_t)> each;
  if (on_token)
    each = [&on_token](size_t, int32_t token) {
      on_token(token);
      return true;
    };
  return generate_batch(model, {prompt}, options, each)[0];
}

std::vector<std::vector<int32_t>> generate_batch(
    DecoderModel& model, const std::vector<std::vector<int32_t>>& prompts,
    const SampleOptions& options, const std::function<bool(size_t, int32_t)>& on_token) {
  if (prompts.empty() || prompts[0].empty())
    throw std::invalid_argument("generate: no prompt, or an empty one");
  for (const std::vector<int32_t>& p : prompts)
    if (p.size() != prompts[0].size())
      throw std::invalid_argument("generate_batch: prompts of one length");
  const int64_t ctx = model.config().ctx;
  const int64_t V = model.config().vocab;
  const auto B = static_cast<int64_t>(prompts.size());
  std::vector<std::mt19937_64> rngs;
  for (int64_t i = 0; i < B; ++i) rngs.emplace_back(options.seed + static_cast<uint64_t>(i));
  std::vector<std::vector<int32_t>> out = prompts;
  if (options.max_new_tokens <= 0) return out;
  // The sequences still going, by index into `out`; the cache holds them in this order.
  std::vector<int64_t> active(static_cast<size_t>(B));
  std::iota(active.begin(), active.end(), 0);
  DecoderModel::KvCache cache;
  // Fills a fresh cache with each going sequence's last `keep` tokens.
  const auto restart = [&](int64_t keep) {
    cache = model.new_kv_cache(static_cast<int64_t>(active.size()));
    std::vector<int32_t> tokens;
    for (const int64_t i : active) {
      const std::vector<int32_t>& t = out[static_cast<size_t>(i)];
      tokens.insert(tokens.end(), t.end() - keep, t.end());
    }
    return model.decode(tokens, cache);
  };
  const int64_t first = std::min<int64_t>(static_cast<int64_t>(prompts[0].size()), ctx);
  Tensor logits;
  if (B > 1 && std::all_of(prompts.begin(), prompts.end(),
                           [&](const std::vector<int32_t>& p) { return p == prompts[0]; })) {
    DecoderModel::KvCache one = model.new_kv_cache();
    const Tensor l =
        model.decode(std::vector<int32_t>(prompts[0].end() - first, prompts[0].end()), one);
    cache = model.repeat_kv_cache(one, B);
    logits = Tensor::empty(Shape{B, V}, DType::F32, MemoryCategory::Workspace);
    for (int64_t i = 0; i < B; ++i) std::copy_n(l.f32(), V, logits.f32() + i * V);
  } else {
    logits = restart(first);
  }
  for (int64_t n = 0; n < options.max_new_tokens; ++n) {
    std::vector<int64_t> going, rows;
    std::vector<int32_t> next;
    for (size_t j = 0; j < active.size(); ++j) {
      const auto i = static_cast<size_t>(active[j]);
      const double uniform = static_cast<double>(rngs[i]() >> 11) * 0x1.0p-53;
      const int32_t token =
          sample_token(logits.f32() + static_cast<int64_t>(j) * V, V, options.temperature,
                       options.top_k, options.top_p, uniform);
      out[i].push_back(token);
      bool goes = token != options.stop_token && n + 1 < options.max_new_tokens;
      if (on_token && !on_token(i, token)) goes = false;
      if (!goes) continue;
      going.push_back(active[j]);
      rows.push_back(static_cast<int64_t>(j));
      next.push_back(token);
    }
    if (going.empty()) break;
    if (going.size() < active.size()) DecoderModel::keep_sequences(cache, rows);
    active = std::move(going);
    logits =
        cache.length < ctx ? model.decode(next, cache) : restart(std::max<int64_t>(1, ctx / 2));
  }
  return out;
}

}  // namespace cputrain
