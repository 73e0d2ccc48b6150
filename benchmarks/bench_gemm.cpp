// GEMM benchmark: measures this machine's FP32 and BF16 peak, then times our kernels, oneDNN
// and Eigen on the GEMM shapes of one training micro-batch of mini, mega and behemoth, measures
// the peak again, and prints GFLOP/s, % of the higher peak and ours / oneDNN.
//
//   build/bench_gemm                                  everything (a few minutes)
//   build/bench_gemm --benchmark_filter=mega          one preset
//   build/bench_gemm --benchmark_format=json          for tools
//
// Benchmarks are named gemm/<impl>/<dtype>/<preset>/<product> (impl: ours, onednn, eigen), with
// counters GFLOPS and pct_peak (of the all-threads peak of that dtype). A weight held quantised
// (kernels/quant/quant.h), Llama 3.2 1B's up projection (W 8192 x 2048), named
// gemm/quant/<W>/<what> with W bf16 (dense; f32 for token) or a format (Q4_0, Q8_0, Q4_K,
// Q5_K, Q6_K): forward and dX, the products on 512 tokens of bf16 activations through the
// dispatched bf16 GEMM; token, the forward of one token of FP32 activations (counter ms);
// dequantise, all of W to bf16 (counter ns_per_value).
#include <benchmark/benchmark.h>
#include <omp.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <random>
#include <string>
#include <vector>

#include "benchmarks/bench_timing.h"
#include "benchmarks/gemm_shapes.h"
#include "kernels/cpu/bf16.h"
#include "kernels/cpu/cpu_features.h"
#include "kernels/cpu/dispatch.h"
#include "kernels/cpu/peak.h"
#include "kernels/gemm/gemm.h"
#include "kernels/gemm/gemm_isa.h"
#include "kernels/quant/quant.h"

