// GEMM comparison robust to a shared machine's changes of speed: for each training shape of a
// preset, calls ours, ours with the fused, direct and skinny paths off (weight-gradient shapes, and
// bf16 products of at most 32 columns) and oneDNN in turn, call after call, so that a spell of
// slowness falls on all of them alike; prints the median GFLOP/s of each and the ratios. With
// --fused-k-blocks N, weight gradients are also timed with the fused path taking N K blocks of 512
// as one (gemm_set_fused_k_blocks), in the same turn; with --fused-column, FP32 weight gradients
// also with the direct path off (the fused path where it suits them, gemm_set_direct). With
// --lora-rank R, also a LoRA adapter's narrow products of each layer type, u = X A' (T x R x in)
// and g = dY B (T x R x out), and each layer type's forward and dX products with the adapter's
// rank-R update added (lora_fwd_*, lora_dx_*: "ours" adds it inside the product,
// gemm_bf16_low_rank; "blocked" runs it as a second product). Operands are 64-byte aligned, as the
// trainer's tensors.
//
//   build/gemm_alternate                                 mega, f32 and bf16, 9 calls each
//   build/gemm_alternate --preset mini --dtype bf16 --calls 15 --products _dw
//   build/gemm_alternate --products _dw --fused-k-blocks 1
//   build/gemm_alternate --dtype f32 --products _dw --fused-column
//   build/gemm_alternate --dtype bf16 --lora-rank 16 --products lora
//   build/gemm_alternate --dtype bf16 --lora-rank 16 --lora-model qwen2-0.5b --products lora_
#include <omp.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "benchmarks/gemm_shapes.h"
#include "kernels/cpu/bf16.h"
#include "kernels/gemm/gemm.h"
#include "kernels/gemm/gemm_test_hooks.h"

