#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "engine/core/error.h"
#include "engine/io/mapped_file.h"

namespace cputrain {
namespace {

namespace fs = std::filesystem;

// A file of 64 pages, each filled with its index, written through and dropped from the page
// cache, so that its pages are read again when touched.
class MappedFileTest : public ::testing::Test {
 protected:
  void SetUp() override {
    page_ = static_cast<size_t>(::sysconf(_SC_PAGESIZE));
    dir_ = fs::current_path() / ("cputrain_mapped_" + std::to_string(::getpid()));
    fs::create_directories(dir_);
    path_ = (dir_ / "weights.bin").string();
    std::vector<uint8_t> bytes(64 * page_);
    for (size_t i = 0; i < bytes.size(); ++i) bytes[i] = static_cast<uint8_t>(i / page_);
    std::ofstream(path_, std::ios::binary)
        .write(reinterpret_cast<const char*>(bytes.data()),
               static_cast<std::streamsize>(bytes.size()));
    const int fd = ::open(path_.c_str(), O_RDONLY);
    ASSERT_GE(fd, 0);
    ::fdatasync(fd);
    ::posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED);
    ::close(fd);
  }
  void TearDown() override { fs::remove_all(dir_); }

  // Which of the mapping's pages are in memory (mincore).
  std::vector<bool> resident(const MappedFile& file) const {
    std::vector<unsigned char> in(file.size() / page_);
    EXPECT_EQ(::mincore(const_cast<uint8_t*>(file.data()), file.size(), in.data()), 0);
    return {in.begin(), in.end()};
  }

  size_t page_ = 0;
  fs::path dir_;
  std::string path_;
};

TEST_F(MappedFileTest, PopulateBringsTheRangesPagesIn) {
  const MappedFile file(path_);
  ASSERT_EQ(file.size(), 64 * page_);
  std::vector<bool> before = resident(file);
  size_t in = 0;
  for (const bool r : before) in += r ? 1 : 0;
  // A file system that keeps every page in memory (tmpfs) has nothing to read ahead.
  if (in == before.size()) GTEST_SKIP() << dir_ << " keeps its files' pages in memory";
  // Pages 21 .. 40, from an address inside page 21 to one inside page 40.
  populate_mapped(file.data() + 21 * page_ + 100, 19 * page_);
  const std::vector<bool> after = resident(file);
  for (size_t p = 21; p <= 40; ++p) EXPECT_TRUE(after[p]) << "page " << p;
  for (size_t p = 21; p <= 40; ++p) EXPECT_EQ(file.data()[p * page_ + 7], p);
}

TEST_F(MappedFileTest, ReleasedPagesKeepTheirValues) {
  const MappedFile file(path_);
  populate_mapped(file.data(), file.size());
  release_mapped(file.data() + 3, file.size() - 3);
  for (size_t p = 0; p < 64; ++p) EXPECT_EQ(file.data()[p * page_ + page_ / 2], p);
  populate_mapped(nullptr, 0);  // nothing, no failure
  release_mapped(file.data(), 0);
}

TEST_F(MappedFileTest, AMissingFileIsOneLine) {
  try {
    const MappedFile file((dir_ / "none.bin").string());
    FAIL() << "mapped a missing file";
  } catch (const UserError& e) {
    EXPECT_NE(std::string(e.what()).find("none.bin: cannot be read"), std::string::npos)
        << e.what();
  }
}

}  // namespace
}  // namespace cputrain
