// What the model tests share for adapters: B drawn away from its zero start, as training leaves
// it, so that the adapters change what the model computes and every A has a gradient.
#pragma once

#include <random>
#include <vector>

#include "engine/train/parameters.h"

namespace cputrain::test {

// Every ".lora_b" of `p` drawn from Normal(0, 0.05) by `rng`, in the order of the parameters.
inline void draw_adapter_b(const ParameterSet& p, std::mt19937& rng) {
  std::normal_distribution<float> normal(0.0f, 0.05f);
  for (size_t i = 0; i < p.infos().size(); ++i) {
    if (!p.infos()[i].name.ends_with(".lora_b")) continue;
    std::vector<float> b(static_cast<size_t>(p.infos()[i].shape.numel()));
    for (float& v : b) v = normal(rng);
    p.write_values(static_cast<int>(i), b.data());
  }
}

}  // namespace cputrain::test
