// `cputrain finetune` as a run like train's: interrupted by a stop signal it saves a checkpoint
// after its step and says how to continue, `finetune --resume RUN` finishes it bit for bit, a
// damaged newest checkpoint is passed over, a resumed run keeps its configuration, bad steps stop
// it, and its budget and dtype are `cputrain budget --model`'s.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "engine/io/gguf_file.h"
#include "tools/cli_fixture.h"

namespace fs = std::filesystem;

namespace {

using namespace cputrain::testing;

const fs::path kShared = CPUTRAIN_SHARED_MODELS;

class FinetuneCli : public Cli {
 protected:
  void SetUp() override {
    if (!fs::exists(kShared / "stories260K.gguf"))
      GTEST_SKIP() << (kShared / "stories260K.gguf") << " is not there";
    Cli::SetUp();
  }
  // Prompts and completions about who had what, for stories260K.
  fs::path write_data() const {
    const char* names[] = {"Lily", "Tom", "Sue", "Ben"};
    const char* things[] = {"ball", "cat", "tree", "cake"};
    const fs::path path = dir_ / "data.jsonl";
    std::ofstream out(path);
    for (int i = 0; i < 48; ++i) {
      const std::string n = names[i % 4], t = things[(i / 4) % 4];
      out << "{\"prompt\": \"" << n << " had a " << t << ". What did " << n
          << " have?\", \"completion\": \" " << n << " had a " << t << ".\"}\n";
    }
    return path;
  }
  // The flags of a short LoRA fine-tune of stories260K (with dropout, whose masks the steps
  // draw), before --out.
  std::string flags(const std::string& lr = "3e-3") const {
    return "finetune --model " + (kShared / "stories260K.gguf").string() + " --data " +
           write_data().string() +
           " --val-fraction 0.25 --ctx 128 --batch 2 --accum 2 --steps 6 --lr " + lr +
           " --lora-dropout 0.1";
  }
  int run_status(const std::string& args) const { return run(args).exit_code; }
  Result run_cli(const std::string& args) const { return run(args); }
  // Waits for the process `pid` started by start(); its status.
  static int wait_for(pid_t pid) {
    int status = 0;
    EXPECT_TRUE(wait_until([&] { return ::waitpid(pid, &status, WNOHANG) == pid; }));
    return status;
  }
};

// SIGINT, SIGTERM, and SIGINT to a fine-tune started with SIGINT ignored (as `&` in a script
// starts it): each stops the run after its step with a checkpoint, says how to continue, and
// what it says finishes the run with the adapter of the run that never stopped, byte for byte.
TEST_F(FinetuneCli, AStopSignalSavesAndTheAdviceFinishesTheSameAdapter) {
  const std::string flags = this->flags() + " --save-every 0";
  const fs::path straight = dir_ / "straight";
  const Result done = run(flags + " --out " + straight.string());
  ASSERT_EQ(done.exit_code, 0) << done.err << done.out;
  ASSERT_TRUE(fs::exists(straight / "train.log"));
  for (const auto& [sig, ignored] :
       {std::pair{SIGINT, false}, std::pair{SIGTERM, false}, std::pair{SIGINT, true}}) {
    const std::string name = std::string(sig == SIGINT ? "int" : "term") + (ignored ? "_ign" : "");
    const fs::path stopped = dir_ / name, log = dir_ / (name + ".log");
    const pid_t pid = start(flags + " --out " + stopped.string(), log, "4", "", ignored);
    ASSERT_GT(pid, 0);
    ASSERT_TRUE(wait_until([&] {
      return read_all(log).find("holding before step 4") != std::string::npos;
    })) << read_all(log);
    ASSERT_EQ(::kill(pid, sig), 0);
    const int status = wait_for(pid);
    ASSERT_TRUE(WIFEXITED(status)) << name << "\n" << read_all(log);
    EXPECT_EQ(WEXITSTATUS(status), 128 + sig) << name;
    const std::string said = read_all(log);
    const std::string advice = "continue with: cputrain finetune --resume " + stopped.string();
    EXPECT_NE(said.find(sig == SIGINT ? "interrupted (SIGINT) after step 4"
                                      : "terminated (SIGTERM) after step 4"),
              std::string::npos)
        << said;
    ASSERT_NE(said.find(advice), std::string::npos) << said;
    EXPECT_TRUE(fs::exists(stopped / "checkpoints" / "step-00000004.ckpt")) << name;
    EXPECT_FALSE(fs::exists(stopped / "adapter.gguf")) << name;
    const Result rest = run(said.substr(said.find(advice) + 24, advice.size() - 24));
    ASSERT_EQ(rest.exit_code, 0) << name << "\n" << rest.err << rest.out;
    EXPECT_EQ(read_all(stopped / "adapter.gguf"), read_all(straight / "adapter.gguf")) << name;
    EXPECT_EQ(losses_of(stopped), losses_of(straight)) << name;
    EXPECT_NE(read_all(stopped / "train.log").find("resumed from"), std::string::npos) << name;
  }
}

// The newest checkpoint damaged: the one before it is taken, with a warning, and the run ends as
// the one that never stopped. The run keeps --keep checkpoints.
TEST_F(FinetuneCli, ADamagedNewestCheckpointIsPassedOver) {
  const std::string flags = this->flags() + " --save-every 1 --keep 3";
  const fs::path straight = dir_ / "straight", stopped = dir_ / "stopped";
  ASSERT_EQ(run(flags + " --out " + straight.string()).exit_code, 0);
  fs::copy(straight, stopped, fs::copy_options::recursive);
  std::vector<std::string> kept;
  for (const auto& e : fs::directory_iterator(straight / "checkpoints"))
    kept.push_back(e.path().filename().string());
  std::sort(kept.begin(), kept.end());
  EXPECT_EQ(kept, (std::vector<std::string>{"step-00000004.ckpt", "step-00000005.ckpt",
                                            "step-00000006.ckpt"}));
  // As if it had stopped after step 5 with its checkpoint of step 5 cut short.
  fs::remove(stopped / "checkpoints" / "step-00000006.ckpt");
  fs::remove(stopped / "adapter.gguf");
  fs::remove_all(stopped / "peft");
  fs::resize_file(stopped / "checkpoints" / "step-00000005.ckpt", 100);
  const Result r = run("finetune --resume " + stopped.string());
  ASSERT_EQ(r.exit_code, 0) << r.err << r.out;
  EXPECT_NE(r.err.find("skipping"), std::string::npos) << r.err;
  EXPECT_NE(r.out.find("resumed from " + (stopped / "checkpoints" / "step-00000004.ckpt").string()),
            std::string::npos)
      << r.out;
  EXPECT_EQ(read_all(stopped / "adapter.gguf"), read_all(straight / "adapter.gguf"));
  EXPECT_EQ(losses_of(stopped), losses_of(straight));

  // The newest two damaged and --keep 1: the checkpoints the resumed run saves are the ones kept
  // (each in turn), and the damaged ones are set aside, never counted among the kept.
  const fs::path twice = dir_ / "twice";
  fs::copy(straight, twice, fs::copy_options::recursive);
  fs::remove(twice / "adapter.gguf");
  for (const char* name : {"step-00000005.ckpt", "step-00000006.ckpt"})
    fs::resize_file(twice / "checkpoints" / name, 100);
  const Result again = run("finetune --resume " + twice.string() + " --save-every 1 --keep 1");
  ASSERT_EQ(again.exit_code, 0) << again.err;
  EXPECT_NE(again.err.find("set aside as"), std::string::npos) << again.err;
  std::vector<std::string> left;
  for (const auto& e : fs::directory_iterator(twice / "checkpoints"))
    left.push_back(e.path().filename().string());
  std::sort(left.begin(), left.end());
  EXPECT_EQ(left, (std::vector<std::string>{"step-00000006.ckpt", "step-00000006.ckpt.damaged"}));
  EXPECT_TRUE(read_all(twice / "adapter.gguf") == read_all(straight / "adapter.gguf"));
}

// A resumed fine-tune keeps its configuration: a flag that would change it is named with the
// run's value; the old spelling (--out RUN --resume, the same flags) still continues it; a run
// that stopped before its first checkpoint says to start again with --overwrite, which works.
TEST_F(FinetuneCli, AResumeKeepsTheRunAndSaysWhatDiffers) {
  const std::string flags = this->flags() + " --save-every 3";
  const fs::path a = dir_ / "a", b = dir_ / "b";
  ASSERT_EQ(run(flags + " --out " + a.string()).exit_code, 0);
  fs::copy(a, b, fs::copy_options::recursive);
  fs::remove(b / "checkpoints" / "step-00000006.ckpt");
  fs::remove(b / "adapter.gguf");
  expect_one_line_error(run("finetune --resume " + b.string() + " --seed 9 --lr 0.01"),
                        "--lr 0.01 (the run's: 0.003), --seed 9 (the run's: 1) would change");
  const Result old_spelling = run(flags + " --out " + b.string() + " --resume");
  ASSERT_EQ(old_spelling.exit_code, 0) << old_spelling.err;
  EXPECT_EQ(read_all(a / "adapter.gguf"), read_all(b / "adapter.gguf"));
  expect_one_line_error(run("finetune --resume " + a.string()), "has trained all its 6 steps");
  expect_one_line_error(run(flags + " --out " + a.string()),
                        "continue it with --resume " + a.string() + ", or replace it");
  // A run killed before its first checkpoint.
  fs::remove_all(a / "checkpoints");
  fs::remove(a / "adapter.gguf");
  const Result none = run("finetune --resume " + a.string());
  expect_one_line_error(none, "and --out " + a.string() + " --overwrite");
  ASSERT_EQ(run(flags + " --out " + a.string() + " --overwrite").exit_code, 0);
  EXPECT_EQ(read_all(a / "adapter.gguf"), read_all(b / "adapter.gguf"));
  expect_one_line_error(run("finetune --resume " + (dir_ / "none").string()),
                        "no such run directory");
}

// A step whose loss or gradient is not finite is never applied: the fine-tune stops, naming the
// step and the last good checkpoint, and writes no adapter.
TEST_F(FinetuneCli, ANonFiniteStepStopsTheFineTune) {
  const fs::path out = dir_ / "out";
  const Result r = run(flags("1e30") + " --out " + out.string());
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.err.find("not applied, training stopped"), std::string::npos) << r.err;
  EXPECT_FALSE(fs::exists(out / "adapter.gguf"));
  EXPECT_FALSE(fs::exists(out / "peft"));
  // Skipped instead, without validation: the steps after the first are skipped to the end, and
  // the adapter the first one blew up is not written as a result.
  const fs::path skipped = dir_ / "skipped";
  std::string unvalidated = flags("1e30");
  unvalidated.replace(unvalidated.find("--val-fraction 0.25"), 19, "--val-fraction 0");
  const Result s = run(unvalidated + " --on-bad-step skip --out " + skipped.string());
  EXPECT_NE(s.exit_code, 0);
  EXPECT_NE(s.err.find("cputrain: error: the last step (6) was skipped: its loss is"),
            std::string::npos)
      << s.err;
  EXPECT_FALSE(fs::exists(skipped / "adapter.gguf"));
  EXPECT_FALSE(fs::exists(skipped / "peft"));
}

