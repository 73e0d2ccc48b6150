// The architecture families of models/architecture.h against llama.cpp: random-weight models of
// each in its real conventions (tests/interop/make_family_models.py: Llama 3's RoPE scaling,
// Qwen3's q/k norms and head dimension, SmolLM3's layers without RoPE, Phi-3's fused tensors,
// longrope scaling and partial rotary, Gemma's GeGLU, 1 + w norms and scaled embeddings, Phi-2's
// parallel block, LayerNorm, GELU MLP and biases), read
// from GGUF and from a Hugging Face folder, give llama.cpp's logits and greedy continuation;
// exported and read back they are the same bits; an adapter fine-tuned on each gives llama.cpp's
// logits. What cputrain does not compute is refused in one line.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <memory>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <vector>

#include "engine/core/error.h"
#include "engine/io/gguf_file.h"
#include "engine/io/safetensors_file.h"
#include "engine/train/parameters.h"
#include "models/architecture.h"
#include "models/generate.h"
#include "models/gguf_model.h"
#include "models/lora.h"
#include "models/tensor_names.h"
#include "tools/cli_test_util.h"
#include "tools/model_source.h"
#include "tools/oracle_util.h"
#include "tools/run/budget_report.h"

namespace cputrain {
namespace {

using namespace interop_test;

const char* const kFamilies[] = {"llama3", "qwen3",  "smollm3", "phi3",  "gemma",
                                 "phi2",   "gemma2", "gemma3",  "qwen35"};

// The models of make_family_models.py, once per test binary.
const fs::path& family_models() {
  static const TempFolder dir{[] {
    const fs::path d = temp_dir("families");
    const std::string cmd = "/usr/bin/python3 " + std::string(CPUTRAIN_SOURCE_DIR) +
                            "/tests/interop/make_family_models.py " + CPUTRAIN_GGUF_PY + " " +
                            d.string();
    EXPECT_EQ(std::system(cmd.c_str()), 0) << cmd;
    return d;
  }()};
  return dir.path;
}

// llama.cpp's quantiser (llama_model_quantize) of `from` into `to` as `type` ("q8_0",
// "mxfp4_moe", ...): whether it succeeded.
bool oracle_quantize(const fs::path& from, const fs::path& to, const std::string& type) {
  return std::system((kOracle + " quantize " + from.string() + " " + to.string() + " " + type +
                      " >/dev/null 2>&1")
                         .c_str()) == 0;
}

LoadedModel load(const fs::path& path) {
  return load_model(path.string(), "--model", "", kDefaultImportCtx);
}

// Each family's parts, as read from either format.
void expect_parts(const std::string& family, const ModelConfig& c) {
  if (family == "llama3") {
    EXPECT_EQ(c.architecture, "llama");
    EXPECT_EQ(c.rope_scaling.type, "llama3");
    EXPECT_EQ(c.rope_scaling.factor, 8.0);
    EXPECT_EQ(c.rope_scaling.original_ctx, 1024);
    EXPECT_EQ(c.n_kv_heads, 2);
    EXPECT_FALSE(c.tie_embeddings);
  } else if (family == "qwen3") {
    EXPECT_EQ(c.architecture, "qwen3");
    EXPECT_TRUE(c.qk_norm);
    EXPECT_FALSE(c.qkv_bias);
    EXPECT_EQ(c.head_size(), 48);  // not d_model / heads = 64
    EXPECT_EQ(c.n_heads, 3);
    EXPECT_TRUE(c.tie_embeddings);
  } else if (family == "smollm3") {
    EXPECT_EQ(c.architecture, "smollm3");
    EXPECT_EQ(c.no_rope_layers, std::vector<int64_t>{3});
    EXPECT_EQ(c.n_kv_heads, 1);
  } else if (family == "phi2") {
    EXPECT_EQ(c.architecture, "phi2");
    EXPECT_EQ(c.rope_dim, 32);
    EXPECT_EQ(c.head_size(), 80);
    EXPECT_TRUE(c.qkv_bias);
    EXPECT_FALSE(c.tie_embeddings);
    EXPECT_EQ(c.norm_eps, 1e-5f);
  } else if (family == "gemma2") {
    EXPECT_EQ(c.architecture, "gemma2");
    EXPECT_EQ(c.sliding_window, 32);
    EXPECT_EQ(c.swa_pattern, 2);
    EXPECT_EQ(c.attn_softcap, 1.0f);
    EXPECT_EQ(c.final_softcap, 5.0f);
    for (int64_t i = 0; i < 4; ++i) EXPECT_EQ(c.windowed_layer(i), i % 2 == 0) << i;
  } else if (family == "gemma3") {
    EXPECT_EQ(c.architecture, "gemma3");
    EXPECT_TRUE(c.qk_norm);
    EXPECT_EQ(c.sliding_window, 32);
    EXPECT_EQ(c.swa_pattern, 6);
    EXPECT_EQ(c.rope_theta_swa, 1e4);
    EXPECT_EQ(c.rope_theta, 1e6);
    EXPECT_EQ(c.rope_scaling.type, "linear");
    EXPECT_EQ(c.rope_scaling.factor, 8.0);
    EXPECT_EQ(c.rope_scaling.freq_factors, std::vector<float>(32, 8.0f));
    EXPECT_TRUE(c.rope_swa_apart());
    for (int64_t i = 0; i < 6; ++i) EXPECT_EQ(c.windowed_layer(i), i != 5) << i;
  } else if (family == "qwen35") {
    EXPECT_EQ(c.architecture, "qwen35");
    EXPECT_EQ(c.n_layers, 4);  // the multi-token-prediction block left out
    EXPECT_EQ(c.linear_layers, (std::vector<int64_t>{0, 1, 2}));
    EXPECT_EQ(c.linear_key_heads, 2);
    EXPECT_EQ(c.linear_value_heads, 4);
    EXPECT_EQ(c.linear_key_dim, 24);
    EXPECT_EQ(c.linear_value_dim, 24);
    EXPECT_EQ(c.linear_conv, 4);
    EXPECT_TRUE(c.attn_output_gate);
    EXPECT_TRUE(c.qk_norm);
    EXPECT_EQ(c.rope_dim, 6);
    EXPECT_EQ(c.head_size(), 24);
    EXPECT_EQ(c.rope_theta, 1e7);
    EXPECT_FALSE(c.tie_embeddings);
  } else if (family == "gemma") {
    EXPECT_EQ(c.architecture, "gemma");
    EXPECT_EQ(c.head_size(), 64);  // not d_model / heads = 32
    EXPECT_EQ(c.n_kv_heads, 1);
    EXPECT_TRUE(c.tie_embeddings);
  } else {
    EXPECT_EQ(c.architecture, "phi3");
    EXPECT_EQ(c.rope_dim, 24);
    EXPECT_EQ(c.rope_scaling.type, "longrope");
    EXPECT_EQ(c.rope_scaling.original_ctx, 128);
    EXPECT_NEAR(c.rope_scaling.attn_factor, std::sqrt(1.0 + std::log(2.0) / std::log(128.0)), 1e-6);
    EXPECT_EQ(c.rope_freq_factors(), c.rope_scaling.long_factors.data());  // ctx 256 > 128
  }
}

// llama.cpp's logits at every position of 200 tokens of the GGUF file; cputrain's of the GGUF
// file and of the Hugging Face folder of the same weights.
TEST(Families, GgufAndHuggingFaceGiveLlamaCppsLogits) {
  REQUIRE_ORACLE();
  for (const std::string family : kFamilies) {
    const fs::path gguf = family_models() / (family + ".gguf");
    const fs::path hf = family_models() / (family + "_hf");
    LoadedModel g = load(gguf), h = load(hf);
    expect_parts(family, g.config);
    expect_parts(family, h.config);
    // Gemma's and Qwen3.5's Hugging Face files hold the norms' gains less 1, GGUF the gains.
    EXPECT_FALSE(g.config.norm_plus_one);
    EXPECT_EQ(h.config.norm_plus_one, family.starts_with("gemma") || family == "qwen35");
    EXPECT_EQ(h.config.rope_scaling.freq_factors, g.config.rope_scaling.freq_factors) << family;
    const std::vector<int32_t> tokens =
        token_sequence(200, g.config.vocab, g.tokenizer->bos_id(), 23);
    const std::vector<float> theirs = oracle_logits(gguf, tokens, family_models());
    EXPECT_LT(max_abs_difference(our_logits(g, tokens), theirs), 1e-4) << family;
    EXPECT_LT(max_abs_difference(our_logits(h, tokens), theirs), 1e-4) << family;
    if (family == "qwen35") {
      // The published checkpoints' form: the text model of an image-and-text folder, the vision
      // model and the multi-token-prediction block left out, said in the line naming it.
      LoadedModel vl = load(family_models() / "qwen35_vl_hf");
      expect_parts(family, vl.config);
      EXPECT_LT(max_abs_difference(our_logits(vl, tokens), theirs), 1e-4);
      EXPECT_NE(vl.source.find("(its vision model and multi-token prediction, 17 tensors, left "
                               "out)"),
                std::string::npos)
          << vl.source;
    }
    // The part matters: without the scaling, with RoPE in every layer, or with llama's SwiGLU
    // and unscaled embeddings for Gemma's, the same weights give other logits.
    // (Without their norms or biases the files' tensors have no place.)
    if (family == "qwen3" || family == "phi2" || family == "qwen35") continue;
    // Gemma 3 with every layer global at one base.
    ModelConfig without = g.config;
    without.rope_scaling = RopeScaling();
    without.no_rope_layers.clear();
    if (family == "gemma") without.architecture = "llama";
    without.sliding_window = 0;
    without.attn_softcap = 0.0f;
    without.final_softcap = 0.0f;
    LoadedModel other;
    other.config = without;
    other.model = std::make_unique<DecoderModel>(without);
    const ParameterSet& from = g.model->parameters();
    std::vector<float> values;
    for (size_t i = 0; i < from.infos().size(); ++i) {
      values.resize(static_cast<size_t>(from.infos()[i].shape.numel()));
      from.read_values(static_cast<int>(i), values.data());
      other.model->parameters().write_values(static_cast<int>(i), values.data());
    }
    EXPECT_GT(max_abs_difference(our_logits(other, tokens), theirs), 1e-2) << family;
  }
}

// 60 greedy tokens of `m` after BOS with the KV cache: those llama.cpp picks with `gguf`.
void expect_greedy_as_llama_cpp(LoadedModel& m, const fs::path& gguf, const std::string& family) {
  SampleOptions options;
  options.max_new_tokens = 60;
  options.temperature = 0.0f;
  const std::vector<int32_t> ours = generate(*m.model, {m.tokenizer->bos_id()}, options);
  const fs::path out = family_models() / (family + "_greedy.txt");
  const std::string cmd = kOracle + " generate " + gguf.string() + " 60 2 > " + out.string();
  ASSERT_EQ(std::system(cmd.c_str()), 0) << cmd;
  std::istringstream line(read_all(out).substr(0, read_all(out).find('\n')));
  std::vector<int32_t> theirs = {m.tokenizer->bos_id()};
  for (int32_t id; line >> id;) theirs.push_back(id);
  EXPECT_EQ(ours, theirs) << family;
}

// 60 greedy tokens after BOS with the KV cache: the tokens llama.cpp picks.
TEST(Families, GreedyContinuationIsLlamaCpps) {
  REQUIRE_ORACLE();
  for (const std::string family : kFamilies) {
    const fs::path gguf = family_models() / (family + ".gguf");
    LoadedModel m = load(gguf);
    expect_greedy_as_llama_cpp(m, gguf, family);
  }
}

void expect_same_values(const LoadedModel& a, const LoadedModel& b, const std::string& where);

// Mixtures of experts: Qwen3-MoE's 8 experts, each token's top 2 and top 4, and Qwen3.5-MoE's (its
// layers, top 2, and a shared expert behind a sigmoid gate): GGUF, and a Hugging Face folder of
// per-expert tensors that reads to the same bits (for Qwen3.5-MoE also Transformers 5's fused
// experts), written back as a folder that reads to them too;
// llama.cpp's logits at every position of 200 tokens, and its 60 greedy tokens after BOS; an
// adapter fine-tuned on each; the same files quantised.
TEST(Families, MixturesOfExpertsAreLlamaCpps) {
  REQUIRE_ORACLE();
  for (const auto& [family, used] : {std::pair<std::string, int64_t>{"qwen3moe", 2},
                                     std::pair<std::string, int64_t>{"qwen3moe_top4", 4},
                                     std::pair<std::string, int64_t>{"qwen35moe", 2}}) {
    const fs::path gguf = family_models() / (family + ".gguf");
    LoadedModel g = load(gguf);
    const bool qwen35 = family == "qwen35moe";
    EXPECT_EQ(g.config.architecture, qwen35 ? "qwen35moe" : "qwen3moe");
    EXPECT_EQ(g.config.n_experts, 8);
    EXPECT_EQ(g.config.experts_used, used);
    EXPECT_TRUE(g.config.expert_weights_norm);
    EXPECT_EQ(g.config.shared_expert_ffn, qwen35 ? 48 : 0);
    EXPECT_EQ(g.config.linear_layers.size(), qwen35 ? 3u : 0u);
    const std::vector<int32_t> tokens =
        token_sequence(200, g.config.vocab, g.tokenizer->bos_id(), 29);
    {
      const LoadedModel h = load(family_models() / (family + "_hf"));
      expect_same_values(g, h, family);
      if (qwen35) expect_same_values(g, load(family_models() / (family + "_fused_hf")), "fused");
      // Written as a Hugging Face folder (the experts one tensor each again), it reads back to
      // the same bits.
      const fs::path out = family_models() / (family + "_exported");
      ASSERT_EQ(cputrain("export --model " + gguf.string() + " --out " + out.string()), 0);
      EXPECT_TRUE(fs::exists(out / "model.safetensors"));
      expect_same_values(g, load(out), family + " exported");
    }
    if (family == "qwen3moe") {
      // A folder whose config.json says what its tensors do not, or what cputrain does not
      // compute: one line naming the key.
      const auto refused = [&](const std::string& key, const nlohmann::json& value,
                               const std::string& needle) {
        const fs::path bad = family_models() / ("qwen3moe_bad_" + key);
        fs::copy(family_models() / "qwen3moe_hf", bad, fs::copy_options::recursive);
        nlohmann::json j = nlohmann::json::parse(read_all(bad / "config.json"));
        j[key] = value;
        std::ofstream(bad / "config.json", std::ios::trunc) << j.dump();
        try {
          load(bad);
          ADD_FAILURE() << key << " taken";
        } catch (const UserError& e) {
          EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
        }
      };
      refused("num_experts", 6, "num_experts 6 differs from the file's tensors");
      refused("num_experts_per_tok", 9, "num_experts_per_tok 9 is more than num_experts 8");
      refused("decoder_sparse_step", 2, "decoder_sparse_step 2: dense MLP layers");
      refused("mlp_only_layers", nlohmann::json::array({1}), "mlp_only_layers [1]");
    }
    EXPECT_LT(
        max_abs_difference(our_logits(g, tokens), oracle_logits(gguf, tokens, family_models())),
        1e-4)
        << family;
    expect_greedy_as_llama_cpp(g, gguf, family);
    // A LoRA fine-tune, adapters on attention and on every expert (one A and B each, in one
    // tensor of all experts), the shared expert and, for Qwen3.5-MoE, the router: llama.cpp with
    // the base file and the adapter computes cputrain's logits within 1e-4, and they are not the
    // base's. PEFT's adapter holds each expert's own (mlp.experts.<e>.gate_proj).
    const fs::path data = family_models() / "moe_finetune.jsonl";
    {
      std::ofstream f(data);
      for (int i = 0; i < 24; ++i)
        f << "{\"prompt\": \"the cat " << i << "\", \"completion\": \" sat on the mat " << 7 * i
          << "\"}\n";
    }
    const fs::path run = family_models() / ("finetune_" + family);
    ASSERT_EQ(
        cputrain("finetune --model " + gguf.string() + " --data " + data.string() + " --out " +
                 run.string() +
                 " --steps 4 --dtype fp32 --lr 1e-2 --ctx 64 --batch 2 --accum 1 --lora-rank 8" +
                 (qwen35 ? " --lora-targets q,k,v,o,gate,up,down,router" : "")),
        0)
        << family;
    const fs::path adapter = run / "adapter.gguf";
    {
      const GgufFile file(adapter.string());
      const int64_t E = 8, F = g.config.ffn, C = g.config.d_model, r = 8;
      ASSERT_NE(file.tensor("blk.1.ffn_gate_exps.weight.lora_a"), nullptr) << family;
      EXPECT_EQ(file.tensor("blk.1.ffn_gate_exps.weight.lora_a")->dims,
                (std::vector<int64_t>{C, r, E}));
      ASSERT_NE(file.tensor("blk.1.ffn_down_exps.weight.lora_b"), nullptr) << family;
      EXPECT_EQ(file.tensor("blk.1.ffn_down_exps.weight.lora_b")->dims,
                (std::vector<int64_t>{r, C, E}));
      EXPECT_EQ(file.tensor("blk.1.ffn_up_shexp.weight.lora_a") != nullptr, qwen35) << family;
      EXPECT_EQ(file.tensor("blk.1.ffn_gate_inp.weight.lora_b") != nullptr, qwen35) << family;
      const SafetensorsFile peft((run / "peft" / "adapter_model.safetensors").string());
      const std::string expert = "base_model.model.model.layers.1.mlp.experts.7.down_proj.lora_";
      ASSERT_EQ(peft.tensors().count(expert + "A.weight"), 1u) << family;
      EXPECT_EQ(peft.tensors().at(expert + "A.weight").shape, (std::vector<int64_t>{r, F}));
      EXPECT_EQ(peft.tensors().at(expert + "B.weight").shape, (std::vector<int64_t>{C, r}));
      const nlohmann::json targets =
          nlohmann::json::parse(read_all(run / "peft" / "adapter_config.json"))["target_modules"];
      EXPECT_EQ(std::count(targets.begin(), targets.end(), "gate"), qwen35 ? 1 : 0) << targets;
      EXPECT_EQ(std::count(targets.begin(), targets.end(), "down_proj"), 1) << targets;
    }
    LoadedModel adapted =
        load_model(gguf.string(), "--model", "", kDefaultImportCtx, false, adapter.string());
    const std::vector<float> with = our_logits(adapted, tokens);
    EXPECT_LT(max_abs_difference(with, oracle_logits(gguf, tokens, family_models(), adapter)), 1e-4)
        << family;
    EXPECT_GT(max_abs_difference(with, our_logits(g, tokens)), 1e-2) << family;
    // Merged into the base (export --merge, each expert's adapter into its own weights):
    // llama.cpp computes the same from the one file.
    const fs::path merged = family_models() / (family + "_merged.gguf");
    fs::remove(merged);
    ASSERT_EQ(cputrain("export --run " + run.string() + " --merge --out " + merged.string()), 0)
        << family;
    EXPECT_LT(max_abs_difference(with, oracle_logits(merged, tokens, family_models())), 1e-4)
        << family;
    // Quantised by llama.cpp's own quantiser (Q8_0, where a row's length allows; the experts
    // dequantised on reading): nearer the unquantised model than llama.cpp, which also rounds the
    // activations to 8 bits (the mean KL divergence of the next-token distributions from the
    // unquantised model's: 2.5e-3 against 6.5e-3, 1e-6 against 1.7e-6, 2.2e-3 against 8.5e-3),
    // its mean NLL within 0.02 of llama.cpp's and its next token at 90% of positions or more
    // (those 8-bit activations move a token's router logits, and where two experts are near a
    // tie, swap them: on these random tokens, llama.cpp's argmax departs from the unquantised
    // model's at up to 9% of positions, cputrain's at up to 5%).
    const fs::path q8 = family_models() / (family + "_q8_0.gguf");
    ASSERT_TRUE(oracle_quantize(gguf, q8, "q8_0"));
    LoadedModel q = load(q8);
    // The experts held as the file holds them, in place, where their rows are whole Q8_0 blocks
    // (qwen3moe's d_model of 96; the others' 80 and 72 and the down projections' rows of 40,
    // 24 and 32 are F16, read to FP32).
    const ParameterSet& qp = q.model->parameters();
    for (const char* w : {"w1", "w3"})
      EXPECT_EQ(qp.mapped(qp.find("layers.0.feed_forward.experts." + std::string(w) + ".weight")),
                family == "qwen3moe")
          << family << " " << w;
    const std::vector<float> ours_q = our_logits(q, tokens),
                             theirs_q = oracle_logits(q8, tokens, family_models()),
                             exact = our_logits(g, tokens);
    const Agreement a = agreement(ours_q, theirs_q, tokens, q.config.vocab);
    // Mean KL divergence of a model's next-token distribution from the unquantised model's.
    const auto kl = [&](const std::vector<float>& logits) {
      const int64_t V = q.config.vocab;
      double total = 0;
      for (size_t i = 0; i < tokens.size(); ++i) {
        const float* p = exact.data() + i * V;
        const float* r = logits.data() + i * V;
        double mp = p[0], mr = r[0], sp = 0, sr = 0;
        for (int64_t v = 1; v < V; ++v)
          mp = std::max<double>(mp, p[v]), mr = std::max<double>(mr, r[v]);
        for (int64_t v = 0; v < V; ++v) sp += std::exp(p[v] - mp), sr += std::exp(r[v] - mr);
        for (int64_t v = 0; v < V; ++v) {
          const double lp = p[v] - mp - std::log(sp), lr = r[v] - mr - std::log(sr);
          total += std::exp(lp) * (lp - lr);
        }
      }
      return total / static_cast<double>(tokens.size());
    };
    const double kl_ours = kl(ours_q), kl_theirs = kl(theirs_q);
    std::printf("KL from the unquantised model: %.3g (cputrain) %.3g (llama.cpp)\n", kl_ours,
                kl_theirs);
    EXPECT_GE(a.argmax, 0.9) << family;
    EXPECT_NEAR(a.nll_ours, a.nll_theirs, 0.02) << family;
    EXPECT_LT(kl_ours, kl_theirs) << family;
    if (family != "qwen3moe") continue;
    // MXFP4, gpt-oss's format, as llama.cpp's quantiser writes a mixture in it (MXFP4_MOE: the
    // experts MXFP4, where their rows are whole blocks of 32, the rest Q8_0): its experts' values
    // are gguf-py's, held in place as MXFP4; llama.cpp (which rounds the activations to 8 bits)
    // gives the same next token at 90% of positions or more and a mean NLL within 0.02.
    const fs::path mx = family_models() / (family + "_mxfp4.gguf");
    ASSERT_TRUE(oracle_quantize(gguf, mx, "mxfp4_moe"));
    const GgufFile mx_file(mx.string());
    ASSERT_NE(mx_file.tensor("blk.0.ffn_up_exps.weight"), nullptr);
    EXPECT_EQ(mx_file.tensor("blk.0.ffn_up_exps.weight")->type,
              static_cast<uint32_t>(GgmlType::MXFP4));
    const fs::path values = family_models() / "mxfp4.values";
    const std::string cmd = "/usr/bin/python3 " + std::string(CPUTRAIN_SOURCE_DIR) +
                            "/tests/interop/dequantize.py " + CPUTRAIN_GGUF_PY + " " + mx.string() +
                            " " + values.string();
    ASSERT_EQ(std::system(cmd.c_str()), 0) << cmd;
    std::ifstream index(values.string() + ".txt"),
        floats(values.string() + ".f32", std::ios::binary);
    int64_t mxfp4 = 0;
    std::string name;
    for (int64_t n; index >> name >> n;) {
      std::vector<float> want(static_cast<size_t>(n));
      floats.read(reinterpret_cast<char*>(want.data()), n * 4);
      const GgufTensor* t = mx_file.tensor(name);
      ASSERT_NE(t, nullptr) << name;
      if (t->type != static_cast<uint32_t>(GgmlType::MXFP4)) continue;
      ++mxfp4;
      EXPECT_EQ(gguf_tensor_values(mx_file, *t), want) << name;
    }
    EXPECT_GE(mxfp4, 4);  // both layers' gate and up
    LoadedModel m4 = load(mx);
    const ParameterSet& mp = m4.model->parameters();
    for (const char* w : {"w1", "w3"}) {
      const int i = mp.find("layers.1.feed_forward.experts." + std::string(w) + ".weight");
      EXPECT_TRUE(mp.mapped(i)) << w;
      EXPECT_EQ(mp.infos()[static_cast<size_t>(i)].mapped_dtype, DType::MXFP4) << w;
    }
    const Agreement a4 =
        agreement(our_logits(m4, tokens), oracle_logits(mx, tokens, family_models()), tokens,
                  m4.config.vocab);
    EXPECT_GE(a4.argmax, 0.9);
    EXPECT_NEAR(a4.nll_ours, a4.nll_theirs, 0.02);
  }
}

// gpt-oss (make_family_models.py's gpt_oss): q/k/v/o biases, a sink per head, every other layer
// within a window of 32, YaRN RoPE, 8 experts with biases behind a biased router (top 4 of the
// logits, softmaxed) and the clamped SwiGLU: llama.cpp's logits at every position of 200 tokens
// and its 60 greedy tokens; without the sinks or YaRN the logits are others; YaRN's scale of cos
// and sin beside its own (rope.scaling.attn_factor) written and read as llama.cpp reads it; written
// back as GGUF it reads to the same bits; a LoRA fine-tune on attention and the experts loads in
// llama.cpp to cputrain's logits, merged or not; quantised to MXFP4_MOE, its own format.
TEST(Families, GptOssIsLlamaCpps) {
  REQUIRE_ORACLE();
  const fs::path gguf = family_models() / "gpt_oss.gguf";
  LoadedModel g = load(gguf);
  const ModelConfig& c = g.config;
  EXPECT_EQ(c.architecture, "gpt-oss");
  EXPECT_EQ(c.n_experts, 8);
  EXPECT_EQ(c.experts_used, 4);
  EXPECT_EQ(c.sliding_window, 32);
  EXPECT_EQ(c.swa_pattern, 2);
  EXPECT_TRUE(c.qkv_bias);
  EXPECT_EQ(c.rope_scaling.type, "yarn");
  EXPECT_EQ(c.rope_scaling.factor, 32.0);
  EXPECT_EQ(c.rope_scaling.original_ctx, 64);
  EXPECT_NEAR(c.rope_scaling.attn_factor, 1.0 + 0.1 * std::log(32.0), 1e-12);
  EXPECT_FALSE(c.rope_swa_apart());  // YaRN scales the windowed layers too
  const ParameterSet& params = g.model->parameters();
  for (const char* name :
       {"layers.3.attention.sinks.weight", "layers.3.attention.wo.bias",
        "layers.3.feed_forward.router.bias", "layers.3.feed_forward.experts.w1.bias",
        "layers.3.feed_forward.experts.w3.bias", "layers.3.feed_forward.experts.w2.bias"})
    EXPECT_GE(params.find(name), 0) << name;
  const std::vector<int32_t> tokens = token_sequence(200, c.vocab, g.tokenizer->bos_id(), 31);
  const std::vector<float> theirs = oracle_logits(gguf, tokens, family_models());
  const std::vector<float> ours = our_logits(g, tokens);
  EXPECT_LT(max_abs_difference(ours, theirs), 1e-4);
  expect_greedy_as_llama_cpp(g, gguf, "gpt_oss");
  // Each part matters: the same weights without the sinks (at -inf: zero weight), without YaRN,
  // or with the plain SwiGLU give other logits.
  // The same weights as a model of `config`, the sinks at -inf (zero weight) where not `sinks`.
  const auto variant = [&](const ModelConfig& config, bool sinks) {
    LoadedModel other;
    other.config = config;
    other.model = std::make_unique<DecoderModel>(config);
    std::vector<float> values;
    for (size_t i = 0; i < params.infos().size(); ++i) {
      values.resize(static_cast<size_t>(params.infos()[i].shape.numel()));
      params.read_values(static_cast<int>(i), values.data());
      if (!sinks && params.infos()[i].name.ends_with("sinks.weight"))
        std::fill(values.begin(), values.end(), -1e30f);
      other.model->parameters().write_values(static_cast<int>(i), values.data());
    }
    return other;
  };
  LoadedModel without_sinks = variant(c, false);
  EXPECT_GT(max_abs_difference(our_logits(without_sinks, tokens), theirs), 1e-2);
  ModelConfig unscaled = c;
  unscaled.rope_scaling = RopeScaling();
  LoadedModel without_yarn = variant(unscaled, true);
  EXPECT_GT(max_abs_difference(our_logits(without_yarn, tokens), theirs), 1e-2);
  // A scale of cos and sin beside YaRN's own (rope.scaling.attn_factor) is written, read back,
  // and computed by llama.cpp from the file as by cputrain.
  {
    ModelConfig scaled = c;
    scaled.rope_scaling.attn_factor *= 1.1;
    const LoadedModel s = variant(scaled, true);
    const fs::path file = family_models() / "gpt_oss_attn_factor.gguf";
    write_gguf(file.string(), scaled, s.model->parameters(), g.tokenizer->to_vocabulary(), {});
    LoadedModel back = load(file);
    EXPECT_NEAR(back.config.rope_scaling.attn_factor, scaled.rope_scaling.attn_factor, 1e-6);
    const std::vector<float> logits = our_logits(back, tokens);
    EXPECT_LT(max_abs_difference(logits, oracle_logits(file, tokens, family_models())), 1e-4);
    EXPECT_GT(max_abs_difference(logits, theirs), 1e-2);
  }
  // Written as GGUF it reads back to the same bits.
  const fs::path out = family_models() / "gpt_oss_exported.gguf";
  ASSERT_EQ(cputrain("export --model " + gguf.string() + " --out " + out.string()), 0);
  expect_same_values(g, load(out), "gpt-oss exported");
  // Transformers' folder of the same weights (the experts' gate and up alternating in one
  // tensor, transposed) reads to the same bits and llama.cpp's logits; written as a folder, it
  // reads back so too. Its YaRN without truncation (gpt-oss's published config) is Transformers'
  // unrounded blend, not llama.cpp's.
  {
    const fs::path folder = family_models() / "gpt_oss_hf";
    LoadedModel h = load(folder);
    expect_same_values(g, h, "gpt-oss folder");
    EXPECT_EQ(h.config.rope_scaling.freq_factors, c.rope_scaling.freq_factors);
    EXPECT_LT(max_abs_difference(our_logits(h, tokens), theirs), 1e-4);
    const fs::path written = family_models() / "gpt_oss_written_hf";
    ASSERT_EQ(cputrain("export --model " + gguf.string() + " --out " + written.string()), 0);
    const nlohmann::json config = nlohmann::json::parse(read_all(written / "config.json"));
    EXPECT_EQ(config["num_local_experts"], 8);
    EXPECT_EQ(config["rope_scaling"]["rope_type"], "yarn");
    expect_same_values(g, load(written), "gpt-oss written folder");
    const fs::path untruncated = family_models() / "gpt_oss_untruncated_hf";
    fs::copy(folder, untruncated, fs::copy_options::recursive);
    nlohmann::json j = nlohmann::json::parse(read_all(folder / "config.json"));
    j["rope_scaling"]["truncate"] = false;
    std::ofstream(untruncated / "config.json", std::ios::trunc) << j.dump();
    const ModelConfig u = load(untruncated).config;
    EXPECT_FALSE(u.rope_scaling.truncate);
    EXPECT_NE(u.rope_scaling.freq_factors, c.rope_scaling.freq_factors);
  }
  // A LoRA fine-tune on attention and every expert: llama.cpp with the adapter, and with the
  // merged file, computes cputrain's logits.
  const fs::path data = family_models() / "gpt_oss_finetune.jsonl";
  {
    std::ofstream f(data);
    for (int i = 0; i < 24; ++i)
      f << "{\"prompt\": \"the cat " << i << "\", \"completion\": \" sat on the mat " << 7 * i
        << "\"}\n";
  }
  const fs::path run = family_models() / "finetune_gpt_oss";
  ASSERT_EQ(
      cputrain("finetune --model " + gguf.string() + " --data " + data.string() + " --out " +
               run.string() +
               " --steps 4 --dtype fp32 --lr 3e-3 --ctx 64 --batch 2 --accum 1 --lora-rank 8"),
      0);
  const fs::path adapter = run / "adapter.gguf";
  LoadedModel adapted =
      load_model(gguf.string(), "--model", "", kDefaultImportCtx, false, adapter.string());
  const std::vector<float> with = our_logits(adapted, tokens);
  EXPECT_LT(max_abs_difference(with, oracle_logits(gguf, tokens, family_models(), adapter)), 1e-4);
  EXPECT_GT(max_abs_difference(with, ours), 1e-2);
  const fs::path merged = family_models() / "gpt_oss_merged.gguf";
  fs::remove(merged);
  ASSERT_EQ(cputrain("export --run " + run.string() + " --merge --out " + merged.string()), 0);
  EXPECT_LT(max_abs_difference(with, oracle_logits(merged, tokens, family_models())), 1e-4);
  // MXFP4_MOE, as llama.cpp's quantiser writes gpt-oss: the experts held in place as MXFP4
  // (rows of 88 are not whole blocks of 32: F16 or Q8_0 where not), the same next token as
  // llama.cpp (which rounds the activations to 8 bits) at 90% of positions, NLL within 0.02.
  const fs::path mx = family_models() / "gpt_oss_mxfp4.gguf";
  ASSERT_TRUE(oracle_quantize(gguf, mx, "mxfp4_moe"));
  LoadedModel m4 = load(mx);
  const Agreement a4 = agreement(our_logits(m4, tokens), oracle_logits(mx, tokens, family_models()),
                                 tokens, m4.config.vocab);
  EXPECT_GE(a4.argmax, 0.9);
  EXPECT_NEAR(a4.nll_ours, a4.nll_theirs, 0.02);
}

// A mixture written as q4_k (export --type q4_k, one tensor at a time) takes the types llama.cpp's
// own quantiser gives the same file for Q4_K_M: its routers F32, its experts quantised as
// matrices, the down projections' (and a shared expert's) extra bits in llama.cpp's layers; a
// mixture of 8 experts' k and v Q8_0. (llama.cpp gives such a mixture's attention output Q5_K, or
// Q5_1 where rows are not whole blocks of 256, which cputrain does not write: Q4_K or Q5_0 there.)
// llama.cpp computes cputrain's logits on it: argmax at 90% of positions, mean NLL within 0.01
// (these small random models' logits are flat, and llama.cpp's 8-bit activations swap near-ties:
// on llama.cpp's own Q4_K_M file of qwen3moe and qwen35moe the argmax agrees at 94% and 95%).
TEST(Families, AMixtureExportedAsQ4KTakesLlamaCppsMix) {
  REQUIRE_ORACLE();
  for (const std::string family : {"qwen3moe", "qwen35moe", "gpt_oss"}) {
    // llama.cpp's quantiser is given the model as cputrain writes it in F32 (without what it
    // leaves out, as Qwen3.5's multi-token prediction block, which llama.cpp's layer count for
    // the extra bits would include).
    const fs::path file = family_models() / (family + ".gguf");
    const fs::path f32 = family_models() / (family + "_f32.gguf");
    const fs::path mine = family_models() / (family + "_q4k.gguf");
    const fs::path theirs = family_models() / (family + "_q4_k_m.gguf");
    ASSERT_EQ(cputrain("export --model " + file.string() + " --out " + f32.string()), 0);
    ASSERT_EQ(cputrain("export --model " + file.string() + " --type q4_k --out " + mine.string()),
              0);
    ASSERT_TRUE(oracle_quantize(f32, theirs, "q4_k_m"));
    const GgufFile a(mine.string()), b(theirs.string());
    ASSERT_EQ(a.tensors().size(), b.tensors().size()) << family;
    int experts_quantised = 0;
    for (const GgufTensor& t : b.tensors()) {
      const GgufTensor* ours = a.tensor(t.name);
      ASSERT_NE(ours, nullptr) << family << " " << t.name;
      // (llama.cpp writes no trailing dimensions of 1.)
      std::vector<int64_t> dims = ours->dims;
      while (dims.size() > t.dims.size() && dims.back() == 1) dims.pop_back();
      EXPECT_EQ(dims, t.dims) << family << " " << t.name;
      if (t.name.ends_with(".attn_output.weight")) continue;
      EXPECT_EQ(ggml_type_name(ours->type), ggml_type_name(t.type)) << family << " " << t.name;
      experts_quantised += t.name.find("_exps.weight") != std::string::npos &&
                           ours->type != static_cast<uint32_t>(GgmlType::F32);
    }
    EXPECT_GT(experts_quantised, 0) << family;
    LoadedModel m = load(mine);
    const std::vector<int32_t> tokens =
        token_sequence(120, m.config.vocab, m.tokenizer->bos_id(), 5);
    const Agreement g =
        agreement(our_logits(m, tokens), oracle_logits(mine, tokens, family_models()), tokens,
                  m.config.vocab);
    EXPECT_GE(g.argmax, 0.9) << family;
    EXPECT_NEAR(g.nll_ours, g.nll_theirs, 0.01) << family;
  }
}

// Each family's vocabulary from its GGUF file (Gemma's without the space prefix) and from its
// Hugging Face folder tokenizes as llama.cpp tokenizes the GGUF file, plain text and text with
// the family's special tokens in it (parsed as those tokens).
TEST(Families, VocabulariesTokenizeAsLlamaCpp) {
  REQUIRE_ORACLE();
  const TempFolder folder{temp_dir("family_tokens")};
  for (const std::string family : kFamilies) {
    const fs::path gguf = family_models() / (family + ".gguf");
    const LoadedModel g = load(gguf), h = load(family_models() / (family + "_hf"));
    for (const char* text : {" the cat sat  on the mat\nand ran far, xyz",
                             "<start_of_turn>user\nthe dog<end_of_turn>\n<start_of_turn>model\n",
                             "<|user|>\na cat<|end|>\n<|assistant|>\n"}) {
      std::ofstream(folder.path / "text.txt", std::ios::binary) << text;
      const std::string cmd = kOracle + " tokenize " + gguf.string() + " " +
                              (folder.path / "text.txt").string() + " special > " +
                              (folder.path / "ids.txt").string();
      ASSERT_EQ(std::system(cmd.c_str()), 0) << cmd;
      std::vector<int32_t> theirs;
      std::istringstream in(read_all(folder.path / "ids.txt"));
      for (int32_t id; in >> id;) theirs.push_back(id);
      EXPECT_EQ(g.tokenizer->encode_piece(text, true, true), theirs) << family << ": " << text;
      EXPECT_EQ(h.tokenizer->encode_piece(text, true, true), theirs) << family << ": " << text;
    }
  }
}

// Each parameter's values in Hugging Face's q/k row order and norm gains whole, for comparing
// models of either pairing and either way of holding the gains.
std::vector<std::vector<float>> values_of(const LoadedModel& m) {
  std::vector<std::vector<float>> out;
  const ParameterSet& p = m.model->parameters();
  for (size_t i = 0; i < p.infos().size(); ++i)
    out.push_back(parameter_values(p, static_cast<int>(i), m.config, RopePairs::HalfSplit, false));
  return out;
}

// Two models' parameters the same bits, but Gated DeltaNet's A_log: GGUF holds -exp(A_log),
// whose log gives it back within float's rounding.
void expect_same_values(const LoadedModel& a, const LoadedModel& b, const std::string& where) {
  const std::vector<std::vector<float>> want = values_of(a), got = values_of(b);
  ASSERT_EQ(got.size(), want.size()) << where;
  for (size_t i = 0; i < want.size(); ++i) {
    const std::string& name = a.model->parameters().infos()[i].name;
    if (!name.ends_with(".a_log.weight")) {
      EXPECT_TRUE(got[i] == want[i]) << where << ": " << name;
      continue;
    }
    ASSERT_EQ(got[i].size(), want[i].size());
    for (size_t j = 0; j < want[i].size(); ++j)
      EXPECT_NEAR(got[i][j], want[i][j], 1e-6) << where << ": " << name;
  }
}

// export (GGUF f32, Hugging Face F32) then import: the same configuration and the same bits, from
// either format; llama.cpp computes the exported GGUF's logits as the original's. The GGUF file
// and the Hugging Face folder of the same weights read to the same bits.
TEST(Families, ExportThenImportIsBitExact) {
  REQUIRE_ORACLE();
  const TempFolder folder{temp_dir("family_export")};
  for (const std::string family : kFamilies) {
    expect_same_values(load(family_models() / (family + ".gguf")),
                       load(family_models() / (family + "_hf")), family + ": GGUF and HF");
    for (const std::string& from : {family + ".gguf", family + "_hf"}) {
      const fs::path source = family_models() / from;
      LoadedModel original = load(source);
      for (const char* to : {"out.gguf", "out_hf"}) {
        const fs::path out = folder.path / to;
        fs::remove_all(out);
        ASSERT_EQ(
            cputrain("export --model " + source.string() + " --type f32 --out " + out.string()), 0)
            << from << " -> " << to;
        LoadedModel back = load(out);
        EXPECT_EQ(back.config.architecture, original.config.architecture) << from << to;
        EXPECT_EQ(back.config.rope_scaling.type, original.config.rope_scaling.type) << from << to;
        EXPECT_EQ(back.config.rope_scaling.freq_factors, original.config.rope_scaling.freq_factors)
            << from << to;
        EXPECT_EQ(back.config.no_rope_layers, original.config.no_rope_layers) << from << to;
        EXPECT_EQ(back.config.qk_norm, original.config.qk_norm) << from << to;
        EXPECT_EQ(back.config.tie_embeddings, original.config.tie_embeddings) << from << to;
        EXPECT_EQ(back.config.norm_plus_one, (family.starts_with("gemma") || family == "qwen35") &&
                                                 std::string(to) == "out_hf")
            << from << to;
        EXPECT_EQ(back.config.linear_layers, original.config.linear_layers) << from << to;
        EXPECT_EQ(back.config.linear_value_heads, original.config.linear_value_heads) << from << to;
        EXPECT_EQ(back.config.sliding_window, original.config.sliding_window) << from << to;
        EXPECT_EQ(back.config.rope_theta_swa, original.config.rope_theta_swa) << from << to;
        EXPECT_EQ(back.config.attn_softcap, original.config.attn_softcap) << from << to;
        EXPECT_EQ(back.config.final_softcap, original.config.final_softcap) << from << to;
        expect_same_values(original, back, from + " -> " + to);
      }
    }
    // (Not named after the family: llama.cpp treats a vocabulary of a model named phi3 as
    // Phi-3's own, which holds <|endoftext|>.)
    const fs::path exported = folder.path / "exported.gguf";
    fs::remove(exported);
    ASSERT_EQ(cputrain("export --model " + (family_models() / (family + "_hf")).string() +
                       " --type f32 --out " + exported.string()),
              0);
    LoadedModel m = load(family_models() / (family + ".gguf"));
    const std::vector<int32_t> tokens = token_sequence(64, m.config.vocab, 1, 3);
    EXPECT_LT(
        max_abs_difference(our_logits(m, tokens), oracle_logits(exported, tokens, folder.path)),
        1e-4)
        << family;
  }
}

// A 3-step LoRA fine-tune of `gguf` on `data` into `run` (rank 4, every target, `flags` beside):
// on 48 tokens llama.cpp with the base and the run's adapter.gguf computes cputrain's logits with
// the adapter (within 1e-4), which differ from the base's; so does llama.cpp with the adapter
// merged into the base (export --merge, to `merged`). `scratch` holds llama.cpp's outputs.
void expect_fine_tune_as_llama_cpp(const fs::path& gguf, const fs::path& data, const fs::path& run,
                                   const fs::path& merged, const std::string& flags,
                                   const fs::path& scratch) {
  ASSERT_EQ(cputrain("finetune --model " + gguf.string() + " --data " + data.string() + " --out " +
                     run.string() + " --steps 3 " + flags +
                     " --lr 1e-2 --ctx 64 --batch 2 --accum 1 --lora-rank 4 --lora-targets all"),
            0);
  const fs::path adapter = run / "adapter.gguf";
  LoadedModel plain = load(gguf);
  LoadedModel with =
      load_model(gguf.string(), "--model", "", kDefaultImportCtx, false, adapter.string());
  const std::vector<int32_t> tokens = token_sequence(48, plain.config.vocab, 1, 5);
  const std::vector<float> ours = our_logits(with, tokens);
  EXPECT_LT(max_abs_difference(ours, oracle_logits(gguf, tokens, scratch, adapter)), 1e-4);
  EXPECT_GT(max_abs_difference(ours, our_logits(plain, tokens)), 1e-3);
  fs::remove(merged);
  ASSERT_EQ(cputrain("export --run " + run.string() + " --merge --out " + merged.string()), 0);
  EXPECT_LT(max_abs_difference(ours, oracle_logits(merged, tokens, scratch)), 1e-4);
}

// A LoRA fine-tune of each family (adapters on all its projections, fp32): llama.cpp with the
// base GGUF and the adapter computes what cputrain computes, and both differ from the base; so
// does llama.cpp with the adapter merged into the base (export --merge).
TEST(Families, FineTunedAdaptersGiveLlamaCppsLogits) {
  REQUIRE_ORACLE();
  const TempFolder folder{temp_dir("family_lora")};
  const fs::path data = write_finetune_data(folder.path);
  for (const std::string family : kFamilies) {
    const fs::path base = family_models() / (family + ".gguf");
    const fs::path run = folder.path / family;
    {
      SCOPED_TRACE(family);
      expect_fine_tune_as_llama_cpp(base, data, run, folder.path / "merged.gguf", "--dtype fp32",
                                    folder.path);
    }
    if (family == "phi2") {
      // Phi-2's modules by its own names; it has no gate to adapt.
      const nlohmann::json config =
          nlohmann::json::parse(read_all(run / "peft" / "adapter_config.json"));
      EXPECT_EQ(config["target_modules"],
                nlohmann::json({"q_proj", "k_proj", "v_proj", "dense", "fc1", "fc2"}));
      expect_one_line_refusal(
          run_cputrain("finetune --model " + base.string() + " --data " + data.string() +
                           " --out " + (folder.path / "gate").string() + " --lora-targets q,gate",
                       folder.path),
          "--lora-targets q,gate: phi2 has no gate projection (its MLP is up, GELU, down: fc1 and "
          "fc2)");
      // Its names for o, up and down.
      ASSERT_EQ(cputrain("finetune --model " + base.string() + " --data " + data.string() +
                         " --out " + (folder.path / "named").string() +
                         " --steps 1 --dtype fp32 --ctx 64 --batch 2 --accum 1 --lora-rank 4 "
                         "--lora-targets dense,fc1,fc2"),
                0);
      EXPECT_EQ(nlohmann::json::parse(read_all(folder.path / "named" / "peft" /
                                               "adapter_config.json"))["target_modules"],
                nlohmann::json({"dense", "fc1", "fc2"}));
    }
    if (family == "qwen35") {
      // Qwen3.5's modules by PEFT's names: a DeltaNet layer's in_proj_qkv (one A, B of q, k and
      // v's rows), out_proj, in_proj_z, _b, _a; attention's q_proj, whose B holds each head's q
      // and gate rows.
      const nlohmann::json config =
          nlohmann::json::parse(read_all(run / "peft" / "adapter_config.json"));
      EXPECT_EQ(config["target_modules"],
                nlohmann::json({"in_proj_qkv", "out_proj", "gate_proj", "up_proj", "down_proj",
                                "in_proj_z", "in_proj_b", "in_proj_a", "q_proj", "k_proj", "v_proj",
                                "o_proj"}));
      const SafetensorsFile peft((run / "peft" / "adapter_model.safetensors").string());
      const std::string qkv = "base_model.model.model.layers.0.linear_attn.in_proj_qkv.lora_";
      ASSERT_EQ(peft.tensors().count(qkv + "A.weight"), 1u);
      EXPECT_EQ(peft.tensors().at(qkv + "A.weight").shape, (std::vector<int64_t>{4, 88}));
      EXPECT_EQ(peft.tensors().at(qkv + "B.weight").shape, (std::vector<int64_t>{2 * 48 + 96, 4}));
      const std::string q = "base_model.model.model.layers.3.self_attn.q_proj.lora_";
      ASSERT_EQ(peft.tensors().count(q + "B.weight"), 1u);
      EXPECT_EQ(peft.tensors().at(q + "B.weight").shape, (std::vector<int64_t>{2 * 96, 4}));
      // 3 DeltaNet layers of 5 modules, one attention layer of 4, 3 MLPs each: A and B.
      EXPECT_EQ(peft.tensors().size(), 2u * (3u * 5u + 4u + 4u * 3u));
      // Part of in_proj_qkv is refused, naming it.
      expect_one_line_refusal(
          run_cputrain("finetune --model " + base.string() + " --data " + data.string() +
                           " --out " + (folder.path / "partial").string() + " --lora-targets q,v",
                       folder.path),
          "--lora-targets q,v: qwen35's q, k and v (in its Gated DeltaNet layers) are one "
          "projection, in_proj_qkv: adapt all or none");
    }
    if (family != "phi3") continue;
    // Phi-3's fused projections take one adapter each, by their own names: qkv_proj's A is the
    // three parts' one, its B their rows one after another.
    const nlohmann::json config =
        nlohmann::json::parse(read_all(run / "peft" / "adapter_config.json"));
    EXPECT_EQ(config["target_modules"],
              nlohmann::json({"qkv_proj", "o_proj", "gate_up_proj", "down_proj"}));
    const SafetensorsFile peft((run / "peft" / "adapter_model.safetensors").string());
    const std::string qkv = "base_model.model.model.layers.0.self_attn.qkv_proj.lora_";
    ASSERT_EQ(peft.tensors().count(qkv + "A.weight"), 1u);
    EXPECT_EQ(peft.tensors().at(qkv + "A.weight").shape, (std::vector<int64_t>{4, 128}));
    EXPECT_EQ(peft.tensors().at(qkv + "B.weight").shape, (std::vector<int64_t>{128 + 2 * 64, 4}));
    EXPECT_EQ(peft.tensors().size(), 2u * 4u * 2u);  // 2 layers, 4 modules, A and B
    // Part of a fused projection is refused, naming it.
    expect_one_line_refusal(
        run_cputrain("finetune --model " + base.string() + " --data " + data.string() + " --out " +
                         (folder.path / "partial").string() + " --lora-targets q,o",
                     folder.path),
        "--lora-targets q,o: phi3's q, k and v are one projection, qkv_proj: adapt all or none");
  }
}

// Phi-2 as converted from its original checkpoint, q, k and v (weights and biases) in one tensor
// (attn_qkv): llama.cpp's logits and greedy continuation; exported as GGUF it is fused again, as
// a Hugging Face folder split as Transformers' Phi holds it, both reading back to the same bits.
// Adapters on q, k and v share one A, written as one attn_qkv adapter that llama.cpp applies to
// the fused tensor (merged too), and as PEFT's q_proj, k_proj and v_proj; part of the three is
// refused.
TEST(Families, Phi2WithFusedQkvIsLlamaCpps) {
  REQUIRE_ORACLE();
  const TempFolder folder{temp_dir("phi2_fused")};
  const fs::path gguf = family_models() / "phi2_fused.gguf";
  LoadedModel g = load(gguf);
  expect_parts("phi2", g.config);
  EXPECT_TRUE(g.config.qkv_fused);
  EXPECT_FALSE(load(family_models() / "phi2.gguf").config.qkv_fused);
  const std::vector<int32_t> tokens =
      token_sequence(200, g.config.vocab, g.tokenizer->bos_id(), 31);
  const std::vector<float> theirs = oracle_logits(gguf, tokens, folder.path);
  EXPECT_LT(max_abs_difference(our_logits(g, tokens), theirs), 1e-4);
  expect_greedy_as_llama_cpp(g, gguf, "phi2_fused");
  for (const char* to : {"out.gguf", "out_hf"}) {
    const fs::path out = folder.path / to;
    ASSERT_EQ(cputrain("export --model " + gguf.string() + " --type f32 --out " + out.string()), 0)
        << to;
    LoadedModel back = load(out);
    EXPECT_EQ(back.config.qkv_fused, std::string(to) == "out.gguf") << to;
    expect_same_values(g, back, to);
  }
  const GgufFile exported((folder.path / "out.gguf").string());
  EXPECT_NE(exported.tensor("blk.1.attn_qkv.weight"), nullptr);
  EXPECT_NE(exported.tensor("blk.1.attn_qkv.bias"), nullptr);
  EXPECT_EQ(exported.tensor("blk.1.attn_q.weight"), nullptr);
  EXPECT_LT(
      max_abs_difference(oracle_logits(folder.path / "out.gguf", tokens, folder.path), theirs),
      1e-6);

  const fs::path data = write_finetune_data(folder.path);
  const fs::path run = folder.path / "run", merged = folder.path / "merged.gguf";
  expect_fine_tune_as_llama_cpp(gguf, data, run, merged, "--dtype fp32", folder.path);
  const GgufFile a((run / "adapter.gguf").string());
  ASSERT_NE(a.tensor("blk.0.attn_qkv.weight.lora_a"), nullptr);
  EXPECT_EQ(a.tensor("blk.0.attn_qkv.weight.lora_b")->dims, (std::vector<int64_t>{4, 3 * 160}));
  EXPECT_EQ(a.tensor("blk.0.attn_q.weight.lora_a"), nullptr);
  EXPECT_NE(GgufFile(merged.string()).tensor("blk.0.attn_qkv.weight"), nullptr);
  // PEFT's modules are Transformers' Phi's: q_proj, k_proj and v_proj, each with the one A.
  EXPECT_EQ(nlohmann::json::parse(read_all(run / "peft" / "adapter_config.json"))["target_modules"],
            nlohmann::json({"q_proj", "k_proj", "v_proj", "dense", "fc1", "fc2"}));
  const SafetensorsFile peft((run / "peft" / "adapter_model.safetensors").string());
  const std::string at = "base_model.model.model.layers.1.self_attn.";
  for (const char* p : {"q_proj", "k_proj", "v_proj"}) {
    ASSERT_EQ(peft.tensors().count(at + p + ".lora_A.weight"), 1u) << p;
    EXPECT_EQ(peft.tensors().at(at + p + ".lora_A.weight").shape, (std::vector<int64_t>{4, 160}));
    EXPECT_EQ(peft.tensors().at(at + p + ".lora_B.weight").shape, (std::vector<int64_t>{160, 4}));
  }
  const auto bytes = [&](const std::string& name) {
    const std::span<const uint8_t> d = peft.tensors().at(name).data;
    return std::vector<uint8_t>(d.begin(), d.end());
  };
  EXPECT_EQ(bytes(at + "q_proj.lora_A.weight"), bytes(at + "v_proj.lora_A.weight"));
  EXPECT_NE(bytes(at + "q_proj.lora_B.weight"), bytes(at + "v_proj.lora_B.weight"));
  expect_one_line_refusal(
      run_cputrain("finetune --model " + gguf.string() + " --data " + data.string() + " --out " +
                       (folder.path / "partial").string() + " --lora-targets q,o",
                   folder.path),
      "--lora-targets q,o: phi2's q, k and v (in its GGUF file) are one projection, attn_qkv: "
      "adapt all or none");
}

// A family's model whose parameters are parameter_count's: its logits of `tokens` within 1e-4 of
// llama.cpp's (which it returns), and its greedy continuation llama.cpp's.
std::vector<float> expect_as_llama_cpp(LoadedModel& g, const fs::path& gguf,
                                       const std::string& family,
                                       const std::vector<int32_t>& tokens,
                                       const fs::path& scratch) {
  int64_t declared = 0;
  for (const ParameterInfo& info : g.model->parameters().infos()) declared += info.shape.numel();
  EXPECT_EQ(declared, parameter_count(g.config)) << family;
  std::vector<float> theirs = oracle_logits(gguf, tokens, scratch);
  EXPECT_LT(max_abs_difference(our_logits(g, tokens), theirs), 1e-4) << family;
  expect_greedy_as_llama_cpp(g, gguf, family);
  return theirs;
}

// Gemma 4 E2B's parts (make_family_models.py gemma4): two head sizes, key/value heads per kind,
// proportional RoPE on the global layers, layers sharing keys and values, per-layer embeddings,
// v norms, output scales and the logits' soft-cap give llama.cpp's logits, greedy continuation
// (through the shared cache), and export back to the same bits; a LoRA adapter fine-tuned on it
// gives llama.cpp's logits with the base.
TEST(Families, Gemma4IsLlamaCpps) {
  REQUIRE_ORACLE();
  const TempFolder folder{temp_dir("gemma4")};
  const fs::path gguf = family_models() / "gemma4.gguf";
  LoadedModel g = load(gguf);
  const ModelConfig& c = g.config;
  EXPECT_EQ(c.architecture, "gemma4");
  EXPECT_EQ(c.head_size(), 64);
  EXPECT_EQ(c.head_dim_swa, 32);
  EXPECT_EQ(c.kv_heads(), 1);
  EXPECT_EQ(c.n_kv_heads_swa, 2);
  EXPECT_EQ(c.swa_pattern, 3);
  EXPECT_EQ(c.sliding_window, 32);
  EXPECT_EQ(c.shared_kv_layers, 3);
  EXPECT_EQ(c.per_layer_dim, 16);
  EXPECT_EQ(c.final_softcap, 5.0f);
  EXPECT_EQ(c.rope_scaling.type, "factors");
  EXPECT_EQ(c.layer_ffn, (std::vector<int64_t>{96, 96, 96, 96, 96, 96, 192, 192, 192}));
  for (const auto& [layer, from] :
       {std::pair{5, 5}, std::pair{6, 4}, std::pair{7, 4}, std::pair{8, 5}})
    EXPECT_EQ(c.kv_layer(layer), from) << layer;
  const ParameterSet& params = g.model->parameters();
  EXPECT_LT(params.find("layers.6.attention.wk.weight"), 0);
  EXPECT_GE(params.find("layers.6.per_layer.gate.weight"), 0);
  const std::vector<int32_t> tokens = token_sequence(200, c.vocab, g.tokenizer->bos_id(), 37);
  const std::vector<float> theirs = expect_as_llama_cpp(g, gguf, "gemma4", tokens, folder.path);
  // The per-layer inputs matter: without their table (zeros) the same weights give other
  // logits.
  const auto variant = [&](const ModelConfig& config, const std::string& zeroed) {
    LoadedModel other;
    other.config = config;
    other.model = std::make_unique<DecoderModel>(config);
    std::vector<float> values;
    for (size_t i = 0; i < params.infos().size(); ++i) {
      const std::string& name = params.infos()[i].name;
      const int to = other.model->parameters().find(name);
      if (to < 0) continue;
      values.resize(static_cast<size_t>(params.infos()[i].shape.numel()));
      params.read_values(static_cast<int>(i), values.data());
      if (name == zeroed) std::fill(values.begin(), values.end(), 0.0f);
      other.model->parameters().write_values(to, values.data());
    }
    return other;
  };
  LoadedModel no_table = variant(c, "per_layer.embeddings.weight");
  EXPECT_GT(max_abs_difference(our_logits(no_table, tokens), theirs), 1e-2);
  // A cache of one chunk and of many give the same continuation (the shared layers read their
  // source's cache as it stands).
  {
    DecoderModel::KvCache one = g.model->new_kv_cache(), pieces = g.model->new_kv_cache();
    const std::vector<int32_t> prompt(tokens.begin(), tokens.begin() + 90);
    const Tensor whole = g.model->decode(prompt, one);
    Tensor last;
    for (size_t s = 0; s < prompt.size(); s += 7)
      last = g.model->decode(
          std::vector<int32_t>(prompt.begin() + static_cast<long>(s),
                               prompt.begin() + static_cast<long>(std::min(prompt.size(), s + 7))),
          pieces);
    const std::vector<float> a(whole.f32(), whole.f32() + c.vocab),
        b(last.f32(), last.f32() + c.vocab);
    const std::vector<float> ref(theirs.begin() + 89 * c.vocab, theirs.begin() + 90 * c.vocab);
    EXPECT_LT(max_abs_difference(a, ref), 1e-4);
    EXPECT_LT(max_abs_difference(b, ref), 1e-4);
  }
  // Written as GGUF it reads back to the same bits, and llama.cpp computes the written file
  // as the original.
  const fs::path out = folder.path / "out.gguf";
  ASSERT_EQ(cputrain("export --model " + gguf.string() + " --type f32 --out " + out.string()), 0);
  expect_same_values(g, load(out), "gemma4 exported");
  EXPECT_LT(max_abs_difference(oracle_logits(out, tokens, folder.path), theirs), 1e-6);

  // A LoRA fine-tune (bf16, each layer recomputed in backward): the shared layers adapt q and o
  // alone; llama.cpp applies the adapter to the base as cputrain does, and the merged model.
  const fs::path run = folder.path / "run";
  expect_fine_tune_as_llama_cpp(gguf, write_finetune_data(folder.path), run,
                                folder.path / "merged.gguf", "--dtype bf16 --checkpoint layer",
                                folder.path);
  const GgufFile a((run / "adapter.gguf").string());
  EXPECT_NE(a.tensor("blk.5.attn_k.weight.lora_a"), nullptr);
  EXPECT_EQ(a.tensor("blk.6.attn_k.weight.lora_a"), nullptr);
  EXPECT_NE(a.tensor("blk.6.attn_q.weight.lora_a"), nullptr);

  // A LoRA fine-tune's base in BF16 holds the per-layer table (the largest part of an E2B) in
  // place in either precision, each row widened as it is looked up: the same logits as the file
  // read into FP32 masters.
  const fs::path bf16 = folder.path / "bf16.gguf";
  ASSERT_EQ(cputrain("export --model " + gguf.string() + " --type bf16 --out " + bf16.string()), 0);
  LoadedModel widened = load(bf16);
  // The budget's table gives the per-layer table its own line: under the base read in place
  // (BF16), or under the weights held in memory (F32), at its bytes (512 tokens x 9 x 16).
  for (const auto& [file, under] : {std::pair{bf16, std::string("base read in place")},
                                    std::pair{gguf, std::string("weights (FP32 master)")}}) {
    const auto r = run_cputrain("budget --model " + file.string() +
                                    " --lora-rank 4 --batch 1 --accum 1 --ctx 64 --dtype bf16",
                                folder.path);
    ASSERT_EQ(r.exit_code, 0) << r.err;
    const size_t at = r.out.find("\n  " + under);
    ASSERT_NE(at, std::string::npos) << r.out;
    const size_t next = r.out.find('\n', at + 1);
    const std::string line = r.out.substr(next + 1, r.out.find('\n', next + 1) - next - 1);
    EXPECT_NE(line.find("of which the per-layer embeddings"), std::string::npos) << r.out;
    EXPECT_NE(line.find(format_bytes(512 * 9 * 16 * (file == bf16 ? 2 : 4))), std::string::npos)
        << r.out;
  }
  const std::vector<int32_t> some(tokens.begin(), tokens.begin() + 64);
  for (const DType dtype : {DType::F32, DType::BF16}) {
    ModelOptions options;
    options.compute_dtype = dtype;
    options.lora.rank = 4;
    options.lora.alpha = 8;
    options.lora.targets = parse_lora_targets("q,v", "--lora-targets");
    LoadedModel tuned = load_model_to_train(bf16.string(), "--model", kDefaultImportCtx, options);
    const ParameterSet& tp = tuned.model->parameters();
    EXPECT_TRUE(tp.mapped(tp.find("per_layer.embeddings.weight"))) << dtype_name(dtype);
    EXPECT_EQ(tp.mapped(tp.find("tok_embeddings.weight")), dtype == DType::BF16);
    if (dtype == DType::F32) {
      EXPECT_LT(max_abs_difference(our_logits(tuned, some), our_logits(widened, some)), 1e-6);
    }
  }
}

// Gemma 4 26B-A4B's and 31B's parts (make_family_models.py gemma4_moe): GELU experts beside the
// dense MLP, their gate and up in one tensor as llama.cpp's converter writes them, the router on
// the residual through a scale of its own, each expert's output scaled; global layers without
// attn_v, taking k as v. llama.cpp computes the same logits and continuation, of the file and of
// cputrain's export of it (written as it was read), and applies a LoRA fine-tune's adapter
// (the experts' gate and up sharing an A, the down product's B under its expert's scale) as
// cputrain does.
TEST(Families, Gemma4ExpertsAndKAsVAreLlamaCpps) {
  REQUIRE_ORACLE();
  const TempFolder folder{temp_dir("gemma4_moe")};
  const fs::path gguf = family_models() / "gemma4_moe.gguf";
  LoadedModel g = load(gguf);
  const ModelConfig& c = g.config;
  EXPECT_EQ(c.n_experts, 8);
  EXPECT_EQ(c.experts_used, 2);
  EXPECT_EQ(c.ffn, 64);
  EXPECT_EQ(c.expert_ffn, 32);
  EXPECT_TRUE(c.experts_gate_up_fused);
  EXPECT_TRUE(c.k_as_v);
  EXPECT_EQ(c.per_layer_dim, 0);
  const ParameterSet& params = g.model->parameters();
  EXPECT_GE(params.find("layers.0.attention.wv.weight"), 0);
  EXPECT_LT(params.find("layers.2.attention.wv.weight"), 0);
  EXPECT_GE(params.find("layers.2.feed_forward.w1.weight"), 0);
  EXPECT_GE(params.find("layers.2.feed_forward.expert_scale.weight"), 0);
  const std::vector<int32_t> tokens = token_sequence(200, c.vocab, g.tokenizer->bos_id(), 41);
  const std::vector<float> theirs = expect_as_llama_cpp(g, gguf, "gemma4_moe", tokens, folder.path);
  // Each expert's output scale matters: all of 1 give other logits.
  {
    LoadedModel ones = load(gguf);
    ParameterSet& p = ones.model->parameters();
    const std::vector<float> one(8, 1.0f);
    for (int64_t l = 0; l < c.n_layers; ++l)
      p.write_values(p.find("layers." + std::to_string(l) + ".feed_forward.expert_scale.weight"),
                     one.data());
    EXPECT_GT(max_abs_difference(our_logits(ones, tokens), theirs), 1e-3);
  }
  const fs::path out = folder.path / "out.gguf";
  ASSERT_EQ(cputrain("export --model " + gguf.string() + " --type f32 --out " + out.string()), 0);
  expect_same_values(g, load(out), "gemma4_moe exported");
  {
    const GgufFile written(out.string());
    EXPECT_NE(written.tensor("blk.0.ffn_gate_up_exps.weight"), nullptr);
    EXPECT_EQ(written.tensor("blk.0.ffn_gate_exps.weight"), nullptr);
    EXPECT_NE(written.tensor("blk.0.attn_v.weight"), nullptr);
    EXPECT_EQ(written.tensor("blk.2.attn_v.weight"), nullptr);
  }
  EXPECT_LT(max_abs_difference(oracle_logits(out, tokens, folder.path), theirs), 1e-6);
  // Quantised (llama.cpp's Q8_0) and BF16, the experts' gate and up in one tensor are one
  // parameter read in place as the file holds them: of the Q8_0 file llama.cpp gives the same
  // next token at 90% of positions or more and a mean NLL within 0.02 (it rounds the activations
  // to 8 bits); a LoRA fine-tune's BF16 base gives the logits of the same values held in memory.
  const fs::path q8 = folder.path / "q8_0.gguf";
  ASSERT_TRUE(oracle_quantize(gguf, q8, "q8_0"));
  {
    LoadedModel q = load(q8);
    const ParameterSet& qp = q.model->parameters();
    const int w13 = qp.find("layers.0.feed_forward.experts.w13.weight");
    ASSERT_GE(w13, 0);
    EXPECT_TRUE(qp.mapped(w13));
    EXPECT_EQ(qp.infos()[static_cast<size_t>(w13)].mapped_dtype, DType::Q8_0);
    EXPECT_LT(qp.find("layers.0.feed_forward.experts.w1.weight"), 0);
    const Agreement agree =
        agreement(our_logits(q, tokens), oracle_logits(q8, tokens, folder.path), tokens, c.vocab);
    EXPECT_GE(agree.argmax, 0.9);
    EXPECT_NEAR(agree.nll_ours, agree.nll_theirs, 0.02);
  }
  const fs::path bf16 = folder.path / "bf16.gguf";
  ASSERT_EQ(cputrain("export --model " + gguf.string() + " --type bf16 --out " + bf16.string()), 0);
  {
    const std::vector<int32_t> some(tokens.begin(), tokens.begin() + 64);
    ModelOptions options;
    options.compute_dtype = DType::BF16;
    LoadedModel held = load_model_to_train(bf16.string(), "--model", kDefaultImportCtx, options);
    options.lora.rank = 4;
    options.lora.alpha = 8;
    LoadedModel tuned = load_model_to_train(bf16.string(), "--model", kDefaultImportCtx, options);
    const std::string w13 = "layers.1.feed_forward.experts.w13.weight";
    const ParameterSet &tp = tuned.model->parameters(), &hp = held.model->parameters();
    ASSERT_GE(tp.find(w13), 0);
    ASSERT_GE(hp.find(w13), 0);
    EXPECT_TRUE(tp.mapped(tp.find(w13)));
    EXPECT_FALSE(hp.mapped(hp.find(w13)));
    EXPECT_LT(max_abs_difference(our_logits(tuned, some), our_logits(held, some)), 1e-6);
  }
  const fs::path run = folder.path / "run";
  expect_fine_tune_as_llama_cpp(gguf, write_finetune_data(folder.path), run,
                                folder.path / "merged.gguf", "--dtype fp32", folder.path);
  const GgufFile a((run / "adapter.gguf").string());
  EXPECT_NE(a.tensor("blk.0.ffn_gate_up_exps.weight.lora_a"), nullptr);
  EXPECT_NE(a.tensor("blk.0.ffn_down_exps.weight.lora_b"), nullptr);
  EXPECT_NE(a.tensor("blk.0.ffn_gate.weight.lora_a"), nullptr);
}

// Gemma 4's Hugging Face folders (make_family_models.py gemma4_e2b, gemma4_moe): Transformers'
// Gemma4ForCausalLM with the shared-KV layers' unused k and v beside it, and the text model of
// Gemma4ForConditionalGeneration with vision and audio towers beside it, read to their GGUF
// files' bits (their config.json's layer_types, two head sizes, rope_parameters by kind,
// num_kv_shared_layers, double-wide MLPs, per-layer embeddings, attention_k_eq_v and the experts
// beside the MLP) and give llama.cpp's logits; written as a folder, each tensor is the bytes and
// name Transformers holds, and reads back to the same bits. What its config does not express is
// refused in one line.
TEST(Families, Gemma4HuggingFaceFoldersAreTheirGgufs) {
  REQUIRE_ORACLE();
  const TempFolder folder{temp_dir("gemma4_hf")};
  for (const auto& [family, left_out] :
       {std::pair<std::string, std::string>{"gemma4_e2b",
                                            "(the shared-KV layers' own k and v, 9 tensors, "
                                            "left out)"},
        std::pair<std::string, std::string>{"gemma4_moe",
                                            "(its vision model and its audio model, 4 tensors, "
                                            "left out)"}}) {
    const fs::path gguf = family_models() / (family + ".gguf");
    const fs::path hf = family_models() / (family + "_hf");
    LoadedModel g = load(gguf), h = load(hf);
    const ModelConfig &a = g.config, &b = h.config;
    EXPECT_EQ(b.architecture, "gemma4");
    EXPECT_FALSE(b.norm_plus_one);
    EXPECT_EQ(b.head_size(), a.head_size()) << family;
    EXPECT_EQ(b.head_dim_swa, a.head_dim_swa) << family;
    EXPECT_EQ(b.head_dim_swa, 32) << family;
    EXPECT_EQ(b.kv_heads(), a.kv_heads()) << family;
    EXPECT_EQ(b.n_kv_heads_swa, a.n_kv_heads_swa) << family;
    EXPECT_EQ(b.swa_pattern, 3) << family;
    EXPECT_EQ(b.sliding_window, 32) << family;
    EXPECT_EQ(b.rope_theta, 1e6) << family;
    EXPECT_EQ(b.rope_theta_swa, 1e4) << family;
    EXPECT_EQ(b.rope_dim, a.rope_dim) << family;
    EXPECT_EQ(b.rope_dim_swa, a.rope_dim_swa) << family;
    EXPECT_EQ(b.rope_scaling.freq_factors, a.rope_scaling.freq_factors) << family;
    EXPECT_EQ(b.shared_kv_layers, a.shared_kv_layers) << family;
    EXPECT_EQ(b.layer_ffn, a.layer_ffn) << family;
    EXPECT_EQ(b.per_layer_dim, a.per_layer_dim) << family;
    EXPECT_EQ(b.final_softcap, 5.0f) << family;
    EXPECT_EQ(b.n_experts, a.n_experts) << family;
    EXPECT_EQ(b.experts_used, a.experts_used) << family;
    EXPECT_EQ(b.expert_ffn, a.expert_ffn) << family;
    EXPECT_EQ(b.experts_gate_up_fused, a.experts_gate_up_fused) << family;
    EXPECT_EQ(b.k_as_v, a.k_as_v) << family;
    EXPECT_EQ(b.k_as_v, family == "gemma4_moe");
    EXPECT_NE(h.source.find(left_out), std::string::npos) << h.source;
    expect_same_values(g, h, family);
    const std::vector<int32_t> tokens = token_sequence(200, a.vocab, g.tokenizer->bos_id(), 43);
    EXPECT_LT(max_abs_difference(our_logits(h, tokens), oracle_logits(gguf, tokens, folder.path)),
              1e-4)
        << family;
    // Exported, every tensor is the one the Transformers-named folder holds, by name and bytes,
    // and the folder reads back to the same bits.
    const fs::path out = folder.path / (family + "_exported");
    ASSERT_EQ(cputrain("export --model " + gguf.string() + " --out " + out.string()), 0);
    {
      const SafetensorsModel written(out.string()), theirs(hf.string());
      const nlohmann::json config = nlohmann::json::parse(read_all(hf / "config.json"));
      const std::string prefix = config.contains("text_config") ? "model.language_model." : "";
      size_t n = 0;
      for (const std::string& name : written.names()) {
        const std::string their_name =
            prefix.empty() || !name.starts_with("model.") ? name : prefix + name.substr(6);
        const SafetensorsTensor* t = theirs.find(their_name);
        if (!t) {
          ADD_FAILURE() << family << ": " << their_name;
          continue;
        }
        const SafetensorsTensor& w = *written.find(name);
        EXPECT_EQ(w.shape, t->shape) << name;
        EXPECT_TRUE(w.data.size() == t->data.size() &&
                    std::memcmp(w.data.data(), t->data.data(), w.data.size()) == 0)
            << name;
        ++n;
      }
      EXPECT_GT(n, 40u) << family;
      EXPECT_NE(written.find("model.layers.2.layer_scalar"), nullptr) << family;
      if (family == "gemma4_moe") {
        EXPECT_NE(written.find("model.layers.0.experts.gate_up_proj"), nullptr);
        EXPECT_NE(written.find("model.layers.0.router.per_expert_scale"), nullptr);
      }
    }
    expect_same_values(g, load(out), family + " exported");
  }
  // gemma4's global layers with a key/value head count of their own, not taking k as v: no
  // config.json says so.
  const fs::path refused = folder.path / "gemma4_refused";
  const auto r = run_cputrain(
      "export --model " + (family_models() / "gemma4.gguf").string() + " --out " + refused.string(),
      folder.path);
  expect_one_line_refusal(r,
                          "a gemma4 model whose global layers have key/value heads of their own "
                          "without taking k as v, which Hugging Face's Gemma4 config does not "
                          "express (export it as GGUF)");
  EXPECT_FALSE(fs::exists(refused));
  // A layer_types of no repeating pattern, proportional RoPE of no even share of the head or on
  // part of the windowed layers' heads.
  const auto bad = [&](const std::string& name, const std::function<void(nlohmann::json&)>& edit,
                       const std::string& needle) {
    const fs::path to = folder.path / name;
    fs::copy(family_models() / "gemma4_e2b_hf", to, fs::copy_options::recursive);
    nlohmann::json config = nlohmann::json::parse(read_all(to / "config.json"));
    edit(config);
    std::ofstream(to / "config.json", std::ios::trunc) << config.dump();
    expect_one_line_refusal(run_cputrain("inspect " + to.string(), folder.path), needle);
  };
  bad(
      "types", [](nlohmann::json& j) { j["layer_types"][1] = "full_attention"; },
      "layer_types windows layers in no repeating pattern of windowed layers then one global");
  bad(
      "rope",
      [](nlohmann::json& j) {
        j["rope_parameters"]["full_attention"]["partial_rotary_factor"] = 0.01;
      },
      "rope_parameters.full_attention.partial_rotary_factor does not give an even number of "
      "the head's 64 dimensions");
  bad(
      "rope_type",
      [](nlohmann::json& j) { j["rope_parameters"]["sliding_attention"]["rope_type"] = "yarn"; },
      "rope_parameters.sliding_attention: rope_type yarn, which cputrain does not compute for "
      "gemma4");
  bad(
      "sliding_proportional",
      [](nlohmann::json& j) {
        j["rope_parameters"]["sliding_attention"] = {
            {"rope_type", "proportional"}, {"rope_theta", 10000.0}, {"partial_rotary_factor", 0.5}};
      },
      "rope_parameters.sliding_attention is proportional with partial_rotary_factor 0.5, which "
      "cputrain does not compute");
  bad(
      "per_layer_vocab", [](nlohmann::json& j) { j["vocab_size_per_layer_input"] = 100; },
      "vocab_size_per_layer_input 100 differs from vocab_size 512");
}

// A key that a file gives at a value where nothing is computable is refused in one line, not read
// as "off": a sliding window of 0 or below, a soft-cap of 0, a RoPE base of 0, in GGUF and in
// config.json. A Gemma 3 GGUF with a RoPE factor and no scaling type is scaled linearly, as
// llama.cpp scales it (its logits), and a factor beside the type "none" is refused.
TEST(Families, ZeroWindowsCapsAndBasesAreRefusedAndAFactorAloneIsLinear) {
  REQUIRE_ORACLE();
  const TempFolder folder{temp_dir("family_zeros")};
  const fs::path& dir = folder.path;
  const auto gguf_with = [&](const std::string& family, const std::string& name,
                             const std::string& drop,
                             const std::function<void(GgufWriter&)>& extra) {
    const fs::path to = dir / (name + ".gguf");
    cli_test::rewrite_gguf(
        family_models() / (family + ".gguf"), to,
        [&](const std::string& key, GgufValue&) { return key != drop; }, nullptr, extra);
    return to;
  };
  const auto refused = [&](const fs::path& file, const std::string& needle) {
    expect_one_line_refusal(run_cputrain("inspect " + file.string(), dir), needle);
  };
  for (const int32_t window : {-1, 0})
    refused(
        gguf_with("gemma2", "window" + std::to_string(window), "gemma2.attention.sliding_window",
                  [&](GgufWriter& w) { w.set_i32("gemma2.attention.sliding_window", window); }),
        "gemma2.attention.sliding_window " + std::to_string(window) + " must be positive");
  for (const char* key : {"gemma2.attn_logit_softcapping", "gemma2.final_logit_softcapping",
                          "gemma2.rope.freq_base_swa"})
    refused(gguf_with("gemma2", key, key, [&](GgufWriter& w) { w.set_f32(key, 0.0f); }),
            std::string(key) + " 0 must be positive");
  refused(gguf_with("gemma2", "base", "gemma2.rope.freq_base",
                    [&](GgufWriter& w) { w.set_f32("gemma2.rope.freq_base", 0.0f); }),
          "rope_theta 0 must be a number above 1");
  refused(gguf_with("gemma3", "none", "gemma3.rope.scaling.type",
                    [](GgufWriter& w) { w.set_string("gemma3.rope.scaling.type", "none"); }),
          "gemma3.rope.scaling.factor 8 beside rope.scaling.type none");

  const fs::path untyped = gguf_with("gemma3", "untyped", "gemma3.rope.scaling.type", nullptr);
  LoadedModel m = load(untyped);
  EXPECT_EQ(m.config.rope_scaling.type, "linear");
  EXPECT_EQ(m.config.rope_scaling.factor, 8.0);
  const std::vector<int32_t> tokens = token_sequence(200, m.config.vocab, m.tokenizer->bos_id(), 5);
  EXPECT_LT(max_abs_difference(our_logits(m, tokens), oracle_logits(untyped, tokens, dir)), 1e-4);

  const auto hf_with = [&](const std::string& key, const nlohmann::json& value,
                           const std::string& family = "gemma2") {
    const fs::path to = dir / ("hf_" + key);
    fs::copy(family_models() / (family + "_hf"), to, fs::copy_options::recursive);
    nlohmann::json config = nlohmann::json::parse(read_all(to / "config.json"));
    config[key] = value;
    std::ofstream(to / "config.json") << config.dump();
    return to;
  };
  refused(hf_with("sliding_window", 0), "sliding_window 0 must be positive");
  refused(hf_with("attn_logit_softcapping", 0.0), "attn_logit_softcapping 0.0 must be positive");
  refused(hf_with("final_logit_softcapping", 0), "final_logit_softcapping 0 must be positive");
  refused(hf_with("rope_local_base_freq", 0, "gemma3"),
          "rope_local_base_freq 0 must be a number above 1");
}

// What cputrain does not compute: an architecture (a mamba GGUF), a RoPE scaling type (yarn), a
// Hugging Face model_type and a config.json key it does not know: one line each, naming it.
TEST(Families, UnknownArchitecturesAndFieldsAreRefused) {
  REQUIRE_ORACLE();  // gguf-py writes the models
  const TempFolder folder{temp_dir("family_refusals")};
  const fs::path& dir = folder.path;
  const fs::path mamba = dir / "mamba.gguf";
  cli_test::rewrite_gguf(
      family_models() / "qwen3.gguf", mamba,
      [](const std::string& key, GgufValue& v) {
        if (key == "general.architecture") v.text = "mamba";
        return true;
      },
      nullptr);
  expect_one_line_refusal(run_cputrain("inspect " + mamba.string(), dir),
                          "architecture mamba, which cputrain does not compute (it computes " +
                              architecture_names() + ")");
  const fs::path scaled = dir / "scaled.gguf";
  cli_test::rewrite_gguf(family_models() / "llama3.gguf", scaled, nullptr, nullptr,
                         [](GgufWriter& w) { w.set_string("llama.rope.scaling.type", "yarn"); });
  expect_one_line_refusal(run_cputrain("inspect " + scaled.string(), dir),
                          "llama.rope.scaling.type yarn, which cputrain does not compute");
  const fs::path unread = dir / "unread.gguf";
  cli_test::rewrite_gguf(family_models() / "qwen3.gguf", unread, nullptr, nullptr,
                         [](GgufWriter& w) { w.set_u32("qwen3.attention.sliding_window", 128); });
  expect_one_line_refusal(run_cputrain("inspect " + unread.string(), dir),
                          "metadata qwen3.attention.sliding_window, which cputrain does not read");

  const auto edited_hf = [&](const std::string& name,
                             const std::function<void(nlohmann::json&)>& edit) {
    const fs::path to = dir / name;
    fs::copy(family_models() / "llama3_hf", to, fs::copy_options::recursive);
    nlohmann::json config = nlohmann::json::parse(read_all(to / "config.json"));
    edit(config);
    std::ofstream(to / "config.json") << config.dump();
    return to;
  };
  expect_one_line_refusal(
      run_cputrain(
          "inspect " + edited_hf("yarn",
                                 [](nlohmann::json& c) {
                                   c["rope_scaling"] = {{"rope_type", "yarn"}, {"factor", 4.0}};
                                 })
                           .string(),
          dir),
      "rope_scaling type yarn, which cputrain does not compute for llama (it computes llama3)");
  expect_one_line_refusal(
      run_cputrain(
          "inspect " +
              edited_hf("mamba", [](nlohmann::json& c) { c["model_type"] = "mamba"; }).string(),
          dir),
      "model_type mamba, which cputrain does not compute (it computes " + hf_model_type_names() +
          ")");
  expect_one_line_refusal(
      run_cputrain(
          "inspect " +
              edited_hf("field", [](nlohmann::json& c) { c["logit_softcapping"] = 30.0; }).string(),
          dir),
      "logit_softcapping 30.0, which cputrain does not read for model_type llama");
  // Gemma 3 4B and larger on Hugging Face: the text model inside an image-and-text one.
  expect_one_line_refusal(
      run_cputrain("inspect " + edited_hf("multimodal",
                                          [](nlohmann::json& c) {
                                            c = {{"model_type", "gemma3"},
                                                 {"text_config", {{"hidden_size", 2560}}},
                                                 {"vision_config", {{"hidden_size", 1152}}}};
                                          })
                                    .string(),
                   dir),
      "model_type gemma3 is an image-and-text model, whose text model cputrain does not read");

  // Qwen3.5: a key it does not read, M-RoPE sections that leave text pairs unrotated, value
  // heads of another width than the keys', a decay A that is not negative; Qwen3-Next's
  // mixture of experts (until cputrain computes one).
  const fs::path q35 = family_models() / "qwen35.gguf";
  const auto refused_q35 = [&](const std::string& name,
                               const std::function<bool(const std::string&, GgufValue&)>& metadata,
                               const std::function<void(GgufWriter&)>& extra,
                               const std::string& needle) {
    const fs::path to = dir / (name + ".gguf");
    cli_test::rewrite_gguf(q35, to, metadata, nullptr, extra);
    expect_one_line_refusal(run_cputrain("inspect " + to.string(), dir), needle);
  };
  refused_q35(
      "dt_b_c", nullptr, [](GgufWriter& w) { w.set_bool("qwen35.ssm.dt_b_c_rms", true); },
      "metadata qwen35.ssm.dt_b_c_rms, which cputrain does not read for qwen35");
  refused_q35(
      "sections",
      [](const std::string& key, GgufValue& v) {
        if (key == "qwen35.rope.dimension_sections") v.numbers = {1, 0, 1, 1};
        return true;
      },
      nullptr, "qwen35.rope.dimension_sections leave RoPE pair 1 of text unrotated");
  refused_q35(
      "inner",
      [](const std::string& key, GgufValue& v) {
        if (key == "qwen35.ssm.inner_size") v.number = 4 * 20;
        return true;
      },
      nullptr,
      "qwen35.ssm.inner_size 80 differs from ssm.time_step_rank 4 value heads of "
      "ssm.state_size 24");
  const fs::path positive = dir / "positive_a.gguf";
  cli_test::rewrite_gguf(
      q35, positive, nullptr,
      [](const std::string& name, std::vector<int64_t>&, uint32_t&, std::vector<uint8_t>& data) {
        if (name != "blk.1.ssm_a") return;
        const float one = 1.0f;
        std::memcpy(data.data(), &one, 4);
      });
  expect_one_line_refusal(
      run_cputrain("sample --model " + positive.string() + " --max-tokens 1", dir),
      "tensor blk.1.ssm_a holds 1, where -A (A = exp(A_log)) is negative");
  refused_q35(
      "next",
      [](const std::string& key, GgufValue& v) {
        if (key == "general.architecture") v.text = "qwen3next";
        return !key.starts_with("qwen35.");
      },
      nullptr, "architecture qwen3next, which cputrain does not compute");
  // A Hugging Face folder's mtp.* tensors are left out where config.json declares the block, and
  // have no place where it does not.
  const fs::path undeclared = dir / "undeclared_mtp";
  fs::copy(family_models() / "qwen35_hf", undeclared, fs::copy_options::recursive);
  nlohmann::json config = nlohmann::json::parse(read_all(undeclared / "config.json"));
  config.erase("mtp_num_hidden_layers");
  std::ofstream(undeclared / "config.json") << config.dump();
  expect_one_line_refusal(
      run_cputrain("sample --model " + undeclared.string() + " --max-tokens 1", dir),
      "has no place in the model cputrain computes");
  // The multi-token-prediction block is said, in the line naming the model.
  std::ofstream(dir / "text.txt") << "the cat sat on the mat and ran far";
  const Result said =
      run_cputrain("eval --model " + q35.string() + " --text " + (dir / "text.txt").string(), dir);
  ASSERT_EQ(said.exit_code, 0) << said.err;
  EXPECT_NE(said.out.find("(blk.4, multi-token prediction, left out)"), std::string::npos)
      << said.out;
}

}  // namespace
}  // namespace cputrain
