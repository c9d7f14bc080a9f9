// 16-byte vectors, and one token's K and V held in an item's lanes as them. A CUDA write loads its
// token into registers before it knows where the token goes, so that the target, the status word and
// the inputs are all in flight at once: one wait on memory per item rather than one after another.
// tests/test_write_lanes.cpp runs this on host lanes against a reference.
#pragma once

#include <cstdint>
#include <cstring>

#include "kvforge/config.hpp"
#include "kvforge/op_args.hpp"

namespace kvforge::detail {

// 16 bytes, moved as one vector access where aligned.
#if defined(__CUDACC__)
using Vec16 = uint4;
#else
struct alignas(16) Vec16 {
  uint32_t x, y, z, w;
};
#endif

// One whole vector at `at`, in one access on the device; the host (tests) copies bytes, which its
// compiler's aliasing rules need.
template <class Vector, class E> KVF_HD KVF_INLINE Vector load_vector(const E* at) {
#if defined(__CUDA_ARCH__)
  return *reinterpret_cast<const Vector*>(at);
#else
  Vector v;
  std::memcpy(&v, at, sizeof v);
  return v;
#endif
}
template <class Vector, class E> KVF_HD KVF_INLINE void store_vector(E* at, const Vector& v) {
#if defined(__CUDA_ARCH__)
  *reinterpret_cast<Vector*>(at) = v;
#else
  std::memcpy(at, &v, sizeof v);
#endif
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

  Vec16 k[kPerLane], v[kPerLane];

  // Whether a side's rows allow 16-byte accesses.
  KVF_HD static KVF_INLINE bool aligned(const T* base, int64_t head_stride) {
    return reinterpret_cast<uintptr_t>(base) % 16 == 0 && (head_stride * int64_t(sizeof(T))) % 16 == 0;
  }

  KVF_HD KVF_INLINE void load(TokenHeads<const T> k_src, TokenHeads<const T> v_src, int lane) {
    KVF_UNROLL
    for (int r = 0; r < kPerLane; ++r) {
      const int i = lane + r * Lanes;
      if (i >= kVectors) break;
      const int h = i / kPerHead, at = i % kPerHead * kElems;
      k[r] = load_vector<Vec16>(k_src.data + h * k_src.head_stride + at);
      v[r] = load_vector<Vec16>(v_src.data + h * v_src.head_stride + at);
    }
  }

  KVF_HD KVF_INLINE void store(TokenHeads<T> k_dst, TokenHeads<T> v_dst, int lane) const {
    KVF_UNROLL
    for (int r = 0; r < kPerLane; ++r) {
      const int i = lane + r * Lanes;
      if (i >= kVectors) break;
      const int h = i / kPerHead, at = i % kPerHead * kElems;
      store_vector(k_dst.data + h * k_dst.head_stride + at, k[r]);
      store_vector(v_dst.data + h * v_dst.head_stride + at, v[r]);
    }
  }
};

}  // namespace kvforge::detail
