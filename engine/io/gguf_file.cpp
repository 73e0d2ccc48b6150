#include "engine/io/gguf_file.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <optional>
#include <stdexcept>

#include "engine/core/error.h"
#include "engine/core/memory.h"
#include "engine/io/atomic_file.h"
#include "kernels/quant/quant.h"

namespace cputrain {
namespace {

constexpr uint32_t kMagic = 0x46554747;  // "GGUF", little-endian
constexpr uint64_t kMaxDims = 4;

// A cursor over the mapped bytes: every read is checked against the end.
class Cursor {
 public:
  Cursor(const uint8_t* data, size_t size, const std::string& path)
      : data_(data), size_(size), path_(path) {}
  template <typename T>
  T value(const char* what) {
    T v;
    std::memcpy(&v, take(sizeof(T), what), sizeof(T));
    return v;
  }
  std::string string(const char* what) {
    const uint64_t n = value<uint64_t>(what);
    if (n > size_ - pos_) fail(std::string(what) + " runs past the end of the file");
    return std::string(reinterpret_cast<const char*>(take(n, what)), n);
  }
  // A count of items each at least `min_bytes` long: never more than the bytes left can hold.
  uint64_t count(const char* what, size_t min_bytes) {
    const uint64_t n = value<uint64_t>(what);
    if (min_bytes > 0 && n > (size_ - pos_) / min_bytes)
      fail(std::string(what) + " (" + std::to_string(n) + ") exceeds what the file holds");
    return n;
  }
  size_t pos() const { return pos_; }
  [[noreturn]] void fail(const std::string& what) const {
    throw UserError(path_ + ": not a valid GGUF file: " + what + " (at byte " +
                    std::to_string(pos_) + ")");
  }

