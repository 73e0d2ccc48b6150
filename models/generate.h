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

// Extends each of `prompts` (non-empty, all of one length) by up to max_new_tokens tokens, the
// sequences decoded together: each step is one pass of the sequences still going, each of its
// projections one GEMM over their rows (DecoderModel::decode of a batch). Sequence i draws with
// its own generator, seeded options.seed + i: it is what generate() gives of prompts[i] with that
// seed, token for token where the logits of its row in the batch and alone pick the same token
// (at temperature 0, unless two logits tie within the GEMMs' rounding). A sequence ends after
// stop_token, or where on_token(i, token), called with each new token as it is chosen, returns
// false (a stop string); the others go on without it. Prompts all alike are run through the model
// once, their cache copied for each sequence. The context as generate()'s, for every sequence at
// once.
std::vector<std::vector<int32_t>> generate_batch(
    DecoderModel& model, const std::vector<std::vector<int32_t>>& prompts,
    const SampleOptions& options, const std::function<bool(size_t, int32_t)>& on_token = nullptr);

// Picks a token from logits (V): softmax(logits / temperature) restricted to the top_k most
// likely, then to the fewest of those whose probabilities (renormalised over them) sum to at
// least top_p, drawn with `uniform` in [0, 1). Temperature 0 picks the most likely token.
int32_t sample_token(const float* logits, int64_t V, float temperature, int64_t top_k, float top_p,
                     double uniform);

}  // namespace cputrain
