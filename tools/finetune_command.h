// `cputrain finetune`: LoRA (or full) fine-tuning of a model file on JSON Lines examples, packed
// into rows, the loss on the replies; the adapter written as llama.cpp's LoRA GGUF.
#pragma once

#include <CLI/CLI.hpp>
#include <cstdint>
#include <string>

#include "tools/train_command.h"

namespace cputrain {

struct FinetuneArgs {
  std::string model;  // a GGUF file or a Hugging Face folder
  std::string data;   // JSON Lines
  std::string val;    // JSON Lines held out (--val), else --val-fraction of --data
  double val_fraction = 0.0;
  std::string out;
  int64_t lora_rank = 16;
  double lora_alpha = 0.0;  // 0: twice the rank
  std::string lora_targets = "q,k,v,o,gate,up,down";
  double lora_dropout = 0.0;
  bool full = false;  // every parameter trains, no adapters
  double epochs = 1.0;
  int64_t steps = 0;  // 0: from --epochs
  int64_t batch = 4;
  int64_t accum = 4;
  int64_t ctx = 512;
  double lr = 2e-4;
  double warmup = 0.03;  // of the steps
  double weight_decay = 0.0;
  std::string dtype = "auto";       // bf16 where the CPU has bf16 products, else fp32
  std::string checkpoint = "none";  // or "layer"
  int64_t eval_every = 0;           // 0: before and after training only
  int64_t save_every = 0;           // a checkpoint every N steps (0: at the end only)
  bool resume = false;              // continue the fine-tune in --out from its newest checkpoint
  std::string chat_template;        // a family name; empty: the model's, recognised
  bool train_on_prompt = false;
  uint64_t seed = 1;
  bool profile = false;  // time each op over the steps after the first; print the table
  int threads = 0;
  std::string offload;         // --offload DIR: the trained masters (bf16), AdamW's m and v
  double mem_limit_gib = 0.0;  // GiB the fine-tune may hold besides a base read in place
  double rank_timeout = 600;   // a job's rank waits this long for the others, then ends the job
  KernelArgs kernels;
};

void add_finetune_flags(CLI::App& app, FinetuneArgs& args);
int run_finetune(const FinetuneArgs& args);

}  // namespace cputrain
