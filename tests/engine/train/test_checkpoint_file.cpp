// The training checkpoint file: an exact round trip of weights, AdamW state and header; every
// damaged, foreign or truncated file a UserError that leaves the model untouched; a failed save
// (disk full) leaves the previous checkpoint as it was.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <vector>

#include "engine/core/error.h"
#include "engine/io/atomic_file.h"
#include "engine/train/adamw.h"
#include "engine/train/checkpoint_file.h"
#include "engine/train/weights_file.h"
#include "kernels/cpu/bf16.h"

namespace cputrain {
namespace {

namespace fs = std::filesystem;

class CheckpointFile : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() / ("cputrain_ckpt_" + std::to_string(::getpid()));
    fs::create_directories(dir_);
    path_ = (dir_ / "step.ckpt").string();
    make(params_);
    for (int64_t i = 0; i < params_.numel(); ++i) {
      params_.weights().f32()[i] = 0.25f * static_cast<float>(i % 97) - 3.0f;
      params_.gradients().f32()[i] = 0.01f * static_cast<float>(i % 13) - 0.05f;
    }
    adamw_ = std::make_unique<AdamW>(params_, AdamWConfig{});
    adamw_->step(0.01f);
    adamw_->step(0.01f);
    info_.step = 42;
    info_.adamw_step = adamw_->step_count();
    info_.data_fingerprint = 0xfedcba9876543210ull;
    info_.config_json = "{\"preset\": \"tiny\"}";
    save_checkpoint(path_, params_, *adamw_, info_);
  }
  void TearDown() override {
    set_atomic_write_limit_for_testing(-1);
    fs::remove_all(dir_);
  }

  static void make(ParameterSet& p) {
    p.add("w", Shape{5, 3}, true, true);
    p.add("g", Shape{3}, false);
    p.allocate();
  }
  std::vector<char> bytes() const {
    std::ifstream in(path_, std::ios::binary);
    return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
  }
  void write(const std::vector<char>& data) const {
    std::ofstream(path_, std::ios::binary | std::ios::trunc).write(data.data(), data.size());
  }
  static std::vector<float> values(const Tensor& t) { return {t.f32(), t.f32() + t.numel()}; }

  fs::path dir_;
  std::string path_;
  ParameterSet params_;
  std::unique_ptr<AdamW> adamw_;
  CheckpointInfo info_;
};

TEST_F(CheckpointFile, RoundTripIsExact) {
  ParameterSet loaded;
  make(loaded);
  loaded.enable_bf16_copies();
  AdamW adamw(loaded, AdamWConfig{});
  const CheckpointInfo info = load_checkpoint(path_, loaded, &adamw);
  EXPECT_EQ(values(loaded.weights()), values(params_.weights()));
  EXPECT_EQ(values(adamw.m()), values(adamw_->m()));
  EXPECT_EQ(values(adamw.v()), values(adamw_->v()));
  EXPECT_EQ(adamw.step_count(), 2);
  EXPECT_EQ(info.step, 42);
  EXPECT_EQ(info.data_fingerprint, 0xfedcba9876543210ull);
  EXPECT_NE(info.config_json.find("\"tiny\""), std::string::npos);
  EXPECT_EQ(loaded.var(0).bf16_value().bf16()[0], kernels::fp32_to_bf16(loaded.weights().f32()[0]));
  EXPECT_FALSE(fs::exists(path_ + ".tmp"));
}

// Truncated at every 10% of its length, or a byte flipped anywhere: a UserError, and the model
// it was to be loaded into is untouched.
TEST_F(CheckpointFile, DamagedFilesAreRefusedWithoutTouchingTheModel) {
  const std::vector<char> good = bytes();
  ParameterSet target;
  make(target);
  AdamW adamw(target, AdamWConfig{});
  for (int64_t i = 0; i < target.numel(); ++i) target.weights().f32()[i] = 7.0f;
  const std::vector<float> before = values(target.weights());
  for (int tenth = 0; tenth < 10; ++tenth) {
    write(std::vector<char>(good.begin(),
                            good.begin() + static_cast<long>(good.size() * tenth / 10)));
    EXPECT_THROW(load_checkpoint(path_, target, &adamw), UserError) << tenth * 10 << "%";
  }
  for (size_t i = 0; i < good.size(); i += 3) {
    std::vector<char> bad = good;
    bad[i] ^= 0x04;
    write(bad);
    EXPECT_THROW(load_checkpoint(path_, target, &adamw), UserError) << "flipped byte " << i;
  }
  EXPECT_EQ(values(target.weights()), before);
  EXPECT_EQ(adamw.step_count(), 0);
}

TEST_F(CheckpointFile, ForeignFilesAndOtherModelsAreRefused) {
  // A weights file has a valid checksum of its own, but not a checkpoint's magic.
  const std::string weights = (dir_ / "model.bin").string();
  save_weights(weights, params_, "{}");
  try {
    read_checkpoint_info(weights);
    FAIL() << "a weights file read as a checkpoint";
  } catch (const UserError& e) {
    EXPECT_NE(std::string(e.what()).find("not a cputrain checkpoint"), std::string::npos)
        << e.what();
  }
  ParameterSet bigger;
  bigger.add("w", Shape{40, 3}, true);
  bigger.allocate();
  AdamW adamw(bigger, AdamWConfig{});
  EXPECT_THROW(load_checkpoint(path_, bigger, &adamw), UserError);
  EXPECT_THROW(read_checkpoint_info((dir_ / "missing.ckpt").string()), UserError);
}

