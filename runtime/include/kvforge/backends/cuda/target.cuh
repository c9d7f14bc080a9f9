// nvcc's answers to what shared kernel code asks of the hardware (the questions are listed in
// backends/cpu/target.hpp): qualifiers for host and device, the 16-byte vector, and the device's own
// instructions for vector moves, int8 and fp8 converts and the gate's barrier. Every CUDA source
// includes this before any other kvforge header (through exec_cuda.cuh, which comes first), so that
// kernel code compiles for the device.
#pragma once

#if defined(KVF_TARGET) || defined(KVF_HD)
#error "kvforge/backends/cuda/target.cuh must come before every other kvforge header of a CUDA source"
#endif
#define KVF_TARGET cuda
#define KVF_HD __host__ __device__
#define KVF_INLINE __forceinline__
#define KVF_UNROLL _Pragma("unroll")  // arrays indexed by a constant-trip loop stay in registers
#define KVF_SIMD           // a loop runs on one thread's registers: nothing to vectorize
#define KVF_SIMD_SUM(x)
#if defined(__CUDA_ARCH__)
#define KVF_HELD_INIT  // a store reads only what a load filled: no zeroing instructions
#else
#define KVF_HELD_INIT = {}
#endif

#include <cuda_fp8.h>  // the hardware's saturating fp8 convert
#include <cuda_runtime.h>

#include <cstdint>
#include <cstring>
#include <type_traits>

namespace kvforge::target {

#if defined(__CUDA_ARCH__)
inline constexpr bool kOnDevice = true;
#else
inline constexpr bool kOnDevice = false;
#endif

using Vec16 = uint4;

// The hooks are callable from host and device code, as the shared bodies that call them are; shared
// code calls them only where kOnDevice, so their host side is never run.

// One whole vector at `at`, in one access.
template <class Vector, class E> KVF_HD KVF_INLINE Vector device_load_vector(const E* at) {
  return *reinterpret_cast<const Vector*>(at);
}
// Spelled as one vector store of its width (st.global.cg: kept in L2 as a plain store is, past L1),
// because NVVM splits a plain struct assignment into 32-bit stores in some bodies (a lazy append's
// staging), which quarters the store instructions' width.
template <class Vector, class E> KVF_HD KVF_INLINE void device_store_vector(E* at, const Vector& v) {
  static_assert(sizeof(Vector) == 16 || sizeof(Vector) == 8 || sizeof(Vector) == 4, "a vector store is 4, 8 or 16 bytes");
  using Word = std::conditional_t<sizeof(Vector) == 16, uint4, std::conditional_t<sizeof(Vector) == 8, uint2, unsigned>>;
  Word word;
  memcpy(&word, &v, sizeof word);
#if defined(__CUDA_ARCH__)
  __stcg(reinterpret_cast<Word*>(at), word);
#else
  memcpy(at, &word, sizeof word);
#endif
}

// The hardware's convert rounds half to even, saturates to int32 and makes NaN 0, which leaves the
// clamp to +-127: three instructions. tests/test_fp8_convert.cu holds it to the software codec bit
// for bit.
KVF_HD KVF_INLINE int8_t device_int8(float v) {
#if defined(__CUDA_ARCH__)
  const int r = __float2int_rn(v);
  return int8_t(min(max(r, -127), 127));
#else
  return int8_t(v);
#endif
}

// fp8 codes from the saturating convert (one cvt instruction on sm_89 and later), with NaN kept
// signed as the software codec keeps it. tests/test_fp8_convert.cu checks the two bit-exact over every
// bf16 input.
template <__nv_fp8_interpretation_t Kind> KVF_HD KVF_INLINE uint8_t device_fp8(float v) {
  uint32_t u;
  memcpy(&u, &v, sizeof u);
  if ((u & 0x7fffffffu) > 0x7f800000u) return uint8_t(((u >> 24) & 0x80u) | 0x7fu);
  return uint8_t(__nv_cvt_float_to_fp8(v, __NV_SATFINITE, Kind));
}
KVF_HD KVF_INLINE uint8_t device_fp8_e4m3(float v) { return device_fp8<__NV_E4M3>(v); }
KVF_HD KVF_INLINE uint8_t device_fp8_e5m2(float v) { return device_fp8<__NV_E5M2>(v); }

// The gate before an item writes (item_gate.hpp); defined in gate.cuh, with the barrier it needs.
template <class Checks, class Status> KVF_HD bool gate_closed(const Checks* checks, const Status* status);

}  // namespace kvforge::target