// budget --model and finetune --model agree on the dtype for the same flags, and on the budget
// but for the LM head: budget has no data and counts every position a target, the most the head
// computes; the fine-tune's own budget, of its packed rows (prompts and padding have no target),
// is below it by less than the head's share.
TEST_F(FinetuneCli, BudgetAndFineTuneAgree) {
  const std::string model = (kShared / "stories260K.gguf").string();
  const Result b =
      run("budget --model " + model + " --lora-rank 8 --batch 2 --accum 2 --ctx 128 --json");
  ASSERT_EQ(b.exit_code, 0) << b.err;
  const nlohmann::json budget = nlohmann::json::parse(b.out);
  const fs::path out = dir_ / "out";
  const Result f =
      run("finetune --model " + model + " --data " + write_data().string() +
          " --lora-rank 8 --batch 2 --accum 2 --ctx 128 --steps 1 --out " + out.string());
  ASSERT_EQ(f.exit_code, 0) << f.err;
  std::ifstream in(out / "metrics.jsonl");
  std::string line;
  ASSERT_TRUE(std::getline(in, line));
  const auto finetune_budget = nlohmann::json::parse(line)["budget_bytes"].get<int64_t>();
  const auto budget_total = budget["total_bytes"].get<int64_t>();
  EXPECT_LT(finetune_budget, budget_total);
  EXPECT_GT(finetune_budget, budget_total * 9 / 10);
  const nlohmann::json config = nlohmann::json::parse(read_all(out / "config.json"));
  EXPECT_EQ(config["dtype"], budget["dtype"]);
}

