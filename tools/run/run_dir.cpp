#include "tools/run/run_dir.h"

#include <filesystem>
#include <fstream>
#include <string_view>

#include "engine/core/error.h"
#include "engine/train/checkpoint_file.h"
#include "engine/train/parameters.h"
#include "engine/train/weights_file.h"
#include "models/lora.h"

namespace fs = std::filesystem;

namespace cputrain {
namespace {

constexpr const char* kReplaced = ".replaced";
constexpr std::string_view kDataCache[] = {"tokenizer.model", "tokenizer.gguf", "tokens.bin"};
constexpr std::string_view kRunFiles[] = {"config.json", "metrics.jsonl", "model.bin",
                                          "checkpoints", "adapter.gguf",  "peft",
                                          "model.gguf"};
// What a run that stopped before its configuration was written can leave: not a run yet.
constexpr std::string_view kRunLeftovers[] = {"train.log", "profile.json", "plot.svg"};
constexpr std::string_view kParityFiles[] = {"parity.json", "parity.csv", "parity.log"};

template <size_t N>
bool among(std::string_view name, const std::string_view (&names)[N]) {
  for (std::string_view n : names)
    if (n == name) return true;
  return false;
}

}  // namespace

DirSurvey survey_dir(const std::string& dir) {
  DirSurvey s;
  std::error_code ec;
  if (!fs::is_directory(dir, ec)) return s;
  std::string parity, other;
  for (const fs::directory_entry& e : fs::directory_iterator(dir, ec)) {
    const std::string name = e.path().filename().string();
    if (name == kDirLockFile || name == kReplaced || among(name, kDataCache) ||
        among(name, kRunLeftovers))
      continue;
    if (among(name, kRunFiles)) return {DirKind::Run, e.path().string()};
    if (among(name, kParityFiles)) {
      if (parity.empty()) parity = e.path().string();
    } else if (other.empty()) {
      other = e.path().string();
    }
  }
  if (!other.empty()) return {DirKind::Other, other};
  if (!parity.empty()) return {DirKind::Parity, parity};
  return s;
}

std::vector<std::string> remove_stale_temporaries(const std::string& dir) {
  std::vector<std::string> removed;
  for (const fs::path& d : {fs::path(dir), fs::path(dir) / "checkpoints"}) {
    std::error_code ec;
    if (!fs::is_directory(d, ec)) continue;
    for (const fs::directory_entry& e : fs::directory_iterator(d, ec)) {
      if (!e.is_regular_file(ec) || e.path().extension() != ".tmp") continue;
      if (fs::remove(e.path(), ec)) removed.push_back(e.path().string());
    }
  }
  return removed;
}

std::string set_run_aside(const std::string& dir) {
  const fs::path aside = fs::path(dir) / kReplaced;
  std::error_code ec;
  if (fs::exists(aside, ec)) {
    // A run set aside already: what is in `dir` now is a successor that never completed a step,
    // and the run to keep is the one aside.
    for (std::string_view name : kRunFiles) fs::remove_all(fs::path(dir) / name, ec);
    for (std::string_view name : kRunLeftovers) fs::remove_all(fs::path(dir) / name, ec);
    return aside.string();
  }
  fs::create_directories(aside, ec);
  if (ec) throw UserError("--overwrite " + dir + ": cannot create " + aside.string());
  auto move_aside = [&](std::string_view name) {
    const fs::path from = fs::path(dir) / name;
    if (!fs::exists(from, ec)) return;
    fs::rename(from, aside / name, ec);
    if (ec)
      throw UserError("--overwrite " + dir + ": cannot move " + from.string() + " aside (" +
                      ec.message() + ")");
  };
  for (std::string_view name : kRunFiles) move_aside(name);
  for (std::string_view name : kRunLeftovers) move_aside(name);
  return aside.string();
}

std::string load_run_weights(const std::string& run, const std::string& weights,
                             const ParameterSet& params) {
  std::string path = weights;
  if (path.empty()) {
    const auto checkpoints = list_checkpoints(run);
    if (fs::exists(run + "/model.bin"))
      path = run + "/model.bin";
    else if (!checkpoints.empty())
      path = checkpoints.back().second;
    else
      throw UserError("--run " + run + ": neither model.bin nor a checkpoint to read");
  }
  const auto load = [&path](const ParameterSet& into) {
    if (path.ends_with(".ckpt"))
      load_checkpoint(path, into, nullptr);
    else
      load_weights(path, into);
  };
  bool as_trained = true;  // every parameter the run's own, trainable, with an FP32 master
  for (size_t i = 0; i < params.infos().size(); ++i)
    as_trained = as_trained && params.infos()[i].trainable &&
                 !is_lora_parameter(params.infos()[i].name) && params.infos()[i].offset >= 0;
  if (as_trained) {
    load(params);
    return path;
  }
  // A fine-tune's set (adapters, a frozen base, maybe bf16 alone): the run's parameters read into
  // a set shaped as the run trained them, then copied over by name; adapters are not the run's.
  ParameterSet base;
  std::vector<int> into;
  for (size_t i = 0; i < params.infos().size(); ++i) {
    const ParameterInfo& p = params.infos()[i];
    if (is_lora_parameter(p.name)) continue;
    base.add(p.name, p.shape, p.decay);
    into.push_back(static_cast<int>(i));
  }
  base.allocate();
  load(base);
  std::vector<float> values;
  for (size_t j = 0; j < into.size(); ++j) {
    values.resize(static_cast<size_t>(base.infos()[j].shape.numel()));
    base.read_values(static_cast<int>(j), values.data());
    params.write_values(into[j], values.data());
  }
  return path;
}

void prepare_run_dir(const std::string& dir, const std::string& flag) {
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec) throw UserError(flag + " " + dir + ": cannot create directory (" + ec.message() + ")");
  const std::string probe = dir + "/.write-test";
  std::ofstream out(probe);
  if (!out || !(out << "ok") || (out.close(), !out))
    throw UserError(flag + " " + dir + ": directory is not writable");
  fs::remove(probe, ec);
}

