// `cputrain finetune --method dpo|orpo`: preference tuning of stories260K on pairs made as
// tools/make_preference_pairs.py makes them (the chosen completion goes on with the prompt's child
// and thing, the rejected one with another's). It learns (held-out reward accuracy, and the
// greedy continuation the chosen's), its figures carry TRL's names, an interrupted or resumed run
// ends bit for bit as the run that never stopped with the reference read back from its run
// directory, and bad input gets one line.
#include <gtest/gtest.h>

#include <cmath>
#include <csignal>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <random>
#include <string>
#include <string_view>
#include <vector>

#include "tools/cli_fixture.h"

namespace fs = std::filesystem;

namespace {

using namespace cputrain::testing;

const fs::path kShared = CPUTRAIN_SHARED_MODELS;

// `count` pairs as tools/make_preference_pairs.py writes them, from `seed`, into `path`.
fs::path pairs_file(const fs::path& path, int count, unsigned seed) {
  const char* names[] = {"Lily", "Tom", "Sue", "Ben", "Mia", "Max", "Anna", "Sam"};
  const char* things[] = {"ball", "cat", "dog", "cake", "kite", "toy", "hat", "book"};
  const char* places[] = {"park", "garden", "house", "school"};
  std::mt19937 rng(seed);
  std::ofstream out(path);
  for (int i = 0; i < count; ++i) {
    const unsigned n = rng() % 8, t = rng() % 8, other_n = (n + 1 + rng() % 7) % 8,
                   other_t = (t + 1 + rng() % 7) % 8;
    const std::string place = places[rng() % 4];
    const auto story = [&](const std::string& who, const std::string& what) {
      return " One day, " + who + " went to the " + place + " with the " + what + ". " + who +
             " was very happy.";
    };
    out << nlohmann::json{{"prompt", std::string("Once upon a time, there was a child named ") +
                                         names[n] + ". " + names[n] + " had a " + things[t] + "."},
                          {"chosen", story(names[n], things[t])},
                          {"rejected", story(names[other_n], things[other_t])}}
               .dump()
        << "\n";
  }
  return path;
}

class PreferenceCli : public Cli {
 protected:
  void SetUp() override {
    if (!fs::exists(kShared / "stories260K.gguf"))
      GTEST_SKIP() << (kShared / "stories260K.gguf") << " is not there";
    Cli::SetUp();
  }
  fs::path write_pairs(const std::string& name, int count, unsigned seed) const {
    return pairs_file(dir_ / name, count, seed);
  }
  std::string model() const { return (kShared / "stories260K.gguf").string(); }
  // A short fine-tune of stories260K on 96 pairs, 24 held out, before --out.
  std::string flags(const std::string& method, const std::string& lr = "2e-3") const {
    return "finetune --method " + method + " --model " + model() + " --data " +
           write_pairs("train.jsonl", 96, 1).string() + " --val " +
           write_pairs("val.jsonl", 24, 2).string() + " --ctx 128 --batch 4 --accum 2 --lr " + lr;
  }
};

// DPO and ORPO each learn the held-out pairs: their reward accuracy ends at 0.9 or more (DPO's
// starts at 0, the policy being the reference: every margin is 0 and its loss log 2), and their
// figures are in metrics.jsonl under TRL's names; ORPO's adapter continues a prompt as the chosen
// completions do.
TEST_F(PreferenceCli, DpoAndOrpoLearnHeldOutPairs) {
  for (const std::string method : {"dpo", "orpo"}) {
    const fs::path run = dir_ / method;
    const Result r = this->run(flags(method) + " --steps 24 --eval-every 12 --out " + run.string());
    ASSERT_EQ(r.exit_code, 0) << r.err << r.out;
    const std::vector<nlohmann::json> lines = records(run);
    std::vector<nlohmann::json> val;
    for (const nlohmann::json& j : lines)
      if (j.contains("val_loss")) val.push_back(j);
    ASSERT_EQ(val.size(), 3u) << method;  // before, at 12, after
    const nlohmann::json& first = val.front();
    const nlohmann::json& last = val.back();
    if (method == "dpo") {
      EXPECT_NEAR(first["val_loss"].get<double>(), std::log(2.0), 1e-9);
      EXPECT_EQ(first["val_rewards/accuracies"].get<double>(), 0.0);
      EXPECT_EQ(first["val_rewards/margins"].get<double>(), 0.0);
    } else {
      EXPECT_TRUE(last.contains("val_log_odds_ratio"));
      EXPECT_TRUE(last.contains("val_nll_loss"));
    }
    EXPECT_LT(last["val_loss"].get<double>(), first["val_loss"].get<double>()) << method;
    EXPECT_GE(last["val_rewards/accuracies"].get<double>(), 0.9) << method;
    EXPECT_GT(last["val_rewards/margins"].get<double>(), first["val_rewards/margins"].get<double>())
        << method;
    for (const char* key : {"rewards/chosen", "rewards/rejected", "rewards/accuracies",
                            "rewards/margins", "logps/chosen", "logps/rejected"})
      EXPECT_TRUE(lines[1].contains(key)) << method << " " << key;
    EXPECT_GE(lines[1]["pairs"].get<int64_t>(), 8) << method;  // a pair or more a row
    EXPECT_TRUE(fs::exists(run / "adapter.gguf"));
    EXPECT_TRUE(fs::exists(run / "peft" / "adapter_model.safetensors"));
    EXPECT_EQ(fs::exists(run / "reference.bin"), method == "dpo");
    // eval of the run: its held-out pairs' loss, as its last validation (in fp32, the run's in
    // bf16 where the CPU has it).
    const Result e = this->run("eval --json --run " + run.string());
    ASSERT_EQ(e.exit_code, 0) << e.err;
    const nlohmann::json j = nlohmann::json::parse(e.out);
    EXPECT_NEAR(j["loss"].get<double>(), last["val_loss"].get<double>(), 2e-2) << method;
    EXPECT_EQ(j["pairs"].get<int64_t>(), 24) << method;
  }
  const Result s =
      run("sample --model " + model() + " --adapter " + (dir_ / "orpo" / "adapter.gguf").string() +
          " --prompt 'Once upon a time, there was a child named Ben. Ben had a kite.' "
          "--temperature 0 --max-tokens 12");
  EXPECT_EQ(s.exit_code, 0) << s.err;
  EXPECT_NE(s.out.find("Ben had a kite. One day, Ben went to the"), std::string::npos) << s.out;
}

// A DPO run with LoRA interrupted before step 4 saves and what it says to run finishes it with
// the adapter and losses of the run that never stopped, the reference read back from the run
// directory; so does a resumed full fine-tune, whose reference cannot be made again: without its
// file the resume is refused in one line. A LoRA run's missing file is made again, with a warning,
// to the same bits.
TEST_F(PreferenceCli, AnInterruptedOrResumedRunEndsBitwise) {
  const std::string flags = this->flags("dpo") + " --steps 6 --lora-dropout 0.1";
  const fs::path straight = dir_ / "straight", stopped = dir_ / "stopped";
  ASSERT_EQ(run(flags + " --out " + straight.string()).exit_code, 0);
  const fs::path log = dir_ / "stopped.log";
  ASSERT_EQ(interrupted(flags + " --out " + stopped.string(), log, "4", "holding before step 4"),
            128 + SIGINT)
      << read_all(log);
  EXPECT_FALSE(fs::exists(stopped / "adapter.gguf"));
  ASSERT_EQ(run("finetune --resume " + stopped.string()).exit_code, 0);
  EXPECT_EQ(read_all(stopped / "adapter.gguf"), read_all(straight / "adapter.gguf"));
  EXPECT_EQ(losses_of(stopped), losses_of(straight));
  EXPECT_NE(
      read_all(stopped / "train.log")
          .find("reference: the log-probabilities of " + (stopped / "reference.bin").string()),
      std::string::npos);
  // Without the file, a LoRA run makes it again: the same reference, the same run.
  fs::remove(stopped / "checkpoints" / "step-00000006.ckpt");
  fs::remove(stopped / "reference.bin");
  const Result again = run("finetune --resume " + stopped.string());
  ASSERT_EQ(again.exit_code, 0) << again.err;
  EXPECT_NE(read_all(stopped / "train.log").find("reference.bin is missing"), std::string::npos);
  EXPECT_EQ(read_all(stopped / "adapter.gguf"), read_all(straight / "adapter.gguf"));
  // Nor is a file edited in place at its size trained on: its checksum names it damaged.
  fs::remove(stopped / "checkpoints" / "step-00000006.ckpt");
  overwrite_bytes(stopped / "reference.bin", -20, std::string(4, '\x7f'));
  const Result edited = run("finetune --resume " + stopped.string());
  ASSERT_EQ(edited.exit_code, 0) << edited.err;
  EXPECT_NE(read_all(stopped / "train.log").find("reference.bin is damaged"), std::string::npos);
  EXPECT_EQ(read_all(stopped / "adapter.gguf"), read_all(straight / "adapter.gguf"));

  const std::string full = this->flags("dpo", "1e-4") + " --steps 4 --full --save-every 2";
  const fs::path a = dir_ / "full_a", b = dir_ / "full_b";
  ASSERT_EQ(run(full + " --out " + a.string()).exit_code, 0);
  fs::copy(a, b, fs::copy_options::recursive);
  fs::remove(b / "checkpoints" / "step-00000004.ckpt");
  fs::remove(b / "model.gguf");
  ASSERT_EQ(run("finetune --resume " + b.string()).exit_code, 0);
  EXPECT_EQ(read_all(a / "model.gguf"), read_all(b / "model.gguf"));
  EXPECT_EQ(losses_of(a), losses_of(b));
  fs::remove(b / "checkpoints" / "step-00000004.ckpt");
  overwrite_bytes(b / "reference.bin", 40, std::string(8, '\xff'));  // a sum made NaN
  expect_one_line_error(run("finetune --resume " + b.string()),
                        "reference.bin is damaged, and a full fine-tune's reference");
  fs::remove(b / "reference.bin");
  expect_one_line_error(run("finetune --resume " + b.string()),
                        "a full fine-tune's reference is its base before the first step");
}

// A stop signal during DPO's reference pass (before the first step, a pass over every pair) ends
// the process at once, saying so; the run started again then completes.
TEST_F(PreferenceCli, AStopSignalDuringTheReferencePassStopsAtOnce) {
  const std::string flags = this->flags("dpo") + " --steps 2";
  const fs::path run_dir = dir_ / "run", log = dir_ / "run.log";
  ASSERT_EQ(interrupted(flags + " --out " + run_dir.string(), log, "reference",
                        "holding in the reference pass"),
            128 + SIGINT)
      << read_all(log);
  EXPECT_NE(read_all(log).find("SIGINT while computing the reference's log-probabilities: "
                               "stopped at once, before any step of this command"),
            std::string::npos)
      << read_all(log);
  EXPECT_EQ(read_all(log).find("stops after this step"), std::string::npos) << read_all(log);
  EXPECT_FALSE(fs::exists(run_dir / "checkpoints"));
  const Result again = run(flags + " --out " + run_dir.string() + " --overwrite");
  ASSERT_EQ(again.exit_code, 0) << again.err;
  EXPECT_TRUE(fs::exists(run_dir / "adapter.gguf"));
}

// Bad input: one line naming the flag, file and line, or value, and a non-zero exit.
TEST_F(PreferenceCli, BadInputGetsOneLine) {
  const std::string base = "finetune --model " + model() + " --ctx 64 --steps 1 --out " +
                           (dir_ / "run").string() + " --data ";
  const std::string pairs = write_pairs("pairs.jsonl", 8, 3).string();
  expect_one_line_error(
      run(base + pairs + " --beta 0.2"),
      "--beta is DPO's and GRPO's: give --method dpo or grpo (the method is sft)");
  expect_one_line_error(run(base + pairs + " --method dpo --orpo-lambda 0.2"),
                        "--orpo-lambda is ORPO's: give --method orpo (the method is dpo)");
  expect_one_line_error(run(base + pairs + " --method orpo --train-on-prompt"),
                        "--train-on-prompt and --method orpo");
  expect_one_line_error(run(base + pairs + " --method kto"), "--method");
  expect_one_line_error(run(base + pairs + " --method dpo --beta 1e300"), "--beta");
  expect_one_line_error(run(base + pairs + " --method orpo --orpo-lambda 1e300"), "--orpo-lambda");
  const fs::path sft = dir_ / "sft.jsonl";
  std::ofstream(sft) << "{\"prompt\": \"a\", \"completion\": \" b\"}\n";
  expect_one_line_error(run(base + sft.string() + " --method dpo"),
                        sft.string() + ":1: not a preference pair");
  const fs::path same = dir_ / "same.jsonl";
  std::ofstream(same) << "{\"prompt\": \"a\", \"chosen\": \" b\", \"rejected\": \" b\"}\n";
  expect_one_line_error(run(base + same.string() + " --method orpo"),
                        same.string() + ":1: \"chosen\" and \"rejected\" are the same");
  EXPECT_FALSE(fs::exists(dir_ / "run"));
}

}  // namespace