// Rank 0 of a 2-rank fine-tune interrupted: the job saves after its step, and `finetune --resume`
// at 2 ranks finishes it with the adapter of the job that never stopped.
TEST_F(FinetuneCli, AnInterruptedJobOfTwoRanksResumesBitwise) {
  if (std::string(CPUTRAIN_MPIEXEC).empty()) GTEST_SKIP() << "built without MPI";
  const std::string launcher = "env OMP_NUM_THREADS=1 " + std::string(CPUTRAIN_MPIEXEC) +
                               " --allow-run-as-root --oversubscribe -np 2 ";
  const std::string flags = this->flags() + " --rank-timeout 120 --threads 1";
  const fs::path straight = dir_ / "straight", stopped = dir_ / "stopped";
  const Result done = run(launcher, flags + " --out " + straight.string());
  ASSERT_EQ(done.exit_code, 0) << done.err << done.out;
  const fs::path log = dir_ / "stopped.log";
  const pid_t pid = start(flags + " --out " + stopped.string(), log, "3", launcher);
  ASSERT_GT(pid, 0);
  ASSERT_TRUE(wait_until([&] {
    return read_all(log).find("holding before step 3") != std::string::npos;
  })) << read_all(log);
  const pid_t rank0 = rank_pid(stopped.string(), 0);
  ASSERT_GT(rank0, 0);
  ASSERT_EQ(::kill(rank0, SIGINT), 0);
  const int status = wait_for(pid);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) != 0) << read_all(log);
  EXPECT_NE(read_all(log).find("interrupted (SIGINT) after step 3"), std::string::npos)
      << read_all(log);
  // The advice is the command that continues it: a job of as many ranks.
  EXPECT_NE(read_all(log).find("continue with: mpirun -np 2 cputrain finetune --resume " +
                               stopped.string()),
            std::string::npos)
      << read_all(log);
  EXPECT_TRUE(fs::exists(stopped / "checkpoints" / "step-00000003.ckpt"));
  const Result rest = run(launcher, "finetune --threads 1 --resume " + stopped.string());
  ASSERT_EQ(rest.exit_code, 0) << rest.err << rest.out;
  EXPECT_EQ(read_all(stopped / "adapter.gguf"), read_all(straight / "adapter.gguf"));
  EXPECT_EQ(losses_of(stopped), losses_of(straight));
}

