// Run directories: what one holds, one writing process at a time on it, and a run replaced only
// once its successor has started.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "engine/io/dir_lock.h"

namespace cputrain {

class ParameterSet;

enum class DirKind {
  Empty,   // missing, empty, or only the data cache (tokenizer.model, tokens.bin) and the log of
           // a run that stopped before it began
  Run,     // a training run: config.json, metrics.jsonl, model.bin or checkpoints/
  Parity,  // the output of `cputrain parity`
  Other,   // anything else
};

struct DirSurvey {
  DirKind kind = DirKind::Empty;
  std::string evidence;  // the path that decided the kind (empty for Empty)
};

// What `dir` holds. The lock file and a run set aside by replace_run do not count.
DirSurvey survey_dir(const std::string& dir);

// The lock a run directory is held with.
using RunDirLock = DirLock;

// Deletes the temporary files (*.tmp, written and renamed into place by every save) in `dir` and
// its checkpoints/; with the directory's lock held, any there were left by a process that died
// while writing them. Returns their paths.
std::vector<std::string> remove_stale_temporaries(const std::string& dir);

// --overwrite: moves the training run in `dir` (its configuration, metrics, log, weights and
// checkpoints) into <dir>/.replaced, where it stays until remove_replaced_run, called once the
// new run has completed a step; a run that fails before that leaves the old one there, whole.
// Where a run is aside already, what `dir` holds is a successor that never completed a step: it
// is deleted and the run aside kept. Returns the directory the old run is in.
std::string set_run_aside(const std::string& dir);
// Loads the weights a command reads from a run into `params`: `weights` (--weights, model.bin or
// a .ckpt) if given, else <run>/model.bin, else the run's newest checkpoint (a run stopped before
// its end). Returns the path read; a UserError where there is none.
std::string load_run_weights(const std::string& run, const std::string& weights,
                             const ParameterSet& params);

// Creates `dir` if it is missing and proves it writable, before any work is done; a UserError
// naming `flag` where it cannot.
void prepare_run_dir(const std::string& dir, const std::string& flag = "--out");

// What a command means to do with a run directory.
enum class RunDirUse {
  NewRun,     // train --out: an empty directory (or one holding only a data cache)
  Overwrite,  // train --out --overwrite: that, or one holding a run, which is set aside
  Resume,     // train --resume: the run in it
  Parity,     // parity --out: anything but a training run or files of another kind
};

// A run directory opened for writing: created where missing, locked for this process, its stale
// temporaries removed, and what it holds checked against the use.
struct RunDirectory {
  std::string path;
  std::unique_ptr<RunDirLock> lock;
  bool created = false;    // this command created it
  bool replacing = false;  // --overwrite: an old run waits in .replaced until the first step
  std::vector<std::string> stale;  // temporaries a dead process left, now removed

  // A run refused before it began leaves no trace: a directory this command created is removed
  // when it holds nothing but the lock and the log.
  void discard_if_unused() const;
};
// A UserError, naming the flag and how to go on, where the directory is in use or holds what
// the use forbids.
RunDirectory open_run_directory(const std::string& dir, RunDirUse use);

// Whether <dir>/.replaced holds a run set aside.
bool has_replaced_run(const std::string& dir);
// Deletes what set_run_aside moved; true if there was something.
bool remove_replaced_run(const std::string& dir);

}  // namespace cputrain
