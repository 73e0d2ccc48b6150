// What the readers and the writer of Hugging Face folders (models/hf_config.h, hf_tokenizer.h,
// hf_writer.h) share: JSON files read with their errors named, values shown in messages, and the
// pre-tokenizers' regular expressions.
#pragma once

#include <filesystem>
#include <nlohmann/json.hpp>
#include <string>
#include <utility>

namespace cputrain {

// The pre-tokenizer regular expressions of Hugging Face's tokenizer.json files, by the name
// llama.cpp gives them.
inline constexpr std::pair<const char*, const char*> kHfPreTokenizers[] = {
    {"llama-bpe",
     "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}| "
     "?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+"},
    {"qwen2",
     "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}| "
     "?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+"},
};

// The JSON of `path`; a UserError naming it where it cannot be read or is malformed.
nlohmann::json read_json(const std::filesystem::path& path);

// What a JSON value is, for a message: "a string", "a fraction", ...
std::string json_kind(const nlohmann::json& v);
// A value of a JSON file as a message shows it: its JSON, shortened.
std::string json_shown(const nlohmann::json& v);

}  // namespace cputrain