// A fine-tune of stories260K on prompt/completion pairs learns them: the held-out loss on the
// completions falls by more than half in 30 steps (metrics.jsonl), and the adapter makes the model
// answer as the data does.
TEST_F(FinetuneCli, Stories260KLearnsHeldOutCompletions) {
  const fs::path& dir = dir_;
  const fs::path data = write_data();
  const fs::path model = kShared / "stories260K.gguf";
  ASSERT_EQ(run_status("finetune --model " + model.string() + " --data " + data.string() +
                       " --val-fraction 0.25 --out " + (dir / "run").string() +
                       " --ctx 128 --batch 4 --accum 1 --steps 30 --lr 3e-3 --eval-every 10"),
            0);
  std::vector<double> val;
  std::ifstream metrics(dir / "run" / "metrics.jsonl");
  for (std::string line; std::getline(metrics, line);) {
    const nlohmann::json j = nlohmann::json::parse(line);
    if (j.contains("val_loss")) val.push_back(j["val_loss"].get<double>());
  }
  ASSERT_EQ(val.size(), 4u);  // before, at 10 and 20, after
  EXPECT_LT(val.back(), 0.5 * val.front());
  const Result r = run("sample --model " + model.string() + " --adapter " +
                       (dir / "run" / "adapter.gguf").string() +
                       " --prompt 'Ben had a cake. What did Ben have?' "
                       "--temperature 0 --max-tokens 8");
  EXPECT_EQ(r.exit_code, 0) << r.err;
  EXPECT_NE(r.out.find("What did Ben have? Ben had a cake"), std::string::npos) << r.out;
}

// A fine-tune (with LoRA dropout, whose masks the step draws) stopped after its step-3 checkpoint
// and resumed ends with the same adapter, byte for byte, and the same losses as the run that
// never stopped; a resume with other flags or other data is refused.
TEST_F(FinetuneCli, ResumeIsBitwiseTheRunThatNeverStopped) {
  const fs::path& dir = dir_;
  const fs::path data = write_data();
  const std::string flags = "finetune --model " + (kShared / "stories260K.gguf").string() +
                            " --data " + data.string() +
                            " --val-fraction 0.25 --ctx 128 --batch 2 --accum 2 --steps 6 "
                            "--save-every 3 --lr 3e-3 --lora-dropout 0.1 --out ";
  ASSERT_EQ(run_status(flags + (dir / "a").string()), 0);
  fs::copy(dir / "a", dir / "b", fs::copy_options::recursive);
  fs::remove(dir / "b" / "checkpoints" / "step-00000006.ckpt");
  fs::remove(dir / "b" / "adapter.gguf");
  fs::remove_all(dir / "b" / "peft");
  ASSERT_EQ(run_status(flags + (dir / "b").string() + " --resume"), 0);
  EXPECT_EQ(read_all(dir / "a" / "adapter.gguf"), read_all(dir / "b" / "adapter.gguf"));
  // PEFT's config records the dropout trained with.
  EXPECT_DOUBLE_EQ(
      nlohmann::json::parse(read_all(dir / "a" / "peft" / "adapter_config.json"))["lora_dropout"]
          .get<double>(),
      0.1);
  const auto losses = [&](const fs::path& run) {
    std::vector<double> l;
    std::ifstream in(run / "metrics.jsonl");
    for (std::string line; std::getline(in, line);) {
      const nlohmann::json j = nlohmann::json::parse(line);
      l.push_back(j.contains("loss") ? j["loss"].get<double>() : j["val_loss"].get<double>());
    }
    return l;
  };
  EXPECT_EQ(losses(dir / "a"), losses(dir / "b"));
  expect_one_line_error(run(flags + (dir / "b").string() + " --resume --seed 9"),
                        "--seed 9 (the run's: 1) would change the fine-tune");
  std::ofstream(dir / "other.jsonl") << "{\"prompt\": \"a\", \"completion\": \" b\"}\n"
                                     << "{\"prompt\": \"c\", \"completion\": \" d\"}\n";
  const std::string other_flags = "finetune --model " + (kShared / "stories260K.gguf").string() +
                                  " --data " + (dir / "other.jsonl").string() +
                                  " --ctx 128 --steps 2 --out " + (dir / "c").string();
  ASSERT_EQ(run_status(other_flags), 0);
  std::ofstream(dir / "other.jsonl", std::ios::app)
      << "{\"prompt\": \"e\", \"completion\": \" f\"}\n";
  expect_one_line_error(run(other_flags + " --resume"), "trained on other data");
}

