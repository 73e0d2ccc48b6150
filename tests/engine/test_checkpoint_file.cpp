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

#include "engine/adamw.h"
#include "engine/atomic_file.h"
#include "engine/checkpoint_file.h"
#include "engine/error.h"
#include "engine/weights_file.h"
#include "kernels/bf16.h"

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
    write(std::vector<char>(good.begin(), good.begin() + static_cast<long>(good.size() * tenth / 10)));
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
    EXPECT_NE(std::string(e.what()).find("not a cputrain checkpoint"), std::string::npos) << e.what();
  }
  ParameterSet bigger;
  bigger.add("w", Shape{40, 3}, true);
  bigger.allocate();
  AdamW adamw(bigger, AdamWConfig{});
  EXPECT_THROW(load_checkpoint(path_, bigger, &adamw), UserError);
  EXPECT_THROW(read_checkpoint_info((dir_ / "missing.ckpt").string()), UserError);
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
