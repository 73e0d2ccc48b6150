// Autoregressive sampling from a DecoderModel.
#pragma once

#include <cstdint>
#include <functional>
#include <vector>

#include "models/decoder.h"

namespace cputrain {

struct SampleOptions {
  int64_t max_new_tokens = 100;
  float temperature = 0.8f;  // 0 picks the most likely token
  int64_t top_k = 40;        // 0 keeps the whole vocabulary
  float top_p = 1.0f;        // nucleus: the fewest most likely tokens whose probability >= top_p
  uint64_t seed = 1;
  int32_t stop_token = -1;  // generation ends after emitting it (-1: never)
};

// Extends `prompt` (non-empty) by up to max_new_tokens tokens with a KV cache (each token costs
// one pass over the cached positions). The context is the prompt's last ctx tokens, then every
// token since; when it reaches ctx tokens it restarts from the last ctx / 2, so the model always
// sees between ctx / 2 and ctx tokens. on_token, when set, is called with each new token as it
// is chosen.
std::vector<int32_t> generate(DecoderModel& model, const std::vector<int32_t>& prompt,
                              const SampleOptions& options,
                              const std::function<void(int32_t)>& on_token = nullptr);

// Picks a token from logits (V): softmax(logits / temperature) restricted to the top_k most
// likely, then to the fewest of those whose probabilities (renormalised over them) sum to at
// least top_p, drawn with `uniform` in [0, 1). Temperature 0 picks the most likely token.
int32_t sample_token(const float* logits, int64_t V, float temperature, int64_t top_k, float top_p,
                     double uniform);

}  // namespace cputrain