 private:
  const uint8_t* take(size_t n, const char* what) {
    if (n > size_ - pos_) fail(std::string("truncated in ") + what);
    const uint8_t* p = data_ + pos_;
    pos_ += n;
    return p;
  }
  const uint8_t* data_;
  size_t size_;
  size_t pos_ = 0;
  const std::string& path_;
};

size_t scalar_bytes(GgufType t) {
  switch (t) {
    case GgufType::U8:
    case GgufType::I8:
    case GgufType::Bool:
      return 1;
    case GgufType::U16:
    case GgufType::I16:
      return 2;
    case GgufType::U32:
    case GgufType::I32:
    case GgufType::F32:
      return 4;
    case GgufType::U64:
    case GgufType::I64:
    case GgufType::F64:
      return 8;
    case GgufType::String:
      return 8;  // at least its length
    case GgufType::Array:
      return 12;
  }
  return 0;
}

bool known_type(uint32_t t) {
  return t <= static_cast<uint32_t>(GgufType::F64);
}

// One scalar of type t: its value as a double, and its bits for the 64-bit integers.
double read_number(Cursor& c, GgufType t, uint64_t* bits) {
  switch (t) {
    case GgufType::U8:
      return c.value<uint8_t>("a u8");
    case GgufType::I8:
      return c.value<int8_t>("an i8");
    case GgufType::U16:
      return c.value<uint16_t>("a u16");
    case GgufType::I16:
      return c.value<int16_t>("an i16");
    case GgufType::U32:
      return c.value<uint32_t>("a u32");
    case GgufType::I32:
      return c.value<int32_t>("an i32");
    case GgufType::F32:
      return c.value<float>("an f32");
    case GgufType::Bool: {
      const uint8_t b = c.value<uint8_t>("a bool");
      if (b > 1) c.fail("a bool of value " + std::to_string(b));
      return b;
    }
    case GgufType::U64: {
      const uint64_t v = c.value<uint64_t>("a u64");
      if (bits) *bits = v;
      return static_cast<double>(v);
    }
    case GgufType::I64: {
      const int64_t v = c.value<int64_t>("an i64");
      if (bits) *bits = static_cast<uint64_t>(v);
      return static_cast<double>(v);
    }
    case GgufType::F64:
      return c.value<double>("an f64");
    default:
      c.fail("a value of type " + std::to_string(static_cast<uint32_t>(t)));
  }
}

GgufValue read_value(Cursor& c, GgufType type) {
  GgufValue v;
  v.type = type;
  if (type == GgufType::String) {
    v.text = c.string("a string value");
  } else if (type == GgufType::Array) {
    const uint32_t element = c.value<uint32_t>("an array's type");
    if (!known_type(element) || element == static_cast<uint32_t>(GgufType::Array))
      c.fail("an array of type " + std::to_string(element));
    v.element = static_cast<GgufType>(element);
    const uint64_t n = c.count("an array's length", scalar_bytes(v.element));
    if (v.element == GgufType::String) {
      v.strings.reserve(n);
      for (uint64_t i = 0; i < n; ++i) v.strings.push_back(c.string("an array's string"));
    } else {
      v.numbers.reserve(n);
      for (uint64_t i = 0; i < n; ++i) v.numbers.push_back(read_number(c, v.element, nullptr));
    }
  } else {
    v.number = read_number(c, type, &v.bits);
    if (type != GgufType::U64 && type != GgufType::I64)
      v.bits = static_cast<uint64_t>(static_cast<int64_t>(v.number));
  }
  return v;
}

uint16_t float_to_bf16(float f) {
  uint32_t x;
  std::memcpy(&x, &f, 4);
  if ((x & 0x7fffffff) > 0x7f800000) return static_cast<uint16_t>((x >> 16) | 0x40);  // NaN
  return static_cast<uint16_t>((x + 0x7fff + ((x >> 16) & 1)) >> 16);
}

uint16_t load_u16(const uint8_t* p) {
  uint16_t v;
  std::memcpy(&v, p, 2);
  return v;
}

}  // namespace

std::string ggml_type_name(uint32_t type) {
  switch (type) {
    case 0:
      return "F32";
    case 1:
      return "F16";
    case 2:
      return "Q4_0";
    case 3:
      return "Q4_1";
    case 6:
      return "Q5_0";
    case 7:
      return "Q5_1";
    case 8:
      return "Q8_0";
    case 9:
      return "Q8_1";
    case 10:
      return "Q2_K";
    case 11:
      return "Q3_K";
    case 12:
      return "Q4_K";
    case 13:
      return "Q5_K";
    case 14:
      return "Q6_K";
    case 15:
      return "Q8_K";
    case 16:
      return "IQ2_XXS";
    case 17:
      return "IQ2_XS";
    case 18:
      return "IQ3_XXS";
    case 19:
      return "IQ1_S";
    case 20:
      return "IQ4_NL";
    case 21:
      return "IQ3_S";
    case 22:
      return "IQ2_S";
    case 23:
      return "IQ4_XS";
    case 24:
      return "I8";
    case 25:
      return "I16";
    case 26:
      return "I32";
    case 27:
      return "I64";
    case 28:
      return "F64";
    case 29:
      return "IQ1_M";
    case 30:
      return "BF16";
    case 34:
      return "TQ1_0";
    case 35:
      return "TQ2_0";
    case 39:
      return "MXFP4";
    case 40:
      return "NVFP4";
    case 41:
      return "Q1_0";
    case 42:
      return "Q2_0";
    default:
      return "type " + std::to_string(type);
  }
}

bool ggml_type_supported(uint32_t type) {
  switch (static_cast<GgmlType>(type)) {
    case GgmlType::F32:
    case GgmlType::F16:
    case GgmlType::BF16:
    case GgmlType::Q4_0:
    case GgmlType::Q5_0:
    case GgmlType::Q5_1:
    case GgmlType::Q8_0:
    case GgmlType::Q4_K:
    case GgmlType::Q5_K:
    case GgmlType::Q6_K:
    case GgmlType::MXFP4:
      return true;
  }
  return false;
}

std::optional<kernels::QuantType> ggml_quant_type(GgmlType type) {
  switch (type) {
    case GgmlType::Q4_0:
      return kernels::QuantType::Q4_0;
    case GgmlType::Q5_0:
      return kernels::QuantType::Q5_0;
    case GgmlType::Q5_1:
      return kernels::QuantType::Q5_1;
    case GgmlType::Q8_0:
      return kernels::QuantType::Q8_0;
    case GgmlType::Q4_K:
      return kernels::QuantType::Q4_K;
    case GgmlType::Q5_K:
      return kernels::QuantType::Q5_K;
    case GgmlType::Q6_K:
      return kernels::QuantType::Q6_K;
    case GgmlType::MXFP4:
      return kernels::QuantType::MXFP4;
    case GgmlType::F32:
    case GgmlType::F16:
    case GgmlType::BF16:
      break;
  }
  return std::nullopt;
}

int64_t ggml_block_size(GgmlType type) {
  const auto q = ggml_quant_type(type);
  return q ? kernels::quant_block_values(*q) : 1;
}

size_t ggml_block_bytes(GgmlType type) {
  if (const auto q = ggml_quant_type(type))
    return static_cast<size_t>(kernels::quant_block_bytes(*q));
  return type == GgmlType::F32 ? 4 : 2;
}

size_t ggml_bytes(GgmlType type, int64_t n) {
  return static_cast<size_t>(n / ggml_block_size(type)) * ggml_block_bytes(type);
}

int64_t GgufTensor::numel() const {
  int64_t n = 1;
  for (int64_t d : dims) n *= d;
  return n;
}

GgufFile::GgufFile(const std::string& path) : path_(path), file_(path) {
  const uint8_t* bytes = file_.data();
  const size_t size_ = file_.size();
  Cursor c(bytes, size_, path_);
  if (size_ < 4 || c.value<uint32_t>("the magic") != kMagic)
    throw UserError(path + ": not a GGUF file (it does not begin with \"GGUF\")");
  version_ = c.value<uint32_t>("the version");
  if (version_ != 2 && version_ != 3)
    throw UserError(path + ": GGUF version " + std::to_string(version_) +
                    ", which cputrain does not read (2 and 3)");
  const uint64_t n_tensors = c.count("the tensor count", 8 + 4 + 8 + 4 + 8);
  const uint64_t n_kv = c.count("the metadata count", 8 + 4 + 1);
  for (uint64_t i = 0; i < n_kv; ++i) {
    std::string key = c.string("a metadata key");
    const uint32_t type = c.value<uint32_t>("a metadata type");
    if (!known_type(type)) c.fail("metadata " + key + " of type " + std::to_string(type));
    metadata_[key] = read_value(c, static_cast<GgufType>(type));
  }
  size_t alignment = 32;
  if (const GgufValue* a = find("general.alignment")) {
    const auto v = static_cast<uint64_t>(a->number);
    if (v == 0 || (v & (v - 1)) != 0 || v > 65536)
      c.fail("general.alignment " + std::to_string(v) + " is not a power of two");
    alignment = v;
  }
  tensors_.reserve(n_tensors);
  for (uint64_t i = 0; i < n_tensors; ++i) {
    GgufTensor t;
    t.name = c.string("a tensor name");
    const uint32_t n_dims = c.value<uint32_t>("a tensor's dimension count");
    if (n_dims == 0 || n_dims > kMaxDims)
      c.fail("tensor " + t.name + " has " + std::to_string(n_dims) + " dimensions");
    int64_t numel = 1;
    for (uint32_t d = 0; d < n_dims; ++d) {
      const uint64_t dim = c.value<uint64_t>("a tensor's dimension");
      if (dim == 0 || dim > (uint64_t{1} << 40) ||
          static_cast<uint64_t>(numel) > (uint64_t{1} << 40) / dim)
        c.fail("tensor " + t.name + " has a dimension of " + std::to_string(dim));
      t.dims.push_back(static_cast<int64_t>(dim));
      numel *= static_cast<int64_t>(dim);
    }
    t.type = c.value<uint32_t>("a tensor's type");
    t.offset = c.value<uint64_t>("a tensor's offset");
    if (t.offset % alignment != 0) c.fail("tensor " + t.name + " is not aligned");
    if (by_name_.count(t.name)) c.fail("tensor " + t.name + " appears twice");
    by_name_[t.name] = tensors_.size();
    tensors_.push_back(std::move(t));
  }
  const size_t data_start = (c.pos() + alignment - 1) / alignment * alignment;
  for (GgufTensor& t : tensors_) {
    if (!ggml_type_supported(t.type)) continue;
    const auto type = static_cast<GgmlType>(t.type);
    if (t.dims[0] % ggml_block_size(type) != 0)
      c.fail("tensor " + t.name + "'s rows of " + std::to_string(t.dims[0]) +
             " are not whole blocks of " + ggml_type_name(t.type));
    const size_t n = ggml_bytes(type, t.numel());
    if (data_start > size_ || t.offset > size_ - data_start || n > size_ - data_start - t.offset)
      throw UserError(path + ": truncated: tensor " + t.name + " runs past the end of the file");
    t.data = {bytes + data_start + t.offset, n};
  }
}

int64_t GgufFile::heap_bytes() const {
  // A std::map node: its links and colour (32 bytes) and its pair.
  constexpr int64_t kMapNode = 32;
  int64_t bytes = 0;
  for (const auto& [key, value] : metadata_) {
    bytes += heap_chunk_bytes(kMapNode + static_cast<int64_t>(sizeof(key) + sizeof(value)));
    bytes += heap_bytes_of(key) + heap_bytes_of(value.text) + heap_bytes_of(value.strings) +
             heap_bytes_of(value.numbers);
    for (const std::string& s : value.strings) bytes += heap_bytes_of(s);
  }
  bytes += heap_bytes_of(tensors_);
  for (const GgufTensor& t : tensors_) bytes += heap_bytes_of(t.name) + heap_bytes_of(t.dims);
  for (const auto& [name, index] : by_name_)
    bytes += heap_chunk_bytes(kMapNode + static_cast<int64_t>(sizeof(name) + sizeof(index))) +
             heap_bytes_of(name);
  return bytes;
}

const GgufValue* GgufFile::find(const std::string& key) const {
  const auto it = metadata_.find(key);
  return it == metadata_.end() ? nullptr : &it->second;
}

const GgufTensor* GgufFile::tensor(const std::string& name) const {
  const auto it = by_name_.find(name);
  return it == by_name_.end() ? nullptr : &tensors_[it->second];
}

namespace {

bool is_number(GgufType t) {
  return t != GgufType::String && t != GgufType::Array;
}

}  // namespace

std::string GgufFile::string(const std::string& key) const {
  const GgufValue* v = find(key);
  if (!v) throw UserError(path_ + ": no metadata " + key);
  if (v->type != GgufType::String)
    throw UserError(path_ + ": metadata " + key + " is not a string");
  return v->text;
}

std::string GgufFile::string(const std::string& key, const std::string& fallback) const {
  return find(key) ? string(key) : fallback;
}

int64_t GgufFile::integer(const std::string& key) const {
  const GgufValue* v = find(key);
  if (!v) throw UserError(path_ + ": no metadata " + key);
  if (!is_number(v->type) || v->type == GgufType::F32 || v->type == GgufType::F64)
    throw UserError(path_ + ": metadata " + key + " is not an integer");
  if (v->type == GgufType::U64 && v->bits > static_cast<uint64_t>(INT64_MAX))
    throw UserError(path_ + ": metadata " + key + " " + std::to_string(v->bits) +
                    " is more than cputrain reads (2^63 - 1)");
  return static_cast<int64_t>(v->bits);
}

int64_t GgufFile::integer(const std::string& key, int64_t fallback) const {
  return find(key) ? integer(key) : fallback;
}

double GgufFile::number(const std::string& key, double fallback) const {
  const GgufValue* v = find(key);
  if (!v) return fallback;
  if (!is_number(v->type)) throw UserError(path_ + ": metadata " + key + " is not a number");
  return v->number;
}

bool GgufFile::flag(const std::string& key, bool fallback) const {
  const GgufValue* v = find(key);
  if (!v) return fallback;
  if (v->type != GgufType::Bool) throw UserError(path_ + ": metadata " + key + " is not a bool");
  return v->number != 0.0;
}

const std::vector<std::string>& GgufFile::strings(const std::string& key) const {
  const GgufValue* v = find(key);
  if (!v) throw UserError(path_ + ": no metadata " + key);
  if (v->type != GgufType::Array || v->element != GgufType::String)
    throw UserError(path_ + ": metadata " + key + " is not an array of strings");
  return v->strings;
}

const std::vector<double>& GgufFile::numbers(const std::string& key) const {
  const GgufValue* v = find(key);
  if (!v) throw UserError(path_ + ": no metadata " + key);
  if (v->type != GgufType::Array || !is_number(v->element))
    throw UserError(path_ + ": metadata " + key + " is not an array of numbers");
  return v->numbers;
}

void ggml_to_float(GgmlType type, const uint8_t* src, float* dst, int64_t n) {
  if (const auto q = ggml_quant_type(type)) {
    kernels::dequantize_blocks(*q, src, n / kernels::quant_block_values(*q), dst);
    return;
  }
  switch (type) {
    case GgmlType::F32:
      std::memcpy(dst, src, static_cast<size_t>(n) * 4);
      return;
    case GgmlType::F16:
      for (int64_t i = 0; i < n; ++i) dst[i] = kernels::half_to_fp32(load_u16(src + 2 * i));
      return;
    case GgmlType::BF16:
      for (int64_t i = 0; i < n; ++i) {
        const uint32_t bits = static_cast<uint32_t>(load_u16(src + 2 * i)) << 16;
        std::memcpy(dst + i, &bits, 4);
      }
      return;
    default:  // the quantised types, above
      return;
  }
}

std::vector<uint8_t> ggml_from_float(GgmlType type, const float* src, int64_t n) {
  std::vector<uint8_t> out(ggml_bytes(type, n));
  uint8_t* dst = out.data();
  const auto store16 = [](uint8_t* p, uint16_t v) { std::memcpy(p, &v, 2); };
  switch (type) {
    case GgmlType::F32:
      std::memcpy(dst, src, static_cast<size_t>(n) * 4);
      break;
    case GgmlType::F16:
      for (int64_t i = 0; i < n; ++i) store16(dst + 2 * i, kernels::fp32_to_half(src[i]));
      break;
    case GgmlType::BF16:
      for (int64_t i = 0; i < n; ++i) store16(dst + 2 * i, float_to_bf16(src[i]));
      break;
    case GgmlType::Q8_0:
      for (int64_t b = 0; b < n / 32; ++b, src += 32, dst += 34) {
        float amax = 0.0f;
        for (int i = 0; i < 32; ++i) amax = std::max(amax, std::abs(src[i]));
        const float d = amax / 127.0f;
        const float id = d != 0.0f ? 1.0f / d : 0.0f;
        store16(dst, kernels::fp32_to_half(d));
        for (int i = 0; i < 32; ++i)
          dst[2 + i] = static_cast<uint8_t>(static_cast<int8_t>(std::lround(src[i] * id)));
      }
      break;
    case GgmlType::Q5_0:
    case GgmlType::Q4_K:
    case GgmlType::Q6_K: {
      const kernels::QuantType q = *ggml_quant_type(type);
      kernels::quantize_blocks(q, src, n / kernels::quant_block_values(q), dst);
      break;
    }
    default:
      throw std::logic_error(
          "ggml_from_float: cputrain writes F32, F16, BF16, Q8_0, Q5_0, Q4_K, Q6_K");
  }
  return out;
}

void GgufWriter::set_value(const std::string& key, GgufValue value) {
  for (Entry& e : metadata_)
    if (e.key == key) {
      e.value = std::move(value);
      return;
    }
  metadata_.push_back({key, std::move(value)});
}

void GgufWriter::set_string(const std::string& key, const std::string& value) {
  GgufValue v;
  v.type = GgufType::String;
  v.text = value;
  set_value(key, std::move(v));
}

void GgufWriter::set_u32(const std::string& key, uint32_t value) {
  GgufValue v;
  v.type = GgufType::U32;
  v.number = value;
  v.bits = value;
  set_value(key, std::move(v));
}

void GgufWriter::set_i32(const std::string& key, int32_t value) {
  GgufValue v;
  v.type = GgufType::I32;
  v.number = value;
  v.bits = static_cast<uint64_t>(static_cast<int64_t>(value));
  set_value(key, std::move(v));
}

void GgufWriter::set_f32(const std::string& key, float value) {
  GgufValue v;
  v.type = GgufType::F32;
  v.number = value;
  set_value(key, std::move(v));
}

void GgufWriter::set_bool(const std::string& key, bool value) {
  GgufValue v;
  v.type = GgufType::Bool;
  v.number = value ? 1.0 : 0.0;
  set_value(key, std::move(v));
}

void GgufWriter::set_strings(const std::string& key, const std::vector<std::string>& values) {
  GgufValue v;
  v.type = GgufType::Array;
  v.element = GgufType::String;
  v.strings = values;
  set_value(key, std::move(v));
}

void GgufWriter::set_f32s(const std::string& key, const std::vector<float>& values) {
  GgufValue v;
  v.type = GgufType::Array;
  v.element = GgufType::F32;
  v.numbers.assign(values.begin(), values.end());
  set_value(key, std::move(v));
}

void GgufWriter::set_i32s(const std::string& key, const std::vector<int32_t>& values) {
  GgufValue v;
  v.type = GgufType::Array;
  v.element = GgufType::I32;
  v.numbers.assign(values.begin(), values.end());
  set_value(key, std::move(v));
}

void GgufWriter::add_tensor(const std::string& name, const std::vector<int64_t>& dims,
                            GgmlType type, std::vector<uint8_t> data) {
  tensors_.push_back({name, dims, type, std::move(data), nullptr});
}

void GgufWriter::add_tensor(const std::string& name, const std::vector<int64_t>& dims,
                            GgmlType type, std::function<std::vector<uint8_t>()> produce) {
  tensors_.push_back({name, dims, type, {}, std::move(produce)});
}

size_t GgufWriter::Tensor::bytes() const {
  if (!produce) return data.size();
  int64_t n = 1;
  for (int64_t d : dims) n *= d;
  return ggml_bytes(type, n);
}

void GgufWriter::write(const std::string& path) const {
  constexpr size_t kAlign = 32;
  AtomicFileWriter out(path);
  size_t written = 0;
  const auto bytes = [&](const void* p, size_t n) {
    out.write(p, n);
    written += n;
  };
  const auto u32 = [&](uint32_t v) { bytes(&v, 4); };
  const auto u64 = [&](uint64_t v) { bytes(&v, 8); };
  const auto str = [&](const std::string& s) {
    u64(s.size());
    bytes(s.data(), s.size());
  };
  // One number of type t; 64-bit integers from their bits where given.
  const auto scalar = [&](GgufType t, double x, uint64_t bits) {
    const auto put = [&](auto v) { bytes(&v, sizeof(v)); };
    switch (t) {
      case GgufType::U8:
        put(static_cast<uint8_t>(x));
        break;
      case GgufType::I8:
        put(static_cast<int8_t>(x));
        break;
      case GgufType::U16:
        put(static_cast<uint16_t>(x));
        break;
      case GgufType::I16:
        put(static_cast<int16_t>(x));
        break;
      case GgufType::U32:
        put(static_cast<uint32_t>(x));
        break;
      case GgufType::I32:
        put(static_cast<int32_t>(x));
        break;
      case GgufType::F32:
        put(static_cast<float>(x));
        break;
      case GgufType::Bool:
        put(static_cast<uint8_t>(x != 0.0));
        break;
      case GgufType::U64:
        put(bits);
        break;
      case GgufType::I64:
        put(static_cast<int64_t>(bits));
        break;
      case GgufType::F64:
        put(x);
        break;
      default:
        throw std::logic_error("GgufWriter: a string or array where a number belongs");
    }
  };
  u32(kMagic);
  u32(3);
  u64(tensors_.size());
  u64(metadata_.size());
  for (const Entry& e : metadata_) {
    str(e.key);
    u32(static_cast<uint32_t>(e.value.type));
    if (e.value.type == GgufType::String) {
      str(e.value.text);
    } else if (e.value.type == GgufType::Array) {
      u32(static_cast<uint32_t>(e.value.element));
      if (e.value.element == GgufType::String) {
        u64(e.value.strings.size());
        for (const std::string& s : e.value.strings) str(s);
      } else {
        u64(e.value.numbers.size());
        for (double x : e.value.numbers)
          scalar(e.value.element, x, static_cast<uint64_t>(static_cast<int64_t>(x)));
      }
    } else {
      scalar(e.value.type, e.value.number, e.value.bits);
    }
  }
  uint64_t offset = 0;
  for (const Tensor& t : tensors_) {
    str(t.name);
    u32(static_cast<uint32_t>(t.dims.size()));
    for (int64_t d : t.dims) u64(static_cast<uint64_t>(d));
    u32(static_cast<uint32_t>(t.type));
    u64(offset);
    offset += (t.bytes() + kAlign - 1) / kAlign * kAlign;
  }
  const char zeros[kAlign] = {};
  bytes(zeros, (kAlign - written % kAlign) % kAlign);
  for (const Tensor& t : tensors_) {
    if (t.produce) {
      const std::vector<uint8_t> data = t.produce();
      if (data.size() != t.bytes())
        throw std::logic_error("GgufWriter: tensor " + t.name + " made of another size");
      bytes(data.data(), data.size());
    } else {
      bytes(t.data.data(), t.data.size());
    }
    bytes(zeros, (kAlign - t.bytes() % kAlign) % kAlign);
  }
  out.commit();
}

void check_tensor_type(const GgufFile& file, const GgufTensor& tensor) {
  if (!ggml_type_supported(tensor.type))
    throw UserError(file.path() + ": tensor " + tensor.name + " is " + ggml_type_name(tensor.type) +
                    ", a type cputrain does not read (F32, F16, BF16, Q4_0, Q5_0, Q5_1, Q8_0, "
                    "Q4_K, Q5_K, Q6_K, MXFP4)");
}

std::vector<float> gguf_tensor_values(const GgufFile& file, const GgufTensor& tensor) {
  check_tensor_type(file, tensor);
  std::vector<float> values(static_cast<size_t>(tensor.numel()));
  ggml_to_float(static_cast<GgmlType>(tensor.type), tensor.data.data(), values.data(),
                tensor.numel());
  return values;
}

}  // namespace cputrain
