#include "models/hf_json.h"

#include <fstream>
#include <string>

#include "engine/core/error.h"

namespace cputrain {

using nlohmann::json;
namespace fs = std::filesystem;

json read_json(const fs::path& path) {
  std::ifstream in(path);
  if (!in) throw UserError(path.string() + ": cannot be read");
  try {
    return json::parse(in);
  } catch (const json::exception& e) {
    throw UserError(path.string() + ": malformed JSON (" + std::string(e.what()) + ")");
  }
}

std::string json_kind(const json& v) {
  if (v.is_string()) return "a string";
  if (v.is_boolean()) return "true or false";
  if (v.is_number_float()) return "a fraction";
  if (v.is_array()) return "an array";
  if (v.is_object()) return "an object";
  return "null";
}

std::string json_shown(const json& v) {
  std::string s = v.dump();
  if (s.size() > 40) s = s.substr(0, 37) + "...";
  return s;
}

}  // namespace cputrain