RunDirectory open_run_directory(const std::string& dir, RunDirUse use) {
  const std::string flag = use == RunDirUse::Resume ? "--resume" : "--out";
  RunDirectory d;
  d.path = dir;
  std::error_code ec;
  if (use == RunDirUse::Resume && !fs::is_directory(dir, ec))
    throw UserError("--resume " + dir + ": no such run directory");
  d.created = !fs::exists(dir, ec);
  prepare_run_dir(dir, flag);
  d.lock = std::make_unique<RunDirLock>(dir, flag);
  // With the lock held, a temporary file here is one a process that died left behind.
  d.stale = remove_stale_temporaries(dir);
  const DirSurvey survey = survey_dir(dir);
  switch (use) {
    case RunDirUse::NewRun:
    case RunDirUse::Overwrite:
      if (survey.kind == DirKind::Run && use == RunDirUse::NewRun)
        throw UserError("--out " + dir + " already holds a run (" + survey.evidence +
                        "): continue it with --resume " + dir + ", or replace it with --overwrite");
      if (survey.kind == DirKind::Parity || survey.kind == DirKind::Other)
        throw UserError("--out " + dir + " holds files that are not a training run (" +
                        survey.evidence + "): choose a new or empty directory");
      if (survey.kind == DirKind::Run) set_run_aside(dir);
      // Also a run set aside by an --overwrite that stopped before its first step.
      d.replacing = use == RunDirUse::Overwrite && has_replaced_run(dir);
      break;
    case RunDirUse::Resume:
      if (survey.kind != DirKind::Run)
        throw UserError("--resume " + dir + ": not a training run (no config.json)");
      break;
    case RunDirUse::Parity:
      if (survey.kind == DirKind::Run || survey.kind == DirKind::Other)
        throw UserError(
            "--out " + dir + " holds " +
            (survey.kind == DirKind::Run ? "a training run" : "files parity did not write") + " (" +
            survey.evidence +
            "), whose tokenizer and token cache parity would replace: choose another directory");
      break;
  }
  return d;
}

void RunDirectory::discard_if_unused() const {
  if (!created) return;
  std::error_code ec;
  for (const fs::directory_entry& e : fs::directory_iterator(path, ec)) {
    const std::string name = e.path().filename().string();
    if (name != kDirLockFile && name != "train.log") return;
  }
  fs::remove_all(path, ec);
}

bool has_replaced_run(const std::string& dir) {
  std::error_code ec;
  return fs::exists(fs::path(dir) / kReplaced, ec);
}

bool remove_replaced_run(const std::string& dir) {
  std::error_code ec;
  return fs::remove_all(fs::path(dir) / kReplaced, ec) > 0;
}

}  // namespace cputrain
