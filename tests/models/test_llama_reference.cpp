// The decoder against PyTorch (tests/models/make_llama_reference.py), in the manner of llm.c's
// test_gpt2.c: from the same weights and batch, the logits, the loss, every parameter gradient,
// and the losses, gradient norms and weights of 10 AdamW steps. Three configurations: the tiny
// preset; one with grouped-query attention (8 query heads, 2 kv heads), tied embeddings, q/k/v
// biases, half-split RoPE at theta 1e6, eps 1e-6 and a head dim of 10; and that one with its
// base frozen and LoRA adapters (rank 4, alpha 8) on all seven projections, which alone train;
// and one with the parts of the newer families: per-head q/k norms, Llama 3's RoPE scaling and a
// layer without RoPE; one with Phi-3's: adapters on its fused projections (one A for q, k and
// v, one for gate and up), RoPE on part of each head, longrope scaling; and one with Gemma's:
// GeGLU, RMSNorm scaling by 1 + w, embeddings scaled by sqrt(d_model); and one with Phi-2's:
// attention and a GELU MLP in parallel from one LayerNorm, biases everywhere; and one with Gemma
// 3's: post-norms, sliding-window layers at a RoPE base of their own, a scale of the scores; and
// one with Gemma 2's soft-capped scores and logits; and one with Qwen3.5's: Gated DeltaNet layers
// (2 key heads read by 4 value heads, convolutions, the decay and write strength, the gated
// norm; the reference's delta rule in its recurrent form against the chunked kernel, over 70
// positions, past a chunk) beside attention with its output gated; and three mixtures of experts,
// trained whole: Qwen3-MoE's (8 experts, the softmax's top 2 renormalised), Qwen3.5-MoE's (a
// DeltaNet and an attention layer, the top 4 of 8 and a shared expert gated by a sigmoid) and
// gpt-oss's (attention sinks, a window, q/k/v/o biases; the router's and experts' biases, the top
// 3 of 7 logits softmaxed, the clamped SwiGLU with its clamps biting): the gradients of the
// router, the chosen experts' weights, the shared expert's gate, the sinks and the clamp.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <string>

#include "engine/data/finetune_data.h"
#include "engine/train/adamw.h"
#include "models/decoder.h"
#include "models/grpo_step.h"
#include "models/preference_step.h"
#include "reference_file.h"

