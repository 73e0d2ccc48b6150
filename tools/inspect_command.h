// `cputrain inspect` (what a model is: architecture, shapes, tensor types, tokenizer, chat
// template, and the memory training it would take) and `cputrain tokenize` (the token ids of a
// text, as llama-tokenize prints them).
#pragma once

#include <CLI/CLI.hpp>
#include <string>

namespace cputrain {

struct InspectArgs {
  std::string path;  // a GGUF file or a run directory
  bool json = false;
};
void add_inspect_flags(CLI::App& app, InspectArgs& args);
int run_inspect(const InspectArgs& args);

struct TokenizeArgs {
  std::string model;  // a GGUF file (a vocabulary-only one will do) or a run directory
  std::string text;   // a text file; empty: standard input
  bool no_bos = false;
  bool special = false;  // special tokens in the text are those tokens
  bool json = false;
};
void add_tokenize_flags(CLI::App& app, TokenizeArgs& args);
int run_tokenize(const TokenizeArgs& args);

}  // namespace cputrain