// --epochs E is E passes over the rows: each epoch's last step takes the rows left of it, so the
// targets trained on are the data's, E times (here rows that a step's 5 do not divide).
// A finished fine-tune is extended by --steps or --epochs on its resume, the schedule it began
// with kept (warm-up and decay over its first steps; the steps past them at a tenth of the peak);
// the extended run resumes as any; a resume that would end at or before where it is is refused.
TEST_F(FinetuneCli, EpochsArePassesAndAFinishedFineTuneIsExtended) {
  const std::string base = "finetune --model " + (kShared / "stories260K.gguf").string() +
                           " --data " + write_data().string() +
                           " --ctx 64 --batch 5 --accum 1 --lr 2e-3 --warmup 0.5";
  const auto lines = [](const fs::path& run) {
    std::vector<nlohmann::json> v;
    std::ifstream in(run / "metrics.jsonl");
    for (std::string line; std::getline(in, line);)
      if (nlohmann::json j = nlohmann::json::parse(line); j.contains("loss")) v.push_back(j);
    return v;
  };
  const auto number_after = [](const std::string& text, const std::string& before) {
    const size_t at = text.find(before);
    return at == std::string::npos ? int64_t{-1} : std::stoll(text.substr(at + before.size()));
  };
  const fs::path one = dir_ / "one";
  const Result r = run(base + " --epochs 1 --out " + one.string());
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const int64_t rows = number_after(r.out, "packed: ");
  const size_t at = r.out.find(" tokens, ", r.out.find("data: "));
  ASSERT_NE(at, std::string::npos) << r.out;
  const int64_t targets = std::stoll(r.out.substr(at + 9));
  ASSERT_GT(rows % 5, 0) << r.out;  // the last step of an epoch is short
  const int64_t epoch_steps = (rows + 4) / 5;
  EXPECT_NE(r.out.find(std::to_string(epoch_steps) + " steps of 5 rows (1.00 epochs)"),
            std::string::npos)
      << r.out;
  int64_t trained = 0;
  for (const nlohmann::json& j : lines(one)) trained += j["targets"].get<int64_t>();
  EXPECT_EQ(trained, targets);
  const fs::path two = dir_ / "two";
  ASSERT_EQ(run_status(base + " --epochs 2 --out " + two.string()), 0);
  trained = 0;
  for (const nlohmann::json& j : lines(two)) trained += j["targets"].get<int64_t>();
  EXPECT_EQ(trained, 2 * targets);
  EXPECT_EQ(lines(two).size(), static_cast<size_t>(2 * epoch_steps));

  // Extended: 4 steps, then to 6; warm-up of 2 and decay to 0 at 4 kept, 5 and 6 at 2e-4.
  const fs::path ext = dir_ / "ext", again = dir_ / "again";
  ASSERT_EQ(run_status(base + " --steps 4 --save-every 1 --out " + ext.string()), 0);
  expect_one_line_error(run("finetune --resume " + ext.string()),
                        "has trained all its 4 steps; give --steps above 4 (or --epochs)");
  expect_one_line_error(
      run("finetune --resume " + ext.string() + " --steps 3"),
      "--steps 3: the fine-tune in " + ext.string() + " has already trained 4 steps");
  expect_one_line_error(run("finetune --resume " + ext.string() + " --steps 6 --epochs 2"),
                        "--steps and --epochs: give one");
  const std::string before = read_all(ext / "adapter.gguf");
  const Result longer = run("finetune --resume " + ext.string() + " --steps 6");
  ASSERT_EQ(longer.exit_code, 0) << longer.err;
  EXPECT_EQ(longer.out.find("--warmup"), std::string::npos) << longer.out;
  EXPECT_NE(longer.out.find("the fine-tune now ends at step 6 (its schedule ends at 4)"),
            std::string::npos)
      << longer.out;
  const std::vector<nlohmann::json> steps = lines(ext);
  ASSERT_EQ(steps.size(), 6u);
  EXPECT_DOUBLE_EQ(steps[1]["lr"].get<double>(), 2e-3);
  EXPECT_EQ(steps[3]["lr"].get<double>(), 0.0);
  EXPECT_DOUBLE_EQ(steps[4]["lr"].get<double>(), 2e-4);
  EXPECT_DOUBLE_EQ(steps[5]["lr"].get<double>(), 2e-4);
  EXPECT_NE(read_all(ext / "adapter.gguf"), before);
  EXPECT_EQ(nlohmann::json::parse(read_all(ext / "config.json"))["steps"].get<int64_t>(), 6);
  // The extended run resumes as any: stopped after step 5, it ends with the same adapter.
  fs::copy(ext, again, fs::copy_options::recursive);
  fs::remove(again / "checkpoints" / "step-00000006.ckpt");
  fs::remove(again / "adapter.gguf");
  ASSERT_EQ(run_status("finetune --resume " + again.string()), 0);
  EXPECT_EQ(read_all(again / "adapter.gguf"), read_all(ext / "adapter.gguf"));
  // --epochs on a resume sets where it ends as --steps does.
  const Result epochs = run("finetune --resume " + ext.string() + " --epochs 2");
  ASSERT_EQ(epochs.exit_code, 0) << epochs.err;
  EXPECT_EQ(lines(ext).size(), static_cast<size_t>(2 * epoch_steps));
}

// A stop signal during the last step: the run is complete, and its result is written as without
// it. A run whose last checkpoint is its last step but whose result is missing (stopped between
// the two) writes it on --resume.
TEST_F(FinetuneCli, AStopSignalDuringTheLastStepEndsTheRun) {
  const fs::path straight = dir_ / "straight", stopped = dir_ / "stopped";
  ASSERT_EQ(run_status(flags() + " --out " + straight.string()), 0);
  const fs::path log = dir_ / "stopped.log";
  const pid_t pid = start(flags() + " --out " + stopped.string(), log, "6");
  ASSERT_GT(pid, 0);
  ASSERT_TRUE(wait_until([&] {
    return read_all(log).find("holding before step 6") != std::string::npos;
  })) << read_all(log);
  ASSERT_EQ(::kill(pid, SIGINT), 0);
  const int status = wait_for(pid);
  ASSERT_TRUE(WIFEXITED(status)) << read_all(log);
  EXPECT_EQ(WEXITSTATUS(status), 0) << read_all(log);
  EXPECT_NE(read_all(log).find("interrupted (SIGINT) during the last step: the run is complete"),
            std::string::npos)
      << read_all(log);
  EXPECT_EQ(read_all(stopped / "adapter.gguf"), read_all(straight / "adapter.gguf"));
  fs::remove(stopped / "adapter.gguf");
  fs::remove_all(stopped / "peft");
  const Result resumed = run("finetune --resume " + stopped.string());
  ASSERT_EQ(resumed.exit_code, 0) << resumed.err;
  EXPECT_NE(resumed.out.find("has trained all its 6 steps, and " +
                             (stopped / "adapter.gguf").string() + " is missing: written from it"),
            std::string::npos)
      << resumed.out;
  EXPECT_EQ(read_all(stopped / "adapter.gguf"), read_all(straight / "adapter.gguf"));
  EXPECT_TRUE(fs::exists(stopped / "peft" / "adapter_model.safetensors"));
}

