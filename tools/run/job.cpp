#include "tools/run/job.h"

#include <cstring>

#include "engine/core/error.h"
#include "engine/train/adamw.h"
#include "engine/train/parameters.h"

namespace cputrain {
namespace {

bool running = false;

}  // namespace

bool job_running() {
  return running;
}

void job_ended() {
  running = false;
}

std::pair<int64_t, bool> JobStart::meet(bool failed) {
  met_ = true;
  double figures[2] = {failed ? 1.0 : 0.0, failed && comm_.rank() == 0 ? 1.0 : 0.0};
  comm_.all_reduce_sum(figures, 2);
  return {static_cast<int64_t>(figures[0]), figures[1] > 0.0};
}

void JobStart::ready() {
  if (met_) return;
  const int64_t failures = meet(false).first;
  if (failures == 0) {
    running = comm_.size() > 1;
    return;
  }
  if (comm_.rank() != 0) throw QuietExit{1};
  throw UserError(std::to_string(failures) + " of the job's " + std::to_string(comm_.size()) +
                  " ranks could not start (their errors are above)");
}

bool JobStart::failed() {
  if (met_) return false;
  const bool rank0_failed = meet(true).second;  // every rank meets the others
  return comm_.rank() != 0 && rank0_failed;
}

void broadcast_text(const Communicator& comm, std::string& text) {
  int64_t n = static_cast<int64_t>(text.size());
  comm.broadcast(&n, sizeof n, 0);
  text.resize(static_cast<size_t>(n));
  comm.broadcast(text.data(), n, 0);
}

std::vector<int32_t> share_tokens(const Communicator& comm, std::span<const int32_t> tokens) {
  const int64_t n = share_value(comm, static_cast<int64_t>(tokens.size()));
  const int64_t bytes = n * static_cast<int64_t>(sizeof(int32_t));
  if (comm.rank() == 0) {
    // The root's buffer is only read.
    comm.broadcast(const_cast<int32_t*>(tokens.data()), bytes, 0);
    return {};
  }
  std::vector<int32_t> copy(static_cast<size_t>(n));
  comm.broadcast(copy.data(), bytes, 0);
  return copy;
}

int64_t share_value(const Communicator& comm, int64_t value) {
  comm.broadcast(&value, sizeof value, 0);
  return value;
}

void broadcast_training_state(const Communicator& comm, const ParameterSet& params,
                              AdamW& optimizer) {
  if (comm.size() == 1) return;
  if (params.offloaded())
    throw UserError("--offload: a data-parallel job holds its state in RAM (give no --offload)");
  // The trainable parameters: the frozen ones are every rank's alike, read from the same model.
  for (const ParameterInfo& p : params.infos()) {
    if (!p.trainable) continue;
    const int64_t n = p.shape.numel();
    if (p.offset >= 0 && !params.weights().measured())
      comm.broadcast(params.weights().f32() + p.offset, n * 4, 0);
    if (p.bf16_offset >= 0 && !params.bf16_weights().measured())
      comm.broadcast(params.bf16_weights().bf16() + p.bf16_offset, n * 2, 0);
  }
  // A sharded state is each rank's own, taken from a checkpoint by share_checkpoint_state.
  if (optimizer.shards().empty())
    for (const Tensor* t : {&optimizer.m(), &optimizer.v()})
      if (t->defined() && !t->measured())
        comm.broadcast(t->raw(), static_cast<int64_t>(t->bytes()), 0);
  optimizer.set_step_count(share_value(comm, optimizer.step_count()));
}

std::vector<RankStep> gather_step(const Communicator& comm, const RankStep& mine) {
  constexpr int kFields = 7;
  std::vector<double> all(static_cast<size_t>(comm.size() * kFields), 0.0);
  double* slot = all.data() + comm.rank() * kFields;
  slot[0] = mine.ms;
  slot[1] = mine.comm_ms;
  slot[2] = static_cast<double>(mine.rss_bytes);
  slot[3] = static_cast<double>(mine.peak_rss);
  slot[4] = mine.stop_signal;
  slot[5] = mine.reducing_ms;
  slot[6] = mine.gather_ms;
  comm.all_reduce_sum(all.data(), static_cast<int64_t>(all.size()));
  std::vector<RankStep> out(static_cast<size_t>(comm.size()));
  for (size_t r = 0; r < out.size(); ++r) {
    const double* s = all.data() + r * kFields;
    out[r] = {s[0],
              s[1],
              s[5],
              s[6],
              static_cast<int64_t>(s[2]),
              static_cast<int64_t>(s[3]),
              static_cast<int>(s[4])};
  }
  return out;
}

nlohmann::json rank_records(const std::vector<RankStep>& ranks, int64_t positions) {
  nlohmann::json out = nlohmann::json::array();
  const double share = static_cast<double>(positions) / static_cast<double>(ranks.size());
  for (const RankStep& r : ranks)
    out.push_back({{"ms", r.ms},
                   {"comm_ms", r.comm_ms},
                   {"reducing_ms", r.reducing_ms},
                   {"gather_ms", r.gather_ms},
                   {"tokens_per_s", r.ms > 0.0 ? share / (r.ms / 1000.0) : 0.0},
                   {"rss_bytes", r.rss_bytes},
                   {"peak_rss_bytes", r.peak_rss}});
  return out;
}

}  // namespace cputrain
