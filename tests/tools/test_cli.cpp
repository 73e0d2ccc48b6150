// The cputrain binary end to end: bad input gets one clear line and a non-zero exit without
// touching what is on disk; a tiny run trains, writes its run directory, and samples.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "kernels/cpu/cpu_features.h"
#include "kernels/cpu/dispatch.h"
#include "tools/cli_fixture.h"

namespace fs = std::filesystem;

namespace {

using namespace cputrain::testing;

TEST_F(Cli, UnknownPreset) {
  expect_one_line_error(run("--preset huge --out " + (dir_ / "run").string()), "--preset huge");
}

TEST_F(Cli, NonPositiveBatchStepsCtx) {
  const std::string base =
      "--preset tiny --corpus " + write_corpus(50).string() + " --out " + (dir_ / "run").string();
  expect_one_line_error(run(base + " --batch 0"), "--batch");
  expect_one_line_error(run(base + " --steps -3"), "--steps");
  expect_one_line_error(run(base + " --ctx 0"), "--ctx");
}

TEST_F(Cli, OutOfRangeAndUnknownFlags) {
  const std::string base =
      "--preset tiny --corpus " + write_corpus(50).string() + " --out " + (dir_ / "run").string();
  expect_one_line_error(run(base + " --lr -1"), "--lr");
  expect_one_line_error(run(base + " --lr 0"), "--lr");
  expect_one_line_error(run(base + " --threads 0"), "--threads");
  expect_one_line_error(run(base + " --steps -1"), "--steps");
  expect_one_line_error(run(base + " --grad-clip -0.5"), "--grad-clip");
  expect_one_line_error(run(base + " --seed -1"), "--seed");
  expect_one_line_error(run(base + " --vocab 1e9"), "not a whole number");
  expect_one_line_error(run(base + " --vocab 1000000000"), "more pieces than cputrain trains");
  expect_one_line_error(run(base + " --threads 1000"), "CPUs this process may run on");
  expect_one_line_error(run("budget --preset tiny --threads 1000"), "--threads");
  expect_one_line_error(run("tune --preset tiny --threads 999"), "CPUs this process may run on");
  expect_one_line_error(run("tune --preset tiny --threads 0"), "--threads");
  for (const char* t : {"nan", "inf", "-1"})
    expect_one_line_error(run("sample --model missing.gguf --temperature " + std::string(t)),
                          "--temperature");
  expect_one_line_error(run(base + " --gemm avx9000"), "--gemm avx9000");
  expect_one_line_error(run("CPUTRAIN_GEMM=avx9000", base), "CPUTRAIN_GEMM=avx9000");
  expect_one_line_error(run("CPUTRAIN_ATTENTION=bogus", base), "CPUTRAIN_ATTENTION=bogus");
  expect_one_line_error(run("CPUTRAIN_ISA=avx9000", base), "CPUTRAIN_ISA=avx9000");
  expect_one_line_error(run(base + " --kernel swiglu=avx9000"), "--kernel swiglu=avx9000");
  expect_one_line_error(run(base + " --kernel avx2"), "--kernel avx2");
  expect_one_line_error(run(base + " --kernel softmax=avx2"), "--kernel softmax=avx2");
  expect_one_line_error(run(base + " --isa avx9000"), "--isa avx9000");
  expect_one_line_error(run(base + " --bogus"), "--bogus");
  expect_one_line_error(run(base + " --batch two"), "--batch");
  EXPECT_FALSE(fs::exists(dir_ / "run" / "model.bin"));
}

// --isa lowers every family's choice, --kernel and --gemm force one; the log names them all.
TEST_F(Cli, KernelFlagsChooseEachFamilyAndTheLogSaysWhich) {
  const std::string base = "--preset tiny --steps 1 --save-every 0 --sample-tokens 0 --corpus " +
                           write_corpus(50).string() + " --out " + (dir_ / "run").string();
  const Result capped = run(base + " --isa avx2 --gemm reference");
  ASSERT_EQ(capped.exit_code, 0) << capped.err;
  EXPECT_NE(capped.out.find("kernels: gemm reference, attention avx2, swiglu avx2, "
                            "cross_entropy avx2, deltanet avx2, peak avx2"),
            std::string::npos)
      << capped.out;
  fs::remove_all(dir_ / "run");
  const Result forced =
      run("CPUTRAIN_SWIGLU=avx2", base + " --kernel cross_entropy=avx2 --kernel deltanet=avx2");
  ASSERT_EQ(forced.exit_code, 0) << forced.err;
  EXPECT_NE(forced.out.find("swiglu avx2, cross_entropy avx2, deltanet avx2"), std::string::npos)
      << forced.out;
}

TEST_F(Cli, MissingAndEmptyCorpus) {
  expect_one_line_error(run("--preset tiny --corpus " + (dir_ / "nope").string() + " --out " +
                            (dir_ / "run").string()),
                        (dir_ / "nope").string());
  const fs::path empty = dir_ / "empty.txt";
  std::ofstream(empty).close();
  expect_one_line_error(
      run("--preset tiny --corpus " + empty.string() + " --out " + (dir_ / "run").string()),
      empty.string());
}

TEST_F(Cli, CorpusShorterThanOneWindow) {
  // About 20 x 60 characters of text cannot fill one window of 4096 tokens.
  expect_one_line_error(run("--preset tiny --vocab 300 --ctx 4096 --corpus " +
                            write_corpus(20).string() + " --out " + (dir_ / "run").string()),
                        "--ctx");
  // The run's log ends with the error too.
  EXPECT_NE(read_all(dir_ / "run" / "train.log").find("error: --corpus"), std::string::npos)
      << read_all(dir_ / "run" / "train.log");
}

TEST_F(Cli, UnwritableOut) {
  // A path under a regular file can never be created, even as root.
  const fs::path blocker = dir_ / "file";
  std::ofstream(blocker) << "x";
  expect_one_line_error(run("--preset tiny --corpus " + write_corpus(50).string() + " --out " +
                            (blocker / "run").string()),
                        "--out");
  EXPECT_EQ(read_all(blocker), "x");
}

TEST_F(Cli, SampleFromMissingRun) {
  expect_one_line_error(run("sample --run " + (dir_ / "none").string()), "--run");
}

TEST_F(Cli, PinThreadsBindsAndSaysWhere) {
  const fs::path run_dir = dir_ / "run";
  const Result r =
      run("--preset tiny --vocab 300 --ctx 32 --batch 4 --steps 2 --threads 2 "
          "--pin-threads --sample-tokens 1 --corpus " +
          write_corpus(100).string() + " --out " + run_dir.string());
  ASSERT_EQ(r.exit_code, 0) << r.err << r.out;
  const std::string log = read_all(run_dir / "train.log");
  const size_t at = log.find("threads pinned to CPUs ");
  ASSERT_NE(at, std::string::npos) << log;
  // Two threads, two CPU numbers.
  const std::string cpus = log.substr(at + 23, log.find('\n', at) - at - 23);
  EXPECT_EQ(std::count(cpus.begin(), cpus.end(), ','), 1) << cpus;
}

// --profile: the table in the log and profile.json over the steps after the first, with every
// linear layer's three GEMMs once per step each, and scopes that sum to no more than the step.
TEST_F(Cli, ProfileTimesTheOpsOfTheStepsAfterTheFirst) {
  const fs::path run_dir = dir_ / "run";
  const Result r =
      run("--preset tiny --vocab 300 --ctx 32 --batch 4 --steps 3 --profile "
          "--sample-tokens 1 --corpus " +
          write_corpus(100).string() + " --out " + run_dir.string());
  ASSERT_EQ(r.exit_code, 0) << r.err << r.out;
  const std::string log = read_all(run_dir / "train.log");
  EXPECT_NE(log.find("profile of the last 2 steps"), std::string::npos) << log;
  EXPECT_NE(log.find("(in no scope)"), std::string::npos) << log;
  const auto j = nlohmann::json::parse(read_all(run_dir / "profile.json"));
  EXPECT_EQ(j["steps"].get<int>(), 2);
  const auto config = nlohmann::json::parse(read_all(run_dir / "config.json"));
  const int layers = config["model"]["n_layers"].get<int>();
  double sum_ms = 0.0;
  std::set<std::string> gemms;
  for (const auto& e : j["scopes"]) {
    sum_ms += e["ms_per_step"].get<double>();
    const std::string name = e["name"].get<std::string>();
    if (name.rfind("linear GEMM", 0) == 0) {
      gemms.insert(name);
      EXPECT_DOUBLE_EQ(e["calls_per_step"].get<double>(), 7.0 * layers) << name;
      EXPECT_GT(e["gflop_per_step"].get<double>(), 0.0) << name;
    }
  }
  EXPECT_EQ(gemms.size(), 3u);
  EXPECT_LE(sum_ms, j["ms_per_step"].get<double>() * 1.0001);
}

// A mixture of experts: each step's expert load and router losses in metrics.jsonl and the log,
// the load-balancing loss on by default (config.json keeps its coefficients), changing the run
// against one without it; the router losses' flags refused for a dense model, for gpt-oss's
// router and below zero.
TEST_F(Cli, AMixtureLogsItsLoadAndTrainsWithItsRouterLosses) {
  const std::string base =
      "--preset tiny --arch qwen3moe --vocab 300 --ctx 32 --batch 4 "
      "--steps 3 --eval-every 3 --sample-tokens 0 --corpus " +
      write_corpus(400).string();
  const fs::path with = dir_ / "with", without = dir_ / "without";
  const Result a = run(base + " --moe-z-loss 0.001 --out " + with.string());
  ASSERT_EQ(a.exit_code, 0) << a.err << a.out;
  const Result b = run(base + " --moe-balance 0 --out " + without.string());
  ASSERT_EQ(b.exit_code, 0) << b.err << b.out;
  const nlohmann::json train = nlohmann::json::parse(read_all(with / "config.json"))["train"];
  EXPECT_FLOAT_EQ(train["moe_balance"].get<float>(), 0.001f);
  EXPECT_FLOAT_EQ(train["moe_z_loss"].get<float>(), 0.001f);
  std::ifstream metrics(with / "metrics.jsonl");
  int steps = 0;
  for (std::string line; std::getline(metrics, line);) {
    const nlohmann::json j = nlohmann::json::parse(line);
    if (!j.contains("expert_spread")) continue;
    ++steps;
    EXPECT_EQ(j["expert_spread"].size(), 2u);  // tiny's layers
    for (const auto& spread : j["expert_spread"]) EXPECT_GE(spread.get<double>(), 1.0);
    EXPECT_GT(j["moe_balance_loss"].get<double>(), 1.0);  // 2 experts a token: 2 when even
    EXPECT_GT(j["moe_z_loss"].get<double>(), 0.0);
  }
  EXPECT_EQ(steps, 3);
  EXPECT_NE(read_all(with / "train.log").find("balance loss"), std::string::npos);
  const std::vector<double> la = losses_of(with), lb = losses_of(without);
  ASSERT_EQ(la.size(), 3u);
  ASSERT_EQ(lb.size(), 3u);
  EXPECT_EQ(la[0], lb[0]);  // the same first step, then the router losses' gradients tell
  EXPECT_NE(la[2], lb[2]);
  const std::string dense =
      "--preset tiny --corpus " + write_corpus(50).string() + " --out " + (dir_ / "d").string();
  expect_one_line_error(run(dense + " --moe-balance 0.01"), "--moe-balance");
  expect_one_line_error(run(dense + " --moe-z-loss 0.01"), "--moe-z-loss");
  expect_one_line_error(run(base + " --moe-balance -1 --out " + (dir_ / "n").string()),
                        "--moe-balance");
  // gpt-oss's router (top k, then a softmax over them) has none: the flags are refused, and its
  // step line and metrics give the experts' load alone.
  const std::string oss =
      "--preset tiny --arch gpt-oss --vocab 300 --ctx 32 --batch 4 --steps 2 --eval-every 2 "
      "--sample-tokens 0 --corpus " +
      write_corpus(400).string() + " --out ";
  expect_one_line_error(run(oss + (dir_ / "oss_refused").string() + " --moe-balance 0.01"),
                        "takes no router losses");
  const Result o = run(oss + (dir_ / "oss").string());
  ASSERT_EQ(o.exit_code, 0) << o.err << o.out;
  const std::string oss_log = read_all(dir_ / "oss" / "train.log");
  EXPECT_NE(oss_log.find("experts: busiest"), std::string::npos) << oss_log;
  EXPECT_EQ(oss_log.find("balance loss"), std::string::npos) << oss_log;
  EXPECT_EQ(read_all(dir_ / "oss" / "metrics.jsonl").find("moe_balance_loss"), std::string::npos);
  // A fine-tune of the mixture: adapters on its experts, the router losses off unless asked
  // (config.json keeps them, a resume takes them); with a preference method's loss too, their
  // gradients changing DPO's steps against a run without them.
  const fs::path data = dir_ / "sft.jsonl";
  {
    std::ofstream f(data);
    for (int i = 0; i < 16; ++i)
      f << "{\"prompt\": \"the cat " << i << "\", \"completion\": \" sat down\"}\n";
  }
  const std::string ft = "finetune --model " + with.string() + " --data " + data.string() +
                         " --batch 2 --accum 1 --ctx 32 --lora-rank 4 --out ";
  const fs::path tuned = dir_ / "tuned";
  const Result f = run(ft + tuned.string() + " --steps 2 --moe-balance 0.01");
  ASSERT_EQ(f.exit_code, 0) << f.err << f.out;
  EXPECT_FLOAT_EQ(
      nlohmann::json::parse(read_all(tuned / "config.json"))["moe_balance"].get<float>(), 0.01f);
  EXPECT_NE(f.out.find("balance loss"), std::string::npos) << f.out;
  const Result resumed = run("finetune --resume " + tuned.string() + " --steps 3");
  ASSERT_EQ(resumed.exit_code, 0) << resumed.err << resumed.out;
  expect_one_line_error(run("finetune --resume " + tuned.string() + " --steps 4 --moe-balance 0"),
                        "--moe-balance");
  const fs::path pairs = dir_ / "pairs.jsonl";
  {
    std::ofstream f(pairs);
    for (int i = 0; i < 16; ++i)
      f << "{\"prompt\": \"the cat " << i
        << "\", \"chosen\": \" sat down\", \"rejected\": \" ran off\"}\n";
  }
  const std::string dpo = "finetune --model " + with.string() + " --data " + pairs.string() +
                          " --batch 2 --accum 1 --ctx 32 --lora-rank 4 --lr 1e-2 --steps 3 --out ";
  for (const char* method : {"dpo", "orpo"}) {
    const std::string m = std::string(" --method ") + method;
    const Result plain = run(dpo + (dir_ / (std::string(method) + "_plain")).string() + m);
    ASSERT_EQ(plain.exit_code, 0) << plain.err << plain.out;
    const fs::path routed = dir_ / (std::string(method) + "_routed");
    const Result r = run(dpo + routed.string() + m + " --moe-balance 0.5 --moe-z-loss 0.1");
    ASSERT_EQ(r.exit_code, 0) << r.err << r.out;
    EXPECT_NE(r.out.find("balance loss"), std::string::npos) << r.out;
    EXPECT_NE(read_all(routed / "metrics.jsonl").find("moe_balance_loss"), std::string::npos);
    const std::vector<double> lp = losses_of(dir_ / (std::string(method) + "_plain")),
                              lr = losses_of(routed);
    ASSERT_EQ(lp.size(), 3u) << method;
    ASSERT_EQ(lr.size(), 3u) << method;
    EXPECT_EQ(lp[0], lr[0]) << method;  // the router losses are not in the logged loss
    EXPECT_NE(lp[2], lr[2]) << method;
  }
}

TEST_F(Cli, TinyRunTrainsSavesAndSamples) {
  const fs::path run_dir = dir_ / "run";
  const Result r =
      run("--preset tiny --vocab 300 --ctx 32 --batch 4 --steps 30 --eval-every 10 "
          "--sample-tokens 8 --corpus " +
          write_corpus(400).string() + " --out " + run_dir.string());
  ASSERT_EQ(r.exit_code, 0) << r.err << r.out;
  for (const char* f :
       {"config.json", "tokenizer.model", "metrics.jsonl", "model.bin", "train.log"})
    EXPECT_TRUE(fs::exists(run_dir / f)) << f;

  std::ifstream metrics(run_dir / "metrics.jsonl");
  std::string line;
  std::vector<nlohmann::json> rows;
  while (std::getline(metrics, line)) rows.push_back(nlohmann::json::parse(line));
  ASSERT_EQ(rows.size(), 30u);
  for (const char* key :
       {"step", "loss", "lr", "grad_norm", "tokens_per_s", "ms", "model_gflops_per_s",
        "activations_peak_bytes", "peak_rss_bytes", "rss_anon_bytes", "rss_file_bytes"})
    EXPECT_TRUE(rows[0].contains(key)) << key;
  // The RSS's parts, read in the same moment as it (within a few pages; no shared memory here).
  const double rss = rows[0]["rss_bytes"].get<double>();
  EXPECT_GT(rows[0]["rss_anon_bytes"].get<int64_t>(), 0);
  EXPECT_NEAR(rows[0]["rss_anon_bytes"].get<double>() + rows[0]["rss_file_bytes"].get<double>(),
              rss, 0.01 * rss);
  // MFU wherever the peak can be measured (any CPU with AVX2 or AVX-512): a fraction of it.
  const auto& cpu = cputrain::kernels::cpu_features();
  ASSERT_EQ(rows[0].contains("mfu"), cpu.avx2 || cpu.avx512);
  if (rows[0].contains("mfu")) {
    EXPECT_GT(rows[0]["mfu"].get<double>(), 0.0);
    EXPECT_LT(rows[0]["mfu"].get<double>(), 1.0);
  }
  EXPECT_TRUE(rows[9].contains("val_loss"));
  EXPECT_FALSE(rows[8].contains("val_loss"));
  // A repetitive corpus is easy: 30 steps must cut the loss well below its start.
  EXPECT_LT(rows[29]["loss"].get<double>(), rows[0]["loss"].get<double>() - 1.0);
  EXPECT_LT(rows[29]["val_loss"].get<double>(), rows[9]["val_loss"].get<double>());

  const Result s = run("sample --run " + run_dir.string() + " --prompt 'The cat' --max-tokens 12");
  ASSERT_EQ(s.exit_code, 0) << s.err;
  EXPECT_EQ(s.out.rfind("The cat", 0), 0u) << s.out;
  EXPECT_GT(s.out.size(), 8u);
}

// A run is a base to fine-tune: finetune --model RUN learns prompt/completion pairs of its corpus
// (the held-out loss falls), and its adapter applies to the run in eval, sample and a merged
// export, which computes what the run with the adapter computes.
TEST_F(Cli, ARunIsABaseToFineTune) {
  const fs::path run_dir = dir_ / "base";
  ASSERT_EQ(run("--preset tiny --vocab 300 --batch 8 --steps 150 --dtype fp32 "
                "--sample-tokens 1 --corpus " +
                write_corpus(400).string() + " --out " + run_dir.string())
                .exit_code,
            0);
  const fs::path data = dir_ / "pairs.jsonl";
  {
    std::ofstream out(data);
    const char* subjects[] = {"The cat", "A programmer", "My neighbour", "The river"};
    const char* answers[] = {" paints small green apples.", " forgets the last train.",
                             " builds an honest answer.", " watches a quiet song."};
    for (int i = 0; i < 32; ++i)
      out << "{\"prompt\": \"" << subjects[i % 4] << "\", \"completion\": \"" << answers[i % 4]
          << "\"}\n";
  }
  const fs::path ft = dir_ / "ft";
  const Result r =
      run("finetune --model " + run_dir.string() + " --data " + data.string() +
          " --val-fraction 0.25 --ctx 64 --batch 4 --accum 1 --steps 60 --lr 1e-2 --dtype "
          "fp32 --out " +
          ft.string());
  ASSERT_EQ(r.exit_code, 0) << r.err << r.out;
  EXPECT_NE(r.out.find("cputrain export --model " + run_dir.string()), std::string::npos) << r.out;
  std::vector<double> val;
  std::ifstream metrics(ft / "metrics.jsonl");
  for (std::string line; std::getline(metrics, line);) {
    const nlohmann::json j = nlohmann::json::parse(line);
    if (j.contains("val_loss")) val.push_back(j["val_loss"].get<double>());
  }
  ASSERT_GE(val.size(), 2u);
  EXPECT_LT(val.back(), 0.75 * val.front());
  const std::string adapter = " --adapter " + (ft / "adapter.gguf").string();
  const auto sample = [&](const std::string& with) {
    const Result s = run("sample --run " + run_dir.string() + with +
                         " --prompt 'The cat' --temperature 0 --max-tokens 24");
    EXPECT_EQ(s.exit_code, 0) << s.err;
    return s.out;
  };
  EXPECT_NE(sample(adapter).find("The cat paints small green apples."), std::string::npos);
  EXPECT_EQ(sample("").find("The cat paints small green apples."), std::string::npos);
  // --stop ends the text before the string; --n decodes continuations together, the i-th what
  // --seed SEED+i gives alone.
  EXPECT_EQ(sample(adapter + " --stop ' green' --stop apples"), "The cat paints small\n");
  const std::string sampling =
      "sample --run " + run_dir.string() + adapter + " --prompt 'The cat' --max-tokens 16";
  const Result together = run(sampling + " --n 3 --seed 7 --temperature 1.5");
  ASSERT_EQ(together.exit_code, 0) << together.err;
  std::string alone;
  for (int i = 0; i < 3; ++i) {
    const Result one = run(sampling + " --seed " + std::to_string(7 + i) + " --temperature 1.5");
    ASSERT_EQ(one.exit_code, 0) << one.err;
    alone += "--- " + std::to_string(i + 1) + " of 3 (seed " + std::to_string(7 + i) + ") ---\n" +
             one.out;
  }
  EXPECT_EQ(together.out, alone);
  expect_one_line_error(run(sampling + " --stop ''"), "--stop: an empty string");
  const fs::path merged = dir_ / "merged.gguf";
  ASSERT_EQ(run("export --run " + run_dir.string() + adapter + " --merge --out " + merged.string())
                .exit_code,
            0);
  std::ofstream(dir_ / "text.txt") << "The cat paints small green apples.";
  const auto loss = [&](const std::string& source) {
    const Result e = run("eval " + source + " --text " + (dir_ / "text.txt").string() + " --json");
    EXPECT_EQ(e.exit_code, 0) << e.err;
    return nlohmann::json::parse(e.out)["loss"].get<double>();
  };
  const double with_adapter = loss("--run " + run_dir.string() + adapter);
  EXPECT_NEAR(loss("--model " + merged.string()), with_adapter, 1e-4);
  EXPECT_LT(with_adapter, loss("--run " + run_dir.string()));
}

// A full fine-tune with --offload is bitwise the one in RAM: the same losses and model.gguf.
TEST_F(Cli, OffloadedFullFineTuneIsBitwiseTheOneInRam) {
  const fs::path base = dir_ / "base";
  ASSERT_EQ(run("--preset tiny --vocab 300 --batch 8 --steps 20 --sample-tokens 1 --corpus " +
                write_corpus(200).string() + " --out " + base.string())
                .exit_code,
            0);
  const fs::path data = dir_ / "pairs.jsonl";
  std::ofstream(data)
      << "{\"prompt\": \"The cat\", \"completion\": \" paints small green apples.\"}\n"
      << "{\"prompt\": \"The river\", \"completion\": \" forgets the last train.\"}\n";
  const std::string flags = "finetune --full --dtype bf16 --model " + base.string() + " --data " +
                            data.string() + " --ctx 64 --batch 1 --accum 2 --steps 6 --lr 1e-3";
  const Result in_ram = run(flags + " --out " + (dir_ / "ram").string());
  ASSERT_EQ(in_ram.exit_code, 0) << in_ram.err;
  const Result offloaded =
      run(flags + " --offload " + (dir_ / "state").string() + " --out " + (dir_ / "off").string());
  ASSERT_EQ(offloaded.exit_code, 0) << offloaded.err;
  EXPECT_NE(offloaded.out.find("on disk"), std::string::npos) << offloaded.out;
  EXPECT_EQ(losses_of(dir_ / "off"), losses_of(dir_ / "ram"));
  EXPECT_EQ(read_all(dir_ / "off" / "model.gguf"), read_all(dir_ / "ram" / "model.gguf"));
  EXPECT_FALSE(fs::exists(dir_ / "state" / "adamw_m.f32"));
}

TEST_F(Cli, Bf16RunTrainsAndRecordsItsDtype) {
  const fs::path run_dir = dir_ / "run";
  const Result r =
      run("--preset tiny --vocab 300 --ctx 32 --batch 4 --steps 30 --dtype bf16 "
          "--sample-tokens 8 --corpus " +
          write_corpus(400).string() + " --out " + run_dir.string());
  ASSERT_EQ(r.exit_code, 0) << r.err << r.out;
  EXPECT_NE(r.out.find("dtype: bf16 (--dtype bf16)"), std::string::npos) << r.out;
  std::ifstream config(run_dir / "config.json");
  EXPECT_EQ(nlohmann::json::parse(config)["train"]["dtype"], "bf16");
  std::ifstream metrics(run_dir / "metrics.jsonl");
  std::string line;
  std::vector<double> losses;
  while (std::getline(metrics, line)) losses.push_back(nlohmann::json::parse(line)["loss"]);
  ASSERT_EQ(losses.size(), 30u);
  EXPECT_LT(losses.back(), losses.front() - 1.0);
}

// Per-layer checkpointing recomputes the same ops on the same values: the same losses to the
// last bit, step after step.
TEST_F(Cli, CheckpointedRunHasTheSameLosses) {
  const std::string base =
      "--preset tiny --vocab 300 --ctx 32 --batch 4 --steps 8 --sample-tokens 1 "
      "--corpus " +
      write_corpus(200).string();
  auto losses = [&](const std::string& flags, const fs::path& out) {
    const Result r = run(base + " " + flags + " --overwrite --out " + out.string());
    EXPECT_EQ(r.exit_code, 0) << r.err << r.out;
    std::ifstream metrics(out / "metrics.jsonl");
    std::string line;
    std::vector<double> v;
    while (std::getline(metrics, line)) v.push_back(nlohmann::json::parse(line)["loss"]);
    return v;
  };
  for (const char* dtype : {"fp32", "bf16"}) {
    const std::vector<double> plain = losses(std::string("--dtype ") + dtype, dir_ / "plain");
    const std::vector<double> ckpt =
        losses(std::string("--dtype ") + dtype + " --checkpoint layer", dir_ / "ckpt");
    ASSERT_EQ(plain.size(), 8u);
    EXPECT_EQ(plain, ckpt) << dtype;
    std::ifstream config(dir_ / "ckpt" / "config.json");
    EXPECT_EQ(nlohmann::json::parse(config)["train"]["checkpoint"], "layer");
  }
  expect_one_line_error(run(base + " --checkpoint some --out " + (dir_ / "bad").string()),
                        "--checkpoint");
}

TEST_F(Cli, BudgetJsonHasEveryCategoryAndTheLeversMove) {
  auto budget = [&](const std::string& flags) {
    const Result r = run("budget --preset tiny --json " + flags);
    EXPECT_EQ(r.exit_code, 0) << r.err;
    return nlohmann::json::parse(r.out);
  };
  const nlohmann::json plain = budget("--dtype fp32 --checkpoint none");
  for (const char* key :
       {"weights_bytes", "bf16_weights_bytes", "gradients_bytes", "optimizer_state_bytes",
        "activations_bytes", "workspace_bytes", "step_peak_bytes", "cache_headroom_bytes",
        "corpus_bytes", "runtime_bytes", "total_bytes"})
    EXPECT_TRUE(plain.contains(key)) << key;
  EXPECT_EQ(plain["total_bytes"].get<int64_t>(),
            plain["step_peak_bytes"].get<int64_t>() + plain["cache_headroom_bytes"].get<int64_t>() +
                plain["corpus_bytes"].get<int64_t>() + plain["runtime_bytes"].get<int64_t>());
  EXPECT_EQ(plain["optimizer_state_bytes"].get<int64_t>(),
            2 * plain["weights_bytes"].get<int64_t>());
  EXPECT_EQ(plain["bf16_weights_bytes"].get<int64_t>(), 0);
  const nlohmann::json bf16 = budget("--dtype bf16 --checkpoint none");
  EXPECT_GT(bf16["bf16_weights_bytes"].get<int64_t>(), 0);
  EXPECT_LT(bf16["activations_bytes"].get<int64_t>(), plain["activations_bytes"].get<int64_t>());
  const nlohmann::json ckpt = budget("--dtype fp32 --checkpoint layer");
  EXPECT_LT(ckpt["activations_bytes"].get<int64_t>(), plain["activations_bytes"].get<int64_t>());
  const nlohmann::json big = budget("--dtype fp32 --checkpoint none --batch 8");
  EXPECT_GT(big["activations_bytes"].get<int64_t>(), plain["activations_bytes"].get<int64_t>());
}

// A model of another shape, pretrained from scratch: grouped-query attention, tied embeddings,
// q/k/v biases and half-split RoPE from the flags; config.json records them, and sample, eval
// and resume rebuild the same model from it. Bad shapes are one line naming the flags.
TEST_F(Cli, ShapeFlagsTrainRecordAndRebuildTheModel) {
  const fs::path run_dir = dir_ / "run";
  const std::string corpus = write_corpus(300).string();
  const std::string shape =
      "--preset tiny --vocab 300 --ctx 32 --batch 4 --kv-heads 2 --tie-embeddings --qkv-bias "
      "--rope-theta 1000000 --rope-pairs half-split --sample-tokens 4 --corpus " +
      corpus;
  const Result r = run(shape + " --steps 12 --save-every 6 --out " + run_dir.string());
  ASSERT_EQ(r.exit_code, 0) << r.err << r.out;
  std::ifstream config_file(run_dir / "config.json");
  const nlohmann::json model = nlohmann::json::parse(config_file)["model"];
  EXPECT_EQ(model["n_heads"], 4);
  EXPECT_EQ(model["n_kv_heads"], 2);
  EXPECT_EQ(model["head_dim"], 16);
  EXPECT_EQ(model["tie_embeddings"], true);
  EXPECT_EQ(model["qkv_bias"], true);
  EXPECT_EQ(model["rope_pairs"], "half-split");
  EXPECT_EQ(model["rope_theta"].get<double>(), 1e6);
  // 300 x 64 embedding (tied), per layer 2 x 64 x 64 (q, o) + 2 x 64 x 32 (k, v) + 64 + 2 x 32
  // biases + 3 x 64 x 192 + 2 x 64, and the final norm.
  EXPECT_EQ(model["parameters"],
            300 * 64 + 2 * (2 * 64 * 64 + 2 * 64 * 32 + 128 + 3 * 64 * 192 + 128) + 64);
  const std::vector<double> losses = losses_of(run_dir);
  ASSERT_EQ(losses.size(), 12u);
  EXPECT_LT(losses.back(), losses.front());
  const Result s = run("sample --run " + run_dir.string() + " --prompt 'The cat' --max-tokens 6");
  ASSERT_EQ(s.exit_code, 0) << s.err;
  EXPECT_EQ(s.out.rfind("The cat", 0), 0u) << s.out;
  const Result e = run("eval --run " + run_dir.string());
  ASSERT_EQ(e.exit_code, 0) << e.err;

  const std::string base = "--preset tiny --corpus " + corpus + " --out " + (dir_ / "bad").string();
  expect_one_line_error(run(base + " --kv-heads 3"), "--heads 4 is not a multiple of --kv-heads 3");
  expect_one_line_error(run(base + " --head-dim 7"), "--head-dim 7 must be even for RoPE");
  expect_one_line_error(run(base + " --rope-pairs diagonal"), "--rope-pairs");
  expect_one_line_error(run(base + " --kv-heads 0"), "--kv-heads");
  expect_one_line_error(run(base + " --arch mamba"),
                        "--arch mamba: not an architecture cputrain computes (llama, qwen2");
  expect_one_line_error(run(base + " --arch qwen3 --qkv-bias"),
                        "--qkv-bias: a qwen3 model has no q/k/v biases");
  expect_one_line_error(run(base + " --sliding-window 8"),
                        "--sliding-window: a llama model has no sliding-window layers");
  expect_one_line_error(run(base + " --arch gemma3 --sliding-window 0"), "--sliding-window");
  expect_one_line_error(run(base + " --experts 4"),
                        "--experts: a llama model has no experts (qwen3moe, ");
  expect_one_line_error(run(base + " --arch gemma4 --experts-used 2"),
                        "--experts-used: a gemma4 model has no experts unless --experts says");
  expect_one_line_error(run(base + " --arch gemma4 --experts 4 --experts-used 5"),
                        "--experts-used 5 is more than the experts (--experts 4)");
  expect_one_line_error(run(base + " --arch qwen3moe --experts 1"),
                        "--experts 1: a qwen3moe model takes 2 to 4096 experts");
  EXPECT_FALSE(fs::exists(dir_ / "bad" / "model.bin"));

  // --arch: the architecture's parts, recorded by name; the run rebuilds it.
  const fs::path qwen3 = dir_ / "qwen3";
  const Result q =
      run("--preset tiny --vocab 300 --ctx 32 --batch 4 --arch qwen3 --heads 3 "
          "--kv-heads 1 --head-dim 24 --steps 2 --sample-tokens 4 --corpus " +
          corpus + " --out " + qwen3.string());
  ASSERT_EQ(q.exit_code, 0) << q.err << q.out;
  const nlohmann::json m = nlohmann::json::parse(std::ifstream(qwen3 / "config.json"))["model"];
  EXPECT_EQ(m["architecture"], "qwen3");
  EXPECT_EQ(m["qk_norm"], true);
  EXPECT_EQ(m["rope_pairs"], "half-split");
  const Result i = run("inspect " + qwen3.string());
  ASSERT_EQ(i.exit_code, 0) << i.err;
  EXPECT_NE(i.out.find("architecture qwen3"), std::string::npos) << i.out;
  EXPECT_NE(i.out.find("q/k norms"), std::string::npos) << i.out;
  ASSERT_EQ(run("sample --run " + qwen3.string() + " --max-tokens 3").exit_code, 0);

  // Qwen3.5: Gated DeltaNet in three of every four layers; it trains, samples from its states,
  // resumes and exports as GGUF (tests/tools/test_interop.cpp: llama.cpp's logits) and as a
  // Hugging Face folder, each read back as the same model.
  const fs::path qwen35 = dir_ / "qwen35";
  const Result q35 =
      run("--preset tiny --vocab 300 --ctx 32 --batch 4 --arch qwen35 --layers 4 "
          "--steps 3 --save-every 2 --sample-tokens 4 --corpus " +
          corpus + " --out " + qwen35.string());
  ASSERT_EQ(q35.exit_code, 0) << q35.err << q35.out;
  const nlohmann::json m35 = nlohmann::json::parse(std::ifstream(qwen35 / "config.json"))["model"];
  EXPECT_EQ(m35["linear_attention"]["layers"], nlohmann::json({0, 1, 2}));
  EXPECT_EQ(m35["attn_output_gate"], true);
  const Result i35 = run("inspect " + qwen35.string());
  ASSERT_EQ(i35.exit_code, 0) << i35.err;
  EXPECT_NE(i35.out.find("Gated DeltaNet in 3 of 4 layers"), std::string::npos) << i35.out;
  ASSERT_EQ(run("sample --run " + qwen35.string() + " --max-tokens 3").exit_code, 0);
  ASSERT_EQ(run("eval --run " + qwen35.string()).exit_code, 0);
  ASSERT_EQ(
      run("export --run " + qwen35.string() + " --out " + (dir_ / "q35.gguf").string()).exit_code,
      0);
  ASSERT_EQ(
      run("export --run " + qwen35.string() + " --out " + (dir_ / "q35_hf").string()).exit_code, 0);
  for (const char* file : {"q35.gguf", "q35_hf"}) {
    const Result back = run("inspect " + (dir_ / file).string());
    ASSERT_EQ(back.exit_code, 0) << file << ": " << back.err;
    EXPECT_NE(back.out.find("Gated DeltaNet in 3 of 4 layers"), std::string::npos) << back.out;
  }

  // A sliding-window architecture takes its window from --sliding-window (else 4096), and
  // samples past it.
  for (const auto& [flag, window] : {std::pair<std::string, int>{" --sliding-window 8", 8},
                                     std::pair<std::string, int>{"", 4096}}) {
    const fs::path gemma3 = dir_ / ("gemma3_" + std::to_string(window));
    const Result g =
        run("--preset tiny --vocab 300 --ctx 32 --batch 4 --arch gemma3 --layers 2" + flag +
            " --steps 2 --sample-tokens 20 --corpus " + corpus + " --out " + gemma3.string());
    ASSERT_EQ(g.exit_code, 0) << g.err << g.out;
    const nlohmann::json gm = nlohmann::json::parse(std::ifstream(gemma3 / "config.json"))["model"];
    EXPECT_EQ(gm["architecture"], "gemma3");
    EXPECT_EQ(gm["sliding_window"], window);
  }
}

// The budget of the same shapes, and of its --threads: fewer kv heads, tied embeddings hold
// fewer weights; the buffers of our GEMM grow with the threads.
TEST_F(Cli, BudgetTakesTheShapeFlagsAndTheThreads) {
  auto budget = [&](const std::string& flags) {
    const Result r = run("budget --json --dtype fp32 " + flags);
    EXPECT_EQ(r.exit_code, 0) << r.err;
    return nlohmann::json::parse(r.out);
  };
  const nlohmann::json plain = budget("--preset tiny");
  const nlohmann::json gqa = budget("--preset tiny --kv-heads 1");
  const nlohmann::json tied = budget("--preset tiny --tie-embeddings");
  EXPECT_LT(gqa["weights_bytes"].get<int64_t>(), plain["weights_bytes"].get<int64_t>());
  EXPECT_EQ(plain["weights_bytes"].get<int64_t>() - tied["weights_bytes"].get<int64_t>(),
            512 * 64 * 4);
  EXPECT_EQ(plain["parameters"].get<int64_t>() - tied["parameters"].get<int64_t>(), 512 * 64);
  // A micro-batch is a micro-batch: the budget at any --accum is one micro-batch's, measured once
  // (a million micro-batches measured in turn would not answer).
  const nlohmann::json many = budget("--preset tiny --accum 1000000");
  EXPECT_EQ(many["total_bytes"].get<int64_t>(), budget("--preset tiny --accum 1")["total_bytes"]);
  // Our blocked GEMM packs per thread (oneDNN, Eigen and the reference keep no buffers of ours).
  if (!cputrain::kernels::isa_usable(cputrain::kernels::Isa::Avx512)) return;
  const nlohmann::json one = budget("--preset mini --gemm avx512 --threads 1");
  const nlohmann::json two = budget("--preset mini --gemm avx512 --threads 2");
  EXPECT_LT(one["workspace_bytes"].get<int64_t>(), two["workspace_bytes"].get<int64_t>());
}

// A budget that does not fit the memory is printed as one that does, and exits with 3, so that a
// script can tell; one that fits exits with 0.
TEST_F(Cli, BudgetThatDoesNotFitExitsWithItsOwnStatus) {
  for (const char* json : {"", " --json"}) {
    const Result fits = run(std::string("budget --preset tiny --mem-limit 4") + json);
    EXPECT_EQ(fits.exit_code, 0) << fits.err;
    const Result over = run(std::string("budget --preset tiny --mem-limit 0.01") + json);
    EXPECT_EQ(over.exit_code, 3) << over.err;
    EXPECT_NE(over.out.find(*json ? "\"fits\": false" : "does not fit"), std::string::npos)
        << over.out;
  }
}

TEST_F(Cli, ParityHelpShowsTheStepsItRuns) {
  const Result help = run("parity --help");
  ASSERT_EQ(help.exit_code, 0);
  const size_t at = help.out.find("--steps");
  ASSERT_NE(at, std::string::npos) << help.out;
  const std::string line = help.out.substr(at, help.out.find('\n', at) - at);
  EXPECT_NE(line.find("100"), std::string::npos) << line;
  EXPECT_EQ(line.find("-1"), std::string::npos) << line;
}

// Over its memory limit training does not start: the table and the levers, one error line,
// no model written. Between the budgets with and without checkpointing, auto checkpoints: the MLP
// where that fits, else per layer.
TEST_F(Cli, TrainingRefusesOverBudgetAndAutoCheckpoints) {
  const std::string corpus = write_corpus(200).string();
  const std::string base =
      "--preset tiny --vocab 300 --batch 4 --steps 2 --sample-tokens 1 "
      "--dtype fp32 --corpus " +
      corpus;
  // Refused before the data is prepared, with the levers; the directory it made is gone.
  const Result refused = run(base + " --mem-limit 0.01 --out " + (dir_ / "small").string());
  expect_one_line_error(refused, "exceeds the available");
  EXPECT_NE(refused.out.find("levers:"), std::string::npos) << refused.out;
  EXPECT_NE(refused.out.find("--batch 2 --accum 2"), std::string::npos) << refused.out;
  EXPECT_EQ(refused.out.find("training a tokenizer"), std::string::npos) << refused.out;
  EXPECT_FALSE(fs::exists(dir_ / "small"));
  EXPECT_NE(refused.out.find("a vocabulary of 300 (the least a corpus gives)"), std::string::npos)
      << refused.out;
  // From a model, the vocabulary is the model's (stories260K's 512), not the least a corpus
  // gives.
  const fs::path stories = fs::path(CPUTRAIN_SHARED_MODELS) / "stories260K.gguf";
  if (fs::exists(stories)) {
    const Result model = run("train --model " + stories.string() + " --corpus " + corpus +
                             " --steps 1 --mem-limit 0.01 --out " + (dir_ / "from").string());
    expect_one_line_error(model, "exceeds the available");
    EXPECT_NE(model.out.find("(a vocabulary of 512, no token cache"), std::string::npos)
        << model.out;
  }

  auto total = [&](const std::string& checkpoint) {
    const Result r =
        run("budget --preset tiny --vocab 300 --batch 4 --dtype fp32 --json "
            "--checkpoint " +
            checkpoint + " --corpus " + corpus);
    EXPECT_EQ(r.exit_code, 0) << r.err;
    return static_cast<double>(nlohmann::json::parse(r.out)["total_bytes"].get<int64_t>());
  };
  // Between mlp's budget and none's, auto takes mlp; between layer's and mlp's, layer.
  const double none = total("none"), mlp = total("mlp"), layer = total("layer");
  ASSERT_LT(layer, mlp);
  ASSERT_LT(mlp, none);
  const auto mem_limit = [](double a, double b) {
    return " --mem-limit " + std::to_string((a + b) / 2.0 / (1024.0 * 1024.0 * 1024.0));
  };
  const Result by_mlp = run(base + mem_limit(none, mlp) + " --out " + (dir_ / "mlp").string());
  ASSERT_EQ(by_mlp.exit_code, 0) << by_mlp.err << by_mlp.out;
  EXPECT_NE(by_mlp.out.find("checkpointing mlp: without it the budget"), std::string::npos)
      << by_mlp.out;
  std::ifstream mlp_config(dir_ / "mlp" / "config.json");
  EXPECT_EQ(nlohmann::json::parse(mlp_config)["train"]["checkpoint"], "mlp");
  const fs::path run_dir = dir_ / "auto";
  const Result r = run(base + mem_limit(mlp, layer) + " --out " + run_dir.string());
  ASSERT_EQ(r.exit_code, 0) << r.err << r.out;
  EXPECT_NE(r.out.find("checkpointing per layer: without it the budget"), std::string::npos)
      << r.out;
  std::ifstream config(run_dir / "config.json");
  EXPECT_EQ(nlohmann::json::parse(config)["train"]["checkpoint"], "layer");
  std::ifstream metrics(run_dir / "metrics.jsonl");
  std::string line;
  ASSERT_TRUE(std::getline(metrics, line));
  const nlohmann::json m = nlohmann::json::parse(line);
  for (const char* key : {"budget_bytes", "activations_peak_bytes", "activations_budget_bytes",
                          "workspace_bytes", "weights_bytes"})
    EXPECT_TRUE(m.contains(key)) << key;
  EXPECT_NE(r.out.find("/ budget "), std::string::npos) << r.out;
}

// 20 steps straight against 10, a resume from the checkpoint at step 10, and 10 more: the same
// losses to the last bit and the same final weights, in fp32 and bf16. A damaged newer
// checkpoint is skipped.
TEST_F(Cli, ResumeIsBitwiseTheRunThatNeverStopped) {
  const std::string corpus = write_corpus(200).string();
  for (const char* dtype : {"fp32", "bf16"}) {
    const fs::path straight = dir_ / (std::string("straight_") + dtype);
    const Result a =
        run("--preset tiny --vocab 300 --batch 4 --steps 20 --save-every 10 --keep 5 "
            "--sample-tokens 1 --dtype " +
            std::string(dtype) + " --corpus " + corpus + " --out " + straight.string());
    ASSERT_EQ(a.exit_code, 0) << a.err << a.out;
    ASSERT_TRUE(fs::exists(straight / "checkpoints" / "step-00000010.ckpt"));
    ASSERT_TRUE(fs::exists(straight / "checkpoints" / "step-00000020.ckpt"));
    // The state of the run after step 10, and a damaged checkpoint for step 15.
    const fs::path resumed = dir_ / (std::string("resumed_") + dtype);
    fs::create_directories(resumed / "checkpoints");
    for (const char* f : {"config.json", "tokenizer.model", "tokens.bin"})
      fs::copy_file(straight / f, resumed / f);
    fs::copy_file(straight / "checkpoints" / "step-00000010.ckpt",
                  resumed / "checkpoints" / "step-00000010.ckpt");
    std::ofstream(resumed / "checkpoints" / "step-00000015.ckpt") << "not a checkpoint";
    {
      std::ifstream in(straight / "metrics.jsonl");
      std::ofstream out(resumed / "metrics.jsonl");
      std::string line;
      for (int i = 0; i < 12 && std::getline(in, line); ++i) out << line << "\n";  // 2 beyond
    }
    const Result b = run("--resume " + resumed.string() + " --sample-tokens 1");
    ASSERT_EQ(b.exit_code, 0) << b.err << b.out;
    // The damaged checkpoint is a warning, once, on stderr.
    EXPECT_EQ(b.out.find("skipping"), std::string::npos) << b.out;
    EXPECT_NE(b.err.find("skipping"), std::string::npos) << b.err;
    EXPECT_EQ(b.err.find("skipping"), b.err.rfind("skipping")) << b.err;
    EXPECT_NE(b.out.find("at step 11"), std::string::npos) << b.out;
    EXPECT_EQ(losses_of(resumed), losses_of(straight)) << dtype;
    EXPECT_EQ(read_all(resumed / "model.bin"), read_all(straight / "model.bin")) << dtype;
  }
  expect_one_line_error(run("--resume " + (dir_ / "nowhere").string()), "--resume");
  fs::create_directories(dir_ / "empty_run");
  std::ofstream(dir_ / "empty_run" / "config.json") << "{}";
  expect_one_line_error(run("--resume " + (dir_ / "empty_run").string()), "config.json");
}

// --offload: the masters and AdamW's state in files, bitwise the run in RAM (losses, final
// weights); a run stopped after step 5 resumes offloaded, or in RAM with --offload none, into the
// same run; the state files are gone once a run ends; the budget puts them on disk.
// A weights file's tensors: what lies between its magic, version and configuration and its
// checksum.
std::string tensors_of(const fs::path& weights) {
  const std::string all = read_all(weights);
  uint64_t json = 0;
  std::memcpy(&json, all.data() + 12, sizeof(json));
  return all.substr(20 + json, all.size() - 20 - json - 8);
}

TEST_F(Cli, OffloadedRunIsBitwiseTheRunInRamAndResumesEitherWay) {
  const std::string corpus = write_corpus(200).string();
  const std::string flags =
      "--preset tiny --vocab 300 --batch 4 --accum 2 --steps 10 "
      "--save-every 5 --keep 5 --sample-tokens 1 --dtype bf16 --corpus " +
      corpus;
  const fs::path straight = dir_ / "in_ram", offloaded = dir_ / "offloaded";
  const fs::path state = dir_ / "state";
  ASSERT_EQ(run(flags + " --out " + straight.string()).exit_code, 0);
  const Result r = run(flags + " --offload " + state.string() + " --out " + offloaded.string());
  ASSERT_EQ(r.exit_code, 0) << r.err << r.out;
  EXPECT_NE(r.out.find("offloaded to " + state.string()), std::string::npos) << r.out;
  EXPECT_EQ(losses_of(offloaded), losses_of(straight));
  EXPECT_EQ(tensors_of(offloaded / "model.bin"), tensors_of(straight / "model.bin"));
  for (const char* f : {"masters.f32", "adamw_m.f32", "adamw_v.f32"})
    EXPECT_FALSE(fs::exists(state / f)) << f;
  for (const std::string& offload : {std::string(), std::string(" --offload none")}) {
    const fs::path resumed = dir_ / ("resumed" + std::to_string(offload.size()));
    fs::create_directories(resumed / "checkpoints");
    for (const char* f : {"config.json", "tokenizer.model", "tokens.bin"})
      fs::copy_file(offloaded / f, resumed / f);
    fs::copy_file(offloaded / "checkpoints" / "step-00000005.ckpt",
                  resumed / "checkpoints" / "step-00000005.ckpt");
    {
      std::ifstream in(offloaded / "metrics.jsonl");
      std::ofstream out(resumed / "metrics.jsonl");
      std::string line;
      for (int i = 0; i < 5 && std::getline(in, line); ++i) out << line << "\n";
    }
    const Result b = run("--resume " + resumed.string() + " --sample-tokens 1" + offload);
    ASSERT_EQ(b.exit_code, 0) << b.err << b.out;
    EXPECT_EQ(b.out.find("offloaded to") == std::string::npos, !offload.empty()) << b.out;
    EXPECT_EQ(losses_of(resumed), losses_of(straight)) << offload;
    EXPECT_EQ(tensors_of(resumed / "model.bin"), tensors_of(straight / "model.bin")) << offload;
  }
  const Result budget = run("budget --preset tiny --vocab 300 --dtype bf16 --json --offload " +
                            state.string() + " --corpus " + corpus);
  ASSERT_EQ(budget.exit_code, 0) << budget.err;
  const nlohmann::json j = nlohmann::json::parse(budget.out);
  EXPECT_GT(j["disk_bytes"].get<int64_t>(), 0);
  const Result in_ram =
      run("budget --preset tiny --vocab 300 --dtype bf16 --json --corpus " + corpus);
  EXPECT_LT(j["total_bytes"].get<int64_t>(),
            nlohmann::json::parse(in_ram.out)["total_bytes"].get<int64_t>());
}

// SIGINT during training: the step finishes, a checkpoint is saved, the exit status is 130;
// resuming completes a run whose losses equal an uninterrupted one's. The run is held before
// step 4 until the signal arrives, so it stops after step 4 however fast the machine is.
TEST_F(Cli, InterruptSavesAndResumeFinishesTheSameRun) {
  const std::string corpus = write_corpus(200).string();
  const std::string flags =
      "--preset tiny --vocab 300 --batch 4 --steps 120 --save-every 1000 "
      "--eval-windows 2 --sample-tokens 1 --dtype fp32 --corpus " +
      corpus;
  const fs::path straight = dir_ / "straight", stopped = dir_ / "stopped";
  ASSERT_EQ(run(flags + " --out " + straight.string()).exit_code, 0);
  const pid_t pid = start_prepared(flags, straight, stopped, dir_ / "stopped.log", 3, "4");
  ASSERT_GE(pid, 0) << read_all(dir_ / "stopped.log");
  ::kill(pid, SIGINT);
  int status = 0;
  ASSERT_EQ(::waitpid(pid, &status, 0), pid);
  ASSERT_TRUE(WIFEXITED(status)) << "killed by signal " << WTERMSIG(status) << "\n"
                                 << read_all(dir_ / "stopped.log");
  EXPECT_EQ(WEXITSTATUS(status), 130) << read_all(dir_ / "stopped.log");
  ASSERT_EQ(losses_of(stopped).size(), 4u);
  EXPECT_NE(read_all(dir_ / "stopped.log").find("interrupted (SIGINT) after step 4"),
            std::string::npos)
      << read_all(dir_ / "stopped.log");
  EXPECT_TRUE(fs::exists(stopped / "checkpoints" / "step-00000004.ckpt"));
  EXPECT_FALSE(fs::exists(stopped / "model.bin"));
  // A stopped run samples from its newest checkpoint, or from the one named.
  for (const std::string& weights :
       {std::string(), " --weights " + (stopped / "checkpoints" / "step-00000004.ckpt").string()}) {
    const Result sampled =
        run("sample --run " + stopped.string() + " --max-tokens 3 --temperature 0" + weights);
    EXPECT_EQ(sampled.exit_code, 0) << sampled.err;
  }
  expect_one_line_error(
      run("sample --run " + stopped.string() + " --weights " + (dir_ / "none.bin").string()),
      "none.bin");

  const Result r = run("--resume " + stopped.string() + " --sample-tokens 1");
  ASSERT_EQ(r.exit_code, 0) << r.err << r.out;
  EXPECT_EQ(losses_of(stopped), losses_of(straight));
  EXPECT_EQ(read_all(stopped / "model.bin"), read_all(straight / "model.bin"));
}

// A run directory that holds a run is refused, with one line saying how to continue or replace
// it, and nothing in it changes; --overwrite replaces it, and only once the new run has started.
TEST_F(Cli, ARunDirectoryIsNeverReplacedSilently) {
  const std::string corpus = write_corpus(200).string();
  const std::string flags =
      "--preset tiny --vocab 300 --batch 4 --sample-tokens 1 --dtype fp32 --corpus " + corpus;
  const fs::path run_dir = dir_ / "run";
  ASSERT_EQ(run(flags + " --steps 6 --save-every 3 --out " + run_dir.string()).exit_code, 0);
  std::map<std::string, std::string> before;
  for (const auto& e : fs::recursive_directory_iterator(run_dir))
    if (e.is_regular_file() && e.path().filename() != ".lock")
      before[e.path().string()] = read_all(e.path());
  auto unchanged = [&] {
    for (const auto& [path, bytes] : before)
      if (read_all(path) != bytes) return ::testing::AssertionFailure() << path << " changed";
    return ::testing::AssertionSuccess();
  };
  const Result again = run(flags + " --steps 4 --out " + run_dir.string());
  expect_one_line_error(again, "--out " + run_dir.string() + " already holds a run");
  EXPECT_NE(again.err.find("--resume " + run_dir.string()), std::string::npos) << again.err;
  EXPECT_NE(again.err.find("--overwrite"), std::string::npos) << again.err;
  EXPECT_TRUE(unchanged());
  // Parity would replace the run's tokenizer and token cache: refused too.
  expect_one_line_error(run("parity --preset tiny --vocab 300 --steps 2 --corpus " + corpus +
                            " --out " + run_dir.string()),
                        "holds a training run");
  EXPECT_TRUE(unchanged());
  // A replacement that fails before its first step leaves the old run whole, set aside.
  const Result failed =
      run(flags + " --ctx 100000 --steps 4 --overwrite --out " + run_dir.string());
  EXPECT_NE(failed.exit_code, 0);
  EXPECT_EQ(read_all(run_dir / ".replaced" / "metrics.jsonl"),
            before[(run_dir / "metrics.jsonl").string()]);
  // So does one killed in its first step, after it wrote its configuration; the next
  // replacement deletes that one's files and keeps the old run aside.
  const pid_t killed =
      start(flags + " --steps 4 --overwrite --out " + run_dir.string(), dir_ / "killed.log", "1+");
  ASSERT_GT(killed, 0);
  ASSERT_TRUE(wait_until([&] {
    return read_all(dir_ / "killed.log").find("holding before step 1") != std::string::npos;
  })) << read_all(dir_ / "killed.log");
  ::kill(killed, SIGKILL);
  ::waitpid(killed, nullptr, 0);
  EXPECT_TRUE(fs::exists(run_dir / "config.json"));
  const Result failed_again =
      run(flags + " --ctx 100000 --steps 4 --overwrite --out " + run_dir.string());
  EXPECT_NE(failed_again.exit_code, 0);
  EXPECT_EQ(read_all(run_dir / ".replaced" / "metrics.jsonl"),
            before[(run_dir / "metrics.jsonl").string()]);
  EXPECT_FALSE(fs::exists(run_dir / "config.json"));
  // One that starts deletes it: the new run alone is left.
  const Result replaced = run(flags + " --steps 4 --overwrite --out " + run_dir.string());
  ASSERT_EQ(replaced.exit_code, 0) << replaced.err << replaced.out;
  EXPECT_EQ(losses_of(run_dir).size(), 4u);
  EXPECT_FALSE(fs::exists(run_dir / ".replaced"));
  EXPECT_FALSE(fs::exists(run_dir / "checkpoints" / "step-00000006.ckpt"));
  EXPECT_TRUE(fs::exists(run_dir / "checkpoints" / "step-00000004.ckpt"));
  // A directory of other files is not a run directory, with or without --overwrite.
  const fs::path notes = dir_ / "notes";
  fs::create_directories(notes);
  std::ofstream(notes / "todo.txt") << "keep me\n";
  expect_one_line_error(run(flags + " --steps 2 --overwrite --out " + notes.string()),
                        "not a training run");
  EXPECT_EQ(read_all(notes / "todo.txt"), "keep me\n");
}

// The corpus is recorded as an absolute path, so a run started with a relative one resumes from
// any folder; temporary files a killed save left behind are removed when the directory is next
// opened, and the log says so.
TEST_F(Cli, RunsResumeFromAnyFolderAndDropStaleTemporaries) {
  write_corpus(200);
  const fs::path run_dir = dir_ / "run";
  const Result first = run("cd " + dir_.string() + " &&",
                           "--preset tiny --vocab 300 --batch 4 --steps 4 --save-every 2 "
                           "--sample-tokens 1 --dtype fp32 --corpus corpus.txt --out run");
  ASSERT_EQ(first.exit_code, 0) << first.err << first.out;
  // Routine saves are logged.
  EXPECT_NE(read_all(run_dir / "train.log").find("saved run/checkpoints/step-00000002.ckpt"),
            std::string::npos)
      << read_all(run_dir / "train.log");
  std::ifstream config_file(run_dir / "config.json");
  EXPECT_EQ(nlohmann::json::parse(config_file)["corpus"], (dir_ / "corpus.txt").string());
  fs::remove(run_dir / "checkpoints" / "step-00000004.ckpt");
  const fs::path stale[] = {run_dir / "checkpoints" / "step-00000004.ckpt.tmp",
                            run_dir / "model.bin.tmp"};
  for (const fs::path& p : stale) std::ofstream(p) << "half a file";
  const Result resumed = run("cd / &&", "--resume " + run_dir.string() + " --sample-tokens 1");
  ASSERT_EQ(resumed.exit_code, 0) << resumed.err << resumed.out;
  for (const fs::path& p : stale) {
    EXPECT_FALSE(fs::exists(p)) << p;
    EXPECT_NE(read_all(run_dir / "train.log").find("removed " + p.string()), std::string::npos)
        << p;
  }
  EXPECT_EQ(losses_of(run_dir).size(), 4u);
}

// While a run trains, a second process on its directory (a new run, a replacement, a resume)
// exits at once with one line naming the first, and the run goes on untouched.
TEST_F(Cli, ASecondProcessOnARunDirectoryIsRefused) {
  const std::string flags =
      "--preset tiny --vocab 300 --batch 4 --save-every 1 --sample-tokens 1 --dtype fp32 "
      "--corpus " +
      write_corpus(200).string();
  const fs::path prepared = dir_ / "prepared", busy = dir_ / "busy";
  ASSERT_EQ(run(flags + " --steps 1 --out " + prepared.string()).exit_code, 0);
  const pid_t pid =
      start_prepared(flags + " --steps 1000", prepared, busy, dir_ / "busy.log", 2, "3+");
  ASSERT_GE(pid, 0) << read_all(dir_ / "busy.log");
  const std::string config = read_all(busy / "config.json");
  for (const std::string& second :
       {flags + " --steps 5 --out " + busy.string(),
        flags + " --steps 5 --overwrite --out " + busy.string(), "--resume " + busy.string()}) {
    const Result r = run(second);
    expect_one_line_error(r, "in use by another cputrain process (pid " + std::to_string(pid));
  }
  EXPECT_EQ(read_all(busy / "config.json"), config);
  EXPECT_EQ(losses_of(busy).size(), 2u);
  ::kill(pid, SIGKILL);
  ::waitpid(pid, nullptr, 0);
  // The lock goes with its process: what a new run hears now is that a run is there.
  expect_one_line_error(run(flags + " --steps 5 --out " + busy.string()), "already holds a run");
}

// A resumed run keeps its configuration: a flag that would change it is refused, naming it; a
// finished run is not silently "resumed"; --steps extends it, the learning rate keeping its
// schedule (the added steps at its final rate); its saving (--save-every, --keep) is kept in
// config.json and survives the resume.
TEST_F(Cli, ResumeRefusesChangesAndExtendsWithItsOwnSaving) {
  const std::string flags =
      "--preset tiny --vocab 300 --batch 4 --sample-tokens 1 --dtype fp32 --lr 0.002 "
      "--warmup 1 --corpus " +
      write_corpus(200).string();
  const fs::path run_dir = dir_ / "run";
  ASSERT_EQ(run(flags + " --steps 6 --save-every 2 --keep 2 --out " + run_dir.string()).exit_code,
            0);
  const std::string config = read_all(run_dir / "config.json");
  const std::string metrics = read_all(run_dir / "metrics.jsonl");
  const std::string resume = "--resume " + run_dir.string() + " --sample-tokens 1";
  expect_one_line_error(run(resume + " --lr 0.1 --batch 2"), "--batch, --lr would change the run");
  expect_one_line_error(run(resume), "the run has trained all its 6 steps; give --steps above 6");
  expect_one_line_error(run(resume + " --steps 4"), "has already trained 6 steps");
  EXPECT_EQ(read_all(run_dir / "config.json"), config);
  EXPECT_EQ(read_all(run_dir / "metrics.jsonl"), metrics);

  const Result extended = run(resume + " --steps 10");
  ASSERT_EQ(extended.exit_code, 0) << extended.err << extended.out;
  EXPECT_NE(extended.out.find("the run now ends at step 10 (it was to end at 6); the learning "
                              "rate keeps the schedule it began with"),
            std::string::npos)
      << extended.out;
  std::ifstream config_file(run_dir / "config.json");
  const nlohmann::json c = nlohmann::json::parse(config_file);
  EXPECT_EQ(c["train"]["steps"], 10);
  EXPECT_EQ(c["train"]["lr_schedule_steps"], 6);
  EXPECT_EQ(c["train"]["save_every"], 2);
  EXPECT_EQ(c["train"]["keep"], 2);
  std::ifstream lines(run_dir / "metrics.jsonl");
  std::string line;
  std::vector<double> lr;
  while (std::getline(lines, line)) lr.push_back(nlohmann::json::parse(line)["lr"]);
  ASSERT_EQ(lr.size(), 10u);
  for (size_t i = 6; i < 10; ++i) EXPECT_DOUBLE_EQ(lr[i], lr[5]) << "step " << i + 1;
  EXPECT_NEAR(lr[5], 0.0002, 1e-12);
  // --save-every 2 and --keep 2 held through the resume: the last two of steps 8 and 10.
  std::vector<std::string> kept;
  for (const auto& e : fs::directory_iterator(run_dir / "checkpoints"))
    kept.push_back(e.path().filename().string());
  std::sort(kept.begin(), kept.end());
  EXPECT_EQ(kept, (std::vector<std::string>{"step-00000008.ckpt", "step-00000010.ckpt"}));
  // Every checkpoint damaged: each said once, on stderr, then the one error.
  for (const std::string& name : kept)
    std::ofstream(run_dir / "checkpoints" / name, std::ios::trunc) << "damaged";
  const Result damaged = run(resume + " --steps 12");
  EXPECT_NE(damaged.exit_code, 0);
  for (const std::string& name : kept) {
    const std::string said = "skipping " + (run_dir / "checkpoints" / name).string();
    EXPECT_NE(damaged.err.find(said), std::string::npos) << damaged.err;
    EXPECT_EQ(damaged.err.find(said), damaged.err.rfind(said)) << damaged.err;
  }
  EXPECT_EQ(damaged.out.find("skipping"), std::string::npos) << damaged.out;
  EXPECT_NE(damaged.err.find("cputrain: error: --resume " + run_dir.string() +
                             ": no readable checkpoint in " + (run_dir / "checkpoints").string() +
                             " (2 damaged)"),
            std::string::npos)
      << damaged.err;
}

// The corpus is its content: touched, it resumes; moved, the message names the run's
// configuration; changed (same size and time), it is refused and the token cache is untouched.
TEST_F(Cli, ACorpusIsItsContent) {
  const fs::path corpus = write_corpus(200);
  const std::string flags =
      "--preset tiny --vocab 300 --batch 4 --sample-tokens 1 --dtype fp32 --save-every 2 "
      "--corpus " +
      corpus.string();
  const fs::path run_dir = dir_ / "run";
  ASSERT_EQ(run(flags + " --steps 2 --out " + run_dir.string()).exit_code, 0);
  const std::string resume = "--resume " + run_dir.string() + " --sample-tokens 1";
  fs::last_write_time(corpus, fs::file_time_type::clock::now() + std::chrono::hours(1));
  const Result touched = run(resume + " --steps 4");
  ASSERT_EQ(touched.exit_code, 0) << touched.err << touched.out;
  EXPECT_EQ(touched.out.find("tokenizing"), std::string::npos) << touched.out;

  const std::string text = read_all(corpus);
  fs::rename(corpus, dir_ / "elsewhere.txt");
  expect_one_line_error(run(resume + " --steps 6"), (run_dir / "config.json").string() +
                                                        ": corpus " + corpus.string() +
                                                        ": no such file or folder");
  fs::rename(dir_ / "elsewhere.txt", corpus);

  const std::string cache = read_all(run_dir / "tokens.bin");
  const auto stamp = fs::last_write_time(corpus);
  std::string changed = text;
  changed[changed.find("cat")] = 'b';  // "The bat"
  std::ofstream(corpus, std::ios::binary | std::ios::trunc) << changed;
  fs::last_write_time(corpus, stamp);
  expect_one_line_error(run(resume + " --steps 6"), "not what the run was trained on");
  EXPECT_EQ(read_all(run_dir / "tokens.bin"), cache);
  EXPECT_EQ(losses_of(run_dir).size(), 4u);
}

// A run directory inside the corpus folder is passed over, this run's and others', and so are
// binary files; a folder of nothing but binary files is refused in cputrain's own words.
TEST_F(Cli, RunDirectoriesAndBinaryFilesInTheCorpusArePassedOver) {
  const fs::path folder = dir_ / "texts";
  fs::create_directories(folder);
  fs::rename(write_corpus(200), folder / "fortunes.txt");
  std::ofstream(folder / "picture.png", std::ios::binary) << std::string("\x89PNG\0\0\0", 7);
  const std::string flags =
      "--preset tiny --vocab 300 --batch 4 --steps 2 --sample-tokens 1 --dtype fp32 --corpus " +
      folder.string();
  const Result first = run(flags + " --out " + (folder / "run1").string());
  ASSERT_EQ(first.exit_code, 0) << first.err << first.out;
  const Result second = run(flags + " --out " + (folder / "run2").string());
  ASSERT_EQ(second.exit_code, 0) << second.err << second.out;
  for (const Result* r : {&first, &second}) {
    EXPECT_NE(r->out.find("tokenizing 200 documents"), std::string::npos) << r->out;
    EXPECT_NE(
        r->out.find("passed over 1 binary files (such as " + (folder / "picture.png").string()),
        std::string::npos)
        << r->out;
  }
  EXPECT_NE(second.out.find("passed over " + (folder / "run1").string() + ", a run directory"),
            std::string::npos)
      << second.out;
  EXPECT_EQ(read_all(folder / "run1" / "tokens.bin").size(),
            read_all(folder / "run2" / "tokens.bin").size());

  const fs::path binaries = dir_ / "binaries";
  fs::create_directories(binaries);
  std::ofstream(binaries / "a.bin", std::ios::binary) << std::string("\0\1\2\3", 4);
  const Result refused =
      run("--preset tiny --corpus " + binaries.string() + " --out " + (dir_ / "run3").string());
  expect_one_line_error(refused, "the folder holds no text files (1 binary files passed over");
  EXPECT_EQ(refused.err.find("character_coverage"), std::string::npos) << refused.err;
  EXPECT_FALSE(fs::exists(dir_ / "run3"));
}

// Said, not silent: a tokenizer smaller than --vocab asked, a step that would take minutes
// (--ctx far beyond the preset), an invalid-UTF-8 prompt that is sampled from exactly.
TEST_F(Cli, WhatARunCannotDoAsAskedIsSaid) {
  const std::string corpus = write_corpus(200).string();
  const fs::path run_dir = dir_ / "run";
  const Result small =
      run("--preset tiny --vocab 5000 --batch 4 --steps 1 --sample-tokens 1 "
          "--corpus " +
          corpus + " --out " + run_dir.string());
  ASSERT_EQ(small.exit_code, 0) << small.err;
  EXPECT_NE(small.err.find("fewer than the 5000 asked (--vocab): the model's vocabulary is"),
            std::string::npos)
      << small.err;
  std::ifstream config(run_dir / "config.json");
  EXPECT_LT(nlohmann::json::parse(config)["model"]["vocab"].get<int64_t>(), 5000);

  const Result slow = run("--preset tiny --vocab 300 --ctx 100000 --corpus " + corpus + " --out " +
                          (dir_ / "slow").string());
  EXPECT_NE(slow.exit_code, 0);  // the corpus is shorter than one window
  EXPECT_NE(slow.err.find("--ctx 100000: attention is 9"), std::string::npos) << slow.err;
  EXPECT_NE(slow.err.find("needs at least"), std::string::npos) << slow.err;

  // Bytes that are not UTF-8 reach the model as they are: the prompt is echoed exactly.
  const Result sampled = run("sample --run " + run_dir.string() +
                             " --max-tokens 1 --prompt \"$(printf 'caf\\303 \\377')\"");
  ASSERT_EQ(sampled.exit_code, 0) << sampled.err;
  EXPECT_EQ(sampled.out.rfind("caf\xc3 \xff", 0), 0u) << sampled.out;
}

// Ctrl-C while the data is prepared (a tokenizer trains in one library call) stops at once,
// says so, and leaves no directory behind where the run made one.
TEST_F(Cli, InterruptWhilePreparingTheDataStopsAtOnce) {
  const fs::path run_dir = dir_ / "run", log = dir_ / "run.log";
  const pid_t pid = start("--preset tiny --vocab 300 --corpus " + write_corpus(200).string() +
                              " --out " + run_dir.string(),
                          log, "0");
  ASSERT_GT(pid, 0);
  ASSERT_TRUE(wait_until([&] {
    return read_all(log).find("holding before step 0") != std::string::npos;
  })) << read_all(log);
  ::kill(pid, SIGINT);
  int status = 0;
  ASSERT_EQ(::waitpid(pid, &status, 0), pid);
  ASSERT_TRUE(WIFEXITED(status)) << read_all(log);
  EXPECT_EQ(WEXITSTATUS(status), 130);
  EXPECT_NE(read_all(log).find("SIGINT while preparing the data: stopped"), std::string::npos)
      << read_all(log);
  EXPECT_FALSE(fs::exists(run_dir));
}

// One large file with no document separators still has a validation loss.
TEST_F(Cli, OneLargeFileHasAValidationLoss) {
  const fs::path book = dir_ / "book.txt";
  std::string text;
  for (int i = 0; i < 4000; ++i)
    text += "Line " + std::to_string(i) + " of the book tells of " +
            (i % 3 ? "the sea.\n" : "the hills.\n\n");
  std::ofstream(book) << text;
  const fs::path run_dir = dir_ / "run";
  const Result r = run("--preset tiny --vocab 300 --batch 4 --steps 2 --sample-tokens 1 --corpus " +
                       book.string() + " --out " + run_dir.string());
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_EQ(r.err.find("no validation loss"), std::string::npos) << r.err;
  std::ifstream metrics(run_dir / "metrics.jsonl");
  std::string line, last;
  while (std::getline(metrics, line)) last = line;
  EXPECT_TRUE(nlohmann::json::parse(last).contains("val_loss")) << last;
}

// A second SIGINT, sent once the first is acknowledged, before the step ends, ends the run at
// once by the signal's default action, without a checkpoint (the run is held in step 3 for good,
// so the second signal always arrives inside it).
TEST_F(Cli, SecondInterruptEndsTheRunAtOnce) {
  const std::string flags =
      "--preset tiny --vocab 300 --batch 4 --save-every 100000 "
      "--eval-windows 2 --sample-tokens 1 --dtype fp32 --corpus " +
      write_corpus(200).string();
  const fs::path prepared = dir_ / "prepared", twice = dir_ / "twice";
  ASSERT_EQ(run(flags + " --steps 1 --out " + prepared.string()).exit_code, 0);
  const pid_t pid =
      start_prepared(flags + " --steps 100000", prepared, twice, dir_ / "twice.log", 2, "3+");
  ASSERT_GE(pid, 0) << read_all(dir_ / "twice.log");
  ::kill(pid, SIGINT);
  const std::string acknowledged = "SIGINT: the run stops after this step";
  ASSERT_TRUE(wait_until([&] {
    return read_all(dir_ / "twice.log").find(acknowledged) != std::string::npos;
  })) << read_all(dir_ / "twice.log");
  ::kill(pid, SIGINT);
  int status = 0;
  ASSERT_EQ(::waitpid(pid, &status, 0), pid);
  ASSERT_TRUE(WIFSIGNALED(status)) << "exit status " << WEXITSTATUS(status) << "\n"
                                   << read_all(dir_ / "twice.log");
  EXPECT_EQ(WTERMSIG(status), SIGINT);
  EXPECT_EQ(read_all(dir_ / "twice.log").find("interrupted (SIGINT)"), std::string::npos)
      << read_all(dir_ / "twice.log");
  EXPECT_NE(read_all(dir_ / "twice.log")
                .find("SIGINT again: stopping at once, without a checkpoint of this step"),
            std::string::npos)
      << read_all(dir_ / "twice.log");
  EXPECT_EQ(losses_of(twice).size(), 2u);
  EXPECT_FALSE(fs::exists(twice / "checkpoints"));
}

// eval reproduces the validation loss training logged at its last step, reads checkpoints too,
// and refuses damaged input with one line.
TEST_F(Cli, EvalMatchesTrainingsValidationLoss) {
  const fs::path run_dir = dir_ / "run";
  const Result r =
      run("--preset tiny --vocab 300 --batch 4 --steps 10 --eval-windows 6 "
          "--sample-tokens 1 --dtype fp32 --corpus " +
          write_corpus(300).string() + " --out " + run_dir.string());
  ASSERT_EQ(r.exit_code, 0) << r.err << r.out;
  std::ifstream metrics(run_dir / "metrics.jsonl");
  std::string line, last;
  while (std::getline(metrics, line)) last = line;
  const double val = nlohmann::json::parse(last)["val_loss"];
  const Result e = run("eval --run " + run_dir.string() + " --windows 6 --batch 4 --json");
  ASSERT_EQ(e.exit_code, 0) << e.err;
  const nlohmann::json j = nlohmann::json::parse(e.out);
  EXPECT_NEAR(j["loss"].get<double>(), val, 1e-6);
  EXPECT_NEAR(j["perplexity"].get<double>(), std::exp(val), 1e-3);
  EXPECT_EQ(j["windows"], 6);
  const Result c = run("eval --run " + run_dir.string() + " --windows 6 --batch 4 --weights " +
                       (run_dir / "checkpoints" / "step-00000010.ckpt").string() + " --json");
  ASSERT_EQ(c.exit_code, 0) << c.err;
  EXPECT_EQ(nlohmann::json::parse(c.out)["loss"], j["loss"]);  // the same weights

  expect_one_line_error(run("eval --run " + (dir_ / "none").string()), "--run");
  std::ofstream(run_dir / "model.bin", std::ios::trunc) << "garbage";
  expect_one_line_error(run("eval --run " + run_dir.string()), "model.bin");
}

TEST_F(Cli, PlotWritesAnSvgOfTheRun) {
  const fs::path run_dir = dir_ / "run";
  ASSERT_EQ(run("--preset tiny --vocab 300 --batch 4 --steps 12 --eval-every 4 --sample-tokens 1 "
                "--corpus " +
                write_corpus(200).string() + " --out " + run_dir.string())
                .exit_code,
            0);
  const Result p = run("plot --run " + run_dir.string());
  ASSERT_EQ(p.exit_code, 0) << p.err;
  EXPECT_NE(p.out.find("12 steps"), std::string::npos) << p.out;
  const std::string svg = read_all(run_dir / "plot.svg");
  EXPECT_EQ(svg.rfind("<svg", 0), 0u);
  EXPECT_NE(svg.find("</svg>"), std::string::npos);
  for (const char* text : {"train loss", "validation loss", "tokens/s"})
    EXPECT_NE(svg.find(text), std::string::npos) << text;
  size_t polylines = 0;
  for (size_t at = svg.find("<polyline"); at != std::string::npos;
       at = svg.find("<polyline", at + 1))
    ++polylines;
  EXPECT_EQ(polylines, 3u);
  // 12 train points, 3 validation points.
  const size_t first = svg.find("points=\"");
  const size_t end = svg.find('"', first + 8);
  EXPECT_EQ(
      std::count(svg.begin() + static_cast<long>(first), svg.begin() + static_cast<long>(end), ','),
      3);

  expect_one_line_error(run("plot --run " + (dir_ / "none").string()), "--run");
  std::ofstream(run_dir / "metrics.jsonl", std::ios::app) << "{broken\n";
  expect_one_line_error(run("plot --run " + run_dir.string()), "metrics.jsonl");
}

// A bad step is never applied: by default it stops the run naming the step and the last good
// checkpoint; with --on-bad-step skip the run goes on. (--spike 0.5 makes every step after the
// first a spike.)
TEST_F(Cli, BadStepsStopOrAreSkipped) {
  const std::string base =
      "--preset tiny --vocab 300 --batch 4 --steps 5 --save-every 1 "
      "--sample-tokens 1 --spike 0.5 --corpus " +
      write_corpus(200).string();
  const Result stopped = run(base + " --out " + (dir_ / "stop").string());
  expect_one_line_error(stopped, "step 2: loss");
  EXPECT_NE(stopped.err.find("spike"), std::string::npos) << stopped.err;
  EXPECT_NE(stopped.err.find("step-00000001.ckpt"), std::string::npos) << stopped.err;
  EXPECT_FALSE(fs::exists(dir_ / "stop" / "checkpoints" / "step-00000002.ckpt"));

  const fs::path skip = dir_ / "skip";
  const Result r = run(base + " --on-bad-step skip --out " + skip.string());
  ASSERT_EQ(r.exit_code, 0) << r.err << r.out;
  EXPECT_NE(r.err.find("step 2: loss"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("skipped"), std::string::npos) << r.err;
  std::ifstream metrics(skip / "metrics.jsonl");
  std::string line;
  std::vector<bool> skipped;
  while (std::getline(metrics, line)) skipped.push_back(nlohmann::json::parse(line)["skipped"]);
  EXPECT_EQ(skipped, (std::vector<bool>{false, true, true, true, true}));
  expect_one_line_error(run(base + " --on-bad-step ignore --out " + skip.string()),
                        "--on-bad-step");
  // Skipped to the end by a first step that blew the weights up: the model is not written as a
  // good one, and the run says so (eval of it would be a NaN loss).
  const fs::path blown = dir_ / "blown";
  const Result b =
      run("--preset tiny --vocab 300 --batch 4 --steps 4 --sample-tokens 1 --lr 1e30 "
          "--on-bad-step skip --corpus " +
          write_corpus(200).string() + " --out " + blown.string());
  EXPECT_NE(b.exit_code, 0);
  EXPECT_NE(b.err.find("cputrain: error: the last step (4) was skipped: its loss is"),
            std::string::npos)
      << b.err;
  EXPECT_FALSE(fs::exists(blown / "model.bin"));
}

// Without --dtype and CPUTRAIN_ISA a run says which dtype and level it took and why: on an Intel
// core with AVX512_FP16 whose AMX is not offered the level is avx512 (bf16 products widened to
// FP32 as they pack, and bf16 still the dtype); elsewhere the CPU's own, with no such note.
TEST_F(Cli, DefaultDtypeAndLevelAreLoggedWithTheirReasons) {
  const Result r =
      run("env -u CPUTRAIN_ISA",
          "--preset tiny --vocab 300 --ctx 32 --batch 4 --steps 1 --sample-tokens 1 --corpus " +
              write_corpus(100).string() + " --out " + (dir_ / "run").string());
  ASSERT_EQ(r.exit_code, 0) << r.err << r.out;
  EXPECT_NE(r.out.find("dtype: "), std::string::npos) << r.out;
  EXPECT_NE(r.out.find(" GEMM "), std::string::npos) << r.out;
  const bool widened = r.out.find(
                           "avx512 by default: on an Intel core with AVX512_FP16 whose AMX "
                           "is not offered") != std::string::npos;
  const auto& cpu = cputrain::kernels::cpu_features();
  const bool slow = cputrain::kernels::vdpbf16ps_slower_than_fma(cpu);
  EXPECT_EQ(widened, slow) << r.out;
  if (std::getenv("CPUTRAIN_GEMM") != nullptr || !cpu.avx512_bf16) return;
  if (slow) {
    EXPECT_NE(r.out.find("attention avx512,"), std::string::npos) << r.out;
    EXPECT_NE(r.out.find("dtype: bf16 (the avx512 GEMM widens bf16 to FP32 as it packs"),
              std::string::npos)
        << r.out;
  } else if (!cpu.amx_bf16) {
    EXPECT_NE(r.out.find("dtype: bf16 (the avx512 GEMM has bf16 instructions"), std::string::npos)
        << r.out;
  }
}

TEST_F(Cli, BadDtypeAndParityFlags) {
  const std::string corpus = write_corpus(50).string();
  expect_one_line_error(
      run("--preset tiny --dtype fp16 --corpus " + corpus + " --out " + (dir_ / "run").string()),
      "--dtype");
  const std::string parity =
      "parity --preset tiny --corpus " + corpus + " --out " + (dir_ / "parity").string();
  expect_one_line_error(run(parity + " --accum 3"), "--accum 3");
  expect_one_line_error(run(parity + " --accum 1"), "--accum 1");
  expect_one_line_error(run(parity + " --tol-bf16 -1"), "--tol-bf16");
  expect_one_line_error(run(parity + " --steps 0"), "--steps");
}

// The parity check on the tiny preset: bf16 tracks fp32, accumulation equals the single batch,
// and a tolerance nobody can meet makes it fail.
TEST_F(Cli, ParityOnTinyPreset) {
  const std::string base =
      "parity --preset tiny --vocab 300 --ctx 32 --batch 8 --accum 2,4 "
      "--corpus " +
      write_corpus(400).string() + " --out " + (dir_ / "parity").string();
  const Result r = run(base + " --steps 20 --json");
  ASSERT_EQ(r.exit_code, 0) << r.err << r.out;
  const nlohmann::json j = nlohmann::json::parse(r.out);
  const double fp32 = j["fp32_final_loss"], bf16 = j["bf16_final_loss"];
  EXPECT_NEAR(j["bf16_delta_nats"].get<double>(), bf16 - fp32, 1e-12);
  EXPECT_LT(std::abs(bf16 - fp32), 0.02);
  EXPECT_NE(bf16, fp32);  // the bf16 run did round
  ASSERT_EQ(j["accum"].size(), 2u);
  EXPECT_EQ(j["accum"][0]["batch"], 4);
  EXPECT_EQ(j["accum"][0]["accum"], 2);
  EXPECT_EQ(j["accum"][1]["batch"], 2);
  EXPECT_EQ(j["accum"][1]["accum"], 4);
  for (const auto& a : j["accum"]) EXPECT_LT(std::abs(a["delta_nats"].get<double>()), 1e-4);
  EXPECT_LT(j["bf16_activation_peak_bytes"].get<int64_t>(),
            j["fp32_activation_peak_bytes"].get<int64_t>());
  EXPECT_TRUE(j["pass"].get<bool>());
  // parity.csv: a header and one row per step.
  std::ifstream csv(dir_ / "parity" / "parity.csv");
  std::string line;
  int lines = 0;
  while (std::getline(csv, line)) ++lines;
  EXPECT_EQ(lines, 21);

  const Result strict = run(base + " --steps 5 --tol-bf16 0");
  EXPECT_EQ(strict.exit_code, 3) << strict.err;
  EXPECT_NE(strict.err.find("exceeds its tolerance"), std::string::npos) << strict.err;
}

// Two ranks at batch 2 train the model one process trains at batch 4 over the same sequences:
// losses and validation losses within 1e-6; a second run at two ranks is the first, bit for
// bit; rank 0 alone writes the run, with each rank's step in metrics.jsonl.
TEST_F(DataParallelCli, TwoRanksTrainAsOneProcessAtTwiceTheBatch) {
  const std::string common =
      "--preset tiny --steps 10 --accum 2 --dtype fp32 --sample-tokens 4 "
      "--eval-every 5 --corpus " +
      write_corpus(200).string();
  const Result one =
      run("OMP_NUM_THREADS=1", common + " --batch 4 --threads 1 --out " + (dir_ / "one").string());
  ASSERT_EQ(one.exit_code, 0) << one.err;
  const Result two = ranks(2, common + " --batch 2 --out " + (dir_ / "two").string());
  ASSERT_EQ(two.exit_code, 0) << two.err << two.out;
  EXPECT_NE(two.out.find("data parallel: 2 ranks"), std::string::npos) << two.out;
  // Rank 0 alone logs: each step's line once (not the lines' count, which sampled text and a
  // peak measured again between steps make differ from run to run).
  const auto occurrences = [](const std::string& text, const std::string& what) {
    int64_t n = 0;
    for (size_t at = text.find(what); at != std::string::npos; at = text.find(what, at + 1)) ++n;
    return n;
  };
  EXPECT_EQ(occurrences(two.out, "data parallel: 2 ranks"), 1) << two.out;
  for (int step = 1; step <= 10; ++step) {
    char line[32];
    std::snprintf(line, sizeof line, "step %5d/10 |", step);
    EXPECT_EQ(occurrences(two.out, line), 1) << line << " in\n" << two.out;
  }
  const auto a = records(dir_ / "one"), b = records(dir_ / "two");
  expect_close(a, b, "loss");
  expect_close(a, b, "val_loss");
  ASSERT_FALSE(b.empty());
  ASSERT_TRUE(b.back().contains("ranks"));
  ASSERT_EQ(b.back()["ranks"].size(), 2u);
  for (const auto& r : b.back()["ranks"]) {
    EXPECT_GT(r["tokens_per_s"].get<double>(), 0.0);
    EXPECT_GT(r["peak_rss_bytes"].get<double>(), 0.0);
  }
  const Result again = ranks(2, common + " --batch 2 --out " + (dir_ / "again").string());
  ASSERT_EQ(again.exit_code, 0) << again.err;
  EXPECT_EQ(losses_of(dir_ / "two"), losses_of(dir_ / "again"));
  EXPECT_EQ(read_all(dir_ / "two" / "model.bin"), read_all(dir_ / "again" / "model.bin"));
}

// A two-rank run resumed from its checkpoint at step 4 makes the steps after it, and the final
// weights, of the run that never stopped, bit for bit, in bf16.
TEST_F(DataParallelCli, TwoRanksResumeBitwise) {
  const fs::path straight = dir_ / "straight", resumed = dir_ / "resumed";
  ASSERT_EQ(ranks(2,
                  "--preset tiny --accum 2 --batch 2 --dtype bf16 --sample-tokens 4 --steps 8 "
                  "--save-every 4 --corpus " +
                      write_corpus(200).string() + " --out " + straight.string())
                .exit_code,
            0);
  // The run as it was at step 4: its checkpoint there, nothing of the steps after it.
  fs::copy(straight, resumed, fs::copy_options::recursive);
  fs::remove(resumed / "model.bin");
  fs::remove(resumed / "checkpoints" / "step-00000008.ckpt");
  const Result rest = ranks(2, "--resume " + resumed.string() + " --sample-tokens 4");
  ASSERT_EQ(rest.exit_code, 0) << rest.err << rest.out;
  EXPECT_NE(rest.out.find("at step 5"), std::string::npos) << rest.out;
  const std::vector<double> a = losses_of(straight), b = losses_of(resumed);
  ASSERT_EQ(a.size(), 8u);
  EXPECT_EQ(a, b);
  EXPECT_EQ(read_all(straight / "model.bin"), read_all(resumed / "model.bin"));
}

// A fine-tune at two ranks of batch 2 is one process at batch 4: LoRA on a tiny run.
TEST_F(DataParallelCli, TwoRanksFineTuneAsOneProcessAtTwiceTheBatch) {
  const fs::path base = dir_ / "base";
  ASSERT_EQ(run("--preset tiny --vocab 300 --batch 8 --steps 20 --dtype fp32 --sample-tokens 1 "
                "--corpus " +
                write_corpus(200).string() + " --out " + base.string())
                .exit_code,
            0);
  const fs::path data = dir_ / "pairs.jsonl";
  {
    std::ofstream out(data);
    for (int i = 0; i < 24; ++i)
      out << "{\"prompt\": \"The cat " << i << "\", \"completion\": \" paints " << (i * 7) % 11
          << " green apples.\"}\n";
  }
  const std::string common = "finetune --model " + base.string() + " --data " + data.string() +
                             " --val-fraction 0.25 --ctx 32 --accum 2 --steps 6 --lr 1e-2 "
                             "--dtype fp32";
  const Result one =
      run("OMP_NUM_THREADS=1", common + " --batch 4 --threads 1 --out " + (dir_ / "one").string());
  ASSERT_EQ(one.exit_code, 0) << one.err;
  const Result two =
      ranks(2, common + " --batch 2 --save-every 3 --out " + (dir_ / "two").string());
  ASSERT_EQ(two.exit_code, 0) << two.err << two.out;
  EXPECT_NE(two.out.find("data parallel: 2 ranks"), std::string::npos) << two.out;
  const auto a = records(dir_ / "one"), b = records(dir_ / "two");
  expect_close(a, b, "loss");
  expect_close(a, b, "val_loss");
  ASSERT_TRUE(fs::exists(dir_ / "two" / "adapter.gguf"));
  // Resumed at 2 ranks from its checkpoint at step 3 (the sharded state given back to each
  // rank): the steps after it and the adapter of the run that never stopped, bit for bit.
  const fs::path resumed = dir_ / "resumed";
  fs::copy(dir_ / "two", resumed, fs::copy_options::recursive);
  fs::remove(resumed / "checkpoints" / "step-00000006.ckpt");
  fs::remove(resumed / "adapter.gguf");
  const Result rest =
      ranks(2, common + " --batch 2 --save-every 3 --resume --out " + resumed.string());
  ASSERT_EQ(rest.exit_code, 0) << rest.err << rest.out;
  const auto losses = [](const std::vector<nlohmann::json>& lines) {
    std::vector<double> v;
    for (const nlohmann::json& j : lines)
      if (j.contains("loss")) v.push_back(j["loss"].get<double>());
    return v;
  };
  EXPECT_EQ(losses(records(dir_ / "two")).size(), 6u);
  EXPECT_EQ(losses(records(dir_ / "two")), losses(records(resumed)));
  EXPECT_EQ(read_all(dir_ / "two" / "adapter.gguf"), read_all(resumed / "adapter.gguf"));
  // At another count of ranks it is refused in one line.
  const Result other = run("OMP_NUM_THREADS=1", common +
                                                    " --batch 2 --save-every 3 --threads 1 "
                                                    "--resume --out " +
                                                    resumed.string());
  EXPECT_NE(other.exit_code, 0);
  EXPECT_NE(other.err.find("runs as 2 ranks"), std::string::npos) << other.err;
}

// Bad input under two ranks is said once, by rank 0, and nothing starts; the commands that are
// not training refuse several ranks in one line.
TEST_F(DataParallelCli, BadInputIsSaidOnce) {
  const auto errors = [](const Result& r) {
    size_t n = 0;
    for (size_t at = r.err.find("cputrain: error:"); at != std::string::npos;
         at = r.err.find("cputrain: error:", at + 1))
      ++n;
    return n;
  };
  const Result preset = ranks(2, "--preset nope --out " + (dir_ / "run").string());
  EXPECT_NE(preset.exit_code, 0);
  EXPECT_EQ(errors(preset), 1u) << preset.err;
  EXPECT_NE(preset.err.find("--preset nope: unknown preset"), std::string::npos) << preset.err;
  EXPECT_FALSE(fs::exists(dir_ / "run"));
  const Result flag = ranks(2, "--steps -3 --out " + (dir_ / "run").string());
  EXPECT_NE(flag.exit_code, 0);
  EXPECT_EQ(errors(flag), 1u) << flag.err;
  const Result budget = ranks(2, "budget --preset tiny");
  EXPECT_NE(budget.exit_code, 0);
  EXPECT_EQ(errors(budget), 1u) << budget.err;
  EXPECT_NE(budget.err.find("only train and finetune run as several ranks"), std::string::npos)
      << budget.err;
}

}  // namespace

namespace {}  // namespace

// A rank that stops answering (stopped: it hangs) or dies (killed) ends the job within a bounded
// time, with a line saying what happened, rather than leaving the other waiting forever.
TEST_F(DataParallelCli, AStoppedOrKilledRankEndsTheJob) {
  const std::string corpus = write_corpus(200).string();
  for (const int sig : {SIGSTOP, SIGKILL}) {
    const fs::path out = dir_ / (sig == SIGSTOP ? "stopped" : "killed");
    const fs::path log = dir_ / (out.filename().string() + ".log");
    const pid_t pid = start(
        "--preset tiny --steps 1000000 --threads 1 --save-every 0 "
        "--rank-timeout 2 --corpus " +
            corpus + " --out " + out.string(),
        log, "", launcher(2));
    ASSERT_GT(pid, 0);
    ASSERT_TRUE(wait_until([&] {
      const std::string metrics = read_all(out / "metrics.jsonl");
      return std::count(metrics.begin(), metrics.end(), '\n') >= 3;
    })) << read_all(log);
    const pid_t rank1 = rank_pid(out.string(), 1);
    ASSERT_GT(rank1, 0);
    const auto sent = std::chrono::steady_clock::now();
    ASSERT_EQ(::kill(rank1, sig), 0);
    int status = 0;
    ASSERT_TRUE(wait_until([&] { return ::waitpid(pid, &status, WNOHANG) == pid; }))
        << read_all(log);
    const double seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - sent).count();
    EXPECT_LT(seconds, 60.0);
    EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) != 0) << read_all(log);
    const std::string said = read_all(log);
    if (sig == SIGSTOP)
      EXPECT_NE(said.find("rank 0: no answer from the other ranks for 2 s"), std::string::npos)
          << said;
    else
      EXPECT_NE(said.find("exited on signal 9"), std::string::npos) << said;
  }
}

