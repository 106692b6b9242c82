// Non-owning tensor views: a pointer, a dtype and a row-major shape.
//
// Views never own or copy memory; whoever creates one keeps the storage alive (an mmap'ed
// safetensors file, a std::vector, a device allocation). Expensive copies are explicit calls.
#pragma once

#include <cstdint>
#include <initializer_list>
#include <string>
#include <vector>

#include "common/dtype.h"

namespace rubato {

// Row-major shape. Rank 0 is a scalar with one element.
struct Shape {
  std::vector<int64_t> dims;

  Shape() = default;
  Shape(std::initializer_list<int64_t> d) : dims(d) {}
  explicit Shape(std::vector<int64_t> d) : dims(std::move(d)) {}

  int rank() const { return static_cast<int>(dims.size()); }
  int64_t operator[](int i) const { return dims[static_cast<size_t>(i)]; }
  int64_t numel() const {
    int64_t n = 1;
    for (int64_t d : dims) n *= d;
    return n;
  }
  bool operator==(const Shape& other) const { return dims == other.dims; }
  bool operator!=(const Shape& other) const { return dims != other.dims; }

  // "[4096, 128]"
  std::string ToString() const {
    std::string s = "[";
    for (size_t i = 0; i < dims.size(); ++i) {
      if (i) s += ", ";
      s += std::to_string(dims[i]);
    }
    return s + "]";
  }
};

// A read-only view of contiguous row-major data of any storage dtype.
struct TensorView {
  const void* data = nullptr;
  DType dtype = DType::kF32;
  Shape shape;

  int64_t numel() const { return shape.numel(); }
  size_t nbytes() const { return static_cast<size_t>(numel()) * DTypeSize(dtype); }
};

// A mutable fp32 view, the working type of the CPU backend.
struct F32View {
  float* data = nullptr;
  Shape shape;

  int64_t numel() const { return shape.numel(); }
};

}  // namespace rubato