namespace cputrain::bench {
namespace {

using kernels::Transpose;

// "dtype/preset/product/impl" -> GFLOP/s of each repetition; the summary takes the median.
std::map<std::string, std::vector<double>> results;

kernels::Peak peak;

void run_one(benchmark::State& state, const Shape& s, const std::string& impl, bool bf16) {
  const GemmOperands o(s);
  const int64_t lda = s.ta == Transpose::No ? s.K : s.M;
  const int64_t ldb = s.tb == Transpose::No ? s.N : s.K;
  auto call = [&] {
    if (bf16) {
      if (impl == "ours" && kernels::gemm_backend_available(kernels::GemmBackend::Amx))
        kernels::gemm_bf16_amx(s.ta, s.tb, s.M, s.N, s.K, o.a16.get(), lda, o.b16.get(), ldb,
                               s.beta, o.c.get(), s.N);
      else if (impl == "ours")
        kernels::gemm_bf16_avx512(s.ta, s.tb, s.M, s.N, s.K, o.a16.get(), lda, o.b16.get(), ldb,
                                  s.beta, o.c.get(), s.N);
      else
        kernels::gemm_bf16_onednn(s.ta, s.tb, s.M, s.N, s.K, o.a16.get(), lda, o.b16.get(), ldb,
                                  s.beta, o.c.get(), s.N);
    } else if (impl == "ours") {
      kernels::gemm_f32_avx512(s.ta, s.tb, s.M, s.N, s.K, o.a.get(), lda, o.b.get(), ldb, s.beta,
                               o.c.get(), s.N);
    } else if (impl == "onednn") {
      kernels::gemm_f32_onednn(s.ta, s.tb, s.M, s.N, s.K, o.a.get(), lda, o.b.get(), ldb, s.beta,
                               o.c.get(), s.N);
    } else {
      kernels::gemm_f32_eigen(s.ta, s.tb, s.M, s.N, s.K, o.a.get(), lda, o.b.get(), ldb, s.beta,
                              o.c.get(), s.N);
    }
  };
  call();  // warm-up: packing buffers, oneDNN primitive creation
  bool reported = false;
  const double seconds = timed_median(state, call, &reported);
  const double flops = 2.0 * static_cast<double>(s.M) * s.N * s.K;
  const double gflops = flops / seconds / 1e9;
  report_gflops(state, gflops, peak, bf16);
  // The summary takes the repetitions Google Benchmark reports, not its short runs that find the
  // iteration count (a run of one call would count as much as a repetition).
  if (reported)
    results[std::string(bf16 ? "bf16" : "f32") + "/" + s.preset + "/" + s.product + "/" + impl]
        .push_back(gflops);
}

enum class QuantBench { Forward, DX, Token, Dequantise };

// Y (512, 8192) = X W^T and dX = dY W with W (8192, 2048) dense (format < 0: bf16, or FP32 for a
// token) or quantised; one token's Y; W dequantised.
void run_quant(benchmark::State& state, int format, QuantBench what) {
  constexpr int64_t N = 8192, K = 2048;
  const int64_t M = what == QuantBench::Token ? 1 : 512;
  std::mt19937 rng(1);
  std::vector<uint16_t> x(M * std::max(N, K)), w16(N * K);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  for (uint16_t& v : x) v = kernels::fp32_to_bf16(u(rng));
  for (uint16_t& v : w16) v = kernels::fp32_to_bf16(0.02f * u(rng));
  std::vector<float> y(M * std::max(N, K)), w32, x32(K, 0.5f);
  if (format < 0 && what == QuantBench::Token) w32.assign(N * K, 0.01f);
  std::vector<uint8_t> data;
  kernels::QuantMatrix w{};
  if (format >= 0) {
    w.type = static_cast<kernels::QuantType>(format);
    w.rows = N;
    w.cols = K;
    data.resize(static_cast<size_t>(N * w.row_bytes()));
    for (uint8_t& b : data) b = static_cast<uint8_t>(rng());
    // Scales of 2^-6 or so (f16 exponent 9) wherever the format keeps them.
    const int64_t bytes = kernels::quant_block_bytes(w.type);
    const bool k_quant = kernels::quant_block_values(w.type) == 256;
    for (size_t b = 0; b < data.size(); b += static_cast<size_t>(bytes)) {
      for (const int64_t at : w.type == kernels::QuantType::Q6_K ? std::vector<int64_t>{208}
                              : k_quant                          ? std::vector<int64_t>{0, 2}
                                                                 : std::vector<int64_t>{0}) {
        data[b + at] = 0;
        data[b + at + 1] = 9 << 2;
      }
    }
    w.data = data.data();
  }
  std::vector<uint16_t> dequantised(what == QuantBench::Dequantise ? N * K : 0);
  auto call = [&] {
    switch (what) {
      case QuantBench::Forward:
        if (format < 0)
          kernels::gemm_bf16(Transpose::No, Transpose::Yes, M, N, K, x.data(), K, w16.data(), K,
                             0.0f, y.data(), N);
        else
          kernels::gemm_quant_forward_bf16(M, x.data(), K, w, 0.0f, y.data(), N);
        break;
      case QuantBench::DX:
        if (format < 0)
          kernels::gemm_bf16(Transpose::No, Transpose::No, M, K, N, x.data(), N, w16.data(), K,
                             0.0f, y.data(), K);
        else
          kernels::gemm_quant_backward_input_bf16(M, x.data(), N, w, 0.0f, y.data(), K);
        break;
      case QuantBench::Token:
        if (format < 0)
          kernels::gemm_f32(Transpose::No, Transpose::Yes, 1, N, K, x32.data(), K, w32.data(), K,
                            0.0f, y.data(), N);
        else
          kernels::gemm_quant_forward(1, x32.data(), K, w, 0.0f, y.data(), N);
        break;
      case QuantBench::Dequantise:
        kernels::dequantize_rows_bf16(w, 0, N, dequantised.data());
        break;
    }
  };
  call();
  const double seconds = timed_median(state, call);
  if (what == QuantBench::Token)
    state.counters["ms"] = seconds * 1e3;
  else if (what == QuantBench::Dequantise)
    state.counters["ns_per_value"] = seconds * 1e9 / static_cast<double>(N * K);
  else
    report_gflops(state, 2.0 * M * N * K / seconds / 1e9, peak, true);
}

void print_peak(const char* when, const kernels::Peak& p) {
  std::printf(
      "peak GFLOP/s (measured %s): f32 %.1f (1 thread %.1f), bf16 %.1f (1 thread %.1f), "
      "amx %.1f (1 thread %.1f), %d threads\n",
      when, p.f32_all_threads, p.f32_one_thread, p.bf16_all_threads, p.bf16_one_thread,
      p.amx_all_threads, p.amx_one_thread, omp_get_max_threads());
}

// The table, with % of `peak` (the higher of the two measurements).
void print_summary(const std::vector<Shape>& shapes, const kernels::Peak& start,
                   const kernels::Peak& end) {
  std::printf("\n");
  print_peak("at the start", start);
  print_peak("at the end", end);
  std::printf("%%peak is of the higher of the two; bf16 %%peak is of %s\n",
              peak.bf16_best_instruction());
  std::printf("GFLOP/s, the median of the repetitions\n");
  std::printf("%-5s %-9s %-12s %6s %6s %6s  %7s %7s  %s\n", "dtype", "preset", "product", "M", "N",
              "K", "ours", "onednn", "ours %peak  onednn %peak  ours/onednn  eigen");
  for (const char* dtype : {"f32", "bf16"}) {
    const double top =
        std::string(dtype) == "bf16" ? peak.bf16_best_all_threads() : peak.f32_all_threads;
    for (const Shape& s : shapes) {
      const std::string key = std::string(dtype) + "/" + s.preset + "/" + s.product + "/";
      // A filter may leave out oneDNN (or ours): its columns then read 0.
      if (!results.count(key + "ours") && !results.count(key + "onednn")) continue;
      const auto of = [&](const char* impl) {
        return results.count(key + impl) ? median(results[key + impl]) : 0.0;
      };
      const double ours = of("ours"), dnnl = of("onednn"), eigen = of("eigen");
      std::printf("%-5s %-9s %-12s %6ld %6ld %6ld  %7.1f %7.1f  %9.1f%% %12.1f%% %12.2f  %5.1f\n",
                  dtype, s.preset.c_str(), s.product.c_str(), static_cast<long>(s.M),
                  static_cast<long>(s.N), static_cast<long>(s.K), ours, dnnl,
                  top > 0 ? 100 * ours / top : 0.0, top > 0 ? 100 * dnnl / top : 0.0,
                  dnnl > 0 ? ours / dnnl : 0.0, eigen);
    }
  }
}

}  // namespace
}  // namespace cputrain::bench

