#include <gtest/gtest.h>

#include <algorithm>
#include <cctype>
#include <cstdlib>
#include <stdexcept>
#include <string>
#include <utility>

#include "kernels/attention/attention.h"
#include "kernels/cpu/cpu_features.h"
#include "kernels/cpu/dispatch.h"
#include "kernels/cpu/peak.h"
#include "kernels/gemm/gemm.h"
#include "kernels/ops/cross_entropy.h"
#include "kernels/ops/swiglu.h"

namespace cputrain::kernels {
namespace {

bool fails() {
  return false;
}
bool passes() {
  return true;
}

// A table in the families' shape; "amx" is above any ceiling on a CPU without AMX.
const KernelRow kRows[] = {
    {"amx", Isa::Amx},
    {"checked", Isa::Avx2, true, fails},
    {"forced_only", Isa::Avx2, false},
    {"avx2", Isa::Avx2, true, passes},
};

// Sets an environment variable for the scope.
struct ScopedEnv {
  ScopedEnv(const char* name, const char* value) : name(name) { ::setenv(name, value, 1); }
  ~ScopedEnv() { ::unsetenv(name); }
  const char* name;
};

TEST(Dispatch, IsaNamesRoundTripAndTheCeilingIsAtMostTheCpu) {
  for (Isa isa : {Isa::Avx2, Isa::Avx512, Isa::Avx512Bf16, Isa::Amx}) {
    Isa parsed{};
    ASSERT_TRUE(isa_from_name(isa_name(isa), &parsed));
    EXPECT_EQ(parsed, isa);
  }
  Isa parsed{};
  EXPECT_FALSE(isa_from_name("sse2", &parsed));
  EXPECT_LE(isa_ceiling(), cpu_isa());
  EXPECT_TRUE(isa_usable(Isa::Avx2));
  EXPECT_TRUE(isa_usable(isa_ceiling()));
  EXPECT_THROW(set_isa_ceiling(static_cast<Isa>(static_cast<int>(cpu_isa()) + 1)),
               std::invalid_argument);
}

// The default level is the CPU's own unless its vdpbf16ps is slower than its FMA (an Intel core
// with AVX512_FP16 whose AMX is not offered): then avx512, where bf16 products widen to FP32.
TEST(Dispatch, TheDefaultLevelLeavesVdpbf16psOnlyWhereItIsSlowerThanTheFma) {
  EXPECT_EQ(default_isa_level(Isa::Avx512Bf16, true), Isa::Avx512);
  EXPECT_EQ(default_isa_level(Isa::Avx512Bf16, false), Isa::Avx512Bf16);
  // AMX is the bf16 path where the CPU has it; below AVX512_BF16 there is nothing to leave.
  EXPECT_EQ(default_isa_level(Isa::Amx, true), Isa::Amx);
  EXPECT_EQ(default_isa_level(Isa::Avx512, true), Isa::Avx512);
  EXPECT_EQ(default_isa_level(Isa::Avx2, true), Isa::Avx2);
  CpuFeatures f;
  f.avx2 = f.avx512 = f.avx512_bf16 = true;
  EXPECT_FALSE(vdpbf16ps_slower_than_fma(f));  // Zen 4 and 5, Cooper Lake
  f.avx512_fp16 = true;
  EXPECT_TRUE(vdpbf16ps_slower_than_fma(f));  // a Sapphire Rapids core without its AMX
  f.amx_bf16 = true;
  EXPECT_FALSE(vdpbf16ps_slower_than_fma(f));  // with it: AMX
  // The note says why only where the default is below the CPU's level and is the ceiling.
  const std::string note = isa_default_note();
  if (!note.empty()) {
    EXPECT_TRUE(vdpbf16ps_slower_than_fma(cpu_features()));
    EXPECT_EQ(isa_ceiling(), Isa::Avx512);
    EXPECT_EQ(note.rfind("avx512 by default: on an Intel core with AVX512_FP16", 0), 0u) << note;
  } else if (vdpbf16ps_slower_than_fma(cpu_features())) {
    EXPECT_NE(isa_ceiling(), Isa::Avx512);  // CPUTRAIN_ISA set another level
  }
}

TEST(Dispatch, TakesTheFirstDefaultRowThisCpuRunsUnlessOneIsForced) {
  // "amx" where AMX is usable; else "checked" fails its check and "forced_only" is not a default.
  const std::size_t expected = isa_usable(Isa::Amx) ? 0 : 3;
  EXPECT_EQ(choose_kernel_row("dispatch_test_a", kRows), expected);
  EXPECT_EQ(usable_kernel_rows(kRows),
            isa_usable(Isa::Amx) ? "amx, forced_only, avx2" : "forced_only, avx2");
  {
    const ScopedEnv env("CPUTRAIN_DISPATCH_TEST_B", "forced_only");
    EXPECT_EQ(choose_kernel_row("dispatch_test_b", kRows), 2u);
  }
  for (const char* name : {"checked", "nonesuch"}) {
    const ScopedEnv env("CPUTRAIN_DISPATCH_TEST_C", name);
    try {
      choose_kernel_row("dispatch_test_c", kRows);
      ADD_FAILURE() << name << " was taken";
    } catch (const std::invalid_argument& e) {
      // Names the variable and what it could have been.
      EXPECT_NE(std::string(e.what()).find(std::string("CPUTRAIN_DISPATCH_TEST_C=") + name),
                std::string::npos)
          << e.what();
      EXPECT_NE(std::string(e.what()).find("forced_only, avx2"), std::string::npos) << e.what();
    }
  }
}

TEST(Dispatch, ForcingNamesAKnownFamilyBeforeItChooses) {
  EXPECT_THROW(force_kernel("softmax", "avx2"), std::invalid_argument);
  // The GEMM has chosen by now; forcing it to something else is a programming error.
  const std::string other = gemm_backend() == GemmBackend::Reference ? "eigen" : "reference";
  EXPECT_THROW(force_kernel("gemm", other), std::logic_error);
}

TEST(Dispatch, EveryFamilyChoosesARowAtOrBelowTheCeilingAndTheLogLineNamesIt) {
  const std::string choices = kernel_choices();
  for (auto [family, name] :
       {std::pair{"attention", attention_kernel()}, std::pair{"swiglu", swiglu_kernel()},
        std::pair{"cross_entropy", cross_entropy_kernel()}, std::pair{"peak", peak_kernel()}}) {
    Isa level{};
    ASSERT_TRUE(isa_from_name(name, &level)) << family << " " << name;
    EXPECT_LE(level, isa_ceiling()) << family;
    EXPECT_NE(choices.find(std::string(family) + " " + std::string(name)), std::string::npos)
        << choices;
    // Unless forced, the fastest the ceiling allows (each of these families has a row per level
    // from avx2 up to where its fastest stops).
    std::string var = "CPUTRAIN_";
    for (const char* c = family; *c != '\0'; ++c) var += static_cast<char>(std::toupper(*c));
    if (std::getenv(var.c_str()) == nullptr) {
      const Isa top = family == std::string("swiglu") || family == std::string("cross_entropy")
                          ? Isa::Avx512
                          : Isa::Amx;
      EXPECT_EQ(level, std::min(top, isa_ceiling())) << family;
    }
  }
  EXPECT_NE(choices.find("gemm " + std::string(gemm_backend_name(gemm_backend()))),
            std::string::npos);
  EXPECT_EQ(attention_bf16_native(), std::string(attention_kernel()) == "amx" ||
                                         std::string(attention_kernel()) == "avx512_bf16");
}

}  // namespace
}  // namespace cputrain::kernels
