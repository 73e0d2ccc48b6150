// --offload: the FP32 masters of a bf16 run's matrices and AdamW's m and v in state files. Ten
// steps with and without it give bitwise the same losses, weights, m and v (bf16 and fp32, the
// update streamed in many small chunks); a checkpoint written from the files resumes bitwise
// the run that never stopped, offloaded or not; the masters and m and v are not in RAM (the
// allocator's counts); a second run on the folder and a disk too small are one UserError each.
#include <gtest/gtest.h>
#include <sys/resource.h>
#include <unistd.h>

#include <csignal>
#include <filesystem>
#include <memory>
#include <numeric>
#include <string>
#include <vector>

#include "engine/core/error.h"
#include "engine/core/memory.h"
#include "engine/io/offload.h"
#include "engine/train/adamw.h"
#include "engine/train/checkpoint_file.h"
#include "engine/train/trainer.h"
#include "models/decoder.h"
#include "models/model_config.h"

namespace cputrain {
namespace {

namespace fs = std::filesystem;

// GQA, q/k/v biases and a tied head: an embedding whose master computing reads (kept in RAM),
// biases and norm gains (no bf16 copy: in RAM), and matrices (offloaded).
ModelConfig config() {
  ModelConfig c = find_preset("tiny")->config;
  c.n_kv_heads = 2;
  c.qkv_bias = true;
  c.tie_embeddings = true;
  return c;
}

std::vector<int32_t> token_stream(int64_t n, int64_t vocab) {
  std::vector<int32_t> t(static_cast<size_t>(n));
  uint64_t x = 88172645463325252ull;
  for (int32_t& v : t) {
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    v = static_cast<int32_t>(x % static_cast<uint64_t>(vocab));
  }
  return t;
}

TrainOptions options() {
  TrainOptions o;
  o.batch = 2;
  o.ctx = 32;
  o.accum = 2;
  o.lr.peak = 0.01;
  o.lr.warmup_steps = 2;
  o.lr.total_steps = 10;
  o.adamw.offload_chunk = 1000;  // 992 elements: every matrix in several chunks
  return o;
}

fs::path temp_dir(const std::string& name) {
  const fs::path dir =
      fs::temp_directory_path() / ("cputrain_offload_" + name + "_" + std::to_string(::getpid()));
  fs::remove_all(dir);
  return dir;
}

// A model and its trainer, the state offloaded into `dir` where it is not empty.
struct TrainingRun {
  std::shared_ptr<OffloadDir> dir;
  std::unique_ptr<DecoderModel> model;
  std::unique_ptr<Trainer> trainer;

