// Non-owning views of device or host memory, as every kvforge call takes them.
#pragma once

#include <array>
#include <cstdint>
#include <string>

#include "kvforge/dtype.hpp"
#include "kvforge/vocab.hpp"  // Device

namespace kvforge {


// A rank-3 view: append takes [tokens, heads, head_dim], gather writes [heads, tokens, head_dim].
// Strides are in elements; the last axis must be contiguous (stride 1).
struct TensorView {
  void* data = nullptr;
  DType dtype = DType::f32;
  Device device = Device::cpu;
  std::array<int64_t, 3> shape{0, 0, 0};
  std::array<int64_t, 3> stride{0, 0, 1};

  static TensorView contiguous(void* data, DType dtype, Device device, int64_t d0, int64_t d1, int64_t d2) {
    return TensorView{data, dtype, device, {d0, d1, d2}, {d1 * d2, d2, 1}};
  }
};

// A 1-D array of indices (rows, positions, slots, pages, beams or block pairs).
struct IndexView {
  const void* data = nullptr;
  DType dtype = DType::i32;
  Device device = Device::cpu;
  int64_t size = 0;

  static IndexView of(const int32_t* p, int64_t n, Device d = Device::cpu) { return {p, DType::i32, d, n}; }
  static IndexView of(const int64_t* p, int64_t n, Device d = Device::cpu) { return {p, DType::i64, d, n}; }
};

}  // namespace kvforge
