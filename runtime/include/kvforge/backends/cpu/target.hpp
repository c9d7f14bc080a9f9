// The host compiler's answers to what shared kernel code (ops.hpp and the headers under it) asks of
// the hardware it is compiled for. Every translation unit that names no other target gets this one
// (config.hpp). A backend with a compiler of its own answers the same questions in its folder
// (backends/cuda/target.cuh), and its sources include that first.
#pragma once

#define KVF_TARGET cpu
#include "kvforge/detail/qualifiers.hpp"  // KVF_HD, KVF_INLINE: the host's
#define KVF_UNROLL                                         // the host compiler unrolls as it sees fit
// The loop that follows runs in the level's vectors (OpenMP's simd); _SUM lets it reorder the sum of x,
// which a float reduction needs before the compiler will vectorize it.
#define KVF_PRAGMA(x) _Pragma(#x)
#define KVF_SIMD KVF_PRAGMA(omp simd)
#define KVF_SIMD_SUM(x) KVF_PRAGMA(omp simd reduction(+ : x))
// An item's held registers start zeroed: the host compiler cannot see that a store reads only what
// the load filled (tests run the device's register paths on host lanes).
#define KVF_HELD_INIT = {}

#include <cstdint>

namespace kvforge::target {

// Whether this pass compiles code for an accelerator. Shared code takes the hooks below only where it
// does, and computes portably otherwise.
inline constexpr bool kOnDevice = false;

// 16 bytes, moved as one vector access where aligned.
struct alignas(16) Vec16 {
  uint32_t x, y, z, w;
};

// A device's hooks, declared so that shared code compiles against them; the host never calls them
// (every call sits under `if constexpr (kOnDevice)`), so they have no definition here.
template <class Vector, class E> Vector device_load_vector(const E* at);
template <class Vector, class E> void device_store_vector(E* at, const Vector& v);
int8_t device_int8(float v);
uint8_t device_fp8_e4m3(float v);
uint8_t device_fp8_e5m2(float v);

// The gate before an item writes (item_gate.hpp): the host checks every index before it loops, so
// only the status word is left to read.
template <class Checks, class Status> inline bool gate_closed(const Checks*, const Status* status) {
  return status->code != 0;
}

}  // namespace kvforge::target
