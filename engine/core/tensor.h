// A contiguous, row-major tensor of up to four dimensions. Storage is reference counted and
// comes from the tagged allocator (engine/core/memory.h); views share it.
#pragma once

#include <array>
#include <cstdint>
#include <initializer_list>
#include <memory>
#include <string>

#include "engine/core/memory.h"
#include "kernels/quant/quant.h"

namespace cputrain {

// Besides the element types, ggml's block-quantised formats (kernels/quant/quant.h): a tensor of
// one holds its blocks as a model file does, row by row, each row whole blocks. Such a tensor is
// read only by the ops that take a frozen weight (linear's products, the embedding's lookup).
enum class DType { F32, BF16, I32, Q4_0, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K, MXFP4 };
// Bytes per element of an element type; 0 for a quantised one (see dtype_bytes).
size_t dtype_size(DType dtype);
std::string_view dtype_name(DType dtype);
bool dtype_quantized(DType dtype);
kernels::QuantType quant_type(DType dtype);      // of a quantised dtype
DType quantized_dtype(kernels::QuantType type);  // its inverse
// Bytes of n elements: of a quantised dtype, n / block values blocks (n a multiple of them).
size_t dtype_bytes(DType dtype, int64_t n);

class Shape {
 public:
  static constexpr int kMaxDims = 4;
  Shape() = default;
  Shape(std::initializer_list<int64_t> dims);
  int ndim() const { return ndim_; }
  int64_t operator[](int i) const { return dims_[i]; }
  int64_t numel() const;
  bool operator==(const Shape& other) const;
  std::string str() const;

 private:
  std::array<int64_t, kMaxDims> dims_{};
  int ndim_ = 0;
};

class Storage {
 public:
  Storage(size_t bytes, MemoryCategory category);
  // `bytes` at `data`, memory that `owner` keeps alive (a mapped file): not allocated, but
  // counted under `category` while the storage lives.
  Storage(void* data, size_t bytes, MemoryCategory category, std::shared_ptr<const void> owner);
  ~Storage();
  Storage(const Storage&) = delete;
  Storage& operator=(const Storage&) = delete;
  void* data() const { return data_; }
  size_t bytes() const { return bytes_; }
  MemoryCategory category() const { return category_; }

 private:
  void* data_;
  size_t bytes_;
  MemoryCategory category_;
  std::shared_ptr<const void> owner_;  // set where the memory is not the allocator's
};

class Tensor {
 public:
  Tensor() = default;
  // Uninitialised contents.
  static Tensor empty(const Shape& shape, DType dtype, MemoryCategory category);
  static Tensor zeros(const Shape& shape, DType dtype, MemoryCategory category);
  // The elements at `data`, which `owner` keeps alive (see Storage). Read-only in practice: a
  // mapped file's pages are mapped without write permission.
  static Tensor external(const void* data, const Shape& shape, DType dtype, MemoryCategory category,
                         std::shared_ptr<const void> owner);

  bool defined() const { return storage_ != nullptr; }
  const Shape& shape() const { return shape_; }
  int64_t dim(int i) const { return shape_[i]; }
  int ndim() const { return shape_.ndim(); }
  int64_t numel() const { return shape_.numel(); }
  DType dtype() const { return dtype_; }
  size_t bytes() const { return dtype_bytes(dtype_, numel()); }
  MemoryCategory category() const { return storage_->category(); }
  // Made while measuring (engine/core/memory.h): a size and a category, no elements. fill_zero and
  // copy_from do nothing on it; its element pointers must not be read.
  bool measured() const { return storage_->data() == nullptr; }

  // The same elements under another shape of equal numel.
  Tensor reshape(const Shape& shape) const;
  // numel(shape) elements starting `offset` elements in, sharing storage.
  Tensor view(int64_t offset, const Shape& shape) const;

  float* f32() const;
  uint16_t* bf16() const;
  int32_t* i32() const;
  void* raw() const;
  // A quantised (rows, cols) tensor as the quantised products take it.
  kernels::QuantMatrix quant() const;

  void fill_zero() const;
  // Copies values of equal dtype and numel.
  void copy_from(const Tensor& other) const;

 private:
  std::shared_ptr<Storage> storage_;
  int64_t offset_ = 0;  // in elements
  Shape shape_;
  DType dtype_ = DType::F32;
};

}  // namespace cputrain
