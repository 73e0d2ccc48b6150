// Preference tuning as a batch source of the run loop (`cputrain finetune --method dpo|orpo`):
// rows packed with whole pairs, a step's rows in an order shuffled anew each epoch, the loss of
// models/preference_step.h, its figures under TRL's names in metrics.jsonl and on the step line,
// and validation on held-out pairs; and the reference's log-probabilities that DPO compares
// with, computed once when a run begins and kept in the run directory.
#pragma once

#include <spdlog/spdlog.h>

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "engine/data/finetune_data.h"
#include "engine/train/preference_loss.h"
#include "tools/run/loop.h"

namespace cputrain {

class Communicator;
class DecoderModel;

// The reference's sum of target log-probabilities for each example of the training and the
// validation pairs.
struct ReferenceLogProbs {
  std::vector<double> train, val;
};

// reference.bin's bytes: "CTPREF2\0", the data's fingerprint, the counts of the training and the
// validation sums (u64 each), the sums (f64), then the FNV-1a of everything before it (u64),
// little-endian as the machine writes them.
std::string reference_bytes(uint64_t fingerprint, const ReferenceLogProbs& r);
// The sums of `bytes`, where they are whole (the checksum, the sizes, every sum finite) and of
// data of `fingerprint` with these counts; else nullopt and why not ("damaged", "of other data").
std::optional<ReferenceLogProbs> parse_reference(std::string_view bytes, uint64_t fingerprint,
                                                 size_t train, size_t val, std::string* why);

// What the reference pass reads: the pairs and their packed rows, and how to batch them.
struct ReferencePass {
  const std::vector<FinetuneExample>* train = nullptr;
  const std::vector<PackedRow>* train_rows = nullptr;
  const std::vector<FinetuneExample>* val = nullptr;
  const std::vector<PackedRow>* val_rows = nullptr;
  int64_t ctx = 0, batch = 0;
  int32_t pad = 0;
};

// DPO's reference: where `resuming`, read from <dir>/reference.bin (written for the same data:
// `fingerprint`), else computed by `model` with its adapters switched off (`adapters`; a full
// fine-tune's model is the base itself before its first step) and, by rank 0, written there.
// Every rank of `comm` calls it and gets the sums. A resumed LoRA run whose file is missing or
// damaged computes them again (the base is frozen), with a warning; a full fine-tune's cannot: a
// UserError.
ReferenceLogProbs reference_log_probs(DecoderModel& model, bool adapters, const ReferencePass& pass,
                                      const std::string& dir, bool resuming, uint64_t fingerprint,
                                      const Communicator& comm, spdlog::logger& log);

class PreferenceRows final : public BatchSource {
 public:
  PreferenceRows(DecoderModel& model, const std::vector<FinetuneExample>& train,
                 std::vector<PackedRow> rows, const std::vector<FinetuneExample>& val,
                 std::vector<PackedRow> val_rows, ReferenceLogProbs reference,
                 const PreferenceLossOptions& loss, int64_t ctx, int64_t batch, const RowPlan& plan,
                 uint64_t seed, int32_t pad, const Communicator& comm);
  StepResult step(Trainer& trainer, int64_t step) override;
  bool validates() const override { return !val_.empty(); }
  double validate(Trainer& trainer) override;
  void describe(int64_t step, nlohmann::json& line) const override;
  std::string note() const override;
  void describe_validation(nlohmann::json& line) const override;
  std::string validation_note() const override;

 private:
  DecoderModel& model_;
  const std::vector<FinetuneExample>& train_;
  StepRows rows_;
  const std::vector<FinetuneExample>& val_;
  std::vector<PackedRow> val_rows_;
  ReferenceLogProbs reference_;
  PreferenceLossOptions loss_;
  int64_t ctx_, batch_;
  int32_t pad_;
  const Communicator& comm_;
  PreferenceStats stats_, val_stats_;
};

}  // namespace cputrain
