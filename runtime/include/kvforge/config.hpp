// Portability macros shared by host-only and CUDA translation units.
#pragma once

#if defined(__CUDACC__)
#define KVF_HD __host__ __device__
#define KVF_INLINE __forceinline__
#else
#define KVF_HD
#define KVF_INLINE inline __attribute__((always_inline))
#endif

// Unrolls a loop of constant trip count on the device, so that arrays indexed by it stay in registers.
#if defined(__CUDACC__)
#define KVF_UNROLL _Pragma("unroll")
#else
#define KVF_UNROLL
#endif