namespace cputrain {
namespace {

using test::ReferenceTensor;

// Tolerances: losses agree to 1e-5 relative; gradients, logits and weights to 1e-4 of the
// largest magnitude in their tensor (float rounding of different summation orders).
constexpr double kLossTolerance = 1e-5;
constexpr double kTensorTolerance = 1e-4;
// Weights after 10 AdamW steps: Adam divides each update by the gradient's own magnitude, so an
// element whose gradient is rounding noise (|g| ~ 1e-9) moves by a noise-driven ~lr. The largest
// such difference, relative to the tensor's largest weight, is near 1e-4 even between float32
// and float64 runs of the reference itself.
constexpr double kFinalWeightTolerance = 1e-3;

class LlamaReference : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    ref_ = test::read_reference_file(std::string(CPUTRAIN_TEST_DATA_DIR) + "/" + GetParam());
    const std::vector<int32_t>& c = ref_.at("config").i32;
    ASSERT_TRUE(c.size() == 7u || c.size() == 12u || c.size() == 13u);
    config_.vocab = c[0];
    config_.d_model = c[1];
    config_.n_layers = c[2];
    config_.n_heads = c[3];
    config_.ffn = c[4];
    config_.ctx = 64;
    B_ = c[5];
    T_ = c[6];
    if (c.size() >= 12u) {
      config_.n_kv_heads = c[7];
      config_.head_dim = c[8];
      config_.tie_embeddings = c[9] != 0;
      config_.qkv_bias = c[10] != 0;
      config_.rope_pairs = c[11] != 0 ? RopePairs::HalfSplit : RopePairs::Adjacent;
      const std::vector<float>& f = ref_.at("config_f32").f32;
      ASSERT_EQ(f.size(), c.size() == 13u ? 3u : 2u);
      config_.rope_theta = f[0];
      config_.norm_eps = f[1];
      if (c.size() == 13u) {
        options_.lora.rank = c[12];
        options_.lora.alpha = f[2];
        options_.lora.targets.fill(true);
      }
    }
    if (ref_.count("parts")) {  // qk_norm, a 0/1 per layer without RoPE; Llama 3's scaling
      const std::vector<int32_t>& parts = ref_.at("parts").i32;
      const std::vector<float>& scaling = ref_.at("parts_f32").f32;
      ASSERT_EQ(static_cast<int64_t>(parts.size()), 1 + config_.n_layers);
      ASSERT_EQ(scaling.size(), 4u);
      config_.qk_norm = parts[0] != 0;
      for (int64_t i = 0; i < config_.n_layers; ++i)
        if (parts[static_cast<size_t>(1 + i)] != 0) config_.no_rope_layers.push_back(i);
      if (scaling[0] > 0.0f) {
        config_.rope_scaling.type = "llama3";
        config_.rope_scaling.freq_factors =
            llama3_freq_factors(config_.rope_theta, config_.head_size(), scaling[0], scaling[1],
                                scaling[2], static_cast<int64_t>(scaling[3]));
      }
    }
    if (ref_.count("phi3")) {  // rope_dim, original ctx, ctx; longrope's factors
      const std::vector<int32_t>& phi3 = ref_.at("phi3").i32;
      ASSERT_EQ(phi3.size(), 3u);
      config_.architecture = "phi3";  // fused q, k, v and gate, up: their adapters share an A
      config_.rope_dim = phi3[0];
      config_.ctx = phi3[2];
      RopeScaling& r = config_.rope_scaling;
      r.type = "longrope";
      r.original_ctx = phi3[1];
      r.freq_factors = ref_.at("short_factors").f32;
      r.long_factors = ref_.at("long_factors").f32;
      r.attn_factor = std::sqrt(1.0 + std::log(static_cast<double>(phi3[2]) / phi3[1]) /
                                          std::log(static_cast<double>(phi3[1])));
    }
    if (ref_.count("architecture")) {  // its name's bytes: a description's parts (gemma, phi2)
      const std::vector<int32_t>& name = ref_.at("architecture").i32;
      config_.architecture = std::string(name.begin(), name.end());
      // Gemma's norms are held as its Hugging Face files hold them, less 1.
      config_.norm_plus_one = config_.architecture.starts_with("gemma");
    }
    if (ref_.count("rope_dim")) config_.rope_dim = ref_.at("rope_dim").i32.at(0);
    if (ref_.count("qwen35")) {  // key and value heads and dims, taps, interval; RoPE's dims
      const std::vector<int32_t>& q = ref_.at("qwen35").i32;
      ASSERT_EQ(q.size(), 7u);
      if (!ref_.count("architecture")) config_.architecture = "qwen35";  // else qwen35moe
      config_.attn_output_gate = true;
      config_.linear_key_heads = q[0];
      config_.linear_value_heads = q[1];
      config_.linear_key_dim = q[2];
      config_.linear_value_dim = q[3];
      config_.linear_conv = q[4];
      for (int64_t i = 0; i < config_.n_layers; ++i)
        if ((i + 1) % q[5] != 0) config_.linear_layers.push_back(i);
      config_.rope_dim = q[6];
      config_.ctx = std::max<int64_t>(config_.ctx, T_);
    }
    if (ref_.count("moe")) {  // experts, used, renormalised, the shared expert's width
      const std::vector<int32_t>& m = ref_.at("moe").i32;
      ASSERT_EQ(m.size(), 4u);
      config_.n_experts = m[0];
      config_.experts_used = m[1];
      config_.expert_weights_norm = m[2] != 0;
      config_.shared_expert_ffn = m[3];
    }
    if (ref_.count("window")) {  // the window and its pattern; their RoPE base, the scale
      config_.sliding_window = ref_.at("window").i32.at(0);
      config_.swa_pattern = ref_.at("window").i32.at(1);
      config_.rope_theta_swa = ref_.at("window_f32").f32.at(0);
      config_.attn_scale = ref_.at("window_f32").f32.at(1);
      config_.attn_softcap = ref_.at("window_f32").f32.at(2);
      config_.final_softcap = ref_.at("window_f32").f32.at(3);
    }
    tokens_ = to_tensor(ref_.at("tokens"));
    targets_ = to_tensor(ref_.at("targets"));
  }