int main(int argc, char** argv) {
  using namespace cputrain::bench;
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  const auto& cpu = cputrain::kernels::cpu_features();
  std::printf("cpu features: %s\n", cputrain::kernels::cpu_features_string().c_str());
  // Each row names its kernel (ours in bf16: vdpbf16ps wherever the CPU has it), so the peaks are
  // the CPU's own level's unless CPUTRAIN_ISA sets one, also where training's default is lower.
  if (std::getenv("CPUTRAIN_ISA") == nullptr)
    cputrain::kernels::set_isa_ceiling(cputrain::kernels::cpu_isa());
  peak = cputrain::kernels::measure_peak();
  const std::vector<Shape> shapes = training_shapes({"mini", "mega", "behemoth"});
  for (const Shape& s : shapes) {
    for (bool bf16 : {false, true}) {
      for (const char* impl : {"ours", "onednn", "eigen"}) {
        if (bf16 && std::string(impl) == "eigen") continue;
        if (std::string(impl) == "ours" && !(bf16 ? cpu.avx512_bf16 : cpu.avx512)) continue;
        const std::string name = std::string("gemm/") + impl + "/" + (bf16 ? "bf16" : "f32") + "/" +
                                 s.preset + "/" + s.product;
        register_timed(name,
                       [s, impl, bf16](benchmark::State& state) { run_one(state, s, impl, bf16); });
      }
    }
  }
  const char* formats[] = {"Q4_0", "Q8_0", "Q4_K", "Q5_K", "Q6_K"};
  const std::pair<QuantBench, const char*> quant_benches[] = {
      {QuantBench::Forward, "forward"},
      {QuantBench::DX, "dX"},
      {QuantBench::Token, "token"},
      {QuantBench::Dequantise, "dequantise"}};
  for (int format = -1; format < 5; ++format)
    for (const auto& [what, name] : quant_benches) {
      if (format < 0 && what == QuantBench::Dequantise) continue;
      const char* dense = what == QuantBench::Token ? "f32" : "bf16";
      register_timed(
          std::string("gemm/quant/") + (format < 0 ? dense : formats[format]) + "/" + name,
          [format, what](benchmark::State& state) { run_quant(state, format, what); });
    }
  benchmark::RunSpecifiedBenchmarks();
  // The peak again: the counters pct_peak, reported during the run, are of the first
  // measurement; the table's % of peak is of the higher of the two.
  const cputrain::kernels::Peak start = peak, end = cputrain::kernels::measure_peak();
  peak = cputrain::kernels::higher_peak(start, end);
  print_summary(shapes, start, end);
  benchmark::Shutdown();
  return 0;
}
