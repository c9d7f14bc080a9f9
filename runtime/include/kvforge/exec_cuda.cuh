// The CUDA executor: each item gets `lanes` threads of a 256-thread block; a block holds as many
// items as fit. Include only from .cu files.
#pragma once

#include <cuda_runtime.h>

#include <cub/util_ptx.cuh>
#include <cub/warp/warp_reduce.cuh>
#include <cuda/functional>

#include <cstdint>

#include "kvforge/errors.hpp"
#include "kvforge/op_args.hpp"

namespace kvforge::detail {

void throw_cuda_error(cudaError_t err, const char* what);

template <class Body> __global__ void item_kernel(int64_t items, int lanes, Body body) {
  const int per_block = blockDim.x / lanes;
  const int local = threadIdx.x / lanes;
  const int64_t item = int64_t(blockIdx.x) * per_block + local;
  if (local >= per_block || item >= items) return;
  body(item, int(threadIdx.x % lanes), lanes);
}

struct CudaExec {
  cudaStream_t stream = nullptr;

  template <class Body> void for_each_item(int64_t items, int lanes, int64_t /*item_bytes*/, Body body) const {
    if (items <= 0) return;
    const int per_block = lanes >= 256 ? 1 : 256 / lanes;
    const int threads = per_block * lanes;
    const int64_t blocks = (items + per_block - 1) / per_block;
    item_kernel<<<unsigned(blocks), threads, 0, stream>>>(items, lanes, body);
    const cudaError_t err = cudaGetLastError();
    if (err != cudaSuccess) throw_cuda_error(err, "kernel launch");
  }

  // The maximum over one item's `Lanes` threads (a logical warp, power of two), given to all of them.
  template <int Lanes> KVF_HD static uint32_t lane_max(uint32_t value) {
#if defined(__CUDA_ARCH__)
    if constexpr (Lanes == 1) {
      return value;
    } else {
      using Reduce = cub::WarpReduce<uint32_t, Lanes>;
      __shared__ typename Reduce::TempStorage storage[256 / Lanes];
      const uint32_t first = Reduce(storage[threadIdx.x / Lanes]).Reduce(value, cuda::maximum<>{});
      const unsigned group = Lanes == 32 ? 0xffffffffu : ((1u << Lanes) - 1u) << (threadIdx.x % 32 / Lanes * Lanes);
      return cub::ShuffleIndex<Lanes>(first, 0, group);
    }
#else
    return value;
#endif
  }

  KVF_HD static void atomic_max(int32_t* target, int32_t value) {
#if defined(__CUDA_ARCH__)
    atomicMax(target, value);
#else
    (void)target;
    (void)value;
#endif
  }
};

}  // namespace kvforge::detail