// Bad input to finetune: one line naming the file and line, flag or value, a non-zero exit.
TEST_F(FinetuneCli, BadInputGetsOneLine) {
  const fs::path& dir = dir_;
  const fs::path data = write_data();
  const std::string model = (kShared / "stories260K.gguf").string();
  const auto finetune = [&](const std::string& data_file, const std::string& flags) {
    fs::remove_all(dir / "out");
    return run("finetune --model " + model + " --data " + data_file + " --out " +
               (dir / "out").string() + " --steps 1 --ctx 64 " + flags);
  };
  std::ofstream(dir / "broken.jsonl") << "{\"text\": \"fine\"}\n{\"text\": \"no end}\n";
  expect_one_line_error(finetune((dir / "broken.jsonl").string(), ""),
                        "broken.jsonl:2: not valid JSON");
  std::ofstream(dir / "chat.jsonl")
      << "{\"messages\": [{\"role\": \"user\", \"content\": \"hi\"}, {\"role\": \"assistant\", "
         "\"content\": \"yo\"}]}\n";
  expect_one_line_error(finetune((dir / "chat.jsonl").string(), ""),
                        "chat.jsonl:1: a chat example, and the model has no chat template");
  std::ofstream(dir / "empty_reply.jsonl")
      << "{\"messages\": [{\"role\": \"user\", \"content\": \"hi\"}, {\"role\": \"assistant\", "
         "\"content\": \" \"}]}\n";
  expect_one_line_error(finetune((dir / "empty_reply.jsonl").string(), "--chat-template chatml"),
                        "empty_reply.jsonl:1: message 2 is an empty assistant reply");
  std::ofstream(dir / "role.jsonl")
      << "{\"messages\": [{\"role\": \"bot\", \"content\": \"hi\"}]}\n";
  expect_one_line_error(finetune((dir / "role.jsonl").string(), "--chat-template chatml"),
                        "role.jsonl:1: message 1 has the role \"bot\"");
  std::ofstream(dir / "field.jsonl") << "{\"question\": \"q\", \"answer\": \"a\"}\n";
  expect_one_line_error(finetune((dir / "field.jsonl").string(), ""),
                        "field.jsonl:1: no field of a known shape");
  expect_one_line_error(finetune(data.string(), "--lora-targets q,attn"),
                        "--lora-targets q,attn: no projection called attn");
  expect_one_line_error(finetune(data.string(), "--chat-template vicuna"),
                        "--chat-template vicuna: no such chat template");
  expect_one_line_error(finetune(data.string(), "--val " + data.string() + " --val-fraction 0.1"),
                        "--val and --val-fraction: give one");
  expect_one_line_error(finetune((dir / "missing.jsonl").string(), ""),
                        "missing.jsonl: cannot be read");
  {
    // One line of 24 MiB: more than --mem-limit 0.1 lets an example hold, refused before it is
    // read whole.
    std::ofstream huge(dir / "huge.jsonl");
    huge << "{\"text\": \"" << std::string(24 << 20, 'a') << "\"}\n";
  }
  expect_one_line_error(finetune((dir / "huge.jsonl").string(), "--mem-limit 0.1"),
                        "huge.jsonl:1: a line longer than 12 MiB");
  {
    // Examples that together hold more tokens than --mem-limit 0.005 lets the data hold.
    std::ofstream many(dir / "many.jsonl");
    std::string text;
    for (int w = 0; w < 140; ++w) text += "ab ";
    for (int i = 0; i < 4000; ++i) many << "{\"text\": \"" << text << "\"}\n";
  }
  expect_one_line_error(finetune((dir / "many.jsonl").string(), "--mem-limit 0.005"),
                        "more than the memory limit lets the data hold");
  expect_one_line_error(finetune(dir.string(), ""),
                        "a folder, where a JSON Lines file of examples is expected");
  expect_one_line_error(finetune(data.string(), "--lora-rank 100000"),
                        "--lora-rank 100000: above the width");
  expect_one_line_error(run("budget --model " + model + " --lora-rank 100000"),
                        "--lora-rank 100000: above the width");
  expect_one_line_error(run("tokenize --model " + model + " --text " + dir.string()),
                        "a folder, not a text file");
}

