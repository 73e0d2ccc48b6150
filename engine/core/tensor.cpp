#include "engine/core/tensor.h"

#include <algorithm>
#include <cassert>
#include <cstring>
#include <stdexcept>
#include <utility>

namespace cputrain {

size_t dtype_size(DType dtype) {
  switch (dtype) {
    case DType::F32:
      return 4;
    case DType::BF16:
      return 2;
    case DType::I32:
      return 4;
    case DType::Q4_0:
    case DType::Q5_0:
    case DType::Q5_1:
    case DType::Q8_0:
    case DType::Q4_K:
    case DType::Q5_K:
    case DType::Q6_K:
    case DType::MXFP4:
      return 0;
  }
  return 0;
}

bool dtype_quantized(DType dtype) {
  return dtype != DType::F32 && dtype != DType::BF16 && dtype != DType::I32;
}

// The quantised dtypes are the kernels' formats in their order, from Q4_0.
static_assert(static_cast<int>(DType::MXFP4) - static_cast<int>(DType::Q4_0) ==
                  static_cast<int>(kernels::QuantType::MXFP4) -
                      static_cast<int>(kernels::QuantType::Q4_0) &&
              static_cast<int>(DType::Q4_K) - static_cast<int>(DType::Q4_0) ==
                  static_cast<int>(kernels::QuantType::Q4_K) -
                      static_cast<int>(kernels::QuantType::Q4_0));

kernels::QuantType quant_type(DType dtype) {
  if (!dtype_quantized(dtype))
    throw std::logic_error("quant_type of " + std::string(dtype_name(dtype)));
  return static_cast<kernels::QuantType>(static_cast<int>(dtype) - static_cast<int>(DType::Q4_0) +
                                         static_cast<int>(kernels::QuantType::Q4_0));
}

DType quantized_dtype(kernels::QuantType type) {
  return static_cast<DType>(static_cast<int>(type) - static_cast<int>(kernels::QuantType::Q4_0) +
                            static_cast<int>(DType::Q4_0));
}

size_t dtype_bytes(DType dtype, int64_t n) {
  if (!dtype_quantized(dtype)) return static_cast<size_t>(n) * dtype_size(dtype);
  const kernels::QuantType q = quant_type(dtype);
  if (n % kernels::quant_block_values(q) != 0)
    throw std::logic_error("dtype_bytes: a part of a block of " + std::string(dtype_name(dtype)));
  return static_cast<size_t>(n / kernels::quant_block_values(q) * kernels::quant_block_bytes(q));
}

std::string_view dtype_name(DType dtype) {
  switch (dtype) {
    case DType::F32:
      return "f32";
    case DType::BF16:
      return "bf16";
    case DType::I32:
      return "i32";
    case DType::Q4_0:
      return "q4_0";
    case DType::Q5_0:
      return "q5_0";
    case DType::Q5_1:
      return "q5_1";
    case DType::Q8_0:
      return "q8_0";
    case DType::Q4_K:
      return "q4_k";
    case DType::Q5_K:
      return "q5_k";
    case DType::Q6_K:
      return "q6_k";
    case DType::MXFP4:
      return "mxfp4";
  }
  return "unknown";
}

Shape::Shape(std::initializer_list<int64_t> dims) {
  if (dims.size() > kMaxDims) throw std::invalid_argument("Shape: more than 4 dimensions");
  for (int64_t d : dims) dims_[ndim_++] = d;
}

int64_t Shape::numel() const {
  int64_t n = 1;
  for (int i = 0; i < ndim_; ++i) n *= dims_[i];
  return n;
}

bool Shape::operator==(const Shape& other) const {
  if (ndim_ != other.ndim_) return false;
  for (int i = 0; i < ndim_; ++i)
    if (dims_[i] != other.dims_[i]) return false;
  return true;
}

std::string Shape::str() const {
  std::string s = "(";
  for (int i = 0; i < ndim_; ++i) s += (i ? ", " : "") + std::to_string(dims_[i]);
  return s + ")";
}

Storage::Storage(size_t bytes, MemoryCategory category)
    : data_(memory_allocate(bytes, category)), bytes_(bytes), category_(category) {}

Storage::Storage(void* data, size_t bytes, MemoryCategory category,
                 std::shared_ptr<const void> owner)
    : data_(data), bytes_(bytes), category_(category), owner_(std::move(owner)) {
  memory_count_mapped(bytes_, category_, true);
}

Storage::~Storage() {
  if (owner_)
    memory_count_mapped(bytes_, category_, false);
  else
    memory_free(data_, bytes_, category_);
}

Tensor Tensor::empty(const Shape& shape, DType dtype, MemoryCategory category) {
  Tensor t;
  t.storage_ = std::make_shared<Storage>(dtype_bytes(dtype, shape.numel()), category);
  t.shape_ = shape;
  t.dtype_ = dtype;
  return t;
}

Tensor Tensor::external(const void* data, const Shape& shape, DType dtype, MemoryCategory category,
                        std::shared_ptr<const void> owner) {
  if (!owner) throw std::logic_error("Tensor::external without an owner");
  Tensor t;
  t.storage_ = std::make_shared<Storage>(const_cast<void*>(data), dtype_bytes(dtype, shape.numel()),
                                         category, std::move(owner));
  t.shape_ = shape;
  t.dtype_ = dtype;
  return t;
}

Tensor Tensor::zeros(const Shape& shape, DType dtype, MemoryCategory category) {
  Tensor t = empty(shape, dtype, category);
  t.fill_zero();
  return t;
}

Tensor Tensor::reshape(const Shape& shape) const {
  if (shape.numel() != numel())
    throw std::invalid_argument("reshape " + shape_.str() + " to " + shape.str());
  Tensor t = *this;
  t.shape_ = shape;
  return t;
}

Tensor Tensor::view(int64_t offset, const Shape& shape) const {
  if (offset < 0 || offset + shape.numel() > numel())
    throw std::invalid_argument("view out of range of " + shape_.str());
  Tensor t = *this;
  t.offset_ = offset_ + offset;
  t.shape_ = shape;
  return t;
}

void* Tensor::raw() const {
  return static_cast<char*>(storage_->data()) + dtype_bytes(dtype_, offset_);
}

kernels::QuantMatrix Tensor::quant() const {
  assert(dtype_quantized(dtype_) && ndim() >= 2);
  // A 3-D tensor (a mixture's experts) as the matrix of all its rows.
  const int64_t cols = dim(ndim() - 1);
  return {quant_type(dtype_), static_cast<const uint8_t*>(raw()), numel() / cols, cols};
}

float* Tensor::f32() const {
  assert(dtype_ == DType::F32);
  return static_cast<float*>(raw());
}

uint16_t* Tensor::bf16() const {
  assert(dtype_ == DType::BF16);
  return static_cast<uint16_t*>(raw());
}

int32_t* Tensor::i32() const {
  assert(dtype_ == DType::I32);
  return static_cast<int32_t*>(raw());
}

void Tensor::fill_zero() const {
  if (measured()) return;
  // Large tensors (a model's gradients) in chunks over the threads: one core's stores reach a
  // fraction of what the memory takes.
  constexpr int64_t kChunk = int64_t{1} << 20;
  const auto n = static_cast<int64_t>(bytes());
  auto* p = static_cast<char*>(raw());
  if (n < 4 * kChunk) {
    std::memset(p, 0, static_cast<size_t>(n));
    return;
  }
  const int64_t chunks = (n + kChunk - 1) / kChunk;
#pragma omp parallel for schedule(static)
  for (int64_t c = 0; c < chunks; ++c)
    std::memset(p + c * kChunk, 0, static_cast<size_t>(std::min(kChunk, n - c * kChunk)));
}

void Tensor::copy_from(const Tensor& other) const {
  if (other.dtype_ != dtype_ || other.numel() != numel())
    throw std::invalid_argument("copy_from: " + other.shape_.str() + " to " + shape_.str());
  if (!measured()) std::memcpy(raw(), other.raw(), bytes());
}

}  // namespace cputrain