// A stop signal to rank 0 stops the whole job after the step, with a checkpoint of the sharded
// state, and the run resumed at 2 ranks is the one that never stopped, bit for bit.
TEST_F(DataParallelCli, AnInterruptedJobSavesAndResumesAsTheRunThatNeverStopped) {
  const std::string common =
      "--preset tiny --steps 8 --batch 2 --accum 2 --save-every 0 --sample-tokens 4 "
      "--rank-timeout 120 --corpus " +
      write_corpus(200).string();
  const fs::path straight = dir_ / "straight", stopped = dir_ / "stopped";
  ASSERT_EQ(ranks(2, common + " --out " + straight.string()).exit_code, 0);
  const fs::path log = dir_ / "stopped.log";
  const pid_t pid = start(common + " --threads 1 --out " + stopped.string(), log, "5", launcher(2));
  ASSERT_GT(pid, 0);
  ASSERT_TRUE(wait_until([&] {
    return read_all(log).find("holding before step 5") != std::string::npos;
  })) << read_all(log);
  const pid_t rank0 = rank_pid(stopped.string(), 0);
  ASSERT_GT(rank0, 0);
  ASSERT_EQ(::kill(rank0, SIGINT), 0);
  int status = 0;
  ASSERT_TRUE(wait_until([&] { return ::waitpid(pid, &status, WNOHANG) == pid; })) << read_all(log);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) != 0);
  EXPECT_NE(read_all(log).find("interrupted (SIGINT) after step 5"), std::string::npos)
      << read_all(log);
  EXPECT_TRUE(fs::exists(stopped / "checkpoints" / "step-00000005.ckpt"));
  EXPECT_FALSE(fs::exists(stopped / "model.bin"));
  const Result rest = ranks(2, "--resume " + stopped.string() + " --sample-tokens 4");
  ASSERT_EQ(rest.exit_code, 0) << rest.err << rest.out;
  EXPECT_EQ(losses_of(straight), losses_of(stopped));
  EXPECT_EQ(read_all(straight / "model.bin"), read_all(stopped / "model.bin"));
}