// A fine-tune's run directory is a run like any other: inspect describes it (and its adapter
// file), sample and eval read it as its base with its adapter (or, stopped, its checkpoint's
// adapters) and compute what the base with the adapter file computes, export --merge writes it,
// and what cannot be done with it is said in one line.
TEST_F(FinetuneCli, AFineTunesRunIsARunLikeAnyOther) {
  const fs::path run = dir_ / "run", text = dir_ / "text.txt";
  const std::string base = (kShared / "stories260K.gguf").string();
  ASSERT_EQ(run_status(flags() + " --save-every 3 --out " + run.string()), 0);
  std::ofstream(text) << "Lily had a ball. What did Lily have? Lily had a ball.";
  const Result about = run_cli("inspect " + run.string());
  ASSERT_EQ(about.exit_code, 0) << about.err;
  EXPECT_NE(about.out.find("a LoRA fine-tune (rank 16, alpha 32"), std::string::npos) << about.out;
  const Result adapter = run_cli("inspect " + (run / "adapter.gguf").string());
  ASSERT_EQ(adapter.exit_code, 0) << adapter.err;
  EXPECT_NE(adapter.out.find("a LoRA adapter (GGUF v3) for llama models: rank 16"),
            std::string::npos)
      << adapter.out;
  const std::string prompt =
      " --prompt 'Ben had a cake. What did Ben have?' --temperature 0 "
      "--max-tokens 8";
  const Result with_file =
      run_cli("sample --model " + base + " --adapter " + (run / "adapter.gguf").string() + prompt);
  const Result with_run = run_cli("sample --run " + run.string() + prompt);
  ASSERT_EQ(with_run.exit_code, 0) << with_run.err;
  EXPECT_EQ(with_run.out, with_file.out);
  const Result eval_file = run_cli("eval --model " + base + " --adapter " +
                                   (run / "adapter.gguf").string() + " --text " + text.string());
  const Result eval_run = run_cli("eval --run " + run.string() + " --text " + text.string());
  ASSERT_EQ(eval_run.exit_code, 0) << eval_run.err;
  EXPECT_EQ(eval_run.out.substr(eval_run.out.find("loss")),
            eval_file.out.substr(eval_file.out.find("loss")));
  // Without --text, the examples it held out, the loss its last validation gave (there in bf16
  // where the CPU has it, here in fp32).
  const Result held = run_cli("eval --json --run " + run.string());
  ASSERT_EQ(held.exit_code, 0) << held.err;
  const nlohmann::json j = nlohmann::json::parse(held.out);
  double val = 0.0;
  std::ifstream metrics(run / "metrics.jsonl");
  for (std::string line; std::getline(metrics, line);)
    if (const nlohmann::json m = nlohmann::json::parse(line); m.contains("val_loss"))
      val = m["val_loss"].get<double>();
  EXPECT_NEAR(j["loss"].get<double>(), val, 1e-2);
  EXPECT_EQ(j["examples"].get<int64_t>(), 12);
  EXPECT_EQ(run_cli("eval --model " + run.string()).exit_code, 0);
  // A folder whose config.json is neither a run's nor names a model_type.
  fs::create_directories(dir_ / "untyped");
  std::ofstream(dir_ / "untyped" / "config.json") << "{\"hidden_size\": 64}";
  expect_one_line_error(
      run_cli("eval --model " + (dir_ / "untyped").string() + " --text " + text.string()),
      "config.json has no model_type");
  expect_one_line_error(
      run_cli("export --run " + run.string() + " --out " + (dir_ / "x.gguf").string()),
      "is a LoRA fine-tune: give --merge");
  const fs::path merged = dir_ / "merged.gguf";
  ASSERT_EQ(run_status("export --run " + run.string() + " --merge --out " + merged.string()), 0);
  const Result eval_merged =
      run_cli("eval --model " + merged.string() + " --text " + text.string());
  EXPECT_EQ(eval_merged.out.substr(eval_merged.out.find("loss")),
            eval_file.out.substr(eval_file.out.find("loss")));
  expect_one_line_error(run_cli("finetune --model " + run.string() + " --data " +
                                write_data().string() + " --out " + (dir_ / "again").string()),
                        "is a LoRA fine-tune: write its base with the adapter merged");
  // Stopped before it wrote its adapter: its newest checkpoint's adapters (those of step 6).
  fs::remove(run / "adapter.gguf");
  const Result stopped = run_cli("sample --run " + run.string() + prompt);
  ASSERT_EQ(stopped.exit_code, 0) << stopped.err;
  EXPECT_EQ(stopped.out, with_file.out);
}

// A full fine-tune writes the model with the context its base declares (stories260K's 512), not
// the rows' --ctx it was tuned on: a later eval or llama.cpp runs at the model's own.
TEST_F(FinetuneCli, AFullFineTuneKeepsTheModelsContext) {
  const fs::path run = dir_ / "full";
  ASSERT_EQ(
      run_status("finetune --full --model " + (kShared / "stories260K.gguf").string() + " --data " +
                 write_data().string() + " --ctx 64 --batch 2 --steps 1 --out " + run.string()),
      0);
  const cputrain::GgufFile base((kShared / "stories260K.gguf").string()),
      tuned((run / "model.gguf").string());
  EXPECT_EQ(base.integer("llama.context_length"), 512);
  EXPECT_EQ(tuned.integer("llama.context_length"), 512);
  // Its budget line names what it holds: every weight's gradients, not adapters'.
  EXPECT_NE(read_all(run / "train.log").find("the weights' gradients and AdamW"),
            std::string::npos);
}

