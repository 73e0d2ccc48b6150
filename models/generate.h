// Autoregressive sampling from a LlamaModel.
#pragma once

#include <cstdint>
#include <functional>
#include <vector>

#include "models/llama.h"

namespace cputrain {

struct SampleOptions {
  int64_t max_new_tokens = 100;
  float temperature = 0.8f;  // 0 picks the most likely token
  int64_t top_k = 40;        // 0 keeps the whole vocabulary
  uint64_t seed = 1;
  int32_t stop_token = -1;   // generation ends after emitting it (-1: never)
};

// Extends `prompt` (non-empty) by up to max_new_tokens tokens; the context is the last ctx
// tokens. on_token, when set, is called with each new token as it is chosen.
std::vector<int32_t> generate(LlamaModel& model, const std::vector<int32_t>& prompt,
                              const SampleOptions& options,
                              const std::function<void(int32_t)>& on_token = nullptr);

// Picks a token from logits (V): softmax(logits / temperature) restricted to the top_k most
// likely, drawn with `uniform` in [0, 1).
int32_t sample_token(const float* logits, int64_t V, float temperature, int64_t top_k,
                     double uniform);

}  // namespace cputrain
