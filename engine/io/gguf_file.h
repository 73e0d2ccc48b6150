// GGUF, llama.cpp's model file (versions 2 and 3): typed metadata, a directory of tensors, and
// their data, mapped read-only. Every count, length and offset is checked against the file, so a
// truncated or corrupt file is a UserError naming it and what is wrong, never a crash.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "engine/io/mapped_file.h"
#include "kernels/quant/quant.h"

namespace cputrain {

// The tensor types of ggml that cputrain reads (and the names of those it does not).
enum class GgmlType : uint32_t {
  F32 = 0,
  F16 = 1,
  Q4_0 = 2,
  Q5_0 = 6,
  Q5_1 = 7,
  Q8_0 = 8,
  Q4_K = 12,
  Q5_K = 13,
  Q6_K = 14,
  BF16 = 30,
  MXFP4 = 39,
};
// "F32", "Q4_K", ...; "type N" for a number cputrain has no name for.
std::string ggml_type_name(uint32_t type);
// Whether cputrain converts tensors of this type.
bool ggml_type_supported(uint32_t type);
// The kernels' name of a quantised type cputrain reads (kernels/quant/quant.h holds their layouts);
// none for F32, F16 and BF16.
std::optional<kernels::QuantType> ggml_quant_type(GgmlType type);
// Elements per block and bytes per block of a supported type.
int64_t ggml_block_size(GgmlType type);
size_t ggml_block_bytes(GgmlType type);
// Bytes of `n` elements (n a multiple of the block size).
size_t ggml_bytes(GgmlType type, int64_t n);

// The value types of GGUF metadata.
enum class GgufType : uint32_t {
  U8 = 0,
  I8 = 1,
  U16 = 2,
  I16 = 3,
  U32 = 4,
  I32 = 5,
  F32 = 6,
  Bool = 7,
  String = 8,
  Array = 9,
  U64 = 10,
  I64 = 11,
  F64 = 12,
};

struct GgufValue {
  GgufType type = GgufType::U8;
  GgufType element = GgufType::U8;   // of an array
  double number = 0.0;               // a number or bool (integers exactly up to 2^53)
  uint64_t bits = 0;                 // an integer's bits, for u64 and i64 beyond 2^53
  std::string text;                  // a string
  std::vector<std::string> strings;  // an array of strings
  std::vector<double> numbers;       // an array of numbers or bools
};

struct GgufTensor {
  std::string name;
  std::vector<int64_t> dims;      // ggml's ne: dims[0] varies fastest (a row's length)
  uint32_t type = 0;              // a GgmlType where supported
  uint64_t offset = 0;            // from the start of the data section
  std::span<const uint8_t> data;  // in the mapped file; empty for an unsupported type
  int64_t numel() const;
};

class GgufFile {
 public:
  // Maps and parses the file; a UserError naming `path` for anything that is not a whole,
  // well-formed GGUF file.
  explicit GgufFile(const std::string& path);

  const std::string& path() const { return path_; }
  uint32_t version() const { return version_; }
  const std::map<std::string, GgufValue>& metadata() const { return metadata_; }
  // What its index (the metadata, a vocabulary's tokens and merges among it, and the tensor
  // directory) holds on the heap, as glibc's malloc takes it (engine/core/memory.h).
  int64_t heap_bytes() const;
  const std::vector<GgufTensor>& tensors() const { return tensors_; }

  // nullptr where absent.
  const GgufValue* find(const std::string& key) const;
  const GgufTensor* tensor(const std::string& name) const;
  // Typed look-ups: a UserError naming the file and key where a required key is missing or of
  // another type; `fallback` where an optional one is missing.
  std::string string(const std::string& key) const;
  std::string string(const std::string& key, const std::string& fallback) const;
  int64_t integer(const std::string& key) const;
  int64_t integer(const std::string& key, int64_t fallback) const;
  double number(const std::string& key, double fallback) const;
  bool flag(const std::string& key, bool fallback) const;
  const std::vector<std::string>& strings(const std::string& key) const;
  const std::vector<double>& numbers(const std::string& key) const;

 private:
  std::string path_;
  MappedFile file_;
  uint32_t version_ = 0;
  std::map<std::string, GgufValue> metadata_;
  std::vector<GgufTensor> tensors_;
  std::map<std::string, size_t> by_name_;
};

// Writes a GGUF v3 file: the metadata in the order set, then the tensor directory and the
// tensors, each aligned to 32 bytes; atomically (engine/io/atomic_file.h).
class GgufWriter {
 public:
  // Any value, as GgufFile reads them (a copy of another file's metadata).
  void set_value(const std::string& key, GgufValue value);
  void set_string(const std::string& key, const std::string& value);
  void set_u32(const std::string& key, uint32_t value);
  void set_i32(const std::string& key, int32_t value);
  void set_f32(const std::string& key, float value);
  void set_bool(const std::string& key, bool value);
  void set_strings(const std::string& key, const std::vector<std::string>& values);
  void set_f32s(const std::string& key, const std::vector<float>& values);
  void set_i32s(const std::string& key, const std::vector<int32_t>& values);
  // `dims` as ggml's ne (dims[0] a row's length); `data` the tensor's bytes in `type`.
  void add_tensor(const std::string& name, const std::vector<int64_t>& dims, GgmlType type,
                  std::vector<uint8_t> data);
  // A tensor whose bytes `produce` gives while write() writes it (ggml_bytes of its elements),
  // one tensor at a time: a file larger than memory is written holding one tensor.
  void add_tensor(const std::string& name, const std::vector<int64_t>& dims, GgmlType type,
                  std::function<std::vector<uint8_t>()> produce);
  void write(const std::string& path) const;

 private:
  struct Entry {
    std::string key;
    GgufValue value;
  };
  struct Tensor {
    std::string name;
    std::vector<int64_t> dims;
    GgmlType type;
    std::vector<uint8_t> data;
    std::function<std::vector<uint8_t>()> produce;  // where data is to be made while writing
    size_t bytes() const;
  };
  std::vector<Entry> metadata_;
  std::vector<Tensor> tensors_;
};

// `n` FP32 values as type `type` (n a multiple of its block size): F32 as they are; F16 and BF16
// rounded to nearest, ties to even; Q8_0 with each block's scale max|x| / 127, as llama.cpp's
// quantiser writes it.
std::vector<uint8_t> ggml_from_float(GgmlType type, const float* src, int64_t n);

// A UserError naming the file and tensor where cputrain does not convert the tensor's type.
void check_tensor_type(const GgufFile& file, const GgufTensor& tensor);
// The FP32 values of a tensor of any supported type (dequantised); a UserError naming the file
// and tensor for an unsupported type.
std::vector<float> gguf_tensor_values(const GgufFile& file, const GgufTensor& tensor);
// Converts `n` elements of type `type` at `src` to FP32 (n a multiple of the block size).
void ggml_to_float(GgmlType type, const uint8_t* src, float* dst, int64_t n);

}  // namespace cputrain