// `tune` measures the blocking of a preset's products and keeps it in the user's cache
// (XDG_CACHE_HOME here). Runs read it back and say so, and compute the same bits as with the
// defaults: tiny runs under a tuning at the edges of its ranges have the default runs' losses,
// in fp32 and bf16. A cache that cannot be read, or holds a value out of range, is refused by
// tune and warned of and passed over by a run, in one line naming the file.
TEST_F(Cli, TuneKeepsABlockingRunsReadWithTheSameResults) {
  const std::string cache = "XDG_CACHE_HOME=" + (dir_ / "cache").string();
  const fs::path file = dir_ / "cache" / "cputrain" / "gemm-tuning.json";
  const Result show = run(cache, "tune --show");
  ASSERT_EQ(show.exit_code, 0) << show.err << show.out;
  ASSERT_NE(show.out.find("no tuning for this CPU"), std::string::npos) << show.out;
  const std::string cpu = show.out.substr(5, show.out.find('\n') - 5);  // "cpu: ..."

  const Result tuned = run(cache, "tune --preset tiny --tokens 256 --rounds 1 --threads 2");
  if (tuned.exit_code == 1 && tuned.err.find("cputrain's own kernels") != std::string::npos) {
    expect_one_line_error(tuned, "tune measures");
    GTEST_SKIP() << "the GEMM here is a library's: " << tuned.err;
  }
  ASSERT_EQ(tuned.exit_code, 0) << tuned.err << tuned.out;
  nlohmann::json written = nlohmann::json::parse(read_all(file));
  ASSERT_TRUE(written["cpus"].contains(cpu)) << written.dump();
  EXPECT_EQ(written["cpus"][cpu].size(), 1u) << written.dump();
  EXPECT_NE(run(cache, "tune --show").out.find("tuned "), std::string::npos);

  // Every kernel on 2 threads at the edges of the ranges.
  nlohmann::json edges = {{"row_panels", 1},    {"nc", 128},           {"super_block_kib", 64},
                          {"shared_a_kib", 64}, {"fused_k_blocks", 1}, {"fused_panels", 1}};
  nlohmann::json tuning = {{"version", 1}, {"cpus", {{cpu, nlohmann::json::object()}}}};
  for (const char* kernel : {"f32_avx512", "bf16_avx512", "bf16_amx"})
    tuning["cpus"][cpu][std::string(kernel) + "/2"] = edges;
  const std::string base =
      "--preset tiny --vocab 300 --ctx 32 --batch 4 --sample-tokens 1 --threads 2 --corpus " +
      write_corpus(200).string();
  for (const char* dtype : {"fp32", "bf16"}) {
    const fs::path plain = dir_ / "plain", edge = dir_ / "edge";
    fs::remove(file);
    Result r =
        run(cache, base + " --steps 6 --dtype " + dtype + " --overwrite --out " + plain.string());
    ASSERT_EQ(r.exit_code, 0) << r.err << r.out;
    EXPECT_NE(r.out.find("gemm blocking: the defaults from the CPU's caches"), std::string::npos)
        << r.out;
    std::ofstream(file) << tuning.dump();
    r = run(cache, base + " --steps 6 --dtype " + dtype + " --overwrite --out " + edge.string());
    ASSERT_EQ(r.exit_code, 0) << r.err << r.out;
    EXPECT_NE(r.out.find("gemm blocking: tuned for this CPU (" + file.string() + ")"),
              std::string::npos)
        << r.out;
    const std::vector<double> want = losses_of(plain), got = losses_of(edge);
    ASSERT_EQ(want.size(), 6u);
    EXPECT_EQ(got, want) << dtype;
  }

  // A cache that is not JSON, and one with a value out of range.
  const std::string run_args = base + " --steps 1 --overwrite --out " + (dir_ / "warned").string();
  for (const std::string& text :
       {std::string("{"),
        nlohmann::json({{"version", 1}, {"cpus", {{cpu, {{"f32_avx512/2", {{"nc", 200}}}}}}}})
            .dump()}) {
    std::ofstream(file) << text;
    const Result r = run(cache, run_args);
    ASSERT_EQ(r.exit_code, 0) << r.err << r.out;
    const std::string what = text == "{" ? "is not JSON" : "nc 200 is not in";
    EXPECT_NE(r.err.find("warning: " + file.string()), std::string::npos) << r.err;
    EXPECT_NE(r.err.find(what), std::string::npos) << r.err;
    EXPECT_NE(r.out.find("gemm blocking: the defaults"), std::string::npos) << r.out;
  }
  std::ofstream(file) << "{";
  expect_one_line_error(run(cache, "tune --preset tiny --rounds 1"), "gemm-tuning.json");
  EXPECT_EQ(read_all(file), "{");  // refused, not rewritten
  const Result reset = run(cache, "tune --reset");
  ASSERT_EQ(reset.exit_code, 0) << reset.err;
  EXPECT_NE(run(cache, "tune --show").out.find("no tuning for this CPU"), std::string::npos);
  expect_one_line_error(run(cache, "tune --preset huge"), "--preset huge");
  expect_one_line_error(run(cache, "tune --rounds 0"), "--rounds");
}
