// `cputrain finetune --method grpo`: stories260K given prompts that name a character, rewarded
// where its completion names the character again. It learns (the held-out mean reward rises), its
// figures carry TRL's names, groups of one make no update, an interrupted run resumed ends bit
// for bit as the run that never stopped, a reward command that fails stops the run in one line
// with a checkpoint, and bad input gets one line. The rewards themselves are checked directly.
#include <gtest/gtest.h>

#include <csignal>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <random>
#include <string>
#include <vector>

#include "tools/cli_fixture.h"
#include "tools/grpo_rewards.h"

namespace fs = std::filesystem;

namespace {

using namespace cputrain::testing;
using nlohmann::json;

const fs::path kShared = CPUTRAIN_SHARED_MODELS;

// `count` prompts naming a character, each with its name as a field, from `seed`.
fs::path prompts_file(const fs::path& path, int count, unsigned seed) {
  const char* names[] = {"Lily", "Tom", "Ben",  "Sue", "Max", "Anna", "Tim", "Lucy",
                         "Sam",  "Mia", "Jack", "Amy", "Bob", "Sara", "Leo", "Kim"};
  const char* kinds[] = {"girl", "boy", "dog", "cat", "bird", "bunny"};
  const char* openings[] = {"Once upon a time, there was a little {k} named {n}.",
                            "One day, a {k} named {n} went to the park.",
                            "There was a happy {k} called {n}.",
                            "{n} was a little {k} who loved to play."};
  std::mt19937 rng(seed);
  std::ofstream out(path);
  for (int i = 0; i < count; ++i) {
    const std::string name = names[rng() % 16], kind = kinds[rng() % 6];
    std::string p = openings[rng() % 4];
    p.replace(p.find("{n}"), 3, name);
    p.replace(p.find("{k}"), 3, kind);
    out << json{{"prompt", p}, {"name", name}}.dump() << "\n";
  }
  return path;
}

class GrpoCli : public Cli {
 protected:
  void SetUp() override {
    if (!fs::exists(kShared / "stories260K.gguf"))
      GTEST_SKIP() << (kShared / "stories260K.gguf") << " is not there";
    Cli::SetUp();
  }
  std::string model() const { return (kShared / "stories260K.gguf").string(); }
  // GRPO of stories260K, 8 completions a step in groups of 4, before --out.
  std::string flags(bool val = true, const std::string& lr = "2e-3",
                    const std::string& generations = "4") const {
    return "finetune --method grpo --model " + model() + " --data " +
           prompts_file(dir_ / "train.jsonl", 64, 1).string() +
           (val ? " --val " + prompts_file(dir_ / "val.jsonl", 8, 2).string() : std::string()) +
           " --ctx 64 --max-completion-length 20 --generations " + generations +
           " --batch 8 --accum 1 --lr " + lr + " --reward regex --reward-pattern '\\b{name}\\b'";
  }
};

// The held-out mean reward rises (from about 0.3: the model names its character again now and
// then); every step line carries TRL's figures, and train.log holds completions of held-out
// prompts at each validation.
TEST_F(GrpoCli, TheHeldOutRewardRises) {
  const fs::path run = dir_ / "run";
  const Result r = this->run(flags() + " --steps 16 --eval-every 8 --out " + run.string());
  ASSERT_EQ(r.exit_code, 0) << r.err << r.out;
  const std::vector<json> lines = records(run);
  std::vector<double> val;
  for (const json& j : lines)
    if (j.contains("val_reward")) val.push_back(j["val_reward"].get<double>());
  ASSERT_EQ(val.size(), 3u);  // before, at 8, after
  EXPECT_GE(val.back() - val.front(), 0.15) << val.front() << " -> " << val.back();
  for (const char* key : {"reward", "reward_std", "frac_reward_zero_std", "rewards/regex/mean",
                          "completions/mean_length", "completions/clipped_ratio",
                          "clip_ratio/region_mean", "generation_ms", "update_ms"})
    EXPECT_TRUE(lines[1].contains(key)) << key;
  EXPECT_FALSE(lines[1].contains("kl"));  // beta 0: no reference
  EXPECT_LE(lines[1]["completions/mean_length"].get<double>(), 20.0);
  const std::string log = read_all(run / "train.log");
  EXPECT_NE(log.find("sample (held-out line"), std::string::npos);
  EXPECT_NE(log.find("| reward "), std::string::npos);
  EXPECT_TRUE(fs::exists(run / "adapter.gguf"));
  // eval names what validates a GRPO run.
  expect_one_line_error(this->run("eval --run " + run.string()), "val_reward");
}

// Groups of one completion have the advantage 0: on policy, every step's loss and gradient are 0,
// so the adapter is the same whatever the learning rate.
TEST_F(GrpoCli, GroupsOfOneMakeNoUpdate) {
  std::vector<std::string> adapters;
  for (const std::string lr : {"1e-3", "1e-1"}) {
    const fs::path run = dir_ / ("lr" + lr);
    const Result r =
        this->run(flags(false, lr, "1") + " --steps 3 --beta 0.1 --out " + run.string());
    ASSERT_EQ(r.exit_code, 0) << r.err;
    for (const json& j : records(run)) {
      if (!j.contains("loss")) continue;
      EXPECT_EQ(j["grad_norm"].get<double>(), 0.0);
      EXPECT_EQ(j["loss"].get<double>(), 0.0);
      EXPECT_EQ(j["kl"].get<double>(), 0.0);  // the policy is still the reference
    }
    adapters.push_back(read_all(run / "adapter.gguf"));
  }
  EXPECT_EQ(adapters[0], adapters[1]);
}

// A full fine-tune with --beta keeps the base, frozen, as its reference: the KL is 0 at the first
// step (the policy is the base) and grows as the weights move; the budget counts the copy.
TEST_F(GrpoCli, AFullFineTuneKeepsItsBaseAsTheReference) {
  const fs::path run = dir_ / "full";
  const Result r =
      this->run(flags(false, "1e-3") + " --full --beta 0.1 --steps 4 --out " + run.string());
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const std::vector<json> lines = records(run);
  ASSERT_EQ(lines.size(), 4u);
  EXPECT_EQ(lines[0]["kl"].get<double>(), 0.0);
  EXPECT_GT(lines[3]["kl"].get<double>(), 0.0);
  const std::string log = read_all(run / "train.log");
  EXPECT_NE(log.find("reference (--beta with --full): the base from"), std::string::npos);
  EXPECT_TRUE(fs::exists(run / "model.gguf"));
  // Its budget is the one without --beta and the reference's weights (stories260K's, F32: held).
  const Result without =
      this->run(flags(false, "1e-3") + " --full --steps 1 --out " + (dir_ / "without").string());
  ASSERT_EQ(without.exit_code, 0) << without.err;
  const auto budget = [](const std::string& text) {
    const size_t at = text.find("memory budget: ");
    return at == std::string::npos ? std::string() : text.substr(at, text.find(' ', at + 15) - at);
  };
  EXPECT_NE(budget(log), budget(read_all(dir_ / "without" / "train.log")));
}

// Interrupted during step 5 (a stop signal ends the run after it: within the generation of steps
// 5 and 6, --iterations 2) and resumed, the run ends with the adapter and losses of the run that
// never stopped: step 6 trains on the generation kept in the run directory.
TEST_F(GrpoCli, AnInterruptedRunEndsBitwise) {
  const std::string flags = this->flags(false) + " --steps 6 --iterations 2 --beta 0.05";
  const fs::path straight = dir_ / "straight", stopped = dir_ / "stopped";
  ASSERT_EQ(run(flags + " --out " + straight.string()).exit_code, 0);
  const fs::path log = dir_ / "stopped.log";
  ASSERT_EQ(interrupted(flags + " --out " + stopped.string(), log, "5", "holding before step 5"),
            128 + SIGINT)
      << read_all(log);
  EXPECT_FALSE(fs::exists(stopped / "adapter.gguf"));
  const Result resumed = run("finetune --resume " + stopped.string());
  ASSERT_EQ(resumed.exit_code, 0) << resumed.err;
  EXPECT_EQ(read_all(stopped / "adapter.gguf"), read_all(straight / "adapter.gguf"));
  EXPECT_EQ(losses_of(stopped), losses_of(straight));
  EXPECT_TRUE(fs::exists(stopped / "generation-0.cbor"));
  EXPECT_EQ(read_all(stopped / "train.log").find("generated anew"), std::string::npos);
  const std::vector<json> lines = records(straight);
  ASSERT_EQ(lines.size(), 6u);
  EXPECT_GT(lines.back()["kl"].get<double>(), 0.0);
  EXPECT_GT(lines[0]["generation_ms"].get<double>(), 0.0);
  EXPECT_EQ(lines[1]["generation_ms"].get<double>(), 0.0);  // the second iteration: none
  // Without the kept generation, step 6 generates anew, and says so.
  fs::remove(stopped / "checkpoints" / "step-00000006.ckpt");
  fs::remove(stopped / "adapter.gguf");
  fs::remove(stopped / "generation-0.cbor");
  ASSERT_EQ(run("finetune --resume " + stopped.string()).exit_code, 0);
  EXPECT_NE(read_all(stopped / "train.log").find("generation-0.cbor is missing: its completions"),
            std::string::npos);
}

// A reward command that ends, hangs, prints a non-number or too many lines stops the run with
// one line naming the command and the completion; the steps trained are saved.
TEST_F(GrpoCli, AFailingRewardCommandStopsWithACheckpoint) {
  struct Case {
    std::string command, says, at;
    int saved;  // the step of the checkpoint left (0: none, the first step failed)
  };
  // Each step sends 8 completions: line 20 is step 3's fourth, line 12 step 2's fourth.
  const std::vector<Case> cases = {
      {"n=0; while read -r l; do n=$((n+1)); echo 1; [ $n -eq 20 ] && exit 3; done",
       "ended (exit status 3)", "completion 5 of 8", 2},
      {"n=0; while read -r l; do n=$((n+1)); [ $n -eq 12 ] && sleep 20 >/dev/null; echo 1; done",
       "gave no score within 1 s (--reward-timeout)", "completion 4 of 8", 1},
      {"n=0; while read -r l; do n=$((n+1)); [ $n -eq 3 ] && echo yes || echo 1; done",
       "printed \"yes\", not a number", "completion 3 of 8", 0},
      {"n=0; while read -r l; do n=$((n+1)); [ $n -eq 8 ] && printf '1\\n1\\n' || echo 1; done",
       "printed more lines than the 8 completions", "completion 8 of 8", 0}};
  int k = 0;
  for (const Case& c : cases) {
    const std::string name = "case" + std::to_string(k++);
    const fs::path run = dir_ / name, script = dir_ / (name + ".sh");
    std::ofstream(script) << c.command << "\n";
    const Result r = this->run("finetune --method grpo --model " + model() + " --data " +
                               prompts_file(dir_ / "train.jsonl", 64, 1).string() +
                               " --ctx 64 --max-completion-length 8 --generations 4 --batch 8 "
                               "--accum 1 --steps 4 --reward-timeout 1 --reward-command 'sh " +
                               script.string() + "' --out " + run.string());
    expect_one_line_error(r, "--reward-command 'sh " + script.string() + "' " + c.says);
    EXPECT_NE(r.err.find(c.at), std::string::npos) << r.err;
    EXPECT_NE(r.err.find("to the prompt"), std::string::npos) << r.err;
    EXPECT_FALSE(fs::exists(run / "adapter.gguf"));
    EXPECT_EQ(fs::exists(run / "checkpoints"), c.saved > 0) << r.err;
    if (c.saved > 0) {
      EXPECT_TRUE(
          fs::exists(run / "checkpoints" / ("step-0000000" + std::to_string(c.saved) + ".ckpt")))
          << r.err;
      EXPECT_NE(r.err.find("--resume " + run.string()), std::string::npos);
    }
  }
}

// Bad input: one line naming the flag, file and line, or value, and a non-zero exit.
TEST_F(GrpoCli, BadInputGetsOneLine) {
  const std::string prompts = prompts_file(dir_ / "p.jsonl", 8, 3).string();
  const std::string base = "finetune --model " + model() + " --ctx 64 --steps 1 --out " +
                           (dir_ / "run").string() + " --data " + prompts;
  expect_one_line_error(run(base + " --generations 4"),
                        "--generations is GRPO's: give --method grpo (the method is sft)");
  const std::string grpo =
      base + " --method grpo --batch 4 --accum 1 --generations 4 --max-completion-length 8";
  expect_one_line_error(run(grpo), "--method grpo: give --reward");
  expect_one_line_error(run(grpo + " --reward regexp"), "--reward regexp: not a reward");
  expect_one_line_error(run(grpo + " --reward regex"), "--reward regex: give --reward-pattern");
  expect_one_line_error(run(grpo + " --reward regex --reward-pattern 'a('"),
                        "--reward-pattern 'a(': missing closing parenthesis");
  expect_one_line_error(run(grpo + " --reward length:0"), "--reward length:0: the weight");
  expect_one_line_error(run(grpo + " --reward length --answer-pattern x"),
                        "--answer-pattern is the exact reward's");
  expect_one_line_error(run(grpo + " --reward exact"),
                        prompts + ":1: no \"answer\" field, which the exact reward reads");
  expect_one_line_error(
      run(base + " --method grpo --batch 4 --accum 1 --generations 3 --reward length"),
      "--batch 4 x --accum 1 = 4 completions a step: not whole groups");
  expect_one_line_error(run(base + " --method grpo --batch 4 --generations 4 --reward length "
                                   "--max-completion-length 64"),
                        "--max-completion-length 64 leaves no room for a prompt within --ctx 64");
  const fs::path bad = dir_ / "bad.jsonl";
  std::ofstream(bad) << "{\"question\": \"a\"}\n";
  expect_one_line_error(
      run("finetune --model " + model() + " --ctx 64 --steps 1 --out " + (dir_ / "run").string() +
          " --method grpo --generations 4 --max-completion-length 8 --data " + bad.string() +
          " --reward length"),
      bad.string() + ":1: no \"prompt\"");
  EXPECT_FALSE(fs::exists(dir_ / "run"));
}

// The built-in rewards: exact (the last number, or a pattern's group), regex with a field, and
// the length penalty.
TEST(GrpoRewards, BuiltInRewardsScoreAsDocumented) {
  using namespace cputrain;
  RewardOptions o;
  o.rewards = "exact,regex:0.5,length";
  o.reward_pattern = "\\b{name}\\b";
  o.max_completion = 10;
  std::vector<WeightedReward> r = make_rewards(o);
  ASSERT_EQ(r.size(), 3u);
  EXPECT_EQ(rewards_text(r), "exact:1,regex:0.5,length:1");
  const json prompt = "p";
  const json fields = {{"answer", "1,234"}, {"name", "Al.x"}};
  const std::vector<std::string> texts = {"so 12 then 1234", "1234.0 is it? no, 7", "Al.x went",
                                          "Alix went", "-3"};
  std::vector<RewardInput> in;
  for (const std::string& t : texts) in.push_back({&prompt, &t, 4, &fields});
  std::vector<double> exact(in.size()), regex(in.size()), length(in.size());
  r[0].function->score(in, exact);
  r[1].function->score(in, regex);
  r[2].function->score(in, length);
  EXPECT_EQ(exact, (std::vector<double>{1, 0, 0, 0, 0}));
  EXPECT_EQ(regex, (std::vector<double>{0, 0, 1, 0, 0}));  // the field matched literally
  EXPECT_EQ(length, (std::vector<double>(5, -0.4)));
  o = RewardOptions();
  o.rewards = "exact";
  o.answer_pattern = "answer: (\\w+)";
  r = make_rewards(o);
  const json word = {{"answer", "blue"}};
  const std::string a = "answer: red ... answer: blue", b = "answer: bluer";
  std::vector<RewardInput> two = {{&prompt, &a, 1, &word}, {&prompt, &b, 1, &word}};
  std::vector<double> s(2);
  r[0].function->score(two, s);
  EXPECT_EQ(s, (std::vector<double>{1, 0}));
}

}  // namespace