  Tensor to_tensor(const ReferenceTensor& r) const {
    Tensor t = Tensor::empty(Shape{B_, T_}, DType::I32, MemoryCategory::Workspace);
    EXPECT_EQ(static_cast<int64_t>(r.i32.size()), B_ * T_);
    std::copy(r.i32.begin(), r.i32.end(), t.i32());
    return t;
  }

  void load_initial_weights(DecoderModel& model) const {
    const ParameterSet& p = model.parameters();
    for (const ParameterInfo& info : p.infos()) {
      const ReferenceTensor& r = ref_.at("init/" + info.name);
      ASSERT_EQ(static_cast<int64_t>(r.f32.size()), info.shape.numel()) << info.name;
      std::copy(r.f32.begin(), r.f32.end(), p.weights().f32() + info.offset);
    }
  }

  // max |got - want| over the tensor, relative to max |want|.
  static double relative_error(const float* got, const std::vector<float>& want) {
    double max_diff = 0.0, max_ref = 1e-12;
    for (size_t i = 0; i < want.size(); ++i) {
      max_diff = std::max(max_diff, std::abs(static_cast<double>(got[i]) - want[i]));
      max_ref = std::max(max_ref, std::abs(static_cast<double>(want[i])));
    }
    return max_diff / max_ref;
  }

  std::map<std::string, ReferenceTensor> ref_;
  ModelConfig config_;
  ModelOptions options_;
  int64_t B_ = 0, T_ = 0;
  Tensor tokens_, targets_;
};

TEST_P(LlamaReference, ParameterNamesShapesAndCount) {
  DecoderModel model(config_, options_);
  int64_t total = 0, adapters = 0;
  for (const ParameterInfo& info : model.parameters().infos()) {
    ASSERT_TRUE(ref_.count("init/" + info.name)) << info.name;
    const ReferenceTensor& r = ref_.at("init/" + info.name);
    ASSERT_EQ(static_cast<int>(r.shape.size()), info.shape.ndim()) << info.name;
    for (int i = 0; i < info.shape.ndim(); ++i) EXPECT_EQ(r.shape[i], info.shape[i]) << info.name;
    (is_lora_parameter(info.name) ? adapters : total) += info.shape.numel();
    // With adapters, they alone train.
    EXPECT_EQ(info.trainable, !options_.lora.active() || is_lora_parameter(info.name)) << info.name;
  }
  EXPECT_EQ(total, parameter_count(config_));
  // Per layer, each projection (out, in) adds rank * (in + out), but fused ones (q, k, v; gate,
  // up) share an A of rank * in.
  const int64_t C = config_.d_model, Q = config_.q_dim(), KV = config_.kv_dim(), F = config_.ffn;
  // Phi-2 has no gate: no adapter of C in, F out.
  const bool fused = config_.architecture == "phi3", gate = config_.architecture != "phi2";
  const int64_t a_in = fused ? C + Q + C + F : (gate ? 5 : 4) * C + Q + F;
  const int64_t b_out = Q + 2 * KV + 2 * C + (gate ? 2 : 1) * F;
  EXPECT_EQ(adapters, options_.lora.rank * config_.n_layers * (a_in + b_out));
  // Every tensor of the reference is a parameter of the model.
  for (const auto& [name, tensor] : ref_) {
    if (!name.starts_with("init/")) continue;
    EXPECT_GE(model.parameters().find(name.substr(5)), 0) << name;
  }
}

TEST_P(LlamaReference, LogitsLossAndGradients) {
  DecoderModel model(config_, options_);
  load_initial_weights(model);
  const Tensor logits = model.logits(tokens_);
  EXPECT_LT(relative_error(logits.f32(), ref_.at("logits").f32), kTensorTolerance);

  Variable loss = model.loss(tokens_, targets_);
  const double want = ref_.at("loss").f32[0];
  EXPECT_NEAR(loss.value().f32()[0], want, kLossTolerance * want);
  backward(loss);
  const ParameterSet& p = model.parameters();
  for (const ParameterInfo& info : p.infos()) {
    EXPECT_EQ(ref_.count("grad/" + info.name), info.trainable ? 1u : 0u) << info.name;
    if (!info.trainable) continue;
    EXPECT_LT(
        relative_error(p.gradients().f32() + info.grad_offset, ref_.at("grad/" + info.name).f32),
        kTensorTolerance)
        << info.name;
  }
}

