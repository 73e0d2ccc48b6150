#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <iterator>
#include <vector>

#include "engine/core/error.h"
#include "engine/train/parameters.h"
#include "engine/train/weights_file.h"

namespace cputrain {
namespace {

namespace fs = std::filesystem;

class WeightsFile : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() / ("cputrain_weights_" + std::to_string(::getpid()));
    fs::create_directories(dir_);
    path_ = (dir_ / "model.bin").string();
    make(params_);
    for (int64_t i = 0; i < params_.numel(); ++i)
      params_.weights().f32()[i] = 0.25f * static_cast<float>(i % 97) - 3.0f;
    save_weights(path_, params_, "{\"hello\": 1}");
  }
  void TearDown() override { fs::remove_all(dir_); }

  static void make(ParameterSet& p) {
    p.add("w", Shape{5, 3}, true);
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

  fs::path dir_;
  std::string path_;
  ParameterSet params_;
};

TEST_F(WeightsFile, RoundTrip) {
  ParameterSet loaded;
  make(loaded);
  load_weights(path_, loaded);
  for (const ParameterInfo& info : params_.infos())
    for (int64_t i = 0; i < info.shape.numel(); ++i)
      EXPECT_EQ(loaded.weights().f32()[info.offset + i], params_.weights().f32()[info.offset + i]);
  EXPECT_EQ(read_weights_config(path_), "{\"hello\": 1}");
  EXPECT_FALSE(fs::exists(path_ + ".tmp"));
}

TEST_F(WeightsFile, EveryTruncationAndFlippedByteIsAUserError) {
  const std::vector<char> good = bytes();
  ParameterSet loaded;
  make(loaded);
  for (size_t n = 0; n < good.size(); n += 7) {
    write(std::vector<char>(good.begin(), good.begin() + static_cast<long>(n)));
    EXPECT_THROW(load_weights(path_, loaded), UserError) << "truncated to " << n;
  }
  for (size_t i = 0; i < good.size(); i += 5) {
    std::vector<char> bad = good;
    bad[i] ^= 0x10;
    write(bad);
    EXPECT_THROW(load_weights(path_, loaded), UserError) << "flipped byte " << i;
  }
}

TEST_F(WeightsFile, ShapeMismatchIsAUserError) {
  ParameterSet other;
  other.add("w", Shape{3, 5}, true);
  other.add("g", Shape{3}, false);
  other.allocate();
  EXPECT_THROW(load_weights(path_, other), UserError);
  EXPECT_THROW(load_weights((dir_ / "missing.bin").string(), other), UserError);
}

TEST_F(WeightsFile, FailedSaveLeavesTheOldFile) {
  const std::vector<char> before = bytes();
  // A directory where the temp file would go makes the save fail before anything is renamed.
  fs::create_directories(path_ + ".tmp");
  EXPECT_THROW(save_weights(path_, params_, "{}"), UserError);
  EXPECT_EQ(bytes(), before);
}

}  // namespace
}  // namespace cputrain