// With frozen parameters a checkpoint holds the trainable ones (and their AdamW state) and a
// fingerprint of the frozen ones: it resumes the trainable weights exactly, on the same frozen
// base only; on another it is refused and nothing is written. In bf16 the frozen matrix lives
// as bf16 alone, and the weights file still holds every parameter.
TEST_F(CheckpointFile, FrozenParametersAreFingerprintedNotStored) {
  for (const DType dtype : {DType::F32, DType::BF16}) {
    const auto make_frozen = [dtype](ParameterSet& p) {
      p.add("frozen", Shape{40, 8}, true, true);
      p.add("w", Shape{5, 3}, true, true);
      p.add("g", Shape{3}, false);
      p.set_trainable(0, false);
      p.allocate(dtype);
    };
    std::vector<float> base(320), other(320);
    for (size_t i = 0; i < base.size(); ++i) {
      base[i] = 0.5f * static_cast<float>(i % 7) - 1.0f;
      other[i] = base[i] + (i == 100 ? 0.5f : 0.0f);
    }
    ParameterSet saved;
    make_frozen(saved);
    EXPECT_EQ(saved.infos()[0].offset >= 0, dtype == DType::F32);
    EXPECT_EQ(saved.trainable_numel(), 16 + 16);  // w and g, each padded to 64 bytes
    saved.write_values(0, base.data());
    for (int i = 1; i < 3; ++i) {
      std::vector<float> v(static_cast<size_t>(saved.infos()[i].shape.numel()));
      for (size_t e = 0; e < v.size(); ++e) v[e] = 0.1f * static_cast<float>(e + i);
      saved.write_values(i, v.data());
    }
    for (int64_t i = 0; i < saved.trainable_numel(); ++i)
      saved.gradients().f32()[i] = 0.01f * static_cast<float>(i % 5);
    AdamW adamw(saved, AdamWConfig{});
    adamw.step(0.01f);
    EXPECT_EQ(adamw.m().numel(), saved.trainable_numel());
    save_checkpoint(path_, saved, adamw, info_);
    EXPECT_LT(fs::file_size(path_), 1000u);  // 32 weights and their m and v, not the 320 frozen

    ParameterSet same;
    make_frozen(same);
    same.write_values(0, base.data());
    AdamW resumed(same, AdamWConfig{});
    load_checkpoint(path_, same, &resumed);
    for (int i = 1; i < 3; ++i) {
      const int64_t n = saved.infos()[i].shape.numel();
      std::vector<float> a(n), b(n);
      saved.read_values(i, a.data());
      same.read_values(i, b.data());
      EXPECT_EQ(a, b) << saved.infos()[i].name;
    }
    EXPECT_EQ(values(resumed.m()), values(adamw.m()));
    EXPECT_EQ(values(resumed.v()), values(adamw.v()));

    ParameterSet changed;
    make_frozen(changed);
    changed.write_values(0, other.data());
    AdamW untouched(changed, AdamWConfig{});
    std::vector<float> w_before(15);
    changed.read_values(1, w_before.data());
    try {
      load_checkpoint(path_, changed, &untouched);
      FAIL() << "a checkpoint resumed on other frozen weights";
    } catch (const UserError& e) {
      EXPECT_NE(std::string(e.what()).find("other frozen weights"), std::string::npos) << e.what();
    }
    std::vector<float> w_after(15);
    changed.read_values(1, w_after.data());
    EXPECT_EQ(w_after, w_before);
    EXPECT_EQ(untouched.step_count(), 0);

    // The weights file holds all three, the frozen one as stored (bf16 widened).
    const std::string weights = (dir_ / "model.bin").string();
    save_weights(weights, saved, "{}");
    ParameterSet read;
    make_frozen(read);
    load_weights(weights, read);
    std::vector<float> a(320), b(320);
    saved.read_values(0, a.data());
    read.read_values(0, b.data());
    EXPECT_EQ(a, b);
  }
}

TEST_F(CheckpointFile, DiskFullKeepsThePreviousCheckpoint) {
  const std::vector<char> before = bytes();
  info_.step = 43;
  set_atomic_write_limit_for_testing(100);  // the disk fills after 100 bytes
  try {
    save_checkpoint(path_, params_, *adamw_, info_);
    FAIL() << "the save did not fail";
  } catch (const UserError& e) {
    EXPECT_NE(std::string(e.what()).find("previous file"), std::string::npos) << e.what();
  }
  set_atomic_write_limit_for_testing(-1);
  EXPECT_EQ(bytes(), before);
  EXPECT_FALSE(fs::exists(path_ + ".tmp"));
  EXPECT_EQ(read_checkpoint_info(path_).step, 42);
}

}  // namespace
}  // namespace cputrain
