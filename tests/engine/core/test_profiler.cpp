// The per-op profiler: nothing recorded while off, each scope's own time with nested scopes
// excluded, FLOPs and calls per (name, pass), and the report's shares and remainder.
#include <gtest/gtest.h>

#include <cstdio>
#include <string>

#include "engine/core/profiler.h"

namespace cputrain::profiler {
namespace {

double g_now = 0.0;
double fake_clock() {
  return g_now;
}

class Profiler : public ::testing::Test {
 protected:
  void SetUp() override {
    g_now = 0.0;
    set_clock(fake_clock);
    reset();
    set_enabled(true);
  }
  void TearDown() override {
    set_enabled(false);
    reset();
    set_clock(nullptr);
  }
  static const Entry* find(const std::vector<Entry>& list, const std::string& name, Pass pass) {
    for (const Entry& e : list)
      if (e.name == name && e.pass == pass) return &e;
    return nullptr;
  }
};

TEST_F(Profiler, RecordsNothingWhileOff) {
  set_enabled(false);
  {
    Scope s("op", Pass::Forward, 10.0);
    g_now = 5.0;
  }
  EXPECT_TRUE(entries().empty());
}

TEST_F(Profiler, NestedScopesKeepTheirOwnTime) {
  {
    Scope outer("linear", Pass::Backward);
    g_now = 1.0;
    {
      Scope inner("gemm", Pass::Backward, 100.0);
      g_now = 3.0;
      add_flops(20.0);  // to the innermost open scope
    }
    g_now = 4.0;
    {
      Scope inner("gemm", Pass::Backward, 50.0);
      g_now = 8.0;
    }
    g_now = 10.0;
  }
  const auto list = entries();
  ASSERT_EQ(list.size(), 2u);
  const Entry* outer = find(list, "linear", Pass::Backward);
  const Entry* inner = find(list, "gemm", Pass::Backward);
  ASSERT_NE(outer, nullptr);
  ASSERT_NE(inner, nullptr);
  EXPECT_DOUBLE_EQ(outer->seconds, 10.0 - 2.0 - 4.0);
  EXPECT_EQ(outer->calls, 1);
  EXPECT_DOUBLE_EQ(outer->flops, 0.0);
  EXPECT_DOUBLE_EQ(inner->seconds, 6.0);
  EXPECT_EQ(inner->calls, 2);
  EXPECT_DOUBLE_EQ(inner->flops, 170.0);
  EXPECT_EQ(list[0].name, "gemm");  // the most time first
}

TEST_F(Profiler, KeysByNameTextAndPass) {
  const std::string a = "rmsnorm", b = "rmsnorm";  // equal text, distinct addresses
  {
    Scope s(a.c_str(), Pass::Forward);
    g_now += 1.0;
  }
  {
    Scope s(b.c_str(), Pass::Forward);
    g_now += 2.0;
  }
  {
    Scope s(b.c_str(), Pass::Backward);
    g_now += 4.0;
  }
  const auto list = entries();
  ASSERT_EQ(list.size(), 2u);
  EXPECT_DOUBLE_EQ(find(list, "rmsnorm", Pass::Forward)->seconds, 3.0);
  EXPECT_EQ(find(list, "rmsnorm", Pass::Forward)->calls, 2);
  EXPECT_DOUBLE_EQ(find(list, "rmsnorm", Pass::Backward)->seconds, 4.0);
}

TEST_F(Profiler, ReportGivesPerStepTimesSharesRatesAndTheRemainder) {
  {
    Scope s("gemm", Pass::Forward, 6e9);
    g_now = 3.0;
  }
  {
    Scope s("adamw", Pass::Step);
    g_now = 4.0;
  }
  // Two steps of 2.5 s each: 5 s, of which 4 s in scopes.
  const auto lines = report(entries(), 2, 5.0);
  ASSERT_EQ(lines.size(), 4u);  // header, two scopes, remainder
  double ms = 0, share = 0, gflops = 0, calls = 0;
  char pass[16], name[32];
  ASSERT_EQ(std::sscanf(lines[1].c_str(), "%lf %lf%% %lf %lf %15s %31s", &ms, &share, &gflops,
                        &calls, pass, name),
            6)
      << lines[1];
  EXPECT_DOUBLE_EQ(ms, 1500.0);
  EXPECT_DOUBLE_EQ(share, 60.0);
  EXPECT_DOUBLE_EQ(gflops, 2.0);
  EXPECT_DOUBLE_EQ(calls, 0.5);
  EXPECT_STREQ(pass, "forward");
  EXPECT_STREQ(name, "gemm");
  ASSERT_EQ(std::sscanf(lines[3].c_str(), "%lf %lf%%", &ms, &share), 2) << lines[3];
  EXPECT_DOUBLE_EQ(ms, 500.0);
  EXPECT_DOUBLE_EQ(share, 20.0);
  EXPECT_NE(lines[3].find("(in no scope)"), std::string::npos);
}

TEST_F(Profiler, EnclosingPassIsTheInnermostOpenScopes) {
  {
    Scope outer("attention", Pass::Backward);
    Scope inner("to fp32", Pass::Enclosing);
  }
  { Scope alone("to fp32", Pass::Enclosing); }
  const auto list = entries();
  ASSERT_EQ(list.size(), 3u);
  EXPECT_NE(find(list, "to fp32", Pass::Backward), nullptr);
  EXPECT_NE(find(list, "to fp32", Pass::Step), nullptr);
}

TEST_F(Profiler, RefusesToToggleOrResetInsideAScope) {
  Scope s("op", Pass::Forward);
  EXPECT_THROW(set_enabled(false), std::logic_error);
  EXPECT_THROW(reset(), std::logic_error);
}

}  // namespace
}  // namespace cputrain::profiler
