// The CUDA executor: each item gets `lanes` threads of a 256-thread block; a block holds as many
// items as fit. Include only from .cu files.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "kvforge/dtype.hpp"
#include "kvforge/errors.hpp"
#include "kvforge/op_args.hpp"
#include "kvforge/op_table.hpp"

namespace kvforge::detail {

void throw_cuda_error(cudaError_t err, const char* what);
// Device-side index validation (backend_cuda.cu): no host read, so graph capture stays legal.
void check_indices_on_device(void* stream, const IndexCheckArgs& a);

template <class Body> __global__ void item_kernel(int64_t items, int lanes, Body body) {
  const int per_block = blockDim.x / lanes;
  const int local = threadIdx.x / lanes;
  const int64_t item = int64_t(blockIdx.x) * per_block + local;
  if (local >= per_block || item >= items) return;
  body(item, int(threadIdx.x % lanes), lanes);
}

struct CudaExec {
  cudaStream_t stream;
  int block_threads;  // Tuning::cuda_block_threads

  // An item is one token: its lanes already cover all heads, coalesced along head_dim.
  static constexpr int kTileItems = 1;

  static CudaExec from(const Launch& l) {
    return CudaExec{static_cast<cudaStream_t>(l.stream), l.tuning.cuda_block_threads};
  }

  // Streaming multiprocessors of the current device, read once per device.
  static int sm_count() {
    static int counts[64] = {};
    int device = 0;
    if (cudaGetDevice(&device) != cudaSuccess || device < 0 || device >= 64) return 1;
    if (!counts[device]) {
      int n = 0;
      cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, device);
      counts[device] = n > 0 ? n : 1;
    }
    return counts[device];
  }

  template <class Body> void for_each_item(int64_t items, int lanes, int64_t /*item_bytes*/, Body body) const {
    if (items <= 0) return;
    int per_block = lanes >= block_threads ? 1 : block_threads / lanes;
    // A launch too small to give every SM a block (a decode step's append) takes smaller blocks, down
    // to one warp, so that more SMs issue its loads and stores. Items map to threads the same way at
    // any block size, and an item keeps its lanes (a quantized item's warp reduction is unchanged).
    const int64_t sms = sm_count();
    while (per_block > 1 && (items + per_block - 1) / per_block < sms && (per_block / 2) * lanes >= 32) per_block /= 2;
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

  // Row primitives: an item's lanes stride through each row.
  KVF_HD static constexpr int row_begin(int lane) { return lane; }
  KVF_HD static constexpr int row_step(int lanes) { return lanes; }

  // One head's row: 16-byte vectors where types match and both ends are aligned. Sizes come as
  // Fixed<N> (generated variants: the branches fold away) or as int.
  template <class DExt, class Dst, class Src>
  KVF_HD static KVF_INLINE void copy_row(Dst* dst, const Src* src, DExt d, int lane, int lanes) {
    if constexpr (std::is_same_v<Dst, Src>) {
      if ((int(d) * sizeof(Dst)) % 16 == 0 && ((reinterpret_cast<uintptr_t>(dst) | reinterpret_cast<uintptr_t>(src)) & 15u) == 0) {
        const int vectors = int(int(d) * sizeof(Dst) / 16);
        for (int i = lane; i < vectors; i += lanes) reinterpret_cast<uint4*>(dst)[i] = reinterpret_cast<const uint4*>(src)[i];
        return;
      }
    }
    for (int i = lane; i < int(d); i += lanes) dst[i] = convert<Dst>(src[i]);
  }

  // All heads of one item: the item's lanes are spread over (head, part of row).
  template <class HExt, class DExt, class Dst, class Src>
  KVF_HD static KVF_INLINE void copy_heads(Dst* dst, int64_t dst_head_stride, const Src* src, int64_t src_head_stride,
                                           HExt heads, DExt head_dim, int lane, int lanes) {
    const int H = int(heads);
    if (lanes >= H && lanes % H == 0) {
      const int per_head = lanes / H;
      const int h = lane / per_head;
      copy_row(dst + h * dst_head_stride, src + h * src_head_stride, head_dim, lane % per_head, per_head);
      return;
    }
    for (int h = 0; h < H; ++h) copy_row(dst + h * dst_head_stride, src + h * src_head_stride, head_dim, lane, lanes);
  }

  // K's and V's heads of one token into a pool. Every 16-byte vector of K and of V is loaded before
  // either is stored, so the V load does not queue behind the K store; the four regions never
  // overlap (__restrict__). Unaligned rows or converting types take copy_heads, K then V.
  template <class HExt, class DExt, class Dst, class Src>
  KVF_HD static KVF_INLINE void copy_heads_kv(Dst* __restrict__ k_dst, Dst* __restrict__ v_dst, int64_t dst_head_stride,
                                              const Src* __restrict__ k_src, int64_t k_head_stride,
                                              const Src* __restrict__ v_src, int64_t v_head_stride, HExt heads,
                                              DExt head_dim, int lane, int lanes) {
    if constexpr (std::is_same_v<Dst, Src>) {
      const uintptr_t bases = reinterpret_cast<uintptr_t>(k_dst) | reinterpret_cast<uintptr_t>(v_dst) |
                              reinterpret_cast<uintptr_t>(k_src) | reinterpret_cast<uintptr_t>(v_src);
      const int64_t strides = (dst_head_stride | k_head_stride | v_head_stride) * int64_t(sizeof(Dst));
      if ((int(head_dim) * sizeof(Dst)) % 16 == 0 && (bases & 15u) == 0 && strides % 16 == 0) {
        const int vectors = int(int(head_dim) * sizeof(Dst) / 16);  // per head
        for (int i = lane; i < int(heads) * vectors; i += lanes) {
          const int h = i / vectors, c = i % vectors;
          const uint4 k = reinterpret_cast<const uint4*>(k_src + h * k_head_stride)[c];
          const uint4 v = reinterpret_cast<const uint4*>(v_src + h * v_head_stride)[c];
          reinterpret_cast<uint4*>(k_dst + h * dst_head_stride)[c] = k;
          reinterpret_cast<uint4*>(v_dst + h * dst_head_stride)[c] = v;
        }
        return;
      }
    }
    copy_heads(k_dst, dst_head_stride, k_src, k_head_stride, heads, head_dim, lane, lanes);
    copy_heads(v_dst, dst_head_stride, v_src, v_head_stride, heads, head_dim, lane, lanes);
  }

  template <class HExt, class DExt, class Dst>
  KVF_HD static KVF_INLINE void zero_heads(Dst* dst, int64_t dst_head_stride, HExt heads, DExt head_dim, int lane,
                                           int lanes) {
    const int D = int(head_dim);
    for (int j = lane; j < int(heads) * D; j += lanes) dst[(j / D) * dst_head_stride + j % D] = Dst{};
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
