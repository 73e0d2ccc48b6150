#include "tools/run/run_flags.h"

#include <algorithm>
#include <filesystem>
#include <optional>
#include <stdexcept>

#include "engine/core/error.h"
#include "engine/core/memory.h"
#include "engine/dist/communicator.h"
#include "kernels/cpu/dispatch.h"
#include "kernels/gemm/gemm.h"
#include "tools/flag_checks.h"
#include "tools/run/gemm_tuning_file.h"

namespace cputrain {

namespace fs = std::filesystem;

void add_kernel_flags(CLI::App& app, KernelArgs& a) {
  app.add_option("--gemm", a.gemm,
                 "GEMM implementation: amx, avx512, eigen, onednn or reference (default: the "
                 "fastest this CPU runs; as --kernel gemm=NAME or CPUTRAIN_GEMM=NAME)");
  app.add_option("--kernel", a.kernel,
                 "FAMILY=NAME: force one kernel family's implementation (families: " +
                     kernels::kernel_families() + "; also CPUTRAIN_<FAMILY>=NAME); repeatable");
  app.add_option("--isa", a.isa,
                 "Highest instruction set any kernel may use: avx2, avx512, avx512_bf16 or amx "
                 "(default: all this CPU has, but avx512 where its vdpbf16ps is slower than its "
                 "FMA; also CPUTRAIN_ISA)");
}

namespace {
std::string& gemm_blocking_slot() {
  static std::string blocking = "the defaults";
  return blocking;
}
}  // namespace

const std::string& gemm_blocking() {
  return gemm_blocking_slot();
}

void select_kernels(const KernelArgs& a, bool tuned) {
  try {
    if (!a.isa.empty()) kernels::set_isa_ceiling(kernels::isa_level(a.isa, "--isa " + a.isa));
    for (const std::string& k : a.kernel) {
      const size_t eq = k.find('=');
      if (eq == std::string::npos || eq == 0 || eq + 1 == k.size())
        throw UserError("--kernel " + k +
                        ": must be FAMILY=NAME (families: " + kernels::kernel_families() + ")");
      kernels::force_kernel(k.substr(0, eq), k.substr(eq + 1));
    }
    if (!a.gemm.empty()) kernels::force_kernel("gemm", a.gemm, "--gemm " + a.gemm);
    kernels::kernel_choices();
    if (tuned) gemm_blocking_slot() = load_gemm_tuning();
  } catch (const std::invalid_argument& e) {
    throw UserError(e.what());
  }
}

Preset preset_flag(const std::string& name) {
  const std::optional<Preset> preset = find_preset(name);
  if (preset) return *preset;
  std::string names;
  for (const std::string& n : preset_names()) names += (names.empty() ? "" : ", ") + n;
  throw UserError("--preset " + name + ": unknown preset (choose one of " + names + ")");
}

DType choose_dtype(const std::string& flag, std::string* why) {
  if (flag == "bf16" || flag == "fp32") {
    *why = "--dtype " + flag;
    return flag == "bf16" ? DType::BF16 : DType::F32;
  }
  if (!flag.empty() && flag != "auto")
    throw UserError("--dtype " + flag + ": must be auto, bf16 or fp32");
  const kernels::GemmBackend backend = kernels::gemm_backend();
  const std::string name(kernels::gemm_backend_name(backend));
  if (kernels::gemm_bf16_native(backend)) {
    *why = "the " + name + " GEMM has bf16 instructions on this CPU";
    return DType::BF16;
  }
  if (kernels::gemm_bf16_widens_in_packing()) {
    *why = "the " + name +
           " GEMM widens bf16 to FP32 as it packs: FP32's rate in half the memory; --dtype fp32 "
           "keeps every value in FP32";
    return DType::BF16;
  }
  *why = "the " + name +
         " GEMM has no bf16 instructions on this CPU, where bf16 would be emulated and slower "
         "than fp32 (--dtype bf16 forces it)";
  return DType::F32;
}

int64_t memory_limit_bytes(double gib) {
  if (gib > 0.0) return static_cast<int64_t>(gib * 1024.0 * 1024.0 * 1024.0);
  // Its anonymous memory alone: the pages of files it maps (a model file read in place) are page
  // cache, which MemAvailable already counts.
  return available_memory_bytes() / Communicator::launched_local_ranks() +
         process_memory().rss_anon_bytes;
}

bool RunFlags::was_given(std::string_view flag) const {
  return std::find(given.begin(), given.end(), flag) != given.end();
}

std::string RunFlags::run_dir() const {
  if (resuming() && !resume.empty() && !out.empty() &&
      fs::path(out).lexically_normal() != fs::path(resume).lexically_normal())
    throw UserError("--out " + out + " and --resume " + resume +
                    ": two run directories; give --resume RUN alone");
  return resume.empty() ? out : resume;
}

void add_threads_flag(CLI::App& app, int& threads) {
  app.add_option("--threads", threads, "OpenMP threads (default: all cores)")
      ->check(threads_limit());
}

void add_dtype_flag(CLI::App& app, std::string& dtype) {
  app.add_option(
         "--dtype", dtype,
         "Training precision: bf16 (bf16 GEMMs and saved activations, FP32 master weights), "
         "fp32, or auto: bf16 where the GEMM has bf16 instructions, else fp32")
      ->capture_default_str()
      ->check(CLI::IsMember({"auto", "bf16", "fp32"}));
}

void add_checkpoint_flag(CLI::App& app, std::string& checkpoint,
                         const std::vector<std::string>& choices) {
  checkpoint = choices.front();
  std::string text =
      "Gradient checkpointing: layer (keep only each block's input, recompute the block in "
      "backward), mlp (keep only the input of each block's MLP, recompute the MLP in backward; "
      "attention's activations are kept), none";
  if (std::find(choices.begin(), choices.end(), "auto") != choices.end())
    text += ", or auto (the first of mlp and layer that the budget needs to fit)";
  app.add_option("--checkpoint", checkpoint, text)
      ->capture_default_str()
      ->check(CLI::IsMember(choices));
}

void add_memory_flags(CLI::App& app, double& mem_limit_gib, std::string& offload) {
  app.add_option("--mem-limit", mem_limit_gib,
                 "GiB the run (each rank of a job) may use (default: the available memory at "
                 "start, shared among a job's ranks on this machine; a base read in place from "
                 "its file is apart: its pages are the page cache's); a run whose budget exceeds "
                 "it is refused before it starts")
      ->check(positive());
  app.add_option("--offload", offload,
                 "Keep the trained FP32 masters (bf16) and AdamW's m and v in files in this "
                 "folder, streamed through RAM in the optimizer step: bitwise the same run in less "
                 "RAM (with --resume: another folder, or none to hold them in RAM again)");
}

namespace {

// How a command's defaults read in the help of the flags it shares.
struct RunFlagHelp {
  const char* out;                      // what --out is, and its default
  const char* steps;                    // how the steps default
  const char* batch;                    // what --batch counts, and its default
  const char* accum;                    // --accum's default
  const char* ctx;                      // what --ctx counts, and its default
  const char* lr;                       // how --lr defaults
  const char* eval_every;               // when a run validates without --eval-every
  const char* save_every;               // when a run saves without --save-every
  std::vector<std::string> checkpoint;  // the --checkpoint choices, the default first
};

const RunFlagHelp& help_of(RunCommand command) {
  static const RunFlagHelp train{"Run directory (default runs/<preset>)",
                                 "default: per preset",
                                 "Sequences per micro-batch (default: per preset)",
                                 " (default: per preset)",
                                 "Tokens per sequence (default: per preset)",
                                 " (default: by model width)",
                                 "default: steps / 10",
                                 "default: steps / 10",
                                 {"auto", "layer", "mlp", "none"}};
  static const RunFlagHelp finetune{
      "The run directory (created; it must not hold a run unless --overwrite)",
      "default: from --epochs",
      "Packed rows per micro-batch",
      "",
      "Positions per row; longer examples are cut (at most the model's context)",
      " (cosine to zero after warm-up)",
      "0: before the first step and after the last only",
      "default: 0",
      {"none", "mlp", "layer"}};
  return command == RunCommand::Train ? train : finetune;
}

}  // namespace

void add_run_flags(CLI::App& app, RunFlags& f, RunCommand command) {
  const RunFlagHelp& help = help_of(command);
  app.add_option("--out", f.out, help.out);
  app.add_option("--resume", f.resume,
                 "Continue the run in this directory (or in --out) from its newest checkpoint "
                 "that reads back whole, with the configuration it began with, bit for bit as if "
                 "it had not stopped")
      ->expected(0, 1);
  app.add_flag("--overwrite", f.overwrite,
               "Replace the run already in --out: it is moved to <out>/.replaced and deleted once "
               "the new run has completed its first step");
  const auto with_default = [](CLI::Option* o, bool shown) {
    if (shown) o->capture_default_str();
    return o;
  };
  with_default(
      app.add_option("--steps", f.steps, std::string("Optimizer steps (") + help.steps + ")"),
      false)
      ->check(positive_whole());
  with_default(app.add_option("--batch", f.batch, help.batch), f.batch > 0)
      ->check(positive_whole());
  with_default(app.add_option("--accum", f.accum,
                              std::string("Micro-batches per optimizer step") + help.accum),
               f.accum > 0)
      ->check(positive_whole());
  with_default(app.add_option("--ctx", f.ctx, help.ctx), f.ctx > 0)->check(positive_whole());
  with_default(app.add_option("--lr", f.lr, std::string("Peak learning rate") + help.lr), f.lr > 0)
      ->check(positive());
  app.add_option("--weight-decay", f.weight_decay, "AdamW weight decay on matrices")
      ->capture_default_str()
      ->check(non_negative());
  app.add_option("--seed", f.seed, "Seed of the initialisation, the batches and the dropout")
      ->capture_default_str()
      ->check(non_negative());
  add_threads_flag(app, f.threads);
  app.add_flag("--profile", f.profile,
               "Time every op (forward and backward), the optimizer and the GEMMs over the steps "
               "after the first; print the table at the end and write <out>/profile.json");
  app.add_option("--eval-every", f.eval_every,
                 std::string("Validation loss every N steps (") + help.eval_every + ")")
      ->check(non_negative());
  app.add_option("--save-every", f.save_every,
                 std::string("Save a checkpoint every N steps (0: only at the end; ") +
                     help.save_every + "); also at the end and on SIGINT or SIGTERM")
      ->check(non_negative());
  app.add_option("--keep", f.keep, "Checkpoints kept in <out>/checkpoints")
      ->capture_default_str()
      ->check(positive_whole());
  app.add_option("--log-every", f.log_every, "Log a line every N steps")
      ->capture_default_str()
      ->check(positive_whole());
  app.add_option("--spike", f.spike,
                 "Treat a loss above this many times the mean of the last 20 steps as a bad step "
                 "(0: off)")
      ->capture_default_str()
      ->check(non_negative());
  app.add_option("--on-bad-step", f.on_bad_step,
                 "On a non-finite loss or gradient norm, or a spike: stop (naming the last good "
                 "checkpoint) or skip the update and go on")
      ->capture_default_str()
      ->check(CLI::IsMember({"stop", "skip"}));
  add_memory_flags(app, f.mem_limit_gib, f.offload);
  app.add_option("--rank-timeout", f.rank_timeout,
                 "Of a job of several ranks (mpirun): seconds a rank waits for the others in a "
                 "step before it ends the job, saying so (0: forever)")
      ->capture_default_str()
      ->check(non_negative());
  add_dtype_flag(app, f.dtype);
  add_checkpoint_flag(app, f.checkpoint, help.checkpoint);
  add_kernel_flags(app, f.kernels);
  app.parse_complete_callback([&app, &f] {
    f.given.clear();
    for (const CLI::Option* option : app.get_options())
      if (option->count() > 0) f.given.push_back(option->get_name());
  });
}

}  // namespace cputrain
