// 16-byte vectors, and one token's K and V held in an item's lanes as them. A CUDA write loads its
// token into registers before it knows where the token goes, so that the target, the status word and
// the inputs are all in flight at once: one wait on memory per item rather than one after another.
// tests/test_write_lanes.cpp runs this on host lanes against a reference.
#pragma once

#include <cstdint>
#include <cstring>
#include <initializer_list>
#include <type_traits>

#include "kvforge/detail/config.hpp"
#include "kvforge/detail/op_args.hpp"

namespace kvforge::detail {

// 16 bytes, moved as one vector access where aligned: the target's vector type.
using target::Vec16;

// One whole vector at `at`, in one access on a device (the target's); the host (tests) copies bytes,
// which its compiler's aliasing rules need, and traps where a device would fault: on an address off
// the vector's alignment.
template <class Vector, class E> KVF_HD KVF_INLINE Vector load_vector(const E* at) {
  if constexpr (target::kOnDevice) {
    return target::device_load_vector<Vector>(at);
  } else {
    if (reinterpret_cast<uintptr_t>(at) % alignof(Vector) != 0) __builtin_trap();
    Vector v;
    std::memcpy(&v, at, sizeof v);
    return v;
  }
}
template <class Vector, class E> KVF_HD KVF_INLINE void store_vector(E* at, const Vector& v) {
  if constexpr (target::kOnDevice) {
    target::device_store_vector(at, v);
  } else {
    if (reinterpret_cast<uintptr_t>(at) % alignof(Vector) != 0) __builtin_trap();
    std::memcpy(at, &v, sizeof v);
  }
}

// Whether every row of one side of a call starts on a `bytes` boundary: its base, and each stride
// between its rows (in elements of T), are multiples of it. The host asks this once per call, so that
// a call whose every row is whole vectors runs a kernel compiled without the element-by-element path
// (ops.hpp, kSplitsOnVectors).
template <class T> bool rows_on_boundary(const T* base, std::initializer_list<int64_t> strides, int64_t bytes) {
  if (reinterpret_cast<uintptr_t>(base) % uintptr_t(bytes) != 0) return false;
  for (const int64_t stride : strides)
    if (stride * int64_t(sizeof(T)) % bytes != 0) return false;
  return true;
}

// A token's [H, D] row of K and of V as 16-byte vectors spread over `Lanes` lanes: vector i (head
// i / kPerHead, piece i % kPerHead) belongs to lane i % Lanes, the r-th of that lane at r = i / Lanes.
template <class T, int H, int D, int Lanes> struct TokenVectors {
  static constexpr bool kWhole = H > 0 && D > 0 && (D * int(sizeof(T))) % 16 == 0;
  static constexpr int kPerHead = kWhole ? D * int(sizeof(T)) / 16 : 1;
  static constexpr int kElems = 16 / int(sizeof(T));  // elements per vector
  static constexpr int kVectors = H * kPerHead;
  static constexpr int kShare = (kVectors + Lanes - 1) / Lanes;  // vectors of K (and of V) per lane
  // Whether a lane can hold its share of K and V (at most 8 vectors, 32 registers).
  static constexpr bool kHeld = kWhole && kShare >= 1 && kShare <= 4;
  static constexpr int kPerLane = kHeld ? kShare : 1;

  Vec16 k[kPerLane] KVF_HELD_INIT, v[kPerLane] KVF_HELD_INIT;  // zeroed where the target asks (the host)

  // Whether a side's rows allow 16-byte accesses.
  KVF_HD static KVF_INLINE bool aligned(const T* base, int64_t head_stride) {
    return reinterpret_cast<uintptr_t>(base) % 16 == 0 && (head_stride * int64_t(sizeof(T))) % 16 == 0;
  }

  KVF_HD KVF_INLINE void load(TokenHeads<const T> k_src, TokenHeads<const T> v_src, int lane) {
    KVF_UNROLL
    for (int r = 0; r < kPerLane; ++r) {
      const int i = lane + r * Lanes;
      if (kVectors % Lanes != 0 && i >= kVectors) break;  // lane < Lanes: only a partial share ends early
      const int h = i / kPerHead, at = i % kPerHead * kElems;
      k[r] = load_vector<Vec16>(k_src.data + h * k_src.head_stride + at);
      v[r] = load_vector<Vec16>(v_src.data + h * v_src.head_stride + at);
    }
  }

  KVF_HD KVF_INLINE void store(TokenHeads<T> k_dst, TokenHeads<T> v_dst, int lane) const {
    KVF_UNROLL
    for (int r = 0; r < kPerLane; ++r) {
      const int i = lane + r * Lanes;
      if (kVectors % Lanes != 0 && i >= kVectors) break;  // lane < Lanes: only a partial share ends early
      const int h = i / kPerHead, at = i % kPerHead * kElems;
      store_vector(k_dst.data + h * k_dst.head_stride + at, k[r]);
      store_vector(v_dst.data + h * v_dst.head_stride + at, v[r]);
    }
  }
};

}  // namespace kvforge::detail