namespace {

// Two ranks of one thread, each of 2 rows a micro-batch, tune as one process of 4 rows: the same
// losses, validation and figures to float rounding (1e-5); resumed at 2 ranks from step 2, the
// reference read back, the adapter of the job that never stopped, bit for bit.
class PreferenceRanksCli : public DataParallelCli {};

TEST_F(PreferenceRanksCli, TwoRanksTuneAsOneProcessAtTwiceTheBatch) {
  if (!fs::exists(kShared / "stories260K.gguf"))
    GTEST_SKIP() << (kShared / "stories260K.gguf") << " is not there";
  const std::string common = "finetune --method dpo --model " +
                             (kShared / "stories260K.gguf").string() + " --data " +
                             pairs_file(dir_ / "train.jsonl", 48, 1).string() + " --val " +
                             pairs_file(dir_ / "val.jsonl", 12, 2).string() +
                             " --ctx 128 --accum 2 --steps 4 --lr 2e-3 --dtype fp32 --eval-every 2";
  const Result one =
      run("OMP_NUM_THREADS=1", common + " --batch 4 --threads 1 --out " + (dir_ / "one").string());
  ASSERT_EQ(one.exit_code, 0) << one.err;
  const Result two =
      ranks(2, common + " --batch 2 --save-every 2 --out " + (dir_ / "two").string());
  ASSERT_EQ(two.exit_code, 0) << two.err << two.out;
  const auto a = records(dir_ / "one"), b = records(dir_ / "two");
  // Float rounding apart: the ranks sum the gradients in another order, and a loss is a float.
  // A margin is beta times a difference of log-probability sums near each other (at the first
  // steps the adapters have hardly moved them), so its rounding is the sums', not 1e-5 of the
  // margin: a floor of 1e-6 (two ranks and one process differ by 6e-8 under oneDNN's GEMMs).
  ASSERT_EQ(a.size(), b.size());
  for (const char* key : {"loss", "val_loss", "rewards/margins", "val_rewards/margins",
                          "logps/chosen", "val_logps/rejected"})
    for (size_t i = 0; i < a.size(); ++i) {
      ASSERT_EQ(a[i].contains(key), b[i].contains(key)) << key << " at line " << i;
      if (!a[i].contains(key)) continue;
      const double x = a[i][key].get<double>(), y = b[i][key].get<double>();
      const double floor = std::string_view(key).ends_with("margins") ? 1e-6 : 1e-9;
      EXPECT_LE(std::abs(x - y), 1e-5 * std::abs(x) + floor) << key << " at line " << i;
    }
  const fs::path resumed = dir_ / "resumed";
  fs::copy(dir_ / "two", resumed, fs::copy_options::recursive);
  fs::remove(resumed / "checkpoints" / "step-00000004.ckpt");
  fs::remove(resumed / "adapter.gguf");
  const Result rest = ranks(2, "finetune --resume " + resumed.string());
  ASSERT_EQ(rest.exit_code, 0) << rest.err << rest.out;
  EXPECT_EQ(read_all(dir_ / "two" / "adapter.gguf"), read_all(resumed / "adapter.gguf"));
  EXPECT_EQ(losses_of(dir_ / "two"), losses_of(resumed));
}

}  // namespace
