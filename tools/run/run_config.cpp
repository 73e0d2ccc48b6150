#include "tools/run/run_config.h"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "engine/core/error.h"
#include "models/config_json.h"

namespace cputrain {

using nlohmann::json;

std::string run_config_to_json(const RunConfig& c) {
  const json j = {
      {"preset", c.preset},
      {"corpus", c.corpus},
      {"init", c.init},
      {"model", model_config_json(c.model)},
      {"train",
       {{"steps", c.steps},
        {"batch", c.train.batch},
        {"accum", c.train.accum},
        {"ctx", c.train.ctx},
        {"seed", c.train.seed},
        {"lr", c.train.lr.peak},
        {"warmup_steps", c.train.lr.warmup_steps},
        {"lr_schedule_steps", c.train.lr.total_steps},
        {"min_lr_ratio", c.train.lr.min_ratio},
        {"beta1", shortest_decimal(c.train.adamw.beta1)},
        {"beta2", shortest_decimal(c.train.adamw.beta2)},
        {"eps", shortest_decimal(c.train.adamw.eps)},
        {"weight_decay", shortest_decimal(c.train.adamw.weight_decay)},
        {"grad_clip", shortest_decimal(c.train.adamw.grad_clip)},
        {"moe_balance", shortest_decimal(c.train.moe_balance)},
        {"moe_z_loss", shortest_decimal(c.train.moe_z)},
        {"save_every", c.save_every},
        {"keep", c.keep},
        {"offload", c.offload},
        {"threads", c.threads},
        {"ranks", c.ranks},
        {"dtype", c.dtype == DType::BF16 ? "bf16" : "fp32"},
        {"checkpoint", checkpointing_name(c.checkpoint)}}},
  };
  return j.dump(2) + "\n";
}

RunConfig read_run_config(const std::string& path) {
  std::ifstream in(path);
  if (!in) throw UserError(path + ": cannot open run configuration");
  std::stringstream text;
  text << in.rdbuf();
  return parse_run_config(text.str(), path);
}

RunConfig parse_run_config(const std::string& text, const std::string& path) {
  RunConfig c;
  try {
    const json j = json::parse(text);
    c.preset = j.at("preset").get<std::string>();
    c.corpus = j.at("corpus").get<std::string>();
    c.init = j.value("init", std::string());
    c.model = model_config_from_json(j.at("model"), path);
    const json& t = j.at("train");
    c.steps = t.at("steps").get<int64_t>();
    c.train.batch = t.at("batch").get<int64_t>();
    c.train.accum = t.at("accum").get<int64_t>();
    c.train.ctx = t.at("ctx").get<int64_t>();
    c.train.seed = t.at("seed").get<uint64_t>();
    c.train.lr.peak = t.at("lr").get<double>();
    c.train.lr.warmup_steps = t.at("warmup_steps").get<int64_t>();
    c.train.lr.min_ratio = t.at("min_lr_ratio").get<double>();
    // Runs made before a run could be extended decay over their steps.
    c.train.lr.total_steps = t.value("lr_schedule_steps", c.steps);
    c.save_every = t.value("save_every", std::max<int64_t>(1, c.steps / 10));
    c.keep = t.value("keep", int64_t{3});
    c.offload = t.value("offload", std::string());
    c.train.adamw.beta1 = t.at("beta1").get<float>();
    c.train.adamw.beta2 = t.at("beta2").get<float>();
    c.train.adamw.eps = t.at("eps").get<float>();
    c.train.adamw.weight_decay = t.at("weight_decay").get<float>();
    c.train.adamw.grad_clip = t.at("grad_clip").get<float>();
    c.train.moe_balance = t.value("moe_balance", 0.0f);
    c.train.moe_z = t.value("moe_z_loss", 0.0f);
    c.threads = t.at("threads").get<int>();
    c.ranks = t.value("ranks", 1);
    const std::string dtype = t.value("dtype", std::string("fp32"));
    if (dtype != "fp32" && dtype != "bf16")
      throw UserError(path + ": train.dtype must be fp32 or bf16 (got " + dtype + ")");
    c.dtype = dtype == "bf16" ? DType::BF16 : DType::F32;
    const std::string checkpoint = t.value("checkpoint", std::string("none"));
    const std::optional<Checkpointing> level = parse_checkpointing(checkpoint);
    if (!level)
      throw UserError(path + ": train.checkpoint must be layer, mlp or none (got " + checkpoint +
                      ")");
    c.checkpoint = *level;
  } catch (const json::exception& e) {
    throw UserError(path + ": malformed run configuration (" + e.what() + ")");
  }
  if (const auto problem = validate(c.model))
    throw UserError(path + ": invalid model configuration: model." + problem->str());
  if (c.steps <= 0 || c.train.lr.total_steps <= 0 || c.save_every < 0 || c.keep <= 0)
    throw UserError(path + ": train.steps, lr_schedule_steps and keep must be positive");
  return c;
}

std::string run_identity(const std::string& config_json) {
  json j = json::parse(config_json);
  // A fine-tune's configuration is the same throughout but for where it ends (its steps; the
  // schedule it began with is kept as lr_schedule_steps): the rest is its identity.
  if (j.value("command", std::string()) == "finetune" || !j.contains("train")) {
    if (j.contains("steps") && !j.contains("lr_schedule_steps"))
      j["lr_schedule_steps"] = j["steps"];
    j.erase("steps");
    return j.dump();
  }
  json& t = j["train"];
  if (!t.contains("lr_schedule_steps")) t["lr_schedule_steps"] = t["steps"];
  if (!t.contains("ranks")) t["ranks"] = 1;
  for (const char* key : {"steps", "threads", "save_every", "keep", "offload"}) t.erase(key);
  // The model as this build writes it, so that a run written before a field existed is the same.
  const json model = model_config_json(model_config_from_json(j["model"], "config.json"));
  return json{model, t, j["corpus"], j.value("init", std::string())}.dump();
}

}  // namespace cputrain