namespace cputrain::bench {
namespace {

using kernels::GemmBackend;
using kernels::Transpose;

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

void run(const Shape& s, bool bf16, int calls, int k_blocks, bool fused_column) {
  const GemmOperands o(s);
  const float *A = o.a.get(), *B = o.b.get();
  const uint16_t *A16 = o.a16.get(), *B16 = o.b16.get();
  float* const C = o.c.get();
  const int64_t lda = s.ta == Transpose::No ? s.K : s.M;
  const int64_t ldb = s.tb == Transpose::No ? s.N : s.K;
  const bool weight_gradient = s.ta == Transpose::Yes && s.tb == Transpose::No;
  const bool skinny = bf16 && kernels::gemm_bf16_avx512_takes_skinny(s.ta, s.tb, s.M, s.N, s.K);
  const bool low_rank = s.rank > 0;
  if (low_rank && !bf16) return;  // the update inside the product is bf16's
  const bool with_blocked = weight_gradient || skinny || low_rank;
  // The update's operands, the values in [-1/64, 1/64) as a scaled adapter's.
  const int64_t r = std::max<int64_t>(s.rank, 1);
  bench::Aligned<uint16_t> u(static_cast<size_t>(s.M * r)), v(static_cast<size_t>(s.N * r));
  for (int64_t i = 0; i < s.M * r; ++i) u.get()[i] = kernels::fp32_to_bf16(A[i % o.a_size] / 64);
  for (int64_t i = 0; i < s.N * r; ++i) v.get()[i] = kernels::fp32_to_bf16(B[i % o.b_size] / 64);
  const kernels::LowRankUpdate update{u.get(), r, v.get(), s.tb == Transpose::Yes ? r : s.N,
                                      s.tb,    r};
  // 0: ours, 1: ours with the fused, direct and skinny paths off, 2: oneDNN, 3: ours with k_blocks
  // K blocks as one, 4: ours with the direct path off
  const int default_k_blocks = kernels::gemm_fused_k_blocks();
  const auto call = [&](int which) {
    kernels::gemm_set_backend(which == 2 ? GemmBackend::Onednn : GemmBackend::Avx512);
    kernels::gemm_set_fused(which != 1);
    kernels::gemm_set_direct(which != 4);
    kernels::gemm_set_skinny(which != 1);
    kernels::gemm_set_low_rank(which != 1);
    kernels::gemm_set_fused_k_blocks(which == 3 ? k_blocks : default_k_blocks);
    const auto start = std::chrono::steady_clock::now();
    if (low_rank)
      kernels::gemm_bf16_low_rank(s.ta, s.tb, s.M, s.N, s.K, A16, lda, B16, ldb, s.beta, C, s.N,
                                  update);
    else if (bf16)
      kernels::gemm_bf16(s.ta, s.tb, s.M, s.N, s.K, A16, lda, B16, ldb, s.beta, C, s.N);
    else
      kernels::gemm_f32(s.ta, s.tb, s.M, s.N, s.K, A, lda, B, ldb, s.beta, C, s.N);
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  };
  const bool with_k_blocks = weight_gradient && k_blocks > 0;
  const bool with_fused = weight_gradient && !bf16 && fused_column;
  std::vector<double> times[5];
  // The first round warms up buffers and oneDNN's primitives. Every other round runs the turn
  // backwards, so that no implementation always follows the same one (a call's speed depends
  // on what the call before left in the caches: up to a few per cent on these shapes).
  for (int i = 0; i <= calls; ++i)
    for (int w = 0; w < 5; ++w) {
      const int which = i % 2 == 0 ? w : 4 - w;
      if ((which == 1 && !with_blocked) || (which == 3 && !with_k_blocks) ||
          (which == 4 && !with_fused))
        continue;
      const double t = call(which);
      if (i > 0) times[which].push_back(t);
    }
  kernels::gemm_set_fused(true);
  kernels::gemm_set_direct(true);
  kernels::gemm_set_skinny(true);
  kernels::gemm_set_low_rank(true);
  kernels::gemm_set_fused_k_blocks(default_k_blocks);
  const double flops = 2.0 * static_cast<double>(s.M) * s.N * (s.K + s.rank);
  const double ours = flops / median(times[0]) / 1e9, onednn = flops / median(times[2]) / 1e9;
  std::printf("%-5s %-9s %-15s %6lld %6lld %6lld  %7.1f", bf16 ? "bf16" : "f32", s.preset.c_str(),
              s.product.c_str(), static_cast<long long>(s.M), static_cast<long long>(s.N),
              static_cast<long long>(s.K), ours);
  if (with_blocked)
    std::printf(" %7.1f", flops / median(times[1]) / 1e9);
  else
    std::printf(" %7s", "-");
  std::printf(" %7.1f  %6.3f", onednn, ours / onednn);
  if (with_blocked) std::printf("  %6.3f", flops / median(times[1]) / 1e9 / onednn);
  if (with_k_blocks) {
    const double kb = flops / median(times[3]) / 1e9;
    std::printf("  %7.1f  %6.3f  %7.3f", kb, kb / onednn, kb / ours);
  }
  if (with_fused) {
    const double fu = flops / median(times[4]) / 1e9;
    std::printf("  %7.1f  %6.3f  %7.3f", fu, fu / onednn, fu / ours);
  }
  std::printf("\n");
}

// The layers of a model LoRA fine-tunes (benchmarks/bench_model.sh's shapes) at 4 x 512 tokens:
// d_model, the key/value projections' width and ffn.
struct LoraModel {
  const char* name;
  int64_t d_model, kv, ffn;
};
constexpr LoraModel kLoraModels[] = {{"qwen2-0.5b", 896, 128, 4864},
                                     {"qwen3-0.6b", 1024, 1024, 3072},
                                     {"llama3.2-1b", 2048, 512, 8192}};

// A LoRA adapter's products of rank r on each layer type of the preset's micro-batch (or a
// model's of kLoraModels, 4 x 512 tokens): u = X A' (T x r x in, A stored r x in) and g = dY B
// (T x r x out, B stored out x r); the gradients dB = dY' (s u) (out x r x T, lora_db_), its
// transpose (r x out x T, lora_dbt_, as the trainer computes it), and dA = (s g)' X (r x in x T);
// and the frozen layer's forward and dX with the update.
std::vector<Shape> lora_shapes(const std::string& preset, int64_t r) {
  std::vector<std::tuple<const char*, int64_t, int64_t>> layers;
  int64_t T = 2048;
  for (const LoraModel& m : kLoraModels)
    if (preset == m.name)
      layers = {{"attn", m.d_model, m.d_model},
                {"attn_kv", m.d_model, m.kv},
                {"ffn_up", m.d_model, m.ffn},
                {"ffn_down", m.ffn, m.d_model}};
  if (layers.empty()) {
    const Preset p = *find_preset(preset);
    const ModelConfig& c = p.config;
    T = p.batch * c.ctx;
    layers = {{"attn", c.d_model, c.d_model},
              {"ffn_up", c.d_model, c.ffn},
              {"ffn_down", c.ffn, c.d_model}};
  }
  std::vector<Shape> shapes;
  for (const auto& [layer, in, out] : layers) {
    shapes.push_back(
        {preset, std::string("lora_u_") + layer, Transpose::No, Transpose::Yes, T, r, in, 0.0f});
    shapes.push_back(
        {preset, std::string("lora_g_") + layer, Transpose::No, Transpose::No, T, r, out, 0.0f});
    shapes.push_back(
        {preset, std::string("lora_db_") + layer, Transpose::Yes, Transpose::No, out, r, T, 1.0f});
    shapes.push_back(
        {preset, std::string("lora_dbt_") + layer, Transpose::Yes, Transpose::No, r, out, T, 1.0f});
    shapes.push_back(
        {preset, std::string("lora_da_") + layer, Transpose::Yes, Transpose::No, r, in, T, 1.0f});
    shapes.push_back({preset, std::string("lora_fwd_") + layer, Transpose::No, Transpose::Yes, T,
                      out, in, 0.0f, r});
    shapes.push_back({preset, std::string("lora_dx_") + layer, Transpose::No, Transpose::No, T, in,
                      out, 0.0f, r});
  }
  return shapes;
}

}  // namespace
}  // namespace cputrain::bench

