// The decoder's presets, parameter count, initialisation, gradient-accumulation equivalence,
// LoRA adapters and sampling.
#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <random>
#include <set>
#include <tuple>
#include <utility>
#include <vector>

#include "adapter_test_util.h"
#include "engine/core/memory.h"
#include "engine/core/moe_ops.h"
#include "engine/core/profiler.h"
#include "engine/train/adamw.h"
#include "engine/train/trainer.h"
#include "kernels/attention/attention.h"
#include "kernels/gemm/gemm.h"
#include "models/decoder.h"
#include "models/generate.h"
#include "models/model_config.h"
#include "tiny_architectures.h"

namespace cputrain {
namespace {

// The parameters the model declares, counted from their shapes.
int64_t declared_count(const ModelConfig& c) {
  ParameterSet params;
  DecoderModel::declare_parameters(c, params);
  int64_t total = 0;
  for (const ParameterInfo& info : params.infos()) total += info.shape.numel();
  return total;
}

TEST(Presets, TableAndParameterCounts) {
  const std::vector<std::string> names = preset_names();
  EXPECT_EQ(names, (std::vector<std::string>{"tiny", "mini", "mega", "behemoth", "titan"}));
  for (const std::string& name : names) {
    const Preset p = *find_preset(name);
    EXPECT_EQ(parameter_count(p.config), declared_count(p.config)) << name;
    EXPECT_FALSE(validate(p.config).has_value()) << name;
    EXPECT_EQ(p.config.d_model % p.config.n_heads, 0) << name;
  }
  EXPECT_FALSE(find_preset("gigantic").has_value());
  // The other shapes: grouped-query and multi-query, a head dim of its own, biases, tied.
  ModelConfig c = find_preset("mini")->config;
  c.n_kv_heads = 2;
  c.head_dim = 48;
  c.qkv_bias = true;
  EXPECT_EQ(parameter_count(c), declared_count(c));
  c.n_kv_heads = 1;
  c.tie_embeddings = true;
  EXPECT_EQ(parameter_count(c), declared_count(c));
  // The sizes DESIGN.md quotes for a 16384 vocabulary.
  EXPECT_NEAR(parameter_count(find_preset("mega")->config) / 1e6, 99, 1);
  EXPECT_NEAR(parameter_count(find_preset("behemoth")->config) / 1e6, 444, 2);
  EXPECT_NEAR(parameter_count(find_preset("titan")->config) / 1e9, 1.41, 0.01);
}

TEST(Presets, ValidateRejectsInconsistentShapes) {
  const auto problem = [](void (*change)(ModelConfig&)) {
    ModelConfig c = find_preset("tiny")->config;
    change(c);
    const auto p = validate(c);
    return p ? p->str() : std::string();
  };
  // 64 is not divisible by 5.
  EXPECT_EQ(problem([](ModelConfig& c) { c.n_heads = 5; }),
            "d_model 64 is not a multiple of n_heads 5");
  // Head dim 15 is odd: RoPE rotates pairs.
  EXPECT_EQ(problem([](ModelConfig& c) { c.d_model = 60; }), "head_dim 15 must be even for RoPE");
  EXPECT_EQ(problem([](ModelConfig& c) { c.n_kv_heads = 3; }),
            "n_heads 4 is not a multiple of n_kv_heads 3");
  EXPECT_EQ(problem([](ModelConfig& c) { c.head_dim = 7; }), "head_dim 7 must be even for RoPE");
  EXPECT_EQ(problem([](ModelConfig& c) { c.vocab = 0; }), "vocab 0 must be positive");
  EXPECT_EQ(problem([](ModelConfig& c) { c.rope_theta = 0.5; }),
            "rope_theta 0.5 must be a number above 1");
  // An explicit head dim need not divide the width, and GQA and MQA are valid.
  EXPECT_EQ(problem([](ModelConfig& c) {
              c.head_dim = 24;
              c.n_kv_heads = 2;
            }),
            "");
  EXPECT_EQ(problem([](ModelConfig& c) { c.n_kv_heads = 1; }), "");
}

TEST(DecoderModel, ParameterSetMatchesCountAndNames) {
  const ModelConfig c = find_preset("mini")->config;
  DecoderModel model(c);
  int64_t total = 0;
  std::set<std::string> names;
  for (const ParameterInfo& info : model.parameters().infos()) {
    total += info.shape.numel();
    EXPECT_TRUE(names.insert(info.name).second) << info.name;
    EXPECT_EQ(info.decay, info.shape.ndim() == 2) << info.name;
  }
  EXPECT_EQ(total, parameter_count(c));
  EXPECT_EQ(names.count("layers.5.feed_forward.w2.weight"), 1u);
}

TEST(DecoderModel, InitIsSeededWithTheDesignedScales) {
  ModelConfig c = find_preset("tiny")->config;
  c.n_layers = 8;
  DecoderModel a(c), b(c), other(c);
  a.init_weights(7);
  b.init_weights(7);
  other.init_weights(8);
  const ParameterSet& p = a.parameters();
  const int64_t n = p.weights().numel();
  EXPECT_TRUE(std::equal(p.weights().f32(), p.weights().f32() + n, b.parameters().weights().f32()));
  EXPECT_FALSE(
      std::equal(p.weights().f32(), p.weights().f32() + n, other.parameters().weights().f32()));
  for (const ParameterInfo& info : p.infos()) {
    const float* w = p.weights().f32() + info.offset;
    const int64_t m = info.shape.numel();
    if (info.shape.ndim() == 1) {
      for (int64_t i = 0; i < m; ++i) ASSERT_EQ(w[i], 1.0f) << info.name;
      continue;
    }
    double sum = 0.0, sq = 0.0;
    for (int64_t i = 0; i < m; ++i) sum += w[i], sq += static_cast<double>(w[i]) * w[i];
    const double mean = sum / m, stddev = std::sqrt(sq / m - mean * mean);
    const bool residual = info.name.ends_with("wo.weight") || info.name.ends_with("w2.weight");
    const double want = residual ? 0.02 / std::sqrt(2.0 * c.n_layers) : 0.02;
    EXPECT_NEAR(stddev, want, 0.06 * want) << info.name;  // >= 4096 samples each
    EXPECT_NEAR(mean, 0.0, 0.1 * want) << info.name;
  }
}

Tensor random_tokens(int64_t B, int64_t T, int64_t V, uint32_t seed) {
  Tensor t = Tensor::empty(Shape{B, T}, DType::I32, MemoryCategory::Workspace);
  std::mt19937 rng(seed);
  for (int64_t i = 0; i < B * T; ++i) t.i32()[i] = static_cast<int32_t>(rng() % V);
  return t;
}

// The gradient of `model`'s loss on x, y at the largest element of each parameter `which`
// takes, against central differences of the FP32 loss at steps of h; how many were checked.
// Also that the parameters declared are parameter_count's.
int expect_central_differences(DecoderModel& model, const Tensor& x, const Tensor& y, float h,
                               const std::function<bool(const std::string&)>& which) {
  ParameterSet& p = model.parameters();
  int64_t declared = 0;
  for (const ParameterInfo& info : p.infos()) declared += info.shape.numel();
  EXPECT_EQ(declared, parameter_count(model.config()));
  const auto loss_now = [&] {
    NoGradGuard no_grad;
    return static_cast<double>(model.loss(x, y).value().f32()[0]);
  };
  p.zero_grad();
  backward(model.loss(x, y));
  int checked = 0;
  for (const ParameterInfo& info : p.infos()) {
    if (!which(info.name)) continue;
    const float* g = p.gradients().f32() + info.grad_offset;
    int64_t at = 0;
    for (int64_t i = 0; i < info.shape.numel(); ++i)
      if (std::abs(g[i]) > std::abs(g[at])) at = i;
    float* w = p.weights().f32() + info.offset + at;
    const float keep = *w;
    *w = keep + h;
    const double up = loss_now();
    *w = keep - h;
    const double down = loss_now();
    *w = keep;
    const double difference = (up - down) / (2.0 * h);
    EXPECT_NEAR(g[at], difference, 3e-2 * std::abs(g[at]) + 1e-4) << info.name;
    ++checked;
  }
  return checked;
}

// Gemma 4's q and k norms' gains at 0.3 in every layer, so that its unscaled scores (heads of 8
// and 16) stay where a step of 5e-3 is within the softmax's linear range.
void set_gemma4_qk_gains(ParameterSet& p, const ModelConfig& c) {
  for (int64_t l = 0; l < c.n_layers; ++l)
    for (const char* norm : {"attention.q_norm.weight", "attention.k_norm.weight"}) {
      const int i = p.find("layers." + std::to_string(l) + "." + norm);
      if (i < 0) continue;
      std::vector<float> gains(static_cast<size_t>(p.infos()[static_cast<size_t>(i)].shape.numel()),
                               0.3f);
      p.write_values(i, gains.data());
    }
}

// Qwen3.5's layers (three Gated DeltaNet, one attention with its output gate): the gradient of
// every parameter, by the element of its largest, against central differences of the FP32 loss,
// over a sequence of 40 (the delta rule's chunks of 64 cross no edge; the kernels' tests cross
// them); and the parameter count declared is parameter_count's.
TEST(DecoderModel, Qwen35GradientsMatchCentralDifferences) {
  const ModelConfig c = test::tiny_as("qwen35");
  ASSERT_EQ(c.linear_layers, (std::vector<int64_t>{0, 1, 2}));
  DecoderModel model(c);
  model.init_weights(3);
  const Tensor x = random_tokens(2, 40, c.vocab, 1), y = random_tokens(2, 40, c.vocab, 2);
  const int checked = expect_central_differences(
      model, x, y, 2e-2f, [](const std::string& name) { return name.starts_with("layers."); });
  EXPECT_GE(checked, 3 * 17 + 14);  // every parameter of the four layers
}

// Gemma 4's parts (tiny_as: per-layer embeddings, layers sharing keys and values, two head
// sizes, v norms, output scales, a soft-cap): every parameter's gradient against central
// differences, and with each checkpointing level, in fp32 and bf16, the same loss, and the same
// gradients (to the bit with the MLP level).
TEST(DecoderModel, Gemma4GradientsMatchCentralDifferencesAndCheckpointingIsExact) {
  const ModelConfig c = test::tiny_as("gemma4");
  ASSERT_EQ(c.kv_layer(4), 2);
  ASSERT_EQ(c.kv_layer(5), 3);
  DecoderModel model(c);
  model.init_weights(3);
  ParameterSet& p = model.parameters();
  // Output scales away from 1.
  set_gemma4_qk_gains(p, c);
  for (int64_t l = 0; l < c.n_layers; ++l) {
    const float s = 0.7f + 0.1f * static_cast<float>(l);
    p.write_values(p.find("layers." + std::to_string(l) + ".layer_scale.weight"), &s);
  }
  const Tensor x = random_tokens(2, 40, c.vocab, 1), y = random_tokens(2, 40, c.vocab, 2);
  const int checked = expect_central_differences(
      model, x, y, 5e-3f, [](const std::string& name) { return name != "tok_embeddings.weight"; });
  EXPECT_EQ(checked, static_cast<int>(p.infos().size()) - 1);
  for (const DType dtype : {DType::F32, DType::BF16}) {
    DecoderModel none(c), layer(c), mlp(c);
    std::vector<float> values;
    for (DecoderModel* m : {&none, &layer, &mlp}) {
      for (size_t i = 0; i < p.infos().size(); ++i) {
        values.resize(static_cast<size_t>(p.infos()[i].shape.numel()));
        p.read_values(static_cast<int>(i), values.data());
        m->parameters().write_values(static_cast<int>(i), values.data());
      }
      m->set_compute_dtype(dtype);
    }
    layer.set_checkpointing(Checkpointing::Layer);
    mlp.set_checkpointing(Checkpointing::Mlp);
    std::vector<float> losses;
    for (DecoderModel* m : {&none, &layer, &mlp}) {
      m->parameters().zero_grad();
      Variable loss = m->loss(x, y);
      losses.push_back(loss.value().f32()[0]);
      backward(loss);
    }
    EXPECT_EQ(losses[0], losses[1]);
    EXPECT_EQ(losses[0], losses[2]);
    const int64_t n = none.parameters().trainable_numel();
    // The MLP level to the bit. Per layer, an input that more than one layer reads (the
    // embedding, which the per-layer inputs project; a shared-KV source's input) sums its
    // gradient's terms in another order: within float rounding of the largest in fp32, and in
    // bf16 within 2^-7 of the largest, one bf16 rounding: a sum in another order that rounds a
    // product's bf16 input to the next value feeds every product after it (seen: 1e-8 of the
    // largest on the AVX-512 kernels, 6e-4 under the reference GEMM, 2.7e-3 under AVX2 and
    // Eigen).
    for (int64_t i = 0; i < n; ++i)
      ASSERT_EQ(none.parameters().gradients().f32()[i], mlp.parameters().gradients().f32()[i])
          << dtype_name(dtype) << " " << i;
    double worst = 0.0, largest = 0.0;
    for (int64_t i = 0; i < n; ++i) {
      const double a = none.parameters().gradients().f32()[i];
      worst = std::max(worst, std::abs(a - layer.parameters().gradients().f32()[i]));
      largest = std::max(largest, std::abs(a));
    }
    EXPECT_LT(worst, (dtype == DType::F32 ? 1e-5 : 0x1p-7) * largest) << dtype_name(dtype);
  }
}

// Gemma 4 26B-A4B's and 31B's parts on the tiny Gemma 4: GELU experts beside each dense MLP
// (the router on the residual through its scale, each expert's output scaled away from 1),
// global layers taking k as v. Every gradient matches central differences, the router's scale
// and the experts' output scales included; a layer-checkpointed pass gives the same loss. Every
// token takes every expert, so that no step of a weight changes a token's choice (a jump in the
// loss); the choice of some is the MoE kernels' tests' and llama.cpp's comparison's.
TEST(DecoderModel, Gemma4ExpertsBesideTheMlpMatchCentralDifferences) {
  ModelConfig c = test::tiny_gemma4_experts();
  c.experts_used = 4;
  ASSERT_FALSE(validate(c).has_value());
  DecoderModel model(c);
  model.init_weights(5);
  ParameterSet& p = model.parameters();
  EXPECT_LT(p.find("layers.1.attention.wv.weight"), 0);
  EXPECT_GE(p.find("layers.2.attention.wv.weight"), 0);
  set_gemma4_qk_gains(p, c);
  const std::vector<float> scales{0.6f, 0.9f, 1.2f, 1.5f};
  for (int64_t l = 0; l < c.n_layers; ++l)
    p.write_values(p.find("layers." + std::to_string(l) + ".feed_forward.expert_scale.weight"),
                   scales.data());
  const Tensor x = random_tokens(2, 40, c.vocab, 3), y = random_tokens(2, 40, c.vocab, 4);
  const int checked = expect_central_differences(
      model, x, y, 5e-3f, [](const std::string& name) { return name != "tok_embeddings.weight"; });
  EXPECT_EQ(checked, static_cast<int>(p.infos().size()) - 1);
  DecoderModel layer(c);
  std::vector<float> values;
  for (size_t i = 0; i < p.infos().size(); ++i) {
    values.resize(static_cast<size_t>(p.infos()[i].shape.numel()));
    p.read_values(static_cast<int>(i), values.data());
    layer.parameters().write_values(static_cast<int>(i), values.data());
  }
  layer.set_checkpointing(Checkpointing::Layer);
  NoGradGuard no_grad;
  EXPECT_EQ(model.loss(x, y).value().f32()[0], layer.loss(x, y).value().f32()[0]);
}

TEST(DecoderModel, InitialLossIsNearUniform) {
  const ModelConfig c = find_preset("tiny")->config;
  DecoderModel model(c);
  model.init_weights(1);
  const Tensor x = random_tokens(2, 16, c.vocab, 1), y = random_tokens(2, 16, c.vocab, 2);
  NoGradGuard no_grad;
  const float loss = model.loss(x, y).value().f32()[0];
  EXPECT_NEAR(loss, std::log(static_cast<double>(c.vocab)), 0.1);
}

int64_t live_bytes(MemoryCategory c) {
  return memory_stats().live_bytes[static_cast<int>(c)];
}

// bf16 mode against fp32 from the same init: the loss and every gradient within bf16
// rounding, the GEMM weights (not the embedding) with bf16 copies, and the activations the
// tape holds smaller by exactly half of what the blocks save.
TEST(DecoderModel, Bf16TracksFp32AndSavesHalfTheBlockActivations) {
  const ModelConfig c = find_preset("tiny")->config;
  const int64_t B = 2, T = 24;
  const Tensor x = random_tokens(B, T, c.vocab, 5), y = random_tokens(B, T, c.vocab, 6);
  DecoderModel f32(c), bf16(c);
  f32.init_weights(3);
  bf16.init_weights(3);
  const int64_t copies_before = live_bytes(MemoryCategory::Bf16Weights);
  bf16.set_compute_dtype(DType::BF16);
  int64_t matrix_elems = 0;
  for (const ParameterInfo& info : bf16.parameters().infos()) {
    EXPECT_EQ(info.bf16_offset >= 0, info.shape.ndim() == 2 && info.name != "tok_embeddings.weight")
        << info.name;
    if (info.bf16_offset >= 0) matrix_elems += info.shape.numel();
  }
  EXPECT_EQ(live_bytes(MemoryCategory::Bf16Weights) - copies_before, matrix_elems * 2);

  auto forward = [&](DecoderModel& m, int64_t* held) {
    const int64_t before = live_bytes(MemoryCategory::Activations);
    Variable loss = m.loss(x, y);
    *held = live_bytes(MemoryCategory::Activations) - before;
    m.parameters().zero_grad();
    backward(loss);
    return static_cast<double>(loss.value().f32()[0]);
  };
  int64_t held_f32 = 0, held_bf16 = 0;
  const double loss_f32 = forward(f32, &held_f32);
  const double loss_bf16 = forward(bf16, &held_bf16);
  EXPECT_NEAR(loss_bf16, loss_f32, 1e-2);
  EXPECT_NE(loss_bf16, loss_f32);
  // Per token and layer the blocks save x, h, q, k, v, the attention output, a and g (8 C) and
  // gate, up and their product (3 F); then the final norm's input and the head's input (2 C);
  // and the LM head keeps the loss's gradient by the logits (V).
  const int64_t saved_elems =
      B * T * (c.n_layers * (8 * c.d_model + 3 * c.ffn) + 2 * c.d_model + c.vocab);
  EXPECT_EQ(held_f32 - held_bf16, saved_elems * 2);

  for (const ParameterInfo& info : f32.parameters().infos()) {
    const float* g32 = f32.parameters().gradients().f32() + info.offset;
    const float* g16 = bf16.parameters().gradients().f32() + info.offset;
    double num = 0.0, den = 0.0;
    for (int64_t i = 0; i < info.shape.numel(); ++i) {
      num += (static_cast<double>(g16[i]) - g32[i]) * (static_cast<double>(g16[i]) - g32[i]);
      den += static_cast<double>(g32[i]) * g32[i];
    }
    EXPECT_LT(std::sqrt(num / den), 0.03) << info.name;
  }
}

// Everything frozen but the attention projections (and, with biases, theirs): those get bitwise
// the gradients of the all-trainable model; nothing else gets a gradient, and the allocator holds
// gradients and AdamW state for the trainable ones alone. Built for bf16, the frozen GEMM
// weights (and a tied embedding) live as bf16 alone: no FP32 master.
class FrozenParameters : public ::testing::TestWithParam<std::tuple<DType, bool>> {};

TEST_P(FrozenParameters, TrainableOnesGetTheAllTrainableGradientsAndFrozenOnesNoMemory) {
  const auto [dtype, shaped] = GetParam();
  ModelConfig c = find_preset("tiny")->config;
  if (shaped) {
    c.n_kv_heads = 2;
    c.head_dim = 24;
    c.qkv_bias = true;
    c.tie_embeddings = true;
    c.rope_pairs = RopePairs::HalfSplit;
  }
  const auto trainable = [](const std::string& name) {
    return name.find(".attention.w") != std::string::npos;
  };
  const Tensor x = random_tokens(2, 24, c.vocab, 9), y = random_tokens(2, 24, c.vocab, 10);
  ModelOptions all_options, frozen_options;
  all_options.compute_dtype = frozen_options.compute_dtype = dtype;
  frozen_options.trainable = trainable;
  DecoderModel all(c, all_options);
  const MemoryStats before = memory_stats();
  DecoderModel part(c, frozen_options);
  const MemoryStats built = memory_stats();
  part.init_weights(5);
  // The same values in both: where part holds a weight as bf16 alone, all holds its rounding.
  std::vector<float> values;
  for (size_t i = 0; i < part.parameters().infos().size(); ++i) {
    values.resize(static_cast<size_t>(part.parameters().infos()[i].shape.numel()));
    part.parameters().read_values(static_cast<int>(i), values.data());
    all.parameters().write_values(static_cast<int>(i), values.data());
  }

  int64_t trainable_bytes = 0, master_bytes = 0, copy_bytes = 0;
  for (const ParameterInfo& info : part.parameters().infos()) {
    const int64_t n = info.shape.numel();
    EXPECT_EQ(info.trainable, trainable(info.name)) << info.name;
    if (info.trainable) trainable_bytes += (n + 15) / 16 * 16 * 4;
    const bool master = info.trainable || dtype == DType::F32 || !info.bf16_copy;
    EXPECT_EQ(info.offset >= 0, master) << info.name;
    if (master) master_bytes += (n + 15) / 16 * 16 * 4;
    if (dtype == DType::BF16 && info.bf16_copy) copy_bytes += (n + 31) / 32 * 32 * 2;
  }
  const auto grew = [&](MemoryCategory category, const MemoryStats& from, const MemoryStats& to) {
    const int i = static_cast<int>(category);
    return to.live_bytes[i] - from.live_bytes[i];
  };
  EXPECT_EQ(grew(MemoryCategory::Gradients, before, built), trainable_bytes);
  EXPECT_EQ(grew(MemoryCategory::Weights, before, built), master_bytes);
  EXPECT_EQ(grew(MemoryCategory::Bf16Weights, before, built), copy_bytes);
  {
    const MemoryStats start = memory_stats();
    AdamW optimizer(part.parameters(), AdamWConfig{});
    EXPECT_EQ(grew(MemoryCategory::OptimizerState, start, memory_stats()), 2 * trainable_bytes);
  }

  for (DecoderModel* m : {&all, &part}) {
    m->parameters().zero_grad();
    Variable loss = m->loss(x, y);
    backward(loss);
  }
  const ParameterSet& a = all.parameters();
  const ParameterSet& p = part.parameters();
  for (size_t i = 0; i < p.infos().size(); ++i) {
    const ParameterInfo& info = p.infos()[i];
    EXPECT_EQ(p.var(static_cast<int>(i)).requires_grad(), info.trainable) << info.name;
    if (!info.trainable) continue;
    const float* ga = a.gradients().f32() + a.infos()[i].grad_offset;
    const float* gp = p.gradients().f32() + info.grad_offset;
    bool any = false;
    for (int64_t e = 0; e < info.shape.numel(); ++e) {
      ASSERT_EQ(ga[e], gp[e]) << info.name << " element " << e;
      any = any || ga[e] != 0.0f;
    }
    EXPECT_TRUE(any) << info.name << " got no gradient";
  }
  // An AdamW step moves the trainable parameters only.
  std::vector<float> frozen_before(static_cast<size_t>(c.vocab * c.d_model)), frozen_after;
  p.read_values(0, frozen_before.data());
  AdamW optimizer(part.parameters(), AdamWConfig{});
  optimizer.step(1e-2f);
  frozen_after.resize(frozen_before.size());
  p.read_values(0, frozen_after.data());
  EXPECT_EQ(frozen_after, frozen_before);
}

INSTANTIATE_TEST_SUITE_P(Configurations, FrozenParameters,
                         ::testing::Combine(::testing::Values(DType::F32, DType::BF16),
                                            ::testing::Bool()),
                         [](const auto& info) {
                           return std::string(dtype_name(std::get<0>(info.param))) +
                                  (std::get<1>(info.param) ? "_gqa_tied_bias" : "_tiny");
                         });

// Per-layer and MLP checkpointing against none, in fp32 and in bf16: the same loss and gradients
// to the bit; of what each layer saved, per layer only its FP32 input is kept, and the MLP level
// keeps less than none and more than per layer.
class CheckpointLevels : public ::testing::TestWithParam<DType> {};

TEST_P(CheckpointLevels, GradientsAreBitwiseIdenticalAndOnlyBlockInputsAreKept) {
  const DType dtype = GetParam();
  ModelConfig c = find_preset("tiny")->config;
  c.n_layers = 3;
  // B T = 80 tokens: every tensor below fills whole 64-byte lines.
  const int64_t B = 4, T = 20, C = c.d_model, F = c.ffn, H = c.n_heads, L = c.n_layers;
  const Tensor x = random_tokens(B, T, c.vocab, 7), y = random_tokens(B, T, c.vocab, 8);
  DecoderModel full(c), ckpt(c), mlp(c);
  for (DecoderModel* m : {&full, &ckpt, &mlp}) {
    m->init_weights(4);
    m->set_compute_dtype(dtype);
  }
  ckpt.set_checkpointing(Checkpointing::Layer);
  mlp.set_checkpointing(Checkpointing::Mlp);
  auto run = [&](DecoderModel& m, int64_t* held) {
    m.parameters().zero_grad();
    const int64_t before = live_bytes(MemoryCategory::Activations);
    Variable loss = m.loss(x, y);
    *held = live_bytes(MemoryCategory::Activations) - before;
    backward(loss);
    return loss.value().f32()[0];
  };
  int64_t held_full = 0, held_ckpt = 0, held_mlp = 0;
  const float loss_full = run(full, &held_full);
  const float loss_ckpt = run(ckpt, &held_ckpt);
  const float loss_mlp = run(mlp, &held_mlp);
  EXPECT_EQ(loss_full, loss_ckpt);
  EXPECT_EQ(loss_full, loss_mlp);
  const ParameterSet& a = full.parameters();
  for (const DecoderModel* m : {&ckpt, &mlp}) {
    const ParameterSet& b = m->parameters();
    const std::string_view level = checkpointing_name(m->checkpointing());
    for (const ParameterInfo& info : a.infos()) {
      const float* ga = a.gradients().f32() + info.offset;
      const float* gb = b.gradients().f32() + info.offset;
      bool any = false;
      for (int64_t i = 0; i < info.shape.numel(); ++i) {
        ASSERT_EQ(ga[i], gb[i]) << level << " " << info.name << " element " << i;
        any = any || ga[i] != 0.0f;
      }
      EXPECT_TRUE(any) << level << " " << info.name << " got no gradient";
    }
  }
  EXPECT_LT(held_mlp, held_full);
  EXPECT_GT(held_mlp, held_ckpt);
  // Per token a layer saves 8 C + 3 F activations (bf16 or FP32), two reciprocal norms and H
  // log-sum-exps (FP32); checkpointed, it keeps its FP32 input, C floats.
  const int64_t bytes = dtype == DType::BF16 ? 2 : 4;
  const int64_t per_token_layer = (8 * C + 3 * F) * bytes + (2 + H) * 4;
  EXPECT_EQ(held_full - held_ckpt, L * B * T * (per_token_layer - C * 4));
}

INSTANTIATE_TEST_SUITE_P(Dtypes, CheckpointLevels, ::testing::Values(DType::F32, DType::BF16),
                         [](const auto& info) { return std::string(dtype_name(info.param)); });

// LoRA on the tiny shape with GQA and biases, all seven projections, rank 4.
LoraConfig lora_all(int64_t rank) {
  LoraConfig lora;
  lora.rank = rank;
  lora.alpha = 2.0 * static_cast<double>(rank);
  lora.targets.fill(true);
  return lora;
}

ModelConfig lora_shape() {
  ModelConfig c = find_preset("tiny")->config;
  c.n_layers = 2;
  c.n_kv_heads = 2;
  c.qkv_bias = true;
  return c;
}

// Copies the base's values into the same-named parameters of `to`.
void copy_base(const DecoderModel& from, DecoderModel& to) {
  const ParameterSet& f = from.parameters();
  const ParameterSet& t = to.parameters();
  for (size_t i = 0; i < f.infos().size(); ++i) {
    std::vector<float> values(static_cast<size_t>(f.infos()[i].shape.numel()));
    f.read_values(static_cast<int>(i), values.data());
    t.write_values(t.find(f.infos()[i].name), values.data());
  }
}

// A frozen base of shape c in `dtype`, and the same weights with adapters (rank 4, all seven
// projections) as PEFT begins them.
struct BaseAndAdapted {
  DecoderModel base, adapted;
  BaseAndAdapted(const ModelConfig& c, DType dtype)
      : base(c, options(dtype, false)), adapted(c, options(dtype, true)) {
    DecoderModel fp32(c);
    fp32.init_weights(5);
    copy_base(fp32, base);
    copy_base(fp32, adapted);
    adapted.init_adapters(6);
  }
  static ModelOptions options(DType dtype, bool lora) {
    ModelOptions o;
    o.compute_dtype = dtype;
    if (lora)
      o.lora = lora_all(4);
    else
      o.trainable = [](const std::string&) { return false; };
    return o;
  }
};

// Adapters as PEFT begins them (B zero) leave the model computing its base's logits, bit for bit,
// in fp32 and in bf16 (where the base is held as bf16 alone, frozen, with no FP32 master and no
// gradient); only the adapters are trainable.
TEST(Lora, BegunAdaptersComputeTheBaseExactly) {
  const ModelConfig c = lora_shape();
  const Tensor x = random_tokens(2, 16, c.vocab, 3);
  for (const DType dtype : {DType::F32, DType::BF16}) {
    BaseAndAdapted m(c, dtype);
    DecoderModel &base = m.base, &adapted = m.adapted;
    const Tensor a = base.logits(x), b = adapted.logits(x);
    for (int64_t i = 0; i < a.numel(); ++i)
      ASSERT_EQ(a.f32()[i], b.f32()[i]) << dtype_name(dtype) << " logit " << i;
    const ParameterSet& p = adapted.parameters();
    int64_t adapters = 0;
    for (size_t i = 0; i < p.infos().size(); ++i) {
      const ParameterInfo& info = p.infos()[i];
      EXPECT_EQ(info.trainable, is_lora_parameter(info.name)) << info.name;
      if (is_lora_parameter(info.name)) adapters += (info.shape.numel() + 15) / 16 * 16;
      if (dtype == DType::BF16 && info.bf16_copy && !info.trainable) {
        EXPECT_TRUE(p.bf16_only(static_cast<int>(i))) << info.name;
      }
    }
    EXPECT_EQ(p.trainable_numel(), adapters);
  }
}

// With its adapters switched off, a model with trained (non-zero) adapters scores every target
// of a packed batch as the model without adapters does, bit for bit, in fp32 and bf16: a
// preference loss's reference needs no second model. Switched on, the adapters change them.
TEST(Lora, AdaptersSwitchedOffScoreTargetsAsTheBase) {
  const ModelConfig c = lora_shape();
  const Tensor x = random_tokens(2, 16, c.vocab, 3), y = random_tokens(2, 16, c.vocab, 4);
  for (int64_t i = 0; i < y.numel(); i += 3) y.i32()[i] = -1;  // no target
  auto packing = std::make_shared<Packing>();
  packing->lengths = {{5, 11}, {16}};
  for (const DType dtype : {DType::F32, DType::BF16}) {
    BaseAndAdapted m(c, dtype);
    DecoderModel &base = m.base, &adapted = m.adapted;
    std::mt19937 rng(7);
    test::draw_adapter_b(adapted.parameters(), rng);
    NoGradGuard no_grad;
    const Tensor want = base.target_log_probs(x, y, packing).value();
    EXPECT_EQ(want.numel(), y.numel() - (y.numel() + 2) / 3);
    adapted.set_adapters_enabled(false);
    const Tensor off = adapted.target_log_probs(x, y, packing).value();
    adapted.set_adapters_enabled(true);
    const Tensor on = adapted.target_log_probs(x, y, packing).value();
    int64_t changed = 0;
    for (int64_t i = 0; i < want.numel(); ++i) {
      ASSERT_EQ(off.f32()[i], want.f32()[i]) << dtype_name(dtype) << " target " << i;
      changed += on.f32()[i] != want.f32()[i];
    }
    EXPECT_GT(changed, want.numel() / 2) << dtype_name(dtype);
  }
}

// The backward pass says where the gradients have become final, from the head down, for the
// data-parallel trainer to sum them meanwhile: at every call, each gradient from the offset on
// already has the value it ends the pass with; the offsets fall; after block 0 every gradient
// but the embedding's (tied: also the head's) is final. Plain, tied, LoRA and checkpointed.
TEST(DecoderModel, BackwardSaysWhereGradientsAreFinal) {
  struct Case {
    const char* name;
    bool tied, lora, checkpoint;
  };
  for (const Case& k :
       {Case{"plain", false, false, false}, Case{"tied", true, false, false},
        Case{"lora", false, true, false}, Case{"checkpointed", false, false, true}}) {
    ModelConfig c = lora_shape();
    c.n_layers = 3;
    c.tie_embeddings = k.tied;
    ModelOptions o;
    if (k.lora) o.lora = lora_all(4);
    DecoderModel model(c, o);
    model.init_weights(4);
    if (k.lora) model.init_adapters(5);
    model.set_checkpointing(k.checkpoint);
    const ParameterSet& p = model.parameters();
    const Tensor x = random_tokens(2, 16, c.vocab, 1), y = random_tokens(2, 16, c.vocab, 2);
    std::vector<std::pair<int64_t, std::vector<float>>> seen;
    p.zero_grad();
    p.set_gradient_watcher([&](int64_t offset) {
      const float* g = p.gradients().f32();
      seen.emplace_back(offset, std::vector<float>(g + offset, g + p.trainable_numel()));
    });
    backward(model.loss(x, y));
    p.set_gradient_watcher(nullptr);
    ASSERT_EQ(seen.size(), static_cast<size_t>(c.n_layers + 1)) << k.name;
    const float* final_grads = p.gradients().f32();
    for (size_t call = 0; call < seen.size(); ++call) {
      const auto& [offset, values] = seen[call];
      if (call > 0) {
        EXPECT_LT(offset, seen[call - 1].first) << k.name << " call " << call;
      }
      for (size_t i = 0; i < values.size(); ++i)
        ASSERT_EQ(values[i], final_grads[offset + static_cast<int64_t>(i)])
            << k.name << " call " << call << " element " << offset + static_cast<int64_t>(i);
    }
    // What block 0 leaves is the embedding's gradient alone (none where it is frozen).
    const ParameterInfo& embedding =
        p.infos()[static_cast<size_t>(p.find("tok_embeddings.weight"))];
    const int64_t below = embedding.trainable ? (embedding.shape.numel() + 15) / 16 * 16 : 0;
    EXPECT_EQ(seen.back().first, below) << k.name;
  }
}

// With B away from zero: bf16 adapter gradients track fp32's, and per-layer checkpointing gives
// them bit for bit.
TEST(Lora, Bf16TracksFp32AndCheckpointingIsExact) {
  const ModelConfig c = lora_shape();
  const Tensor x = random_tokens(2, 16, c.vocab, 7), y = random_tokens(2, 16, c.vocab, 8);
  DecoderModel reference(c);
  reference.init_weights(9);
  std::vector<std::vector<float>> grads;
  for (const auto& [dtype, checkpoint] :
       {std::pair{DType::F32, false}, std::pair{DType::BF16, false},
        std::pair{DType::BF16, true}}) {
    ModelOptions o;
    o.compute_dtype = dtype;
    o.lora = lora_all(4);
    DecoderModel m(c, o);
    copy_base(reference, m);
    m.init_adapters(10);
    std::mt19937 rng(11);
    const ParameterSet& p = m.parameters();
    test::draw_adapter_b(p, rng);
    m.set_checkpointing(checkpoint);
    backward(m.loss(x, y));
    grads.emplace_back(p.gradients().f32(), p.gradients().f32() + p.trainable_numel());
  }
  double diff = 0.0, scale = 0.0;
  for (size_t i = 0; i < grads[0].size(); ++i) {
    diff = std::max(diff, static_cast<double>(std::abs(grads[0][i] - grads[1][i])));
    scale = std::max(scale, static_cast<double>(std::abs(grads[0][i])));
  }
  EXPECT_GT(scale, 0.0);
  EXPECT_LT(diff / scale, 0.05);
  EXPECT_EQ(grads[1], grads[2]);
}

// Packed rows (fine-tuning): sequences of 5, 9 and 2 tokens in one row of 16, and one of 16 in
// another, give each sequence the logits it has alone (RoPE from position 0, attention within
// itself; a Gated DeltaNet layer's convolution and state from its start), in fp32 and bf16, with
// and without checkpointing; the loss over targets (some below 0: none) divided by a normalizer
// has the gradients of the sequences' losses so weighted.
class PackedRows : public ::testing::TestWithParam<const char*> {};

TEST_P(PackedRows, ComputeEachSequenceAlone) {
  ModelConfig c = lora_shape();
  c.rope_pairs = RopePairs::HalfSplit;
  if (std::string(GetParam()) != "llama") c = test::tiny_as(GetParam());
  const std::vector<std::vector<int64_t>> rows = {{5, 9, 2}, {16}};
  const int64_t T = 16;
  const Tensor x = random_tokens(2, T, c.vocab, 31), y = random_tokens(2, T, c.vocab, 32);
  // Some targets are none, as a prompt's are.
  for (const int64_t i : {0, 1, 2, 7, 20, 21}) y.i32()[i] = -1;
  auto packing = std::make_shared<Packing>();
  packing->lengths = rows;
  for (const DType dtype : {DType::F32, DType::BF16}) {
    DecoderModel m(c);
    m.init_weights(33);
    m.set_compute_dtype(dtype);
    const Tensor packed = m.logits(x, packing);
    const int64_t V = c.vocab;
    double worst = 0.0;
    for (size_t b = 0; b < rows.size(); ++b) {
      int64_t start = 0;
      for (const int64_t n : rows[b]) {
        Tensor alone = Tensor::empty(Shape{1, n}, DType::I32, MemoryCategory::Workspace);
        std::copy_n(x.i32() + static_cast<int64_t>(b) * T + start, n, alone.i32());
        const Tensor l = m.logits(alone);
        for (int64_t i = 0; i < n * V; ++i)
          worst = std::max(
              worst,
              static_cast<double>(std::abs(
                  l.f32()[i] - packed.f32()[(static_cast<int64_t>(b) * T + start) * V + i])));
        start += n;
      }
    }
    EXPECT_LT(worst, dtype == DType::F32 ? 1e-5 : 2e-2) << dtype_name(dtype);

    // Gradients: the packed loss over 40 against each sequence's summed loss over 40.
    const int64_t normalizer = 40;
    std::vector<float> want;
    {
      m.parameters().zero_grad();
      for (size_t b = 0; b < rows.size(); ++b) {
        int64_t start = 0;
        for (const int64_t n : rows[b]) {
          Tensor in = Tensor::empty(Shape{1, n}, DType::I32, MemoryCategory::Workspace);
          Tensor tg = Tensor::empty(Shape{1, n}, DType::I32, MemoryCategory::Workspace);
          std::copy_n(x.i32() + static_cast<int64_t>(b) * T + start, n, in.i32());
          std::copy_n(y.i32() + static_cast<int64_t>(b) * T + start, n, tg.i32());
          backward(m.loss(in, tg, nullptr, normalizer));
          start += n;
        }
      }
      const ParameterSet& p = m.parameters();
      want.assign(p.gradients().f32(), p.gradients().f32() + p.trainable_numel());
    }
    for (const bool checkpoint : {false, true}) {
      m.set_checkpointing(checkpoint);
      m.parameters().zero_grad();
      backward(m.loss(x, y, packing, normalizer));
      const ParameterSet& p = m.parameters();
      double diff = 0.0, scale = 0.0;
      for (size_t i = 0; i < want.size(); ++i) {
        diff = std::max(diff, static_cast<double>(std::abs(p.gradients().f32()[i] - want[i])));
        scale = std::max(scale, static_cast<double>(std::abs(want[i])));
      }
      EXPECT_GT(scale, 0.0);
      EXPECT_LT(diff / scale, dtype == DType::F32 ? 1e-4 : 5e-2)
          << dtype_name(dtype) << (checkpoint ? " checkpointed" : "");
    }
    m.set_checkpointing(false);
  }
}

INSTANTIATE_TEST_SUITE_P(Architectures, PackedRows, ::testing::Values("llama", "qwen35", "gemma4"));

// The LM head on the positions with a target alone (a prompt's and padding's have none) against
// the head on every position: the same loss and the same gradients bit for bit, LoRA adapters'
// and, training the whole model, every parameter's but the head's own weight, whose sum over the
// positions is grouped otherwise (to FP32 rounding there). fp32 and bf16, with and without
// checkpointing, 4 rows of 96 with half the positions no target. Bit for bit on cputrain's own
// GEMMs, whose rows do not depend on how many there are; Eigen and oneDNN choose their blocking
// of the inner dimension by the whole shape, and there every gradient agrees to FP32 rounding.
TEST(Packing, TheHeadOnTargetPositionsAloneIsExact) {
  const kernels::GemmBackend gemm = kernels::gemm_backend();
  const bool exact = gemm != kernels::GemmBackend::Eigen && gemm != kernels::GemmBackend::Onednn;
  ModelConfig c = lora_shape();
  c.ctx = 96;
  const int64_t B = 4, T = 96;
  const Tensor x = random_tokens(B, T, c.vocab, 41), y = random_tokens(B, T, c.vocab, 42);
  std::mt19937 rng(43);
  for (int64_t i = 0; i < B * T; ++i)
    if (rng() % 2 == 0) y.i32()[i] = -1;
  auto packing = std::make_shared<Packing>();
  packing->lengths = {{40, 56}, {96}, {10, 30, 50, 6}, {96}};
  DecoderModel reference(c);
  reference.init_weights(44);
  for (const DType dtype : {DType::F32, DType::BF16}) {
    for (const bool lora : {true, false}) {
      for (const bool checkpoint : {false, true}) {
        ModelOptions o;
        o.compute_dtype = dtype;
        if (lora) o.lora = lora_all(4);
        DecoderModel m(c, o);
        copy_base(reference, m);
        if (lora) m.init_adapters(45);
        m.set_checkpointing(checkpoint);
        const ParameterSet& p = m.parameters();
        // B away from zero, so that every adapter has a gradient.
        test::draw_adapter_b(p, rng);
        std::vector<float> losses;
        std::vector<std::vector<float>> grads;
        for (const bool every : {true, false}) {
          m.set_head_on_every_position(every);
          p.zero_grad();
          const Variable loss = m.loss(x, y, packing, 0);
          losses.push_back(loss.value().f32()[0]);
          backward(loss);
          grads.emplace_back(p.gradients().f32(), p.gradients().f32() + p.trainable_numel());
        }
        const std::string what = std::string(dtype_name(dtype)) + (lora ? " lora" : " full") +
                                 (checkpoint ? " checkpointed" : "");
        if (exact) {
          EXPECT_EQ(losses[0], losses[1]) << what;
        } else {
          EXPECT_NEAR(losses[0], losses[1], 1e-6 * std::abs(losses[0])) << what;
        }
        int64_t head_from = 0, head_to = 0;
        if (!lora) {
          const int head = p.find("output.weight");
          ASSERT_GE(head, 0);
          head_from = p.infos()[static_cast<size_t>(head)].grad_offset;
          head_to = head_from + p.infos()[static_cast<size_t>(head)].shape.numel();
        }
        double head_diff = 0.0, head_scale = 0.0, diff = 0.0, scale = 0.0;
        for (int64_t i = 0; i < static_cast<int64_t>(grads[0].size()); ++i) {
          const float a = grads[0][static_cast<size_t>(i)], b = grads[1][static_cast<size_t>(i)];
          if (i >= head_from && i < head_to) {
            head_diff = std::max(head_diff, static_cast<double>(std::abs(a - b)));
            head_scale = std::max(head_scale, static_cast<double>(std::abs(a)));
            continue;
          }
          if (exact) {
            ASSERT_EQ(a, b) << what << " gradient element " << i;
          }
          diff = std::max(diff, static_cast<double>(std::abs(a - b)));
          scale = std::max(scale, static_cast<double>(std::abs(a)));
        }
        EXPECT_LE(head_diff, 1e-5 * head_scale) << what;
        EXPECT_LE(diff, 1e-5 * scale) << what;
      }
    }
  }
}

// The same 8 sequences as 8x1, 4x2, 2x4 and 1x8 (micro-batch x accumulation), each
// micro-batch's loss scaled by 1/accum: the gradients of the whole batch, to FP32 rounding.
TEST(DecoderModel, GradientAccumulationEqualsTheFullBatch) {
  const ModelConfig c = find_preset("tiny")->config;
  DecoderModel model(c);
  model.init_weights(3);
  const int64_t B = 8, T = 24;
  const Tensor x = random_tokens(B, T, c.vocab, 3), y = random_tokens(B, T, c.vocab, 4);
  ParameterSet& p = model.parameters();
  const int64_t n = p.gradients().numel();
  auto gradients = [&](int64_t accum) {
    const int64_t micro = B / accum;
    p.zero_grad();
    for (int64_t m = 0; m < accum; ++m) {
      Tensor xm = Tensor::empty(Shape{micro, T}, DType::I32, MemoryCategory::Workspace);
      Tensor ym = Tensor::empty(Shape{micro, T}, DType::I32, MemoryCategory::Workspace);
      std::copy_n(x.i32() + m * micro * T, micro * T, xm.i32());
      std::copy_n(y.i32() + m * micro * T, micro * T, ym.i32());
      backward(model.loss(xm, ym), 1.0f / static_cast<float>(accum));
    }
    return std::vector<float>(p.gradients().f32(), p.gradients().f32() + n);
  };
  const std::vector<float> full = gradients(1);
  for (int64_t accum : {2, 4, 8}) {
    const std::vector<float> split = gradients(accum);
    // Per parameter, relative to its largest gradient.
    for (const ParameterInfo& info : p.infos()) {
      double max_diff = 0.0, max_ref = 0.0;
      for (int64_t i = info.offset; i < info.offset + info.shape.numel(); ++i) {
        max_diff = std::max(max_diff, std::abs(static_cast<double>(split[i]) - full[i]));
        max_ref = std::max(max_ref, std::abs(static_cast<double>(full[i])));
      }
      EXPECT_GT(max_ref, 0.0) << info.name;
      EXPECT_LT(max_diff / max_ref, 1e-6) << info.name << " at " << B / accum << "x" << accum;
    }
  }
}

// Training FLOPs per token: 6 x every matrix that multiplies activations (all 2-D parameters
// but the embedding table, which is a lookup) plus causal attention, 6 x layers x ctx x d.
TEST(ModelConfig, TrainingFlopsPerToken) {
  const ModelConfig c = find_preset("tiny")->config;
  DecoderModel model(c);
  double matrix_params = 0.0;
  for (const ParameterInfo& info : model.parameters().infos())
    if (info.shape.ndim() == 2 && info.name != "tok_embeddings.weight")
      matrix_params += static_cast<double>(info.shape.numel());
  const double attention = 6.0 * c.n_layers * 48 * c.d_model;
  EXPECT_DOUBLE_EQ(training_flops_per_token(c, 48), 6.0 * matrix_params + attention);
}

// A profiled forward and backward counts, in its GEMM scopes, exactly the matrix FLOPs that
// training_flops_per_token (MFU's numerator) counts per token, and in attention's forward the
// causal pairs: 2 products x 2 D FLOPs x T (T + 1) / 2 query-key pairs per head and sequence.
TEST(DecoderModel, ProfiledStepCountsTheFlopsMfuCounts) {
  const ModelConfig c = find_preset("tiny")->config;
  DecoderModel model(c);
  model.init_weights(1);
  const int64_t B = 2, T = 48;
  const Tensor x = random_tokens(B, T, c.vocab, 1), y = random_tokens(B, T, c.vocab, 2);
  profiler::reset();
  profiler::set_enabled(true);
  backward(model.loss(x, y));
  profiler::set_enabled(false);
  double gemm = 0.0, attention_forward = 0.0;
  int64_t linear_calls = 0;
  for (const profiler::Entry& e : profiler::entries()) {
    if (e.name.find("GEMM") != std::string::npos) gemm += e.flops;
    if (e.name == "attention" && e.pass == profiler::Pass::Forward) attention_forward = e.flops;
    if (e.name == "linear" && e.pass == profiler::Pass::Forward) linear_calls = e.calls;
  }
  profiler::reset();
  const double tokens = static_cast<double>(B * T);
  const double attention_mfu = 6.0 * c.n_layers * T * c.d_model;  // per token, T^2 / 2 pairs
  EXPECT_DOUBLE_EQ(gemm, (training_flops_per_token(c, T) - attention_mfu) * tokens);
  EXPECT_DOUBLE_EQ(attention_forward,
                   4.0 * c.n_layers * B * c.d_model * static_cast<double>(T * (T + 1)) / 2.0);
  EXPECT_EQ(linear_calls, 7 * c.n_layers);
}

// A mixture's expert load: each router's tokens counted once a forward pass, the same with the
// MLP in a checkpoint region (whose second forward in the backward pass is not counted), none
// in a pass no count is alive for; a training step's spread per layer from them.
TEST(DecoderModel, ExpertLoadIsCountedOnceAForwardPass) {
  const ModelConfig c = test::tiny_as("qwen3moe");
  const int64_t B = 2, T = 24;
  const Tensor x = random_tokens(B, T, c.vocab, 3), y = random_tokens(B, T, c.vocab, 4);
  std::vector<std::vector<std::vector<int64_t>>> counts;  // [pass][layer][expert]
  for (const Checkpointing checkpoint : {Checkpointing::None, Checkpointing::Layer}) {
    DecoderModel model(c);
    model.init_weights(1);
    model.set_checkpointing(checkpoint);
    moe_load_take();
    Variable loss;
    {
      const MoeLoadCount count;
      loss = model.loss(x, y);
    }
    backward(loss);
    counts.emplace_back();
    for (const MoeLoad& load : moe_load_take()) counts.back().push_back(load.tokens);
    {
      const NoGradGuard no_grad;
      model.loss(x, y);
    }
    EXPECT_TRUE(moe_load_take().empty()) << "a pass with no count alive";
  }
  ASSERT_EQ(static_cast<int64_t>(counts[0].size()), c.n_layers);
  for (const std::vector<int64_t>& load : counts[0]) {
    ASSERT_EQ(static_cast<int64_t>(load.size()), c.n_experts);
    int64_t sum = 0;
    for (const int64_t n : load) sum += n;
    EXPECT_EQ(sum, B * T * c.experts_used);
  }
  EXPECT_EQ(counts[0], counts[1]) << "a checkpoint region's recomputation counted";

  DecoderModel model(c);
  model.init_weights(1);
  TrainOptions options;
  options.batch = B;
  options.ctx = T;
  options.accum = 2;
  options.lr.total_steps = 1;
  Trainer trainer(
      model.parameters(),
      [&model](const Tensor& in, const Tensor& tgt) { return model.loss(in, tgt); }, options);
  std::vector<int32_t> tokens(4000);
  std::mt19937 rng(5);
  for (int32_t& t : tokens) t = static_cast<int32_t>(rng() % c.vocab);
  const StepResult r = trainer.step(tokens, 1);
  ASSERT_EQ(static_cast<int64_t>(r.expert_spread.size()), c.n_layers);
  for (const double spread : r.expert_spread) {
    EXPECT_GE(spread, 1.0);
    EXPECT_LE(spread, static_cast<double>(c.n_experts) / c.experts_used);
  }
}

TEST(Generate, GreedyIsDeterministicAndSamplingHonoursTopK) {
  const ModelConfig c = find_preset("tiny")->config;
  DecoderModel model(c);
  model.init_weights(5);
  SampleOptions greedy;
  greedy.temperature = 0.0f;
  greedy.max_new_tokens = 10;
  const std::vector<int32_t> a = generate(model, {1, 2, 3}, greedy);
  const std::vector<int32_t> b = generate(model, {1, 2, 3}, greedy);
  EXPECT_EQ(a, b);
  ASSERT_EQ(a.size(), 13u);
  EXPECT_EQ(std::vector<int32_t>(a.begin(), a.begin() + 3), (std::vector<int32_t>{1, 2, 3}));

  const std::vector<float> logits = {0.0f, 5.0f, 1.0f, 4.0f, -2.0f};
  EXPECT_EQ(sample_token(logits.data(), 5, 0.0f, 0, 1.0f, 0.5), 1);
  for (double u : {0.0, 0.3, 0.7, 0.999999}) {
    const int32_t t = sample_token(logits.data(), 5, 1.0f, 2, 1.0f, u);
    EXPECT_TRUE(t == 1 || t == 3) << u;  // only the two largest survive top-k 2
  }
  EXPECT_EQ(sample_token(logits.data(), 5, 1.0f, 0, 1.0f, 0.0), 1);
  EXPECT_EQ(sample_token(logits.data(), 5, 1.0f, 0, 1.0f, 0.999999), 4);  // whole vocabulary
  // Probabilities exp(l) / sum: 0.705, 0.259, 0.035, ...: top-p 0.9 keeps tokens 1 and 3 only,
  // top-p 0.5 token 1 only.
  for (double u : {0.0, 0.5, 0.8, 0.999999}) {
    const int32_t t = sample_token(logits.data(), 5, 1.0f, 0, 0.9f, u);
    EXPECT_TRUE(t == 1 || t == 3) << u;
    EXPECT_EQ(sample_token(logits.data(), 5, 1.0f, 0, 0.5f, u), 1) << u;
  }
  EXPECT_EQ(sample_token(logits.data(), 5, 1.0f, 0, 0.9f, 0.999999), 3);
}

// Decoding with the KV cache gives, at every step, the logits of a full forward pass over the
// sequence so far; in fp32 and bf16, from a prompt and one token at a time, up to ctx; for
// multi-head, grouped-query and multi-query attention, and the newer blocks (Gemma's, Phi-2's,
// Gemma 2's and 3's with windows of 16 keys on every other layer, past which the tiny context
// goes: their caches hold 32 rows, so positions move to the start as decoding goes on, and a
// prompt of 40 goes through in pieces of the window). A second run on the same cache (length 0)
// starts afresh.
TEST(Generate, KvCacheMatchesFullForward) {
  ModelConfig gqa = find_preset("tiny")->config;  // 2 kv heads, head dim 24, biases, half-split
  gqa.n_kv_heads = 2;
  gqa.head_dim = 24;
  gqa.qkv_bias = true;
  gqa.tie_embeddings = true;
  gqa.rope_pairs = RopePairs::HalfSplit;
  ModelConfig mqa = gqa;  // one kv head, adjacent pairs
  mqa.n_kv_heads = 1;
  mqa.rope_pairs = RopePairs::Adjacent;
  using test::tiny_as;
  for (const ModelConfig& c :
       {find_preset("tiny")->config, gqa, mqa, tiny_as("gemma"), tiny_as("phi2"), tiny_as("gemma2"),
        tiny_as("gemma3"), tiny_as("qwen35"), tiny_as("gemma4")})
    for (DType dtype : {DType::F32, DType::BF16}) {
      DecoderModel model(c);
      model.init_weights(6);
      if (architecture_of(c).unscaled_scores) {
        // Gemma 4's scores are unscaled: with unit q and k norms over heads of 16 they reach
        // 16, where bf16's rounding of q and k moves them by up to 16 x 2^-8; gains of 0.3
        // keep them where the other families' are.
        ParameterSet& p = model.parameters();
        for (size_t i = 0; i < p.infos().size(); ++i) {
          const std::string& name = p.infos()[i].name;
          if (!name.ends_with("q_norm.weight") && !name.ends_with("k_norm.weight")) continue;
          std::vector<float> gains(static_cast<size_t>(p.infos()[i].shape.numel()), 0.3f);
          p.write_values(static_cast<int>(i), gains.data());
        }
      }
      model.set_compute_dtype(dtype);
      DecoderModel::KvCache cache = model.new_kv_cache();
      for (int64_t l = 0; l < c.n_layers; ++l) {
        if (c.linear_layer(l) || c.kv_layer(l) != l) continue;  // none, or its source's
        EXPECT_EQ(cache.keys[l].shape()[0], c.windowed_layer(l) ? 32 : c.ctx) << "layer " << l;
      }
      for (const int64_t prompt : {int64_t{5}, int64_t{40}}) {
        std::vector<int32_t> tokens = {5, 9, 2, 77, 3};
        for (int32_t t = 0; static_cast<int64_t>(tokens.size()) < prompt; ++t)
          tokens.push_back((t * 13 + 7) % static_cast<int32_t>(c.vocab));
        cache.length = 0;
        Tensor cached = model.decode(tokens, cache);
        for (int64_t step = 0; static_cast<int64_t>(tokens.size()) <= c.ctx; ++step) {
          const auto T = static_cast<int64_t>(tokens.size());
          Tensor input = Tensor::empty(Shape{1, T}, DType::I32, MemoryCategory::Workspace);
          std::copy(tokens.begin(), tokens.end(), input.i32());
          const Tensor full = model.last_logits(input);
          double max_diff = 0.0, max_ref = 0.0;
          for (int64_t v = 0; v < c.vocab; ++v) {
            max_diff = std::max(max_diff, std::abs(double{cached.f32()[v]} - full.f32()[v]));
            max_ref = std::max(max_ref, std::abs(double{full.f32()[v]}));
          }
          ASSERT_GT(max_ref, 0.0);
          // Where attention has bf16 products, the full forward rounds the probabilities to bf16
          // (relative error up to 2^-9); decoding keeps them FP32. Without them, both compute
          // attention in FP32 but sum in other orders, and the output projection takes the bf16
          // rounding of each: an output a last bit apart can round to neighbouring bf16 values
          // (2^-8 apart), a few 1e-4 of the logits, up to 2.3e-3 through Gemma 2's post-norms,
          // which scale each layer's attention output to unit RMS before the residual.
          // Gemma 4's layers each add two more bf16 products (the per-layer input's gate and
          // projection) to what the roundings reach: up to 1.01e-2 under the reference GEMM.
          const double tol = (dtype == DType::F32                ? 1e-5
                              : kernels::attention_bf16_native() ? 1e-2
                                                                 : 4e-3) *
                             (dtype != DType::F32 && c.per_layer_dim > 0 ? 2.0 : 1.0);
          ASSERT_LT(max_diff / max_ref, tol)
              << "step " << step << (dtype == DType::F32 ? " fp32" : " bf16") << ", kv heads "
              << c.kv_heads() << ", prompt " << prompt << ", " << c.architecture;
          if (T == c.ctx) break;
          const auto next = static_cast<int32_t>((step * 37 + 11) % c.vocab);
          tokens.push_back(next);
          cached = model.decode({next}, cache);
        }
        EXPECT_EQ(cache.length, c.ctx);
        EXPECT_THROW(model.decode({1}, cache), std::invalid_argument);  // the cache is full
      }
    }
}

// Sequences decoded together are each what it gives alone, token for token: for every
// architecture (and Gemma 4's experts, their gate and up in one tensor), in FP32 and bf16, greedy
// from three prompts of one length past the context (every sequence restarted from its last
// ctx / 2 at once); with a stop token that ends one sequence early (the batch goes on without it,
// its cache's rows dropped); and, sampling at temperature 1, from one prompt filled once, sequence
// i as the prompt alone with seed + i. In bf16 a product over the batch's rows can round an
// activation to a neighbouring bf16 value: the sequences may part where the token alone leads the
// next by less than bf16's resolution (2^-8 of the logit), and only there. Decoding a batch whose
// tokens are not m of each sequence is refused.
TEST(Generate, BatchedIsEachSequenceAlone) {
  std::vector<std::pair<std::string, ModelConfig>> configs;
  for (const Architecture& a : architectures())
    configs.emplace_back(a.name, test::tiny_as(std::string(a.name).c_str()));
  ModelConfig fused = test::tiny_gemma4_experts();
  fused.experts_gate_up_fused = true;
  configs.emplace_back("gemma4 experts", fused);
  for (const auto& [name, c] : configs)
    for (const DType dtype : {DType::F32, DType::BF16}) {
      DecoderModel model(c);
      model.init_weights(8);
      model.set_compute_dtype(dtype);
      const std::string at = name + (dtype == DType::F32 ? " fp32" : " bf16");
      std::vector<std::vector<int32_t>> prompts;
      for (int32_t i = 0; i < 3; ++i) {
        prompts.emplace_back();
        for (int32_t t = 0; t < 40; ++t)
          prompts.back().push_back((t * (7 + 4 * i) + 3 * i + 1) % static_cast<int32_t>(c.vocab));
      }
      SampleOptions greedy;
      greedy.temperature = 0.0f;
      greedy.max_new_tokens = 40;  // past the tiny context of 64
      // Equal, or in bf16 equal up to a near-tie of the sequence alone.
      const auto expect_alone = [&](const std::vector<int32_t>& batched,
                                    const std::vector<int32_t>& alone, const std::string& what) {
        size_t d = 0;
        while (d < std::min(alone.size(), batched.size()) && alone[d] == batched[d]) ++d;
        if (d == alone.size() && d == batched.size()) return;
        ASSERT_EQ(dtype, DType::BF16) << what;
        ASSERT_LT(d, std::min(alone.size(), batched.size())) << what;
        DecoderModel::KvCache one = model.new_kv_cache();
        const Tensor l = model.decode(std::vector<int32_t>(alone.begin(), alone.begin() + d), one);
        std::vector<float> v(l.f32(), l.f32() + c.vocab);
        std::partial_sort(v.begin(), v.begin() + 2, v.end(), std::greater<>());
        EXPECT_LT(v[0] - v[1], std::abs(v[0]) * 0x1.0p-8f) << what << ", parting at " << d;
      };
      const std::vector<std::vector<int32_t>> together = generate_batch(model, prompts, greedy);
      ASSERT_EQ(together.size(), 3u);
      for (size_t i = 0; i < 3; ++i)
        expect_alone(together[i], generate(model, prompts[i], greedy),
                     at + ", sequence " + std::to_string(i));
      EXPECT_NE(together[0], together[1]) << at;
      // Sequence 1's sixth new token ends it (and any other that emits it).
      SampleOptions stopping = greedy;
      stopping.stop_token = together[1][40 + 5];
      const std::vector<std::vector<int32_t>> stopped = generate_batch(model, prompts, stopping);
      EXPECT_LE(stopped[1].size(), 46u) << at;
      for (size_t i = 0; i < 3; ++i)
        expect_alone(stopped[i], generate(model, prompts[i], stopping),
                     at + ", stopping, sequence " + std::to_string(i));
      if (dtype == DType::BF16) continue;
      SampleOptions sampling;
      sampling.temperature = 1.0f;
      sampling.max_new_tokens = 12;
      sampling.seed = 5;
      const std::vector<std::vector<int32_t>> fanned =
          generate_batch(model, std::vector<std::vector<int32_t>>(4, prompts[2]), sampling);
      for (size_t i = 0; i < 4; ++i) {
        SampleOptions alone = sampling;
        alone.seed = sampling.seed + i;
        EXPECT_EQ(fanned[i], generate(model, prompts[2], alone)) << at << ", sequence " << i;
      }
      EXPECT_NE(fanned[0], fanned[1]) << at;
    }
  DecoderModel model(find_preset("tiny")->config);
  DecoderModel::KvCache cache = model.new_kv_cache(2);
  EXPECT_THROW(model.decode({1, 2, 3}, cache), std::invalid_argument);
}

// Past ctx tokens, generation goes on from the last ctx / 2 (a fresh cache), as a full forward
// pass over those tokens would.
TEST(Generate, GoesOnPastTheContext) {
  const ModelConfig c = find_preset("tiny")->config;
  DecoderModel model(c);
  model.init_weights(7);
  SampleOptions greedy;
  greedy.temperature = 0.0f;
  greedy.max_new_tokens = c.ctx + 10;
  const std::vector<int32_t> out = generate(model, {1, 2, 3}, greedy);
  ASSERT_EQ(static_cast<int64_t>(out.size()), 3 + c.ctx + 10);
  // The token after the restart: greedy on the last ctx / 2 tokens before it.
  const int64_t restart_at = c.ctx + 1;  // tokens in the sequence at the restart
  Tensor input = Tensor::empty(Shape{1, c.ctx / 2}, DType::I32, MemoryCategory::Workspace);
  std::copy(out.begin() + restart_at - c.ctx / 2, out.begin() + restart_at, input.i32());
  const Tensor logits = model.last_logits(input);
  EXPECT_EQ(out[restart_at], sample_token(logits.f32(), c.vocab, 0.0f, 0, 1.0f, 0.0));
}

}  // namespace
}  // namespace cputrain
