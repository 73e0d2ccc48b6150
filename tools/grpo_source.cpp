#include "tools/grpo_source.h"

#include <algorithm>
#include <cmath>
#include <fstream>
#include <iterator>
#include <numeric>

#include "engine/core/autograd.h"
#include "engine/core/error.h"
#include "engine/core/hash.h"
#include "engine/core/memory.h"
#include "engine/data/example_text.h"
#include "engine/dist/communicator.h"
#include "engine/io/atomic_file.h"
#include "engine/text/tokenizer.h"
#include "engine/train/trainer.h"
#include "models/decoder.h"
#include "models/finetune_step.h"
#include "models/generate.h"
#include "models/grpo_step.h"
#include "tools/run/progress.h"

namespace cputrain {

using json = nlohmann::json;

GrpoPrompts read_grpo_prompts(const std::string& path, const Tokenizer& tokenizer,
                              const std::optional<ChatTemplate>& chat, int64_t max_tokens,
                              int64_t max_line_bytes) {
  GrpoPrompts out;
  for_each_json_object(
      path, "prompts", max_line_bytes,
      [&](const json& object, const std::string& where, int64_t number) {
        GrpoPrompt p;
        p.line = number;
        const char* key = object.contains("prompt")     ? "prompt"
                          : object.contains("messages") ? "messages"
                                                        : nullptr;
        if (!key) throw UserError(where + ": no \"prompt\" (text or messages) or \"messages\"");
        p.prompt = object.at(key);
        std::vector<Segment> segments;
        if (p.prompt.is_string()) {
          const std::string text = p.prompt.get<std::string>();
          if (blank(text)) throw UserError(where + ": \"" + key + "\" is empty");
          segments.push_back({text, false, false});
          ++out.text;
        } else {
          const std::vector<ChatMessage> messages = read_messages(p.prompt, key, where);
          if (messages.back().role == "assistant")
            throw UserError(where + ": \"" + key +
                            "\" ends with the assistant's message: a prompt ends with the user's");
          if (!chat)
            throw UserError(where +
                            ": a chat prompt, and the model has no chat template cputrain "
                            "recognises (give --chat-template: " +
                            chat_family_names() + ")");
          for (const ChatPiece& piece : render_chat(*chat, messages, true))
            segments.push_back({piece.text, piece.markers, false});
          ++out.chat;
        }
        p.tokens = tokenize_segments(segments, tokenizer, false, 0).tokens;
        if (static_cast<int64_t>(p.tokens.size()) > max_tokens) {
          ++out.dropped;
          return;
        }
        p.fields = object;
        p.fields.erase(key);
        out.prompts.push_back(std::move(p));
      });
  if (out.prompts.empty())
    throw UserError(path + ": no prompt" +
                    (out.dropped > 0 ? " of at most " + std::to_string(max_tokens) +
                                           " tokens (--ctx less --max-completion-length; " +
                                           std::to_string(out.dropped) + " longer)"
                                     : std::string(" (the file is empty)")));
  return out;
}

// One generation: completions of prompts, G each (a group), in order.
struct GrpoSource::Generation {
  std::vector<size_t> prompts;  // per group, into the set
  std::vector<FinetuneExample> examples;
  std::vector<std::string> texts;
  std::vector<int64_t> lengths;
  std::vector<uint8_t> truncated;  // ended at max_completion, not at a stop token
  std::vector<double> rewards;
  std::vector<std::vector<double>> scores;  // per reward function, per completion
  std::vector<double> advantages;
  std::vector<PackedRow> rows;
  std::vector<std::vector<float>> old, reference;
  std::vector<double> figures;  // the job's (step_figures_)
};

GrpoSource::GrpoSource(DecoderModel& model, const Tokenizer& tokenizer, const GrpoPrompts& train,
                       const GrpoPrompts& val, std::vector<WeightedReward>& rewards,
                       const GrpoOptions& options, std::vector<int32_t> stop_tokens,
                       DecoderModel* reference, const Communicator& comm,
                       std::shared_ptr<spdlog::logger> log)
    : model_(model),
      tokenizer_(tokenizer),
      train_(train),
      val_(val),
      rewards_(rewards),
      o_(options),
      stop_(std::move(stop_tokens)),
      reference_(reference),
      comm_(comm),
      log_(std::move(log)),
      order_(train.prompts.size(), options.seed + 29) {
  inputs_ = Tensor::empty(Shape{o_.batch, o_.ctx}, DType::I32, MemoryCategory::Workspace);
  targets_ = Tensor::empty(Shape{o_.batch, o_.ctx}, DType::I32, MemoryCategory::Workspace);
}

GrpoSource::~GrpoSource() = default;

int64_t GrpoSource::prompts_per_rank() const {
  return o_.batch * o_.accum / o_.generations;
}

void GrpoSource::generate(const GrpoPrompts& set, const std::vector<size_t>& prompts,
                          const std::vector<uint64_t>& keys, uint64_t seed_base, Generation& g) {
  const auto G = static_cast<size_t>(o_.generations);
  g.prompts = prompts;
  SampleOptions so;
  so.max_new_tokens = o_.max_completion;
  so.temperature = o_.temperature;
  so.top_k = o_.top_k;
  so.top_p = o_.top_p;
  so.stop_token = stop_.empty() ? -1 : stop_[0];
  const auto stops = [this](size_t, int32_t token) {
    return std::find(stop_.begin(), stop_.end(), token) == stop_.end();
  };
  for (size_t j = 0; j < prompts.size(); ++j) {
    const GrpoPrompt& p = set.prompts[prompts[j]];
    so.seed = splitmix64(seed_base ^ splitmix64(keys[j] + 1));
    const std::vector<std::vector<int32_t>> out =
        generate_batch(model_, std::vector<std::vector<int32_t>>(G, p.tokens), so, stops);
    for (const std::vector<int32_t>& seq : out) {
      FinetuneExample e;
      e.tokens = seq;
      e.target.assign(seq.size(), 0);
      std::fill(e.target.begin() + static_cast<std::ptrdiff_t>(p.tokens.size()), e.target.end(),
                uint8_t{1});
      e.line = p.line;
      std::vector<int32_t> completion(seq.begin() + static_cast<std::ptrdiff_t>(p.tokens.size()),
                                      seq.end());
      const bool stopped = !completion.empty() &&
                           std::find(stop_.begin(), stop_.end(), completion.back()) != stop_.end();
      g.lengths.push_back(static_cast<int64_t>(completion.size()));
      g.truncated.push_back(stopped ? 0 : 1);
      if (stopped) completion.pop_back();
      g.texts.push_back(tokenizer_.decode(completion));
      g.examples.push_back(std::move(e));
    }
  }
  // The rewards, every rank's at once: a failure on any stops them all.
  const size_t n = g.examples.size();
  std::vector<RewardInput> inputs(n);
  for (size_t i = 0; i < n; ++i) {
    const GrpoPrompt& p = set.prompts[prompts[i / G]];
    inputs[i] = {&p.prompt, &g.texts[i], g.lengths[i], &p.fields};
  }
  g.rewards.assign(n, 0.0);
  g.scores.assign(rewards_.size(), std::vector<double>(n, 0.0));
  std::string failure;
  try {
    for (size_t f = 0; f < rewards_.size(); ++f) {
      rewards_[f].function->score(inputs, g.scores[f]);
      for (size_t i = 0; i < n; ++i) g.rewards[i] += rewards_[f].weight * g.scores[f][i];
    }
  } catch (const RewardFailure& e) {
    failure = e.what();
    if (failure.empty()) failure = "a reward failed";
  }
  double failed = failure.empty() ? 0.0 : 1.0;
  if (comm_.size() > 1) comm_.all_reduce_sum(&failed, 1);
  if (failed > 0.0) throw StepFailure(failure);
  g.advantages = group_advantages(g.rewards, o_.generations, o_.scale_rewards);
}

void GrpoSource::make_generation(int64_t cycle) {
  const int64_t per_rank = prompts_per_rank();
  const int64_t per_step = per_rank * comm_.size();
  std::vector<size_t> prompts;
  std::vector<uint64_t> keys;
  for (int64_t j = 0; j < per_rank; ++j) {
    const int64_t at = cycle * per_step + comm_.rank() * per_rank + j;  // in the job's sequence
    prompts.push_back(order_.at(at));
    keys.push_back(static_cast<uint64_t>(at));
  }
  auto g = std::make_unique<Generation>();
  // Each draw of a prompt (a place in the sequence of epochs) draws completions of its own.
  generate(train_, prompts, keys, splitmix64(o_.seed ^ 0x67656eull), *g);
  g->rows = pack_examples(g->examples, o_.ctx);
  const int32_t pad = tokenizer_.eos_id();
  if (o_.loss.beta > 0.0 && reference_) {
    g->reference = target_log_probs_of(*reference_, g->rows, g->examples, o_.ctx, o_.batch, pad);
  } else if (o_.loss.beta > 0.0) {
    model_.set_adapters_enabled(false);
    g->reference = target_log_probs_of(model_, g->rows, g->examples, o_.ctx, o_.batch, pad);
    model_.set_adapters_enabled(true);
  }
  if (o_.iterations > 1)
    g->old = target_log_probs_of(model_, g->rows, g->examples, o_.ctx, o_.batch, pad);
  // The job's figures of the generation.
  const auto G = o_.generations;
  const size_t F = rewards_.size();
  std::vector<double> sums(6 + F, 0.0);
  const auto n = static_cast<double>(g->examples.size());
  sums[0] = n;
  sums[1] = std::accumulate(g->rewards.begin(), g->rewards.end(), 0.0);
  sums[2] = mean_group_std(g->rewards, G) * static_cast<double>(prompts.size());
  sums[3] = zero_std_fraction(g->rewards, G) * static_cast<double>(prompts.size());
  for (size_t i = 0; i < g->examples.size(); ++i) {
    sums[4] += static_cast<double>(g->lengths[i]);
    sums[5] += g->truncated[i];
  }
  for (size_t f = 0; f < F; ++f)
    sums[6 + f] = std::accumulate(g->scores[f].begin(), g->scores[f].end(), 0.0);
  if (comm_.size() > 1) comm_.all_reduce_sum(sums.data(), static_cast<int64_t>(sums.size()));
  const double groups = sums[0] / static_cast<double>(G);
  step_figures_ = {sums[1] / sums[0], sums[2] / groups,  sums[3] / groups,
                   sums[4] / sums[0], sums[5] / sums[0], sums[4]};
  for (size_t f = 0; f < F; ++f) step_figures_.push_back(sums[6 + f] / sums[0]);
  g->figures = step_figures_;
  gen_ = std::move(g);
  cycle_ = cycle;
  if (o_.iterations > 1 && !o_.dir.empty()) keep_generation();
}

std::string GrpoSource::kept_path() const {
  return o_.dir + "/generation-" + std::to_string(comm_.rank()) + ".cbor";
}

void GrpoSource::keep_generation() const {
  const Generation& g = *gen_;
  json j = {{"identity", o_.identity},    {"cycle", cycle_},
            {"prompts", g.prompts},       {"texts", g.texts},
            {"lengths", g.lengths},       {"truncated", g.truncated},
            {"rewards", g.rewards},       {"scores", g.scores},
            {"advantages", g.advantages}, {"old", g.old},
            {"reference", g.reference},   {"figures", g.figures}};
  json examples = json::array();
  for (const FinetuneExample& e : g.examples)
    examples.push_back({{"tokens", e.tokens}, {"target", e.target}, {"line", e.line}});
  j["examples"] = std::move(examples);
  const std::vector<uint8_t> bytes = json::to_cbor(j);
  write_file_atomic(kept_path(), bytes.data(), bytes.size());
}

std::unique_ptr<GrpoSource::Generation> GrpoSource::kept_generation(int64_t cycle,
                                                                    std::string* why) const {
  std::ifstream in(kept_path(), std::ios::binary);
  if (!in) {
    *why = kept_path() + " is missing";
    return nullptr;
  }
  const std::vector<uint8_t> bytes((std::istreambuf_iterator<char>(in)),
                                   std::istreambuf_iterator<char>());
  try {
    const json j = json::from_cbor(bytes);
    if (j.at("identity").get<uint64_t>() != o_.identity || j.at("cycle").get<int64_t>() != cycle) {
      *why = kept_path() + " is another generation's";
      return nullptr;
    }
    auto g = std::make_unique<Generation>();
    j.at("prompts").get_to(g->prompts);
    j.at("texts").get_to(g->texts);
    j.at("lengths").get_to(g->lengths);
    j.at("truncated").get_to(g->truncated);
    j.at("rewards").get_to(g->rewards);
    j.at("scores").get_to(g->scores);
    j.at("advantages").get_to(g->advantages);
    j.at("old").get_to(g->old);
    j.at("reference").get_to(g->reference);
    j.at("figures").get_to(g->figures);
    for (const json& e : j.at("examples")) {
      FinetuneExample x;
      e.at("tokens").get_to(x.tokens);
      e.at("target").get_to(x.target);
      e.at("line").get_to(x.line);
      g->examples.push_back(std::move(x));
    }
    const size_t n = g->examples.size();
    if (n != static_cast<size_t>(o_.batch * o_.accum) || g->lengths.size() != n ||
        g->rewards.size() != n || g->advantages.size() != n || g->texts.size() != n) {
      *why = kept_path() + " is damaged";
      return nullptr;
    }
    g->rows = pack_examples(g->examples, o_.ctx);
    return g;
  } catch (const json::exception&) {
    *why = kept_path() + " is damaged";
    return nullptr;
  }
}

StepResult GrpoSource::step(Trainer& trainer, int64_t step) {
  const int64_t cycle = (step - 1) / o_.iterations;
  const Stopwatch generation;
  generation_ms_ = 0.0;
  // A run resumed within a generation's iterations takes the generation kept in the run
  // directory (where it is whole, and the one of this cycle).
  if (cycle != cycle_ && cycle_ < 0 && (step - 1) % o_.iterations != 0) {
    std::string why;
    std::unique_ptr<Generation> kept = kept_generation(cycle, &why);
    // Every rank's, or none: the ranks generate together.
    double found = kept ? 1.0 : 0.0;
    if (comm_.size() > 1) comm_.all_reduce_sum(&found, 1);
    if (found < static_cast<double>(comm_.size()) && kept) {
      kept.reset();
      why = "another rank's kept generation is not whole";
    }
    if (kept) {
      step_figures_ = kept->figures;
      gen_ = std::move(kept);
      cycle_ = cycle;
    } else if (log_) {
      log_->warn(
          "step {} is within a generation's {} iterations, and {}: its completions are generated "
          "anew from the weights as they are (the uninterrupted run generated them {} steps "
          "before)",
          step, o_.iterations, why, (step - 1) % o_.iterations);
    }
  }
  if (cycle != cycle_) {
    make_generation(cycle);
    generation_ms_ = generation.seconds() * 1e3;
  }
  const Generation& g = *gen_;
  // Each completion's weight: the loss type's normalisation over the job's step.
  const double completions = static_cast<double>(o_.batch * o_.accum * comm_.size());
  double tokens = 0.0;
  for (const int64_t l : g.lengths) tokens += static_cast<double>(l);
  if (comm_.size() > 1) comm_.all_reduce_sum(&tokens, 1);
  std::vector<double> weights(g.examples.size());
  for (size_t i = 0; i < weights.size(); ++i) {
    switch (o_.loss.type) {
      case GrpoLossType::Dapo:
        weights[i] = 1.0 / std::max(tokens, 1.0);
        break;
      case GrpoLossType::Grpo:
        weights[i] = 1.0 / (completions * static_cast<double>(std::max<int64_t>(g.lengths[i], 1)));
        break;
      case GrpoLossType::DrGrpo:
        weights[i] = 1.0 / (completions * static_cast<double>(o_.max_completion));
        break;
    }
  }
  // The rows, spread over the micro-batches in turn; the job's step holds each rank's at its
  // micro-batches' places (finetune_step's order).
  const int64_t ranks = comm_.size(), rank = comm_.rank();
  static const PackedRow empty;
  std::vector<const PackedRow*> job(static_cast<size_t>(o_.batch * o_.accum * ranks), &empty);
  for (size_t q = 0; q < g.rows.size(); ++q) {
    const auto micro = static_cast<int64_t>(q) % o_.accum;
    const auto at = static_cast<int64_t>(q) / o_.accum;
    job[static_cast<size_t>((micro * ranks + rank) * o_.batch + at)] = &g.rows[q];
  }
  GrpoStats stats;
  GrpoBatches b;
  b.examples = &g.examples;
  b.advantages = g.advantages;
  b.weights = weights;
  b.old = &g.old;
  b.reference = &g.reference;
  b.loss = o_.loss;
  b.stats = &stats;
  const int32_t pad = tokenizer_.eos_id();
  const Stopwatch update;
  StepResult r = packed_rows_step(
      trainer, model_, step, job, o_.batch, o_.ctx, [&](std::span<const PackedRow* const> mine) {
        // Only the rows that hold completions run (at least one).
        int64_t used = 0;
        while (used < std::ssize(mine) && !mine[static_cast<size_t>(used)]->examples.empty())
          ++used;
        used = std::max<int64_t>(used, 1);
        return grpo_batch_loss(model_, mine.first(static_cast<size_t>(used)), b, pad,
                               inputs_.view(0, Shape{used, o_.ctx}),
                               targets_.view(0, Shape{used, o_.ctx}));
      });
  update_ms_ = update.seconds() * 1e3;
  if (ranks > 1) {
    std::array<double, GrpoStats::kFields> v = stats.values();
    comm_.all_reduce_sum(v.data(), static_cast<int64_t>(v.size()));
    stats.set(v);
  }
  stats_ = stats;
  return r;
}

double GrpoSource::validate(Trainer&) {
  const size_t ranks = static_cast<size_t>(comm_.size()), rank = static_cast<size_t>(comm_.rank());
  std::vector<size_t> mine;
  for (size_t i = rank; i < val_.prompts.size(); i += ranks) mine.push_back(i);
  Generation g;
  // The same seeds at every validation: its completions change only as the model does.
  generate(val_, mine, std::vector<uint64_t>(mine.begin(), mine.end()),
           splitmix64(o_.seed ^ 0x76616cull), g);
  const size_t F = rewards_.size();
  std::vector<double> sums(3 + F, 0.0);
  sums[0] = static_cast<double>(g.examples.size());
  sums[1] = std::accumulate(g.rewards.begin(), g.rewards.end(), 0.0);
  for (const int64_t l : g.lengths) sums[2] += static_cast<double>(l);
  for (size_t f = 0; f < F; ++f)
    sums[3 + f] = std::accumulate(g.scores[f].begin(), g.scores[f].end(), 0.0);
  if (ranks > 1) comm_.all_reduce_sum(sums.data(), static_cast<int64_t>(sums.size()));
  val_figures_ = {sums[0], sums[2] / std::max(sums[0], 1.0)};
  for (size_t f = 0; f < F; ++f) val_figures_.push_back(sums[3 + f] / std::max(sums[0], 1.0));
  // A few of rank 0's completions, in train.log.
  if (log_) {
    const auto G = static_cast<size_t>(o_.generations);
    for (size_t j = 0; j < std::min<size_t>(2, mine.size()); ++j) {
      const GrpoPrompt& p = val_.prompts[mine[j]];
      // A chat prompt by its last message.
      const json& last = p.prompt.is_array() && !p.prompt.empty() ? p.prompt.back() : p.prompt;
      const std::string prompt =
          last.is_string() ? last.get<std::string>()
          : last.is_object() && last.contains("content") && last["content"].is_string()
              ? last["content"].get<std::string>()
              : last.dump();
      log_->info("sample (held-out line {}, reward {:.3f}): {} => {}", p.line, g.rewards[j * G],
                 json(prompt).dump(-1, ' ', false, json::error_handler_t::replace),
                 json(g.texts[j * G]).dump(-1, ' ', false, json::error_handler_t::replace));
    }
  }
  return sums[1] / std::max(sums[0], 1.0);
}

void GrpoSource::describe(int64_t, json& line) const {
  if (step_figures_.empty()) return;
  line["reward"] = step_figures_[0];
  line["reward_std"] = step_figures_[1];
  line["frac_reward_zero_std"] = step_figures_[2];
  line["completions/mean_length"] = step_figures_[3];
  line["completions/clipped_ratio"] = step_figures_[4];
  line["completion_tokens"] = step_figures_[5];
  for (size_t f = 0; f < rewards_.size(); ++f)
    line["rewards/" + rewards_[f].name + "/mean"] = step_figures_[6 + f];
  const double t = std::max(stats_.tokens, 1.0);
  if (o_.loss.beta > 0.0) line["kl"] = stats_.kl / t;
  line["clip_ratio/low_mean"] = stats_.clipped_low / t;
  line["clip_ratio/high_mean"] = stats_.clipped_high / t;
  line["clip_ratio/region_mean"] = (stats_.clipped_low + stats_.clipped_high) / t;
  line["generation_ms"] = generation_ms_;
  line["update_ms"] = update_ms_;
}

std::string GrpoSource::note() const {
  if (step_figures_.empty()) return "";
  const double t = std::max(stats_.tokens, 1.0);
  std::string s = fmt::format(" | reward {:.3f} (std {:.3f}) | completions {:.1f} tokens",
                              step_figures_[0], step_figures_[1], step_figures_[3]);
  if (o_.loss.beta > 0.0) s += fmt::format(" | kl {:.4f}", stats_.kl / t);
  if (o_.iterations > 1)
    s += fmt::format(" | clipped {:.3f}", (stats_.clipped_low + stats_.clipped_high) / t);
  s += fmt::format(" | generation {:.0f} ms, update {:.0f} ms", generation_ms_, update_ms_);
  return s;
}

void GrpoSource::describe_validation(json& line) const {
  if (val_figures_.empty()) return;
  line["val_completions"] = val_figures_[0];
  line["val_completions/mean_length"] = val_figures_[1];
  for (size_t f = 0; f < rewards_.size(); ++f)
    line["val_rewards/" + rewards_[f].name + "/mean"] = val_figures_[2 + f];
}

std::string GrpoSource::validation_note() const {
  if (val_figures_.empty()) return "";
  std::string per;
  if (rewards_.size() > 1)
    for (size_t f = 0; f < rewards_.size(); ++f)
      per += fmt::format(", {} {:.3f}", rewards_[f].name, val_figures_[2 + f]);
  return fmt::format(" ({:.0f} completions of held-out prompts, {:.1f} tokens{})", val_figures_[0],
                     val_figures_[1], per);
}

}  // namespace cputrain