// An export that cannot be completed (here a file size limit, as a full disk does) leaves no
// half-written Hugging Face folder behind.
TEST_F(FinetuneCli, AnExportThatFailsLeavesNoFolder) {
  const fs::path out = dir_ / "hf";
  const Result r =
      run("ulimit -f 16; trap '' XFSZ;",
          "export --model " + (kShared / "stories260K.gguf").string() + " --out " + out.string());
  EXPECT_NE(r.exit_code, 0);
  EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << r.err;
  EXPECT_FALSE(fs::exists(out));
  fs::create_directories(out);
  EXPECT_NE(
      run("ulimit -f 16; trap '' XFSZ;",
          "export --model " + (kShared / "stories260K.gguf").string() + " --out " + out.string())
          .exit_code,
      0);
  EXPECT_TRUE(fs::is_directory(out));
  EXPECT_TRUE(fs::is_empty(out));
  // Over a whole folder, with --overwrite: the folder it held, every file as it was.
  const fs::path whole = dir_ / "whole";
  ASSERT_EQ(run("export --model " + (kShared / "stories260K.gguf").string() + " --type f16 --out " +
                whole.string())
                .exit_code,
            0);
  std::map<std::string, std::string> before;
  for (const auto& e : fs::directory_iterator(whole))
    before[e.path().filename().string()] = read_all(e.path());
  const Result over = run("ulimit -f 16; trap '' XFSZ;",
                          "export --model " + (kShared / "stories260K.gguf").string() +
                              " --overwrite --out " + whole.string());
  EXPECT_NE(over.exit_code, 0);
  EXPECT_EQ(std::count(over.err.begin(), over.err.end(), '\n'), 1) << over.err;
  std::map<std::string, std::string> after;
  for (const auto& e : fs::directory_iterator(whole))
    after[e.path().filename().string()] = read_all(e.path());
  EXPECT_EQ(after, before);
  for (const auto& e : fs::directory_iterator(dir_))
    EXPECT_EQ(e.path().filename().string().find(".export-"), std::string::npos) << e.path();
}

// Export's messages name what is wrong with a run: a damaged config.json as such (not a missing
// --adapter), a base that is gone as its config.json's (not --run). Exports are named as
// llama.cpp's converter names them: a GGUF's own general.name (none where it has none: never its
// file's, which llama.cpp reads as a hint, "phi3.gguf" taken for Phi-3), a Hugging Face folder's
// name as a title.
TEST_F(FinetuneCli, ExportsNameTheRunsDamageAndTheModelAsLlamaCppsConverter) {
  const fs::path ft = dir_ / "ft", base = dir_ / "phi3.gguf";
  fs::copy_file(kShared / "stories260K.gguf", base);
  ASSERT_EQ(run_status("finetune --model " + base.string() + " --data " + write_data().string() +
                       " --ctx 64 --steps 1 --out " + ft.string()),
            0);
  const fs::path damaged = dir_ / "damaged", moved = dir_ / "moved";
  fs::copy(ft, damaged, fs::copy_options::recursive);
  fs::copy(ft, moved, fs::copy_options::recursive);
  std::ofstream(damaged / "config.json") << "{\"command\": \"finetune\", \"model";
  expect_one_line_error(
      run("export --run " + damaged.string() + " --merge --out " + (dir_ / "d.gguf").string()),
      (damaged / "config.json").string() + ": not valid JSON");
  nlohmann::json config = nlohmann::json::parse(read_all(moved / "config.json"));
  config["model"] = (dir_ / "gone.gguf").string();
  std::ofstream(moved / "config.json") << config.dump(2);
  expect_one_line_error(
      run("export --run " + moved.string() + " --merge --out " + (dir_ / "m.gguf").string()),
      "--run " + moved.string() + ": the base it fine-tuned, " + (dir_ / "gone.gguf").string() +
          " (" + moved.string() + "/config.json's model), is not there");
  // Names: the base's own (stories260K's file has none), never "phi3.gguf".
  const cputrain::GgufFile source(base.string());
  const std::string own = source.string("general.name", "");
  const fs::path merged = dir_ / "merged.gguf", folder = dir_ / "tiny-stories_hf",
                 again = dir_ / "again.gguf";
  ASSERT_EQ(run_status("export --run " + ft.string() + " --merge --out " + merged.string()), 0);
  EXPECT_EQ(cputrain::GgufFile(merged.string()).string("general.name", ""), own);
  EXPECT_EQ(cputrain::GgufFile((ft / "adapter.gguf").string()).string("general.name", ""),
            own.empty() ? "" : own + " LoRA");
  ASSERT_EQ(run_status("export --model " + base.string() + " --out " + folder.string()), 0);
  ASSERT_EQ(run_status("export --model " + folder.string() + " --out " + again.string()), 0);
  EXPECT_EQ(cputrain::GgufFile(again.string()).string("general.name", ""), "Tiny Stories_Hf");
}

}  // namespace