TEST_P(LlamaReference, TenAdamWSteps) {
  DecoderModel model(config_, options_);
  load_initial_weights(model);
  AdamWConfig adamw;  // betas 0.9/0.95, eps 1e-8, decay 0.1 on matrices, clip 1.0
  AdamW optimizer(model.parameters(), adamw);
  const std::vector<float>& losses = ref_.at("steps/loss").f32;
  const std::vector<float>& norms = ref_.at("steps/grad_norm").f32;
  ASSERT_EQ(losses.size(), 10u);
  for (size_t step = 0; step < 10; ++step) {
    model.parameters().zero_grad();
    Variable loss = model.loss(tokens_, targets_);
    backward(loss);
    EXPECT_NEAR(loss.value().f32()[0], losses[step], kLossTolerance * losses[step])
        << "step " << step + 1;
    const float norm = optimizer.step(1e-3f);
    // Where the reference says how far its own float32 norms stray from float64's (Qwen3.5's
    // decay makes its later steps sensitive to rounding), ten times that.
    double tolerance = kTensorTolerance;
    if (ref_.count("steps/grad_norm_f64")) {
      const double f64 = ref_.at("steps/grad_norm_f64").f32.at(step);
      tolerance = std::max(tolerance, 10.0 * std::abs(norms[step] - f64) / f64);
    }
    EXPECT_NEAR(norm, norms[step], tolerance * norms[step]) << "step " << step + 1;
  }
  EXPECT_LT(losses[9], losses[0]);  // the reference itself learns
  const ParameterSet& p = model.parameters();
  for (const ParameterInfo& info : p.infos()) {
    EXPECT_LT(relative_error(p.weights().f32() + info.offset, ref_.at("final/" + info.name).f32),
              kFinalWeightTolerance)
        << info.name;
  }
}

