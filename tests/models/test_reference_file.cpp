// The CTRF reader the PyTorch comparison depends on, on a file built byte by byte here.
#include <gtest/gtest.h>
#include <unistd.h>

#include <fstream>

#include "reference_file.h"

namespace cputrain::test {
namespace {

class Bytes {
 public:
  Bytes& raw(const std::string& s) { return data_ += s, *this; }
  template <typename T>
  Bytes& value(T v) {
    data_.append(reinterpret_cast<const char*>(&v), sizeof(v));
    return *this;
  }
  const std::string& str() const { return data_; }

 private:
  std::string data_;
};

std::string write_temp(const std::string& bytes, const std::string& name) {
  const std::string path =
      ::testing::TempDir() + "/ctrf_" + name + "_" + std::to_string(::getpid()) + ".ctrf";
  std::ofstream(path, std::ios::binary) << bytes;
  return path;
}

std::string two_records() {
  Bytes b;
  b.raw("CTRF").value<uint32_t>(1).value<uint32_t>(2);
  b.value<uint32_t>(1).raw("w").value<uint32_t>(0).value<uint32_t>(2);
  b.value<uint64_t>(2).value<uint64_t>(3);
  for (float f : {1.0f, -2.5f, 3.0f, 0.0f, 1e-3f, 7.0f}) b.value(f);
  b.value<uint32_t>(3).raw("ids").value<uint32_t>(1).value<uint32_t>(1).value<uint64_t>(2);
  b.value<int32_t>(-7).value<int32_t>(511);
  return b.str();
}

TEST(ReferenceFile, ReadsRecords) {
  const auto r = read_reference_file(write_temp(two_records(), "good"));
  ASSERT_EQ(r.size(), 2u);
  const ReferenceTensor& w = r.at("w");
  EXPECT_EQ(w.dtype, 0);
  EXPECT_EQ(w.shape, (std::vector<int64_t>{2, 3}));
  EXPECT_EQ(w.f32, (std::vector<float>{1.0f, -2.5f, 3.0f, 0.0f, 1e-3f, 7.0f}));
  const ReferenceTensor& ids = r.at("ids");
  EXPECT_EQ(ids.dtype, 1);
  EXPECT_EQ(ids.shape, std::vector<int64_t>{2});
  EXPECT_EQ(ids.i32, (std::vector<int32_t>{-7, 511}));
}

TEST(ReferenceFile, RejectsDamage) {
  const std::string good = two_records();
  for (size_t cut : {size_t{0}, size_t{3}, size_t{11}, good.size() - 1})
    EXPECT_THROW(read_reference_file(write_temp(good.substr(0, cut), "cut")), std::runtime_error)
        << cut;
  std::string magic = good;
  magic[0] = 'X';
  EXPECT_THROW(read_reference_file(write_temp(magic, "magic")), std::runtime_error);
  EXPECT_THROW(read_reference_file(write_temp(good + "x", "trailing")), std::runtime_error);
  EXPECT_THROW(read_reference_file("/nonexistent/file.ctrf"), std::runtime_error);
}

}  // namespace
}  // namespace cputrain::test
