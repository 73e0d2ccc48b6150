// The cputrain binary run end to end by tests: a fixture with a temporary folder per test, runs
// to completion with their output, runs started in the background (held at a step until a stop
// signal, as CPUTRAIN_TEST_HOLD_STEP asks), and jobs of several ranks under mpirun.
#pragma once

#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <vector>

namespace cputrain::testing {

namespace fs = std::filesystem;

struct Result {
  int exit_code = -1;
  std::string out;
  std::string err;
};

inline std::string read_all(const fs::path& p) {
  std::ifstream in(p);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

// Writes `bytes` over the file's own at `offset` (from the end where negative), its size kept.
inline void overwrite_bytes(const fs::path& p, int64_t offset, const std::string& bytes) {
  std::fstream f(p, std::ios::binary | std::ios::in | std::ios::out);
  if (offset < 0)
    f.seekp(offset, std::ios::end);
  else
    f.seekp(offset);
  f.write(bytes.data(), std::ssize(bytes));
}

// The training losses of a run's metrics.jsonl, step by step (a line without one, such as a
// validation before the first step, is passed over).
inline std::vector<double> losses_of(const fs::path& run_dir) {
  std::ifstream metrics(run_dir / "metrics.jsonl");
  std::vector<double> v;
  for (std::string line; std::getline(metrics, line);) {
    const nlohmann::json j = nlohmann::json::parse(line);
    if (j.contains("loss")) v.push_back(j["loss"].get<double>());
  }
  return v;
}

class Cli : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() /
           ("cputrain_cli_" + std::to_string(::getpid()) + "_" +
            ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  void TearDown() override {
    // A run a failed assertion left held or training: still our child, so not yet reaped.
    for (pid_t pid : started_) {
      if (::waitpid(pid, nullptr, WNOHANG) != 0) continue;  // reaped, or gone
      ::kill(pid, SIGKILL);
      ::waitpid(pid, nullptr, 0);
    }
    fs::remove_all(dir_);
  }

  // Runs cputrain with `args`, after environment assignments `env` ("NAME=value ...").
  Result run(const std::string& env, const std::string& args) const {
    const fs::path out = dir_ / "stdout.txt", err = dir_ / "stderr.txt";
    const std::string cmd = env + " " + std::string(CPUTRAIN_BINARY) + " " + args + " >" +
                            out.string() + " 2>" + err.string() + " </dev/null";
    const int status = std::system(cmd.c_str());
    Result r;
    r.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
    r.out = read_all(out);
    r.err = read_all(err);
    return r;
  }
  Result run(const std::string& args) const { return run("", args); }

  // Starts cputrain with `args` in the background, its output to `log`, with
  // CPUTRAIN_TEST_HOLD_STEP=`hold` where it is given (the loop waits before that step for a stop
  // signal, or for good with "N+"; tools/train_command.cpp), by `launcher` where it is given (a
  // command line that runs the binary after it, such as mpirun's); returns its pid.
  // With `ignore_sigint` it starts with SIGINT ignored, as a shell starts a command with `&`.
  pid_t start(const std::string& args, const fs::path& log, const std::string& hold,
              const std::string& launcher = "", bool ignore_sigint = false) {
    const pid_t pid = ::fork();
    if (pid == 0) {
      if (ignore_sigint) std::signal(SIGINT, SIG_IGN);
      // Both appending: the one without O_APPEND would write over the other's lines.
      std::fclose(std::fopen(log.c_str(), "w"));
      std::freopen(log.c_str(), "a", stdout);
      std::freopen(log.c_str(), "a", stderr);
      if (!hold.empty()) ::setenv("CPUTRAIN_TEST_HOLD_STEP", hold.c_str(), 1);
      const std::string cmd = launcher + std::string(CPUTRAIN_BINARY) + " " + args;
      ::execl("/bin/sh", "sh", "-c", ("exec " + cmd).c_str(), static_cast<char*>(nullptr));
      ::_exit(127);
    }
    if (pid > 0) started_.push_back(pid);
    return pid;
  }

  // Waits until `done` holds, for as long as a loaded machine may take; false if it never did.
  template <typename Done>
  static bool wait_until(Done done) {
    for (int i = 0; i < 600'000; ++i) {
      if (done()) return true;
      ::usleep(1000);
    }
    return false;
  }

  // start() with `args` --out `run_dir`, the tokenizer and tokens of the run in `prepared` copied
  // there first so that it trains at once, held before step `steps` + 1 (`hold` is "steps + 1",
  // or that and "+"); returns once it holds there (-1, the process killed, if it never does).
  pid_t start_prepared(const std::string& args, const fs::path& prepared, const fs::path& run_dir,
                       const fs::path& log, size_t steps, const std::string& hold) {
    fs::create_directories(run_dir);
    for (const char* f : {"tokenizer.model", "tokens.bin"})
      fs::copy_file(prepared / f, run_dir / f);
    const pid_t pid = start(args + " --out " + run_dir.string(), log, hold);
    if (pid < 0) return -1;
    const std::string held = "holding before step " + std::to_string(steps + 1);
    if (!wait_until([&] { return read_all(log).find(held) != std::string::npos; })) {
      ::kill(pid, SIGKILL);
      ::waitpid(pid, nullptr, 0);
      return -1;
    }
    return pid;
  }

  // A corpus of fortune-style documents, large enough for the tiny preset.
  fs::path write_corpus(int documents) const {
    const fs::path corpus = dir_ / "corpus.txt";
    std::ofstream out(corpus);
    const char* subjects[] = {"The cat",      "A programmer",  "My neighbour",
                              "The old tree", "Every student", "The river"};
    const char* verbs[] = {"likes", "watches", "remembers", "forgets", "builds", "paints"};
    const char* objects[] = {"the morning sun.",    "a quiet song.",     "the long road home.",
                             "small green apples.", "an honest answer.", "the last train."};
    for (int d = 0; d < documents; ++d) {
      for (int s = 0; s < 3; ++s)
        out << subjects[(d + s) % 6] << " " << verbs[(d * 5 + s) % 6] << " "
            << objects[(d * 7 + s * 3) % 6] << "\n";
      out << "%\n";
    }
    return corpus;
  }

  // Starts `args`, held as `hold` asks; sends SIGINT once its log says `held`; its exit status
  // (-1 where it never held there or did not exit).
  int interrupted(const std::string& args, const fs::path& log, const std::string& hold,
                  const std::string& held) {
    const pid_t pid = start(args, log, hold);
    if (pid <= 0 || !wait_until([&] { return read_all(log).find(held) != std::string::npos; }) ||
        ::kill(pid, SIGINT) != 0)
      return -1;
    int status = 0;
    if (!wait_until([&] { return ::waitpid(pid, &status, WNOHANG) == pid; })) return -1;
    return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  }

  // A run's metrics.jsonl, a JSON object a line.
  static std::vector<nlohmann::json> records(const fs::path& run_dir) {
    std::vector<nlohmann::json> out;
    std::ifstream in(run_dir / "metrics.jsonl");
    for (std::string line; std::getline(in, line);) out.push_back(nlohmann::json::parse(line));
    return out;
  }

  static void expect_one_line_error(const Result& r, const std::string& needle) {
    EXPECT_NE(r.exit_code, 0);
    EXPECT_NE(r.err.find(needle), std::string::npos) << "stderr: " << r.err;
    EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << "stderr: " << r.err;
  }

  fs::path dir_;
  std::vector<pid_t> started_;  // processes start() began
};

// Data parallelism through the command line: `mpirun -np 2 cputrain train|finetune`, one thread a
// rank (CPUTRAIN_MPIEXEC: the build's mpirun; empty where it was built without MPI).
class DataParallelCli : public Cli {
 protected:
  void SetUp() override {
    if (std::string(CPUTRAIN_MPIEXEC).empty()) GTEST_SKIP() << "built without MPI";
    Cli::SetUp();
  }
  // mpirun starting n ranks of one thread each, before the binary.
  static std::string launcher(int n) {
    return "env OMP_NUM_THREADS=1 " + std::string(CPUTRAIN_MPIEXEC) +
           " --allow-run-as-root --oversubscribe -np " + std::to_string(n) + " ";
  }
  Result ranks(int n, const std::string& args) const {
    return run(launcher(n), args + " --threads 1");
  }
  static void expect_close(const std::vector<nlohmann::json>& a,
                           const std::vector<nlohmann::json>& b, const char* key) {
    ASSERT_EQ(a.size(), b.size());
    int compared = 0;
    for (size_t i = 0; i < a.size(); ++i) {
      ASSERT_EQ(a[i].contains(key), b[i].contains(key)) << "line " << i;
      if (!a[i].contains(key)) continue;
      const double x = a[i][key].get<double>(), y = b[i][key].get<double>();
      EXPECT_LE(std::abs(x - y), 1e-6 * std::abs(x)) << key << " at line " << i;
      ++compared;
    }
    EXPECT_GT(compared, 0) << key;
  }
};

// The pid of rank `rank` of the job whose command line holds `marker`; -1 where there is none.
inline pid_t rank_pid(const std::string& marker, int rank) {
  for (const fs::directory_entry& e : fs::directory_iterator("/proc")) {
    const std::string name = e.path().filename().string();
    if (name.find_first_not_of("0123456789") != std::string::npos) continue;
    std::string cmdline = read_all(e.path() / "cmdline"), environ = read_all(e.path() / "environ");
    std::replace(cmdline.begin(), cmdline.end(), '\0', ' ');
    std::replace(environ.begin(), environ.end(), '\0', '\n');
    if (cmdline.find(CPUTRAIN_BINARY) != 0 || cmdline.find(marker) == std::string::npos) continue;
    if (("\n" + environ).find("\nOMPI_COMM_WORLD_RANK=" + std::to_string(rank) + "\n") !=
        std::string::npos)
      return static_cast<pid_t>(std::stol(name));
  }
  return -1;
}

}  // namespace cputrain::testing