// The configurations with adapters: DPO and ORPO on two pairs (a sequence a row), the
// reference's sums from the same weights with the adapters switched off, each loss and the
// adapters' gradients; and the gradients of a few adapter weights against central differences
// of the loss.
TEST_P(LlamaReference, PreferenceLossesAndGradients) {
  if (!ref_.count("dpo/loss")) GTEST_SKIP() << "no adapters in this configuration";
  DecoderModel model(config_, options_);
  load_initial_weights(model);
  const ReferenceTensor& tokens = ref_.at("pref/tokens");
  const std::vector<int32_t>& prompts = ref_.at("pref/prompts").i32;
  const int64_t rows = 2 * std::ssize(prompts);
  ASSERT_EQ(tokens.shape, (std::vector<int64_t>{rows, T_ + 1}));
  std::vector<FinetuneExample> examples(static_cast<size_t>(rows));
  std::vector<PackedRow> packed(static_cast<size_t>(rows));
  double chosen_tokens = 0.0;
  for (int64_t r = 0; r < rows; ++r) {
    FinetuneExample& e = examples[static_cast<size_t>(r)];
    e.tokens.assign(tokens.i32.begin() + r * (T_ + 1), tokens.i32.begin() + (r + 1) * (T_ + 1));
    for (int64_t i = 0; i <= T_; ++i) e.target.push_back(i >= prompts[static_cast<size_t>(r / 2)]);
    if (r % 2 == 0)
      chosen_tokens += static_cast<double>(std::count(e.target.begin(), e.target.end(), 1));
    packed[static_cast<size_t>(r)] = {{static_cast<int32_t>(r)}, T_};
  }
  // The reference: the same model, its adapters switched off.
  model.set_adapters_enabled(false);
  const std::vector<double> reference = sequence_log_probs(model, packed, examples, T_, rows, 0);
  model.set_adapters_enabled(true);
  const std::vector<float>& want_reference = ref_.at("pref/reference").f32;
  for (size_t i = 0; i < reference.size(); ++i)
    EXPECT_NEAR(reference[i], want_reference[i], kLossTolerance * std::abs(want_reference[i]));
  std::vector<const PackedRow*> all;
  for (const PackedRow& r : packed) all.push_back(&r);
  const Tensor inputs = Tensor::empty(Shape{rows, T_}, DType::I32, MemoryCategory::Workspace);
  const Tensor targets = Tensor::empty(Shape{rows, T_}, DType::I32, MemoryCategory::Workspace);
  const std::vector<float>& options = ref_.at("pref/options").f32;
  for (const PreferenceMethod method : {PreferenceMethod::Dpo, PreferenceMethod::Orpo}) {
    const std::string name = method == PreferenceMethod::Dpo ? "dpo" : "orpo";
    PreferenceBatches b;
    b.examples = &examples;
    if (method == PreferenceMethod::Dpo) b.reference = reference;
    b.loss.method = method;
    b.loss.beta = options[0];
    b.loss.lambda = options[1];
    const auto loss_now = [&] {
      NoGradGuard no_grad;
      return preference_batch_loss(model, all, b, 0, inputs, targets, rows / 2.0, chosen_tokens)
          .value()
          .f32()[0];
    };
    ParameterSet& p = model.parameters();
    p.zero_grad();
    const Variable loss =
        preference_batch_loss(model, all, b, 0, inputs, targets, rows / 2.0, chosen_tokens);
    const double want = ref_.at(name + "/loss").f32[0];
    EXPECT_NEAR(loss.value().f32()[0], want, kLossTolerance * want) << name;
    backward(loss);
    const ParameterInfo* largest = nullptr;
    for (const ParameterInfo& info : p.infos()) {
      if (!info.trainable) continue;
      const float* g = p.gradients().f32() + info.grad_offset;
      EXPECT_LT(relative_error(g, ref_.at(name + "/grad/" + info.name).f32), kTensorTolerance)
          << name << " " << info.name;
      if (!largest || std::abs(g[0]) > std::abs(p.gradients().f32()[largest->grad_offset]))
        largest = &info;
    }
    // Central differences by the first element of each of a few adapters (and of the one whose
    // first gradient is largest), in FP32: to 2% of the gradient's scale.
    std::vector<const ParameterInfo*> probe = {largest};
    for (size_t i = 0; i < p.infos().size(); i += 7)
      if (p.infos()[i].trainable) probe.push_back(&p.infos()[i]);
    for (const ParameterInfo* info : probe) {
      float* w = p.weights().f32() + info->offset;
      const float g = p.gradients().f32()[info->grad_offset];
      const float keep = *w, h = 1e-2f;
      *w = keep + h;
      const double up = loss_now();
      *w = keep - h;
      const double down = loss_now();
      *w = keep;
      const double difference = (up - down) / (2.0 * h);
      EXPECT_NEAR(g, difference, 2e-2 * std::abs(g) + 2e-4) << name << " " << info->name;
    }
  }
}

