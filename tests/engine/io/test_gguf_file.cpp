// GGUF files: what GgufWriter writes GgufFile reads back, every value type and tensor type; the
// F16 and BF16 encoders against independent references; Q8_0 within half a step; and a file cut
// or damaged anywhere is a UserError, never a crash.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <random>
#include <sstream>

#include "engine/core/error.h"
#include "engine/io/gguf_file.h"

namespace cputrain {
namespace {

namespace fs = std::filesystem;

fs::path temp_file(const std::string& name) {
  return fs::temp_directory_path() /
         ("cputrain_gguf_" + name + "_" + std::to_string(::getpid()) + ".gguf");
}

std::string read_all(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

// The nearest bf16 to x (ties to even), found by comparing the two candidates in double.
float reference_bf16(float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, 4);
  const uint32_t down = bits & 0xffff0000u, up = down + 0x10000u;
  float lo, hi;
  std::memcpy(&lo, &down, 4);
  std::memcpy(&hi, &up, 4);
  const double dl = std::abs(static_cast<double>(x) - lo),
               dh = std::abs(static_cast<double>(hi) - x);
  if (dl < dh) return lo;
  if (dh < dl) return hi;
  return (down >> 16) % 2 == 0 ? lo : hi;
}

TEST(Gguf, WhatIsWrittenReadsBack) {
  GgufWriter w;
  w.set_string("general.architecture", "llama");
  w.set_u32("a.u32", 4000000000u);
  w.set_i32("a.i32", -7);
  w.set_f32("a.f32", 0.25f);
  w.set_bool("a.bool", true);
  w.set_strings("a.strings", {"x", "", "ünïcode"});
  w.set_f32s("a.f32s", {1.5f, -2.0f});
  w.set_i32s("a.i32s", {1, -1, 6});
  std::vector<float> values(64);
  for (size_t i = 0; i < values.size(); ++i) values[i] = 0.1f * static_cast<float>(i) - 3.0f;
  for (GgmlType type : {GgmlType::F32, GgmlType::F16, GgmlType::BF16, GgmlType::Q8_0})
    w.add_tensor(ggml_type_name(static_cast<uint32_t>(type)), {32, 2}, type,
                 ggml_from_float(type, values.data(), 64));
  const fs::path path = temp_file("roundtrip");
  w.write(path.string());
  const GgufFile f(path.string());
  EXPECT_EQ(f.version(), 3u);
  EXPECT_EQ(f.string("general.architecture"), "llama");
  EXPECT_EQ(f.integer("a.u32"), 4000000000);
  EXPECT_EQ(f.integer("a.i32"), -7);
  EXPECT_EQ(f.number("a.f32", 0), 0.25);
  EXPECT_TRUE(f.flag("a.bool", false));
  EXPECT_EQ(f.strings("a.strings"), (std::vector<std::string>{"x", "", "ünïcode"}));
  EXPECT_EQ(f.numbers("a.f32s"), (std::vector<double>{1.5, -2.0}));
  EXPECT_EQ(f.numbers("a.i32s"), (std::vector<double>{1, -1, 6}));
  EXPECT_EQ(f.integer("missing", 5), 5);
  EXPECT_THROW(f.integer("missing"), UserError);
  EXPECT_THROW(f.string("a.u32"), UserError);
  ASSERT_EQ(f.tensors().size(), 4u);
  for (const GgufTensor& t : f.tensors()) {
    EXPECT_EQ(t.dims, (std::vector<int64_t>{32, 2}));
    EXPECT_EQ(reinterpret_cast<uintptr_t>(t.data.data()) % 32, 0u) << t.name;
    const std::vector<float> back = gguf_tensor_values(f, t);
    const auto type = static_cast<GgmlType>(t.type);
    for (size_t i = 0; i < 64; ++i) {
      const float x = values[i];
      float want = x, tolerance = 0.0f;
      if (type == GgmlType::F16) want = static_cast<float>(static_cast<_Float16>(x));
      if (type == GgmlType::BF16) want = reference_bf16(x);
      if (type == GgmlType::Q8_0) {
        float amax = 0;
        for (size_t j = i / 32 * 32; j < i / 32 * 32 + 32; ++j)
          amax = std::max(amax, std::abs(values[j]));
        tolerance = 0.5f * amax / 127.0f * 1.01f;
      }
      EXPECT_LE(std::abs(back[i] - want), tolerance) << t.name << " " << i;
    }
  }
  fs::remove(path);
}

// F16 and BF16 over edge cases and random values of every magnitude: the encoders round as the
// compiler's _Float16 and the two-candidate reference do.
TEST(Gguf, HalfAndBf16EncodersRoundToNearestEven) {
  std::vector<float> xs = {0.0f,
                           -0.0f,
                           1.0f,
                           65504.0f,
                           65519.9f,
                           65520.0f,
                           1e-8f,
                           5.96e-8f,
                           2.98e-8f,
                           6.1e-5f,
                           6.09e-5f,
                           -3.14159f,
                           1e30f,
                           -1e-30f,
                           std::numeric_limits<float>::infinity(),
                           -std::numeric_limits<float>::infinity()};
  std::mt19937 rng(5);
  for (int i = 0; i < 20000; ++i) {
    uint32_t bits = static_cast<uint32_t>(rng());
    if ((bits & 0x7f800000u) == 0x7f800000u) continue;  // NaN and infinity: above
    float x;
    std::memcpy(&x, &bits, 4);
    xs.push_back(x);
  }
  const int64_t n = static_cast<int64_t>(xs.size());
  std::vector<float> half(xs.size()), bf(xs.size());
  ggml_to_float(GgmlType::F16, ggml_from_float(GgmlType::F16, xs.data(), n).data(), half.data(), n);
  ggml_to_float(GgmlType::BF16, ggml_from_float(GgmlType::BF16, xs.data(), n).data(), bf.data(), n);
  for (size_t i = 0; i < xs.size(); ++i) {
    const float want_half = static_cast<float>(static_cast<_Float16>(xs[i]));
    EXPECT_EQ(std::memcmp(&half[i], &want_half, 4), 0)
        << xs[i] << " -> " << half[i] << " not " << want_half;
    const float want_bf = reference_bf16(xs[i]);
    EXPECT_EQ(std::memcmp(&bf[i], &want_bf, 4), 0) << xs[i];
  }
  const float nan = std::numeric_limits<float>::quiet_NaN();
  float back;
  ggml_to_float(GgmlType::F16, ggml_from_float(GgmlType::F16, &nan, 1).data(), &back, 1);
  EXPECT_TRUE(std::isnan(back));
}

// Cut anywhere before the end of its data, or with one byte changed anywhere in the header and
// directory: a UserError naming the file, or (a changed byte the format allows) a file that
// reads.
TEST(Gguf, DamagedFilesAreUserErrors) {
  GgufWriter w;
  w.set_string("general.architecture", "llama");
  w.set_strings("tokenizer.ggml.tokens", {"a", "b"});
  std::vector<float> values(64, 1.0f);
  w.add_tensor("t", {32, 2}, GgmlType::Q8_0, ggml_from_float(GgmlType::Q8_0, values.data(), 64));
  const fs::path good = temp_file("good"), bad = temp_file("bad");
  w.write(good.string());
  const std::string bytes = read_all(good);
  // The data: 2 blocks of 34 bytes, padded to 96; a cut in the padding after them leaves a whole
  // file.
  const size_t header = bytes.size() - 96, data_end = header + 68;
  for (size_t cut = 0; cut < data_end; ++cut) {
    std::ofstream(bad, std::ios::binary | std::ios::trunc)
        .write(bytes.data(), static_cast<std::streamsize>(cut));
    try {
      const GgufFile f(bad.string());
      ADD_FAILURE() << "a file cut at " << cut << " of " << bytes.size() << " bytes was read";
    } catch (const UserError& e) {
      EXPECT_NE(std::string(e.what()).find(bad.string()), std::string::npos) << e.what();
    }
  }
  size_t refused = 0, read = 0;
  for (size_t at = 0; at < header; ++at) {
    for (unsigned char value : {0x00, 0xff, 0x7f}) {
      std::string damaged = bytes;
      damaged[at] = static_cast<char>(value);
      std::ofstream(bad, std::ios::binary | std::ios::trunc)
          .write(damaged.data(), static_cast<std::streamsize>(damaged.size()));
      try {
        const GgufFile f(bad.string());
        for (const GgufTensor& t : f.tensors())
          if (ggml_type_supported(t.type)) gguf_tensor_values(f, t);
        ++read;
      } catch (const UserError& e) {
        EXPECT_NE(std::string(e.what()).find(bad.string()), std::string::npos) << e.what();
        ++refused;
      }
    }
  }
  // Both outcomes occur: damage to a count, length or type is refused; to a name's or a
  // value's bytes is a file that still reads.
  EXPECT_GT(refused, 0u);
  EXPECT_GT(read, 0u);
  fs::remove(good);
  fs::remove(bad);
}

// Every type of ggml's list has its name in messages, the ones cputrain does not read too; a
// number outside the list is named as a number.
TEST(Gguf, EveryGgmlTypeIsNamed) {
  EXPECT_EQ(ggml_type_name(20), "IQ4_NL");
  EXPECT_EQ(ggml_type_name(23), "IQ4_XS");
  EXPECT_EQ(ggml_type_name(39), "MXFP4");
  for (uint32_t type = 0; type <= 42; ++type) {
    if (type == 4 || type == 5 || (type >= 31 && type <= 33) || (type >= 36 && type <= 38))
      continue;  // removed from ggml
    EXPECT_FALSE(ggml_type_name(type).starts_with("type ")) << type;
  }
  EXPECT_EQ(ggml_type_name(99), "type 99");
}

}  // namespace
}  // namespace cputrain
