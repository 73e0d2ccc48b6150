// Helpers of the tests that run the cputrain binary (CPUTRAIN_BINARY): temporary folders, the
// shared model files, a child run measured (exit status, output, wall time, peak RSS), and a
// GGUF file copied with its metadata or tensors edited.
#pragma once

#include <gtest/gtest.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <functional>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "engine/io/gguf_file.h"

namespace cputrain::cli_test {

namespace fs = std::filesystem;

inline const fs::path kShared = CPUTRAIN_SHARED_MODELS;

#define REQUIRE_SHARED_MODEL(file)                          \
  if (!std::filesystem::exists(cli_test::kShared / (file))) \
  GTEST_SKIP() << (cli_test::kShared / (file)) << " is not there"

inline std::string read_all(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

// A fresh folder under the system's temporary one, removed when the object goes.
struct TempFolder {
  explicit TempFolder(const std::string& name)
      : path(fs::temp_directory_path() / ("cputrain_" + name + "_" + std::to_string(::getpid()))) {
    fs::remove_all(path);
    fs::create_directories(path);
  }
  ~TempFolder() {
    std::error_code ec;
    fs::remove_all(path, ec);
  }
  TempFolder(const TempFolder&) = delete;
  TempFolder& operator=(const TempFolder&) = delete;
  fs::path path;
};

// What a run of the binary did.
struct ChildRun {
  std::string args;
  int exit_code = -1;  // -1: killed (by a signal, or at the time limit)
  bool timed_out = false;
  std::string out, err;
  double wall_seconds = 0.0;
  int64_t peak_rss_bytes = 0;  // the child's own (wait4's ru_maxrss)
};

// Starts `cputrain ARGS` (split at spaces; no argument holds one) with its stdout and stderr in
// files of `dir` named after `tag`. Returns the child's pid.
inline pid_t start_cputrain(const std::string& args, const fs::path& dir, const std::string& tag) {
  std::vector<std::string> words = {CPUTRAIN_BINARY};
  std::istringstream in(args);
  for (std::string w; in >> w;) words.push_back(w);
  const std::string out = (dir / (tag + ".out")).string(), err = (dir / (tag + ".err")).string();
  const pid_t pid = ::fork();
  if (pid == 0) {
    if (!std::freopen(out.c_str(), "w", stdout) || !std::freopen(err.c_str(), "w", stderr))
      ::_exit(126);
    std::vector<char*> argv;
    for (std::string& w : words) argv.push_back(w.data());
    argv.push_back(nullptr);
    ::execv(argv[0], argv.data());
    ::_exit(127);
  }
  return pid;
}

// Runs each of `args` (at most `parallel` at once), each killed after `limit_seconds`.
inline std::vector<ChildRun> run_cputrain_all(const std::vector<std::string>& args,
                                              const fs::path& dir, int parallel = 2,
                                              double limit_seconds = 20.0) {
  using Clock = std::chrono::steady_clock;
  struct Running {
    size_t index;
    pid_t pid;
    Clock::time_point start;
  };
  std::vector<ChildRun> runs(args.size());
  std::vector<Running> running;
  size_t next = 0;
  while (next < args.size() || !running.empty()) {
    while (next < args.size() && static_cast<int>(running.size()) < parallel) {
      runs[next].args = args[next];
      running.push_back(
          {next, start_cputrain(args[next], dir, "run" + std::to_string(next)), Clock::now()});
      ++next;
    }
    bool any = false;
    for (size_t r = 0; r < running.size();) {
      Running& c = running[r];
      ChildRun& run = runs[c.index];
      const double seconds = std::chrono::duration<double>(Clock::now() - c.start).count();
      int status = 0;
      struct rusage usage {};
      pid_t done = ::wait4(c.pid, &status, WNOHANG, &usage);
      if (done == 0 && seconds > limit_seconds) {
        ::kill(c.pid, SIGKILL);
        done = ::wait4(c.pid, &status, 0, &usage);
        run.timed_out = true;
      }
      if (done == 0) {
        ++r;
        continue;
      }
      any = true;
      run.wall_seconds = seconds;
      run.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
      run.peak_rss_bytes = static_cast<int64_t>(usage.ru_maxrss) * 1024;
      const std::string tag = "run" + std::to_string(c.index);
      run.out = read_all(dir / (tag + ".out"));
      run.err = read_all(dir / (tag + ".err"));
      running.erase(running.begin() + static_cast<std::ptrdiff_t>(r));
    }
    if (!any) std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
  return runs;
}

inline ChildRun run_cputrain(const std::string& args, const fs::path& dir,
                             double limit_seconds = 60.0) {
  return run_cputrain_all({args}, dir, 1, limit_seconds)[0];
}

// A copy of a GGUF file with its metadata and tensors edited: `metadata` may change a value or
// return false to drop it; `tensor` may change a tensor's type and bytes or dims; `extra` adds
// metadata after the rest.
inline void rewrite_gguf(const fs::path& from, const fs::path& to,
                         const std::function<bool(const std::string&, GgufValue&)>& metadata,
                         const std::function<void(const std::string&, std::vector<int64_t>&,
                                                  uint32_t&, std::vector<uint8_t>&)>& tensor,
                         const std::function<void(GgufWriter&)>& extra = nullptr) {
  const GgufFile file(from.string());
  GgufWriter w;
  for (const auto& [key, value] : file.metadata()) {
    GgufValue v = value;
    if (!metadata || metadata(key, v)) w.set_value(key, v);
  }
  if (extra) extra(w);
  for (const GgufTensor& t : file.tensors()) {
    std::vector<int64_t> dims = t.dims;
    uint32_t type = t.type;
    std::vector<uint8_t> data(t.data.begin(), t.data.end());
    if (tensor) tensor(t.name, dims, type, data);
    w.add_tensor(t.name, dims, static_cast<GgmlType>(type), std::move(data));
  }
  w.write(to.string());
}

}  // namespace cputrain::cli_test
