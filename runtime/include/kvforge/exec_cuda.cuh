// The CUDA executor: each item gets `lanes` threads of a 256-thread block; a block holds as many
// items as fit. Include only from .cu files.
#pragma once

#include <cuda_runtime.h>

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
  int block_threads = 256;  // Tuning::cuda_block_threads

  template <class Body> void for_each_item(int64_t items, int lanes, int64_t /*item_bytes*/, Body body) const {
    if (items <= 0) return;
    const int per_block = lanes >= block_threads ? 1 : block_threads / lanes;
    const int threads = per_block * lanes;
    const int64_t blocks = (items + per_block - 1) / per_block;
    item_kernel<<<unsigned(blocks), threads, 0, stream>>>(items, lanes, body);
    const cudaError_t err = cudaGetLastError();
    if (err != cudaSuccess) throw_cuda_error(err, "kernel launch");
  }

  // The maximum over one item's `Lanes` threads (a logical warp, power of two), given to all of them.
  // Defined in exec_cuda_reduce.cuh, which only quantized variants include: CUB's headers would
  // otherwise more than double every variant's compile time.
  template <int Lanes> KVF_HD static uint32_t lane_max(uint32_t value);

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
