// CudaExec::lane_max: the amax of a quantization group across an item's lanes, a CUB warp reduction.
// Included by the generated .cu of quantized variants only (see exec_cuda.cuh).
#pragma once

#include <cub/util_ptx.cuh>
#include <cub/warp/warp_reduce.cuh>
#include <cuda/functional>

#include "kvforge/exec_cuda.cuh"

namespace kvforge::detail {

template <int Lanes> KVF_HD uint32_t CudaExec::lane_max(uint32_t value) {
#if defined(__CUDA_ARCH__)
  if constexpr (Lanes == 1) {
    return value;
  } else {
    using Reduce = cub::WarpReduce<uint32_t, Lanes>;
    __shared__ typename Reduce::TempStorage storage[tunables::cuda_block_threads.hi / Lanes];  // the largest block
    const uint32_t first = Reduce(storage[threadIdx.x / Lanes]).Reduce(value, cuda::maximum<>{});
    const unsigned group = Lanes == 32 ? 0xffffffffu : ((1u << Lanes) - 1u) << (threadIdx.x % 32 / Lanes * Lanes);
    return cub::ShuffleIndex<Lanes>(first, 0, group);
  }
#else
  return value;
#endif
}

}  // namespace kvforge::detail