// The configurations with adapters: GRPO on two groups of three completions of several lengths
// (a sequence a row), the old log-probabilities given, the reference's from the same weights with
// the adapters switched off; each loss type's loss and the adapters' gradients.
TEST_P(LlamaReference, GrpoLossesAndGradients) {
  if (!ref_.count("dapo/loss")) GTEST_SKIP() << "no adapters in this configuration";
  DecoderModel model(config_, options_);
  load_initial_weights(model);
  const ReferenceTensor& tokens = ref_.at("grpo/tokens");
  const std::vector<float>& mask = ref_.at("grpo/mask").f32;
  const std::vector<float>& old_flat = ref_.at("grpo/old").f32;
  const std::vector<float>& options = ref_.at("grpo/options").f32;
  const std::vector<float>& reward_values = ref_.at("grpo/rewards").f32;
  const int64_t rows = tokens.shape[0];
  ASSERT_EQ(tokens.shape, (std::vector<int64_t>{rows, T_ + 1}));
  std::vector<FinetuneExample> examples(static_cast<size_t>(rows));
  std::vector<PackedRow> packed(static_cast<size_t>(rows));
  std::vector<std::vector<float>> old(static_cast<size_t>(rows));
  std::vector<double> lengths(static_cast<size_t>(rows), 0.0);
  double all_tokens = 0.0;
  for (int64_t r = 0; r < rows; ++r) {
    FinetuneExample& e = examples[static_cast<size_t>(r)];
    e.tokens.assign(tokens.i32.begin() + r * (T_ + 1), tokens.i32.begin() + (r + 1) * (T_ + 1));
    e.target.assign(static_cast<size_t>(T_ + 1), 0);
    for (int64_t t = 0; t < T_; ++t)
      if (mask[static_cast<size_t>(r * T_ + t)] != 0.0f) {
        e.target[static_cast<size_t>(t + 1)] = 1;
        old[static_cast<size_t>(r)].push_back(old_flat[static_cast<size_t>(r * T_ + t)]);
        lengths[static_cast<size_t>(r)] += 1.0;
      }
    all_tokens += lengths[static_cast<size_t>(r)];
    packed[static_cast<size_t>(r)] = {{static_cast<int32_t>(r)}, T_};
  }
  model.set_adapters_enabled(false);
  const std::vector<std::vector<float>> reference =
      target_log_probs_of(model, packed, examples, T_, rows, 0);
  model.set_adapters_enabled(true);
  const std::vector<double> rewards(reward_values.begin(), reward_values.end());
  const std::vector<double> advantages =
      group_advantages(rewards, static_cast<int64_t>(options[3]), true);
  std::vector<const PackedRow*> all;
  for (const PackedRow& r : packed) all.push_back(&r);
  const Tensor inputs = Tensor::empty(Shape{rows, T_}, DType::I32, MemoryCategory::Workspace);
  const Tensor targets = Tensor::empty(Shape{rows, T_}, DType::I32, MemoryCategory::Workspace);
  for (const GrpoLossType type : {GrpoLossType::Dapo, GrpoLossType::Grpo, GrpoLossType::DrGrpo}) {
    const std::string name = grpo_loss_type_name(type);
    std::vector<double> weights(static_cast<size_t>(rows));
    for (size_t i = 0; i < weights.size(); ++i)
      weights[i] = type == GrpoLossType::Dapo   ? 1.0 / all_tokens
                   : type == GrpoLossType::Grpo ? 1.0 / (static_cast<double>(rows) * lengths[i])
                                                : 1.0 / static_cast<double>(rows * T_);
    GrpoStats stats;
    GrpoBatches b;
    b.examples = &examples;
    b.advantages = advantages;
    b.weights = weights;
    b.old = &old;
    b.reference = &reference;
    b.loss.beta = options[0];
    b.loss.epsilon = options[1];
    b.loss.epsilon_high = options[2];
    b.loss.type = type;
    b.stats = &stats;
    ParameterSet& p = model.parameters();
    p.zero_grad();
    const Variable loss = grpo_batch_loss(model, all, b, 0, inputs, targets);
    const double want = ref_.at(name + "/loss").f32[0];
    EXPECT_NEAR(loss.value().f32()[0], want, kLossTolerance * std::abs(want)) << name;
    backward(loss);
    for (const ParameterInfo& info : p.infos()) {
      if (!info.trainable) continue;
      EXPECT_LT(relative_error(p.gradients().f32() + info.grad_offset,
                               ref_.at(name + "/grad/" + info.name).f32),
                kTensorTolerance)
          << name << " " << info.name;
    }
    // The old log-probabilities put some ratios outside the clipping, on both sides.
    EXPECT_EQ(stats.tokens, all_tokens);
    EXPECT_GT(stats.clipped_low + stats.clipped_high, 0.0) << name;
    EXPECT_LT(stats.clipped_low + stats.clipped_high, stats.tokens) << name;
  }
}

INSTANTIATE_TEST_SUITE_P(
    Configurations, LlamaReference,
    ::testing::Values("llama_tiny_reference.ctrf", "llama_gqa_reference.ctrf",
                      "llama_lora_reference.ctrf", "llama_parts_reference.ctrf",
                      "llama_phi3_reference.ctrf", "llama_gemma_reference.ctrf",
                      "llama_gemma3_reference.ctrf", "llama_gemma2_reference.ctrf",
                      "llama_phi2_reference.ctrf", "llama_qwen35_reference.ctrf",
                      "llama_qwen3moe_reference.ctrf", "llama_qwen35moe_reference.ctrf",
                      "llama_gpt_oss_reference.ctrf"),
    [](const auto& info) { return info.param.substr(6, info.param.find("_reference") - 6); });

}  // namespace
}  // namespace cputrain
