#include "models/lora.h"

#include "engine/error.h"

namespace cputrain {

namespace {
constexpr std::string_view kNames[kProjectionCount] = {"q", "k", "v", "o", "gate", "up", "down"};
std::array<bool, kProjectionCount> all_projections() {
  std::array<bool, kProjectionCount> all{};
  all.fill(true);
  return all;
}

}  // namespace

std::string_view projection_name(Projection p) {
  return kNames[static_cast<int>(p)];
}

std::array<bool, kProjectionCount> parse_lora_targets(const std::string& list,
                                                      const std::string& flag) {
  std::array<bool, kProjectionCount> targets{};
  size_t pos = 0;
  while (pos <= list.size()) {
    size_t end = list.find(',', pos);
    if (end == std::string::npos) end = list.size();
    const std::string_view name = std::string_view(list).substr(pos, end - pos);
    pos = end + 1;
    if (name == "all") {
      targets = all_projections();
      continue;
    }
    bool known = false;
    for (int i = 0; i < kProjectionCount; ++i) {
      if (name == kNames[i]) {
        targets[static_cast<size_t>(i)] = true;
        known = true;
      }
    }
    if (!known) {
      std::string what = "an empty name";
      if (!name.empty()) {
        what = "no projection called ";
        what += name;
      }
      throw UserError(flag + " " + list + ": " + what + " (the projections are " +
                      lora_targets_text(all_projections()) + ", or all)");
    }
  }
  return targets;
}

std::string lora_targets_text(const std::array<bool, kProjectionCount>& targets) {
  std::string text;
  for (int i = 0; i < kProjectionCount; ++i) {
    if (!targets[static_cast<size_t>(i)]) continue;
    if (!text.empty()) text += ',';
    text += kNames[i];
  }
  return text;
}

bool is_lora_parameter(std::string_view name) {
  return name.ends_with(".lora_a") || name.ends_with(".lora_b");
}

}  // namespace cputrain