namespace {

// Two ranks of one thread, each generating for half the step's prompts, tune as one process at
// twice the batch: the same rewards, losses and held-out reward to float rounding.
class GrpoRanksCli : public DataParallelCli {};

TEST_F(GrpoRanksCli, TwoRanksTuneAsOneProcessAtTwiceTheBatch) {
  if (!fs::exists(kShared / "stories260K.gguf"))
    GTEST_SKIP() << (kShared / "stories260K.gguf") << " is not there";
  const std::string common =
      "finetune --method grpo --model " + (kShared / "stories260K.gguf").string() + " --data " +
      prompts_file(dir_ / "train.jsonl", 32, 1).string() + " --val " +
      prompts_file(dir_ / "val.jsonl", 4, 2).string() +
      " --ctx 64 --max-completion-length 12 --generations 4 --accum 1 --steps 3 --lr 2e-3 "
      "--dtype fp32 --beta 0.05 --reward regex --reward-pattern '\\b{name}\\b'";
  const Result one =
      run("OMP_NUM_THREADS=1", common + " --batch 8 --threads 1 --out " + (dir_ / "one").string());
  ASSERT_EQ(one.exit_code, 0) << one.err;
  const Result two = ranks(2, common + " --batch 4 --out " + (dir_ / "two").string());
  ASSERT_EQ(two.exit_code, 0) << two.err << two.out;
  const auto a = records(dir_ / "one"), b = records(dir_ / "two");
  ASSERT_EQ(a.size(), b.size());
  for (const char* key :
       {"loss", "reward", "reward_std", "kl", "val_reward", "grad_norm", "completions/mean_length"})
    for (size_t i = 0; i < a.size(); ++i) {
      ASSERT_EQ(a[i].contains(key), b[i].contains(key)) << key << " at line " << i;
      if (!a[i].contains(key)) continue;
      const double x = a[i][key].get<double>(), y = b[i][key].get<double>();
      EXPECT_LE(std::abs(x - y), 1e-5 * std::abs(x) + 1e-7) << key << " at line " << i;
    }
}

}  // namespace
