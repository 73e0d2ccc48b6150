#include "models/lora.h"

#include <algorithm>
#include <array>
#include <cstdio>
#include <stdexcept>
#include <tuple>
#include <vector>

#include "engine/core/error.h"
#include "engine/core/hash.h"
#include "engine/train/parameters.h"
#include "kernels/cpu/bf16.h"
#include "models/architecture.h"
#include "models/tensor_names.h"

namespace cputrain {

namespace {
constexpr std::string_view kNames[kProjectionCount] = {
    "q", "k", "v", "o", "gate", "up", "down", "in_proj_z", "in_proj_b", "in_proj_a", "router"};
// Every projection but a mixture's router, which is adapted only where named.
std::array<bool, kProjectionCount> all_projections() {
  std::array<bool, kProjectionCount> all{};
  all.fill(true);
  all[static_cast<size_t>(Projection::Router)] = false;
  return all;
}

// Whether `targets` are "all" (the router named or not).
bool every_projection(const std::array<bool, kProjectionCount>& targets) {
  for (int j = 0; j < kProjectionCount; ++j)
    if (!targets[static_cast<size_t>(j)] && static_cast<Projection>(j) != Projection::Router)
      return false;
  return true;
}

}  // namespace

std::string_view projection_name(Projection p) {
  return kNames[static_cast<int>(p)];
}

std::array<bool, kProjectionCount> parse_lora_targets(const std::string& list,
                                                      const std::string& flag) {
  std::array<bool, kProjectionCount> targets{};
  size_t pos = 0;
  while (pos <= list.size()) {
    size_t end = list.find(',', pos);
    if (end == std::string::npos) end = list.size();
    const std::string_view name = std::string_view(list).substr(pos, end - pos);
    pos = end + 1;
    if (name == "all") {
      targets = all_projections();
      continue;
    }
    if (name == "in_proj_qkv") {  // Gated DeltaNet's q, k and v in one
      for (const Projection p : {Projection::Q, Projection::K, Projection::V})
        targets[static_cast<size_t>(p)] = true;
      continue;
    }
    // Phi-2's names of its output, up and down projections.
    const std::pair<std::string_view, std::string_view> aliases[] = {
        {"dense", "o"}, {"fc1", "up"}, {"fc2", "down"}, {"out_proj", "o"}};
    std::string_view canonical = name;
    for (const auto& [alias, to] : aliases)
      if (name == alias) canonical = to;
    bool known = false;
    for (int i = 0; i < kProjectionCount; ++i) {
      if (canonical == kNames[i]) {
        targets[static_cast<size_t>(i)] = true;
        known = true;
      }
    }
    if (!known) {
      std::string what = "an empty name";
      if (!name.empty()) {
        what = "no projection called ";
        what += name;
      }
      throw UserError(flag + " " + list + ": " + what + " (the projections are " +
                      lora_targets_text(all_projections()) +
                      ", router, or all; Phi-2's dense, fc1 and fc2 are o, up and down; Qwen3.5's "
                      "in_proj_qkv and out_proj are q, k, v and o)");
    }
  }
  return targets;
}

std::string lora_targets_text(const std::array<bool, kProjectionCount>& targets) {
  std::string text;
  for (int i = 0; i < kProjectionCount; ++i) {
    if (!targets[static_cast<size_t>(i)]) continue;
    if (!text.empty()) text += ',';
    text += kNames[i];
  }
  return text;
}

bool has_projection(const ModelConfig& c, Projection p) {
  switch (p) {
    case Projection::Gate:
      return architecture_of(c).mlp != Mlp::Gelu;
    case Projection::Router:
      return c.moe();
    case Projection::Z:
    case Projection::Beta:
    case Projection::Alpha:
      return !c.linear_layers.empty();
    default:
      return true;
  }
}

std::string lora_targets_held(const ModelConfig& c, const LoraConfig& lora) {
  std::array<bool, kProjectionCount> held = lora.targets;
  for (int j = 0; j < kProjectionCount; ++j)
    held[static_cast<size_t>(j)] =
        held[static_cast<size_t>(j)] && has_projection(c, static_cast<Projection>(j));
  return lora_targets_text(held);
}

int64_t projection_width(const ModelConfig& c, Projection p) {
  // A Gated DeltaNet layer's q, k, v and o are its own widths'.
  const bool linear = !c.linear_layers.empty();
  const bool attention = static_cast<int64_t>(c.linear_layers.size()) < c.n_layers;
  const auto narrowest = [&](int64_t attention_width, int64_t linear_width) {
    int64_t w = c.d_model;
    if (attention) w = std::min(w, attention_width);
    if (linear) w = std::min(w, linear_width);
    return w;
  };
  switch (p) {
    case Projection::Q:
      return narrowest(c.q_dim(), c.linear_qk_dim());
    case Projection::O:
      return narrowest(c.q_dim(), c.linear_v_dim());
    case Projection::K:
      return narrowest(c.kv_dim(), c.linear_qk_dim());
    case Projection::V:
      return narrowest(c.kv_dim(), c.linear_v_dim());
    case Projection::Gate:
    case Projection::Up:
    case Projection::Down:
      // A mixture's experts' (and a dense MLP's beside them) and its shared expert's.
      return std::min({c.d_model, c.ffn, c.expert_width(),
                       c.shared_expert_ffn > 0 ? c.shared_expert_ffn : c.ffn});
    case Projection::Router:
      return std::min(c.d_model, c.n_experts);
    case Projection::Z:
      return std::min(c.d_model, c.linear_v_dim());
    case Projection::Beta:
    case Projection::Alpha:
      return std::min(c.d_model, c.linear_value_heads);
  }
  return 0;
}

void check_lora_rank(const ModelConfig& c, const LoraConfig& lora, const std::string& flag) {
  if (!lora.active()) return;
  int narrowest = -1;
  for (int j = 0; j < kProjectionCount; ++j) {
    const auto p = static_cast<Projection>(j);
    if (lora.on(p) && has_projection(c, p) &&
        (narrowest < 0 ||
         projection_width(c, p) < projection_width(c, static_cast<Projection>(narrowest))))
      narrowest = j;
  }
  if (narrowest < 0) return;
  const auto p = static_cast<Projection>(narrowest);
  const int64_t width = projection_width(c, p);
  if (lora.rank > width)
    throw UserError(flag + " " + std::to_string(lora.rank) + ": above the width of the " +
                    std::string(projection_name(p)) + " projection (" + std::to_string(width) +
                    "); at most " + std::to_string(width));
}

bool is_lora_parameter(std::string_view name) {
  return name.ends_with(".lora_a") || name.ends_with(".lora_b");
}

uint64_t base_fingerprint(const ModelConfig& c, const ParameterSet& params) {
  uint64_t h = kFnvOffset;
  for (const int64_t v :
       {c.vocab, c.d_model, c.n_layers, c.n_heads, c.kv_heads(), c.ffn, c.head_size()})
    h = fnv1a_u64(static_cast<uint64_t>(v), h);
  std::vector<float> values;
  for (size_t i = 0; i < params.infos().size(); ++i) {
    const ParameterInfo& p = params.infos()[i];
    if (!is_norm_gain(p.name)) continue;
    values.resize(static_cast<size_t>(p.shape.numel()));
    params.read_values(static_cast<int>(i), values.data());
    // The gains themselves, however the model holds them (ModelConfig::norm_plus_one).
    if (c.norm_plus_one)
      for (float& v : values) v += c.norm_offset();
    h = fnv1a(p.name, h);
    for (const float v : values) {
      const uint16_t b = kernels::fp32_to_bf16(v);
      h = fnv1a(&b, sizeof b, h);
    }
  }
  return h;
}

std::string fused_lora_a(const ModelConfig& c, const std::string& lora_a) {
  const Architecture& arch = architecture_of(c);
  // (part, fused projection, whether the model fuses them)
  const std::tuple<const char*, const char*, bool> fused[] = {
      {".attention.wq.", ".attention.wqkv.", arch.fused_qkv || c.qkv_fused},
      {".attention.wk.", ".attention.wqkv.", arch.fused_qkv || c.qkv_fused},
      {".attention.wv.", ".attention.wqkv.", arch.fused_qkv || c.qkv_fused},
      {".feed_forward.w1.", ".feed_forward.w13.", arch.fused_gate_up},
      {".feed_forward.w3.", ".feed_forward.w13.", arch.fused_gate_up},
      // Qwen3.5: a Gated DeltaNet layer's in_proj_qkv; a gated attention's q_proj (q and gate).
      {".linear.wq.", ".linear.wqkv.", !c.linear_layers.empty()},
      {".linear.wk.", ".linear.wqkv.", !c.linear_layers.empty()},
      {".linear.wv.", ".linear.wqkv.", !c.linear_layers.empty()},
      {".attention.wq.", ".attention.wqg.", c.attn_output_gate},
      {".attention.wg.", ".attention.wqg.", c.attn_output_gate},
      // A mixture's experts' gate and up in one GGUF tensor.
      {".feed_forward.experts.w1.", ".feed_forward.experts.w13.", c.experts_gate_up_fused},
      {".feed_forward.experts.w3.", ".feed_forward.experts.w13.", c.experts_gate_up_fused}};
  for (const auto& [part, whole, on] : fused) {
    const size_t at = lora_a.find(part);
    if (at == std::string::npos || !on) continue;
    return lora_a.substr(0, at) + whole + lora_a.substr(at + std::string_view(part).size());
  }
  return lora_a;
}

bool is_fused_experts(const std::string& base) {
  return base.ends_with(".experts.w13.");
}

std::string fused_experts_part(const std::string& base, int part) {
  return base.substr(0, base.size() - 3) + (part == 0 ? "1." : "3.");
}

void check_lora_targets(const ModelConfig& c, const LoraConfig& lora, const std::string& flag) {
  if (!lora.active()) return;
  const Architecture& arch = architecture_of(c);
  const auto check = [&](bool fused, std::initializer_list<Projection> parts, const char* names,
                         const char* module) {
    if (!fused) return;
    int on = 0;
    for (const Projection p : parts) on += lora.on(p);
    if (on == 0 || on == static_cast<int>(parts.size())) return;
    throw UserError(flag + " " + lora_targets_text(lora.targets) + ": " + std::string(arch.name) +
                    "'s " + names + " are one projection, " + module + ": adapt all or none");
  };
  // A gate the MLP does not have: refused when named, passed over in "all" (every projection).
  if (arch.mlp == Mlp::Gelu && lora.on(Projection::Gate) && !every_projection(lora.targets))
    throw UserError(flag + " " + lora_targets_text(lora.targets) + ": " + std::string(arch.name) +
                    " has no gate projection (its MLP is up, GELU, down: fc1 and fc2)");
  check(arch.fused_qkv, {Projection::Q, Projection::K, Projection::V}, "q, k and v", "qkv_proj");
  check(!arch.fused_qkv && c.qkv_fused, {Projection::Q, Projection::K, Projection::V},
        "q, k and v (in its GGUF file)", "attn_qkv");
  check(!c.linear_layers.empty(), {Projection::Q, Projection::K, Projection::V},
        "q, k and v (in its Gated DeltaNet layers)", "in_proj_qkv");
  // Gated DeltaNet's projections named for a model without its layers.
  if (c.linear_layers.empty() && !every_projection(lora.targets))
    for (const Projection p : {Projection::Z, Projection::Beta, Projection::Alpha})
      if (lora.on(p))
        throw UserError(flag + " " + lora_targets_text(lora.targets) + ": " +
                        std::string(arch.name) + " has no " + std::string(projection_name(p)) +
                        " projection (Gated DeltaNet's)");
  check(arch.fused_gate_up, {Projection::Gate, Projection::Up}, "gate and up", "gate_up_proj");
  check(c.experts_gate_up_fused, {Projection::Gate, Projection::Up},
        "experts' gate and up (in its GGUF file)", "ffn_gate_up_exps");
  if (!c.moe() && lora.on(Projection::Router))
    throw UserError(flag + " " + lora_targets_text(lora.targets) + ": " + std::string(arch.name) +
                    " has no router (a mixture of experts' projection)");
}

void merge_lora(const ModelConfig& config, const ParameterSet& adapted, const LoraConfig& lora,
                const ParameterSet& merged) {
  for (size_t i = 0; i < merged.infos().size(); ++i) {
    const ParameterInfo& info = merged.infos()[i];
    const int from = adapted.find(info.name);
    if (from < 0) throw std::logic_error("merge_lora: no parameter " + info.name);
    std::vector<float> w(static_cast<size_t>(info.shape.numel()));
    merged_values(config, adapted, lora, from, w.data());
    merged.write_values(static_cast<int>(i), w.data());
  }
}

void merged_values(const ModelConfig& config, const ParameterSet& adapted, const LoraConfig& lora,
                   int index, float* w) {
  const ParameterInfo& info = adapted.infos().at(static_cast<size_t>(index));
  if (is_lora_parameter(info.name))
    throw std::logic_error("merged_values: " + info.name + " is an adapter");
  adapted.read_values(index, w);
  if (!info.name.ends_with(".weight")) return;
  const std::string base = info.name.substr(0, info.name.size() - std::string("weight").size());
  // A mixture's experts (E, N, K): an adapter each, A (E, r, K) and B (E, N, r). The gate and up
  // in one (E, 2 N, K): each part's adapter (B by the part's name, one A) on its rows.
  const bool fused = is_fused_experts(base);
  const int parts = fused ? 2 : 1;
  std::string names[2];
  int bs[2] = {-1, -1};
  for (int part = 0; part < parts; ++part) {
    names[part] = fused ? fused_experts_part(base, part) : base;
    bs[part] = adapted.find(names[part] + "lora_b");
  }
  if (bs[0] < 0 && bs[1] < 0) return;  // no adapter (a norm, a frozen projection)
  const int d = info.shape.ndim();
  const int64_t pitch = info.shape[d - 2], N = pitch / parts, K = info.shape[d - 1];
  const int64_t r = lora.rank, E = info.shape.numel() / (pitch * K);
  const double s = lora.alpha / static_cast<double>(r);
  std::vector<float> av(static_cast<size_t>(E * r * K)), bv(static_cast<size_t>(E * N * r));
  int read_a = -1;  // the parts share their A: read once
  for (int part = 0; part < parts; ++part) {
    const int b = bs[part];
    if (b < 0) continue;
    const int a = adapted.find(fused_lora_a(config, names[part] + "lora_a"));
    if (a != read_a) adapted.read_values(a, av.data());
    read_a = a;
    adapted.read_values(b, bv.data());
#pragma omp parallel for collapse(2) schedule(static)
    for (int64_t e = 0; e < E; ++e)
      for (int64_t n = 0; n < N; ++n)
        for (int64_t k = 0; k < K; ++k) {
          double sum = 0.0;
          for (int64_t j = 0; j < r; ++j)
            sum += static_cast<double>(bv[static_cast<size_t>((e * N + n) * r + j)]) *
                   av[static_cast<size_t>((e * r + j) * K + k)];
          w[static_cast<size_t>((e * pitch + part * N + n) * K + k)] += static_cast<float>(s * sum);
        }
  }
}

std::string fingerprint_text(uint64_t fingerprint) {
  char s[17];
  std::snprintf(s, sizeof s, "%016llx", static_cast<unsigned long long>(fingerprint));
  return s;
}

}  // namespace cputrain
