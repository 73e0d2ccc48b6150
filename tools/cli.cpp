#include "tools/cli.h"

#include <omp.h>
#include <spdlog/sinks/basic_file_sink.h>
#include <spdlog/spdlog.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <cstdio>
#include <string>
#include <vector>

#include "engine/core/error.h"
#include "engine/dist/communicator.h"
#include "tools/budget_command.h"
#include "tools/eval_command.h"
#include "tools/export_command.h"
#include "tools/finetune_command.h"
#include "tools/inspect_command.h"
#include "tools/parity_command.h"
#include "tools/plot_command.h"
#include "tools/run/job.h"
#include "tools/sample_command.h"
#include "tools/train_command.h"
#include "tools/tune_command.h"

namespace cputrain {
namespace {

bool is_subcommand(const std::string& arg) {
  return arg == "train" || arg == "sample" || arg == "parity" || arg == "budget" || arg == "eval" ||
         arg == "plot" || arg == "export" || arg == "inspect" || arg == "tokenize" ||
         arg == "finetune" || arg == "tune";
}

}  // namespace

int run_cli(int argc, char** argv) {
  // `train` is the default subcommand: `cputrain --preset mini` means `cputrain train ...`.
  std::vector<std::string> args(argv + 1, argv + argc);
  const bool top_help = !args.empty() && (args[0] == "-h" || args[0] == "--help");
  if (!top_help && (args.empty() || !is_subcommand(args[0]))) args.insert(args.begin(), "train");
  std::reverse(args.begin(), args.end());  // CLI11 consumes a reversed vector

  CLI::App app{"cputrain: train decoder-only transformers on CPUs", "cputrain"};
  app.require_subcommand(1);
  TrainArgs train_args;
  CLI::App* train = app.add_subcommand("train", "Train a model (the default subcommand)");
  add_train_flags(*train, train_args);
  SampleArgs sample_args;
  CLI::App* sample = app.add_subcommand("sample", "Generate text from a trained run");
  add_sample_flags(*sample, sample_args);
  ParityArgs parity_args;
  CLI::App* parity = app.add_subcommand(
      "parity", "Train the same steps in fp32, bf16 and fp32 with accumulation; compare losses");
  add_parity_flags(*parity, parity_args);
  BudgetArgs budget_args;
  CLI::App* budget = app.add_subcommand(
      "budget", "Print the memory budget of a training run and whether it fits in this machine");
  add_budget_flags(*budget, budget_args);
  EvalArgs eval_args;
  CLI::App* eval = app.add_subcommand("eval", "Loss and perplexity of a trained run");
  add_eval_flags(*eval, eval_args);
  ExportArgs export_args;
  CLI::App* exporter =
      app.add_subcommand("export", "Write a run or a model file as a GGUF file llama.cpp runs");
  add_export_flags(*exporter, export_args);
  InspectArgs inspect_args;
  CLI::App* inspect = app.add_subcommand(
      "inspect",
      "What a model is: shapes, tensor types, tokenizer, chat template, training memory");
  add_inspect_flags(*inspect, inspect_args);
  TokenizeArgs tokenize_args;
  CLI::App* tokenize =
      app.add_subcommand("tokenize", "The token ids of a text under a model's tokenizer");
  add_tokenize_flags(*tokenize, tokenize_args);
  FinetuneArgs finetune_args;
  CLI::App* finetune = app.add_subcommand(
      "finetune", "Fine-tune a model file on JSON Lines examples: LoRA adapters, or --full");
  add_finetune_flags(*finetune, finetune_args);
  PlotArgs plot_args;
  CLI::App* plot = app.add_subcommand("plot", "Plot a run's losses and tokens/s as an SVG file");
  add_plot_flags(*plot, plot_args);

  TuneArgs tune_args;
  CLI::App* tune = app.add_subcommand(
      "tune", "Measure the GEMM blocking fastest on this CPU for a run's products; cache it");
  add_tune_flags(*tune, tune_args);

  try {
    app.parse(args);
  } catch (const CLI::CallForHelp& e) {
    return app.exit(e);
  } catch (const CLI::CallForAllHelp& e) {
    return app.exit(e);
  } catch (const CLI::ParseError& e) {
    // One line naming the flag, like every other input error.
    std::string message = e.what();
    std::replace(message.begin(), message.end(), '\n', ' ');
    // Every rank of a job parses the same flags: rank 0 says what is wrong.
    if (Communicator::launched_rank() == 0)
      std::fprintf(stderr, "cputrain: error: %s (see cputrain --help)\n", message.c_str());
    return 2;
  }
  // Under an MPI launcher, train and finetune run as the ranks of one job; the other commands,
  // which would each write the same files, run as one process.
  const int launched = Communicator::launched_ranks();
  const bool job_command = train->parsed() || finetune->parsed();
  std::string rank_prefix;
  try {
    if (launched > 1 && (!job_command || !Communicator::built_with_mpi())) {
      if (Communicator::launched_rank() != 0) return 1;  // rank 0 says why
      if (!job_command)
        throw UserError("started as " + std::to_string(launched) +
                        " ranks by an MPI launcher: only train and finetune run as several "
                        "ranks, the other commands as one process (-np 1)");
      if (!Communicator::built_with_mpi())
        throw UserError("started as " + std::to_string(launched) +
                        " ranks by an MPI launcher, but this cputrain was built without MPI "
                        "(install libopenmpi-dev and build again with -DCPUTRAIN_MPI=ON)");
    }
  } catch (const UserError& e) {
    std::fprintf(stderr, "cputrain: error: %s\n", e.what());
    return 1;
  }
  if (launched > 1 && Communicator::world().rank() > 0)
    rank_prefix = "rank " + std::to_string(Communicator::world().rank()) + ": ";
  try {
    if (train->parsed()) return run_train(train_args);
    if (sample->parsed()) return run_sample(sample_args);
    if (parity->parsed()) return run_parity(parity_args);
    if (budget->parsed()) return run_budget(budget_args);
    if (eval->parsed()) return run_eval(eval_args);
    if (plot->parsed()) return run_plot(plot_args);
    if (exporter->parsed()) return run_export(export_args);
    if (inspect->parsed()) return run_inspect(inspect_args);
    if (tokenize->parsed()) return run_tokenize(tokenize_args);
    if (finetune->parsed()) return run_finetune(finetune_args);
    if (tune->parsed()) return run_tune(tune_args);
  } catch (const QuietExit& e) {
    return e.code;
  } catch (const UserError& e) {
    std::fprintf(stderr, "cputrain: error: %s%s\n", rank_prefix.c_str(), e.what());
    // A run that had opened its log ends with the error there too.
    if (auto log = spdlog::get("cputrain")) {
      for (const spdlog::sink_ptr& sink : log->sinks()) {
        if (!std::dynamic_pointer_cast<spdlog::sinks::basic_file_sink_mt>(sink)) continue;
        sink->log(spdlog::details::log_msg("cputrain", spdlog::level::err,
                                           std::string("error: ") + e.what()));
        sink->flush();
      }
    }
    // The other ranks of a running job would wait for this one forever: the job ends.
    if (job_running()) {
      std::fflush(stderr);
      Communicator::world().abort(1);
    }
    return 1;
  }
  return 1;
}

}  // namespace cputrain