  TrainingRun(DType dtype, const std::string& offload) {
    ModelOptions o;
    o.compute_dtype = dtype;
    if (!offload.empty()) {
      dir = std::make_shared<OffloadDir>(offload);
      o.offload = true;
      o.offload_dir = dir;
    }
    model = std::make_unique<DecoderModel>(config(), o);
    model->init_weights(7);
    trainer = std::make_unique<Trainer>(
        model->parameters(),
        [m = model.get()](const Tensor& in, const Tensor& tg) { return m->loss(in, tg); },
        options());
  }
  const ParameterSet& params() const { return model->parameters(); }
  // Every parameter's values, then m and v.
  std::vector<float> state() const {
    std::vector<float> all;
    for (size_t i = 0; i < params().infos().size(); ++i) {
      std::vector<float> v(static_cast<size_t>(params().infos()[i].shape.numel()));
      params().read_values(static_cast<int>(i), v.data());
      all.insert(all.end(), v.begin(), v.end());
    }
    const AdamW& a = trainer->optimizer();
    for (const bool second : {false, true}) {
      std::vector<float> s(static_cast<size_t>(a.state_numel()));
      a.read_state(second, 0, a.state_numel(), s.data());
      all.insert(all.end(), s.begin(), s.end());
    }
    return all;
  }
  std::vector<double> train(const std::vector<int32_t>& tokens, int64_t first, int64_t last) {
    std::vector<double> losses;
    for (int64_t step = first; step <= last; ++step)
      losses.push_back(trainer->step(tokens, step).loss);
    return losses;
  }
};

class Offload : public ::testing::TestWithParam<DType> {};

TEST_P(Offload, TenStepsAreBitwiseTheRunInRam) {
  const fs::path dir = temp_dir("steps");
  const std::vector<int32_t> tokens = token_stream(4000, config().vocab);
  TrainingRun in_ram(GetParam(), "");
  const std::vector<double> expected = in_ram.train(tokens, 1, 10);
  {
    TrainingRun offloaded(GetParam(), dir.string());
    const ParameterSet& p = offloaded.params();
    int matrices = 0;
    for (size_t i = 0; i < p.infos().size(); ++i) {
      const ParameterInfo& info = p.infos()[i];
      // bf16: every matrix but the embedding (whose FP32 rows the lookup reads) is in the file;
      // fp32 computes from the masters, which stay.
      const bool in_file = GetParam() == DType::BF16 && info.shape.ndim() == 2 &&
                           info.name != "tok_embeddings.weight";
      EXPECT_EQ(p.master_offloaded(static_cast<int>(i)), in_file) << info.name;
      matrices += in_file;
    }
    EXPECT_GT(matrices, GetParam() == DType::BF16 ? 10 : -1);
    EXPECT_FALSE(offloaded.trainer->optimizer().m().defined());
    EXPECT_TRUE(fs::exists(dir / "adamw_m.f32"));
    EXPECT_EQ(fs::file_size(dir / "adamw_v.f32"), static_cast<uintmax_t>(p.trainable_numel()) * 4);
    EXPECT_EQ(offloaded.train(tokens, 1, 10), expected);
    EXPECT_EQ(offloaded.state(), in_ram.state());
  }
  // The state files are scratch: gone with the run.
  EXPECT_FALSE(fs::exists(dir / "adamw_m.f32"));
  EXPECT_FALSE(fs::exists(dir / "masters.f32"));
  fs::remove_all(dir);
}

// Stopped after step 5 and resumed from the checkpoint: offloaded into offloaded, offloaded into
// RAM and RAM into offloaded, each ends as the run that never stopped.
TEST_P(Offload, CheckpointsResumeBitwiseEitherWay) {
  const fs::path dir = temp_dir("resume");
  fs::create_directories(dir);
  const std::vector<int32_t> tokens = token_stream(4000, config().vocab);
  TrainingRun whole(GetParam(), "");
  const std::vector<double> expected = whole.train(tokens, 1, 10);
  const std::vector<double> expected_tail(expected.begin() + 5, expected.end());
  const auto save = [&](const TrainingRun& run, const std::string& path) {
    CheckpointInfo info;
    info.step = 5;
    info.adamw_step = run.trainer->optimizer().step_count();
    info.config_json = "{}";
    save_checkpoint(path, run.params(), run.trainer->optimizer(), info);
  };
  const std::string from_file = (dir / "offloaded.ckpt").string();
  const std::string from_ram = (dir / "in_ram.ckpt").string();
  {
    TrainingRun first(GetParam(), (dir / "a").string());
    first.train(tokens, 1, 5);
    save(first, from_file);
    TrainingRun ram_first(GetParam(), "");
    ram_first.train(tokens, 1, 5);
    save(ram_first, from_ram);
  }
  for (const auto& [checkpoint, offload] :
       {std::pair{from_file, (dir / "b").string()}, std::pair{from_file, std::string()},
        std::pair{from_ram, (dir / "c").string()}}) {
    TrainingRun resumed(GetParam(), offload);
    load_checkpoint(checkpoint, resumed.model->parameters(), &resumed.trainer->optimizer());
    EXPECT_EQ(resumed.train(tokens, 6, 10), expected_tail) << checkpoint << " into " << offload;
    EXPECT_EQ(resumed.state(), whole.state()) << checkpoint << " into " << offload;
  }
  fs::remove_all(dir);
}

INSTANTIATE_TEST_SUITE_P(Dtypes, Offload, ::testing::Values(DType::BF16, DType::F32),
                         [](const auto& info) {
                           return std::string(info.param == DType::BF16 ? "bf16" : "fp32");
                         });

// What stays in RAM, by the allocator's counts: no FP32 master of an offloaded matrix, and of
// the optimizer's state only the staging of three chunks.
TEST(OffloadMemory, MastersAndOptimizerStateLeaveRam) {
  const fs::path dir = temp_dir("memory");
  const auto held = [&](bool offload) {
    const MemoryStats before = memory_stats();
    TrainingRun run(DType::BF16, offload ? dir.string() : "");
    const MemoryStats after = memory_stats();
    const auto live = [&](MemoryCategory c) {
      return after.live_bytes[static_cast<int>(c)] - before.live_bytes[static_cast<int>(c)];
    };
    return std::pair{live(MemoryCategory::Weights), live(MemoryCategory::OptimizerState)};
  };
  const auto [ram_weights, ram_state] = held(false);
  const auto [off_weights, off_state] = held(true);
  TrainingRun probe(DType::BF16, "");
  const ParameterSet& p = probe.params();
  int64_t matrices = 0;
  for (const ParameterInfo& info : p.infos())
    if (info.shape.ndim() == 2 && info.name != "tok_embeddings.weight")
      matrices += (info.shape.numel() + 15) / 16 * 16;
  EXPECT_EQ(ram_weights - off_weights, matrices * 4);
  EXPECT_EQ(ram_state, 2 * p.trainable_numel() * 4);
  EXPECT_EQ(off_state, 3 * 3 * 992 * 4);  // three slots of (master, m, v) chunks
  fs::remove_all(dir);
}

// A set with nothing to train offloads nothing: no state file is made and a step moves nothing.
TEST(OffloadMemory, NothingTrainedNothingStreamed) {
  const fs::path dir = temp_dir("frozen");
  {
    ParameterSet params;
    const int w = params.add("w", Shape{4, 16}, true, true);
    params.set_trainable(w, false);
    params.set_offload(std::make_shared<OffloadDir>(dir.string()));
    params.allocate(DType::BF16);
    AdamW adamw(params, AdamWConfig{});
    EXPECT_EQ(adamw.step(0.01f), 0.0f);
    EXPECT_FALSE(fs::exists(dir / "adamw_m.f32"));
    EXPECT_FALSE(fs::exists(dir / "masters.f32"));
  }
  fs::remove_all(dir);
}

TEST(OffloadDir, ASecondRunOnTheFolderIsRefused) {
  const fs::path dir = temp_dir("lock");
  OffloadDir first(dir.string());
  try {
    OffloadDir second(dir.string());
    FAIL() << "a second OffloadDir on the same folder was allowed";
  } catch (const UserError& e) {
    EXPECT_NE(std::string(e.what()).find("--offload " + dir.string() + ": in use by another"),
              std::string::npos)
        << e.what();
  }
  fs::remove_all(dir);
}

// A disk with less room than the state (here a file-size limit) is found when the file is made,
// before any step, in one line naming it; nothing is left behind.
TEST(OffloadDir, ADiskTooSmallIsRefusedWhenTheFileIsMade) {
  const fs::path dir = temp_dir("full");
  OffloadDir folder(dir.string());
  rlimit old{};
  ASSERT_EQ(::getrlimit(RLIMIT_FSIZE, &old), 0);
  const auto previous = std::signal(SIGXFSZ, SIG_IGN);
  rlimit small = old;
  small.rlim_cur = 1 << 20;
  ASSERT_EQ(::setrlimit(RLIMIT_FSIZE, &small), 0);
  std::string message;
  try {
    folder.file("adamw_m.f32", int64_t{1} << 20);  // 4 MiB
  } catch (const UserError& e) {
    message = e.what();
  }
  ::setrlimit(RLIMIT_FSIZE, &old);
  std::signal(SIGXFSZ, previous);
  EXPECT_NE(message.find((dir / "adamw_m.f32").string() + ": cannot reserve 4 MiB"),
            std::string::npos)
      << message;
  EXPECT_FALSE(fs::exists(dir / "adamw_m.f32"));
  // Within the room, the file is made and reads back what was written.
  {
    const std::unique_ptr<StateFile> f = folder.file("masters.f32", 1000);
    std::vector<float> in(1000), out(1000);
    std::iota(in.begin(), in.end(), 0.5f);
    f->write(0, 1000, in.data());
    f->read(0, 1000, out.data());
    EXPECT_EQ(in, out);
  }
  fs::remove_all(dir);
}

}  // namespace
}  // namespace cputrain