int main(int argc, char** argv) {
  using namespace cputrain;
  CLI::App app{
      "GEMM shapes of a preset: ours, ours without the fused and direct paths, oneDNN, in turn"};
  std::string preset = "mega", dtype = "both", products;
  int calls = 9, k_blocks = 0, lora_rank = 0;
  bool fused_column = false;
  std::string lora_model;
  app.add_option("--preset", preset, "Preset whose training shapes to run")
      ->check([](const std::string& name) {
        return find_preset(name) ? std::string() : "unknown preset '" + name + "'";
      });
  app.add_option("--lora-model", lora_model,
                 "With --lora-rank: the LoRA products of this model's layers at 4 x 512 tokens "
                 "(qwen2-0.5b, qwen3-0.6b, llama3.2-1b) instead of the preset's")
      ->check(CLI::IsMember({"qwen2-0.5b", "qwen3-0.6b", "llama3.2-1b"}));
  app.add_option("--dtype", dtype, "f32, bf16 or both")
      ->check(CLI::IsMember({"f32", "bf16", "both"}));
  app.add_option("--calls", calls, "Timed calls of each implementation")
      ->check(CLI::Range(1, 1000));
  app.add_option("--products", products, "Only products whose name contains this, e.g. _dw");
  app.add_option("--fused-k-blocks", k_blocks,
                 "Also time weight gradients with the fused path taking this many K blocks of "
                 "512 as one (columns kblk, kb/o, kb/ours)")
      ->check(CLI::Range(1, 16));
  app.add_flag("--fused-column", fused_column,
               "Also time FP32 weight gradients with the direct path off (columns fused, fu/o, "
               "fu/ours)");
  app.add_option("--lora-rank", lora_rank,
                 "Also a LoRA adapter's products of this rank on each layer type (lora_u_*, "
                 "lora_g_*) and the frozen products with its update (lora_fwd_*, lora_dx_*)")
      ->check(CLI::Range(1, 256));
  CLI11_PARSE(app, argc, argv);
  if (!kernels::gemm_backend_available(kernels::GemmBackend::Avx512) ||
      !kernels::gemm_backend_available(kernels::GemmBackend::Onednn)) {
    std::fprintf(stderr, "gemm_alternate: needs the avx512 and onednn GEMM paths (this CPU: %s)\n",
                 kernels::gemm_available_backends().c_str());
    return 1;
  }
  std::printf(
      "%d threads, %d calls each, medians; blocked: ours with the fused, direct and skinny paths "
      "off (weight gradients, bf16 products of at most 32 columns)\n",
      omp_get_max_threads(), calls);
  if (k_blocks > 0)
    std::printf("kblk: ours with the fused path taking %d K blocks of 512 as one (default %d)\n",
                k_blocks, kernels::gemm_fused_k_blocks());
  if (fused_column) std::printf("fused: ours with the direct path off (FP32 weight gradients)\n");
  std::printf("%-5s %-9s %-15s %6s %6s %6s  %7s %7s %7s  %6s  %6s", "dtype", "preset", "product",
              "M", "N", "K", "ours", "blocked", "onednn", "ours/o", "blk/o");
  if (k_blocks > 0) std::printf("  %7s  %6s  %7s", "kblk", "kb/o", "kb/ours");
  if (fused_column) std::printf("  %7s  %6s  %7s", "fused", "fu/o", "fu/ours");
  std::printf("\n");
  for (const bool bf16 : {false, true}) {
    if ((bf16 && dtype == "f32") || (!bf16 && dtype == "bf16")) continue;
    std::vector<bench::Shape> shapes = bench::training_shapes({preset});
    if (lora_rank > 0) {
      const std::vector<bench::Shape> lora =
          bench::lora_shapes(lora_model.empty() ? preset : lora_model, lora_rank);
      shapes.insert(shapes.end(), lora.begin(), lora.end());
    }
    for (const bench::Shape& s : shapes)
      if (products.empty() || s.product.find(products) != std::string::npos)
        bench::run(s, bf16, calls, k_blocks, fused_column);
  }
  return 0;
}
