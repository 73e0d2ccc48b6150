#include "tools/preference_rows.h"

#include <cmath>
#include <cstring>
#include <fstream>
#include <iterator>
#include <optional>

#include "engine/core/error.h"
#include "engine/core/hash.h"
#include "engine/dist/communicator.h"
#include "engine/io/atomic_file.h"
#include "engine/train/trainer.h"
#include "models/decoder.h"
#include "models/preference_step.h"
#include "tools/run/job.h"

namespace cputrain {
namespace {

// <dir>/reference.bin: "CTPREF2\0", the data's fingerprint, the counts of the training and the
// validation sums (u64 each), the sums (f64), then the FNV-1a of everything before it (u64),
// little-endian as the machine writes them.
constexpr char kMagic[8] = {'C', 'T', 'P', 'R', 'E', 'F', '2', '\0'};

std::string reference_path(const std::string& dir) {
  return dir + "/reference.bin";
}

}  // namespace

std::string reference_bytes(uint64_t fingerprint, const ReferenceLogProbs& r) {
  std::string bytes(kMagic, sizeof kMagic);
  const auto put = [&bytes](const void* p, size_t n) {
    bytes.append(static_cast<const char*>(p), n);
  };
  const uint64_t counts[2] = {r.train.size(), r.val.size()};
  put(&fingerprint, sizeof fingerprint);
  put(counts, sizeof counts);
  put(r.train.data(), r.train.size() * sizeof(double));
  put(r.val.data(), r.val.size() * sizeof(double));
  const uint64_t sum = fnv1a(bytes);
  put(&sum, sizeof sum);
  return bytes;
}

std::optional<ReferenceLogProbs> parse_reference(std::string_view bytes, uint64_t fingerprint,
                                                 size_t train, size_t val, std::string* why) {
  const size_t header = sizeof kMagic + 3 * sizeof(uint64_t);
  uint64_t fields[3] = {}, sum = 0;
  if (bytes.size() >= header + sizeof sum) {
    std::memcpy(fields, bytes.data() + sizeof kMagic, sizeof fields);
    std::memcpy(&sum, bytes.data() + bytes.size() - sizeof sum, sizeof sum);
  }
  const uint64_t limit = bytes.size() / sizeof(double);
  if (bytes.size() < header + sizeof sum || std::memcmp(bytes.data(), kMagic, sizeof kMagic) != 0 ||
      fields[1] > limit || fields[2] > limit ||
      bytes.size() != header + (fields[1] + fields[2]) * sizeof(double) + sizeof sum ||
      fnv1a(bytes.data(), bytes.size() - sizeof sum) != sum) {
    *why = "damaged";
    return std::nullopt;
  }
  if (fields[0] != fingerprint || fields[1] != train || fields[2] != val) {
    *why = "of other data";
    return std::nullopt;
  }
  ReferenceLogProbs r;
  r.train.resize(train);
  r.val.resize(val);
  std::memcpy(r.train.data(), bytes.data() + header, train * sizeof(double));
  std::memcpy(r.val.data(), bytes.data() + header + train * sizeof(double), val * sizeof(double));
  for (const std::vector<double>* sums : {&r.train, &r.val})
    for (const double v : *sums)
      if (!std::isfinite(v)) {
        *why = "damaged";
        return std::nullopt;
      }
  return r;
}

namespace {

void write_reference(const std::string& dir, uint64_t fingerprint, const ReferenceLogProbs& r) {
  write_file_atomic(reference_path(dir), reference_bytes(fingerprint, r));
}

// The file's sums, where it is whole and of this data with these counts; else why not.
std::optional<ReferenceLogProbs> read_reference(const std::string& dir, uint64_t fingerprint,
                                                size_t train, size_t val, std::string* why) {
  std::ifstream in(reference_path(dir), std::ios::binary);
  if (!in) {
    *why = "missing";
    return std::nullopt;
  }
  const std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  return parse_reference(bytes, fingerprint, train, val, why);
}

}  // namespace

ReferenceLogProbs reference_log_probs(DecoderModel& model, bool adapters, const ReferencePass& pass,
                                      const std::string& dir, bool resuming, uint64_t fingerprint,
                                      const Communicator& comm, spdlog::logger& log) {
  const bool lead = comm.rank() == 0;
  if (resuming) {
    // Rank 0 reads the file; every rank learns whether it could, and then its sums (each rank
    // but 0 adds zeros: the sums are rank 0's, bit for bit).
    std::string why;
    std::optional<ReferenceLogProbs> r;
    if (lead) r = read_reference(dir, fingerprint, pass.train->size(), pass.val->size(), &why);
    if (share_value(comm, r ? 1 : 0) == 1) {
      if (!r)
        r = ReferenceLogProbs{std::vector<double>(pass.train->size()),
                              std::vector<double>(pass.val->size())};
      comm.all_reduce_sum(r->train.data(), std::ssize(r->train));
      comm.all_reduce_sum(r->val.data(), std::ssize(r->val));
      if (lead) log.info("reference: the log-probabilities of {}", reference_path(dir));
      return *r;
    }
    if (!adapters)
      throw UserError("--resume " + dir + ": " + reference_path(dir) + " is " +
                      (why.empty() ? "unreadable" : why) +
                      ", and a full fine-tune's reference is its base before the first step: "
                      "start the run again");
    if (lead)
      log.warn("{} is {}: the reference's log-probabilities are computed again",
               reference_path(dir), why);
  }
  const Stopwatch time;
  model.set_adapters_enabled(false);
  ReferenceLogProbs r;
  try {
    r.train = sequence_log_probs(model, *pass.train_rows, *pass.train, pass.ctx, pass.batch,
                                 pass.pad, &comm);
    r.val =
        sequence_log_probs(model, *pass.val_rows, *pass.val, pass.ctx, pass.batch, pass.pad, &comm);
  } catch (...) {
    model.set_adapters_enabled(true);
    throw;
  }
  model.set_adapters_enabled(true);
  if (lead) {
    write_reference(dir, fingerprint, r);
    log.info(
        "reference: the log-probabilities of {} pairs ({} held out) by the base{}, {:.1f} s; "
        "kept in {}",
        (r.train.size() + r.val.size()) / 2, r.val.size() / 2,
        adapters ? " (the adapters switched off)" : " before the first step", time.seconds(),
        reference_path(dir));
  }
  return r;
}

PreferenceRows::PreferenceRows(DecoderModel& model, const std::vector<FinetuneExample>& train,
                               std::vector<PackedRow> rows, const std::vector<FinetuneExample>& val,
                               std::vector<PackedRow> val_rows, ReferenceLogProbs reference,
                               const PreferenceLossOptions& loss, int64_t ctx, int64_t batch,
                               const RowPlan& plan, uint64_t seed, int32_t pad,
                               const Communicator& comm)
    : model_(model),
      train_(train),
      rows_(std::move(rows), ctx, batch, plan, seed),
      val_(val),
      val_rows_(std::move(val_rows)),
      reference_(std::move(reference)),
      loss_(loss),
      ctx_(ctx),
      batch_(batch),
      pad_(pad),
      comm_(comm) {}

StepResult PreferenceRows::step(Trainer& trainer, int64_t step) {
  stats_ = {};
  const PreferenceBatches b{&train_, reference_.train, loss_, &stats_};
  return preference_step(trainer, model_, step, rows_.take(step), b, pad_, rows_.inputs(),
                         rows_.targets());
}

double PreferenceRows::validate(Trainer&) {
  val_stats_ = {};
  const PreferenceBatches b{&val_, reference_.val, loss_, &val_stats_};
  return preference_validation_loss(model_, val_rows_, b, ctx_, batch_, pad_, &comm_);
}

void PreferenceRows::describe(int64_t, nlohmann::json& line) const {
  line["pairs"] = static_cast<int64_t>(stats_.pairs);
  line["targets"] = count_targets(rows_.last(), train_);
  stats_.describe(loss_.method, line, "");
}

std::string PreferenceRows::note() const {
  return " (" + stats_.summary() + ")";
}

void PreferenceRows::describe_validation(nlohmann::json& line) const {
  val_stats_.describe(loss_.method, line, "val_");
}

std::string PreferenceRows::validation_note() const {
  return " (" + val_stats_.summary() + ")";
}

}  // namespace cputrain
