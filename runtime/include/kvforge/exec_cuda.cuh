// The CUDA executor: each item gets `Lanes` threads (a compile-time constant) of a block that holds
// as many items as fit. Include only from .cu files.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "kvforge/dtype.hpp"
#include "kvforge/errors.hpp"
#include "kvforge/op_args.hpp"
#include "kvforge/op_table.hpp"
#include "kvforge/vocab.hpp"

namespace kvforge::detail {

void throw_cuda_error(cudaError_t err, const char* what);
// Device-side index validation (backend_cuda.cu), every check in one launch: no host read, so graph
// capture stays legal.
void check_indices_on_device(void* stream, const IndexChecks& checks);

// Records a failed check in the status word; the first failure to claim it records itself.
__device__ inline void record_index_failure(const IndexCheckArgs& a, int64_t i, int64_t value) {
  if (atomicCAS(&a.status->code, 0, a.code) == 0) {
    a.status->index = i;
    a.status->value = value;
    a.status->lo = a.lo;
    a.status->hi = a.hi;
  }
}

// A block is Lanes x items: an item's lanes are threadIdx.x and its place in the block threadIdx.y,
// so neither needs a division, and a body inlined here sees its lane count as a constant. A thread
// takes items a grid apart, several where the launch asks for it (Tuning::cuda_items_per_thread).
// With `Checked`, every block first checks every index of `checks` and goes on only if all pass: a
// failure then writes nothing anywhere without a check launch of its own. Block 0 records it.
template <int Lanes, bool Checked, class Body>
__global__ void __launch_bounds__(tunables::cuda_block_threads.hi) item_kernel(int64_t items, IndexChecks checks,
                                                                              Body body) {
  if constexpr (Checked) {
    const int thread = int(threadIdx.y) * Lanes + int(threadIdx.x), threads = Lanes * int(blockDim.y);
    bool failed = false;
    for (int c = 0; c < checks.count; ++c)
      for (int64_t i = thread; i < checks.check[c].count; i += threads) {
        int64_t value;
        if (!index_passes(checks.check[c], i, value)) {
          failed = true;
          if (blockIdx.x == 0) record_index_failure(checks.check[c], i, value);
        }
      }
    if (__syncthreads_or(failed)) return;
  }
  const int64_t stride = int64_t(gridDim.x) * blockDim.y;
  for (int64_t item = int64_t(blockIdx.x) * blockDim.y + threadIdx.y; item < items; item += stride)
    body(item, int(threadIdx.x), Lanes);
}

struct CudaExec {
  cudaStream_t stream;
  int block_threads;        // Tuning::cuda_block_threads
  int items_per_thread = 1; // Tuning::cuda_items_per_thread

  // An item is one token: its lanes already cover all heads, coalesced along head_dim.
  static constexpr int kTileItems = 1;
  // Index checks of at most this many entries run inside the operation's launch (every block reads
  // them all: 256 entries are 2 KiB, next to a decode token's 4 KiB or more of K and V per block).
  // Longer ones, a prefill's, get launches of their own, whose cost the prefill's copy hides.
  static constexpr int64_t kFusedCheckEntries = 256;

  static CudaExec from(const Launch& l) {
    return CudaExec{static_cast<cudaStream_t>(l.stream), l.tuning.cuda_block_threads, l.tuning.cuda_items_per_thread};
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

  // Runs body(item, lane, Lanes) for every item, after `checks` (fused into the launch where short).
  template <int Lanes, class Body>
  void for_each_item(int64_t items, Fixed<Lanes>, int64_t /*item_bytes*/, Body body,
                     const IndexChecks& checks = IndexChecks{}) const {
    static_assert(Lanes >= 1 && Lanes <= tunables::cuda_block_threads.hi, "an item's lanes fit one block");
    const bool fused = checks.count > 0 && items > 0 && checks.entries() <= kFusedCheckEntries;
    if (!fused && checks.count > 0) check_indices_on_device(stream, checks);
    if (items <= 0) return;
    int per_block = Lanes >= block_threads ? 1 : block_threads / Lanes;
    // A launch too small to give every SM a block (a decode step's append) takes smaller blocks, down
    // to one warp, so that more SMs issue its loads and stores. An item keeps its lanes (a quantized
    // item's warp reduction is unchanged).
    const int64_t sms = sm_count();
    while (per_block > 1 && (items + per_block - 1) / per_block < sms && (per_block / 2) * Lanes >= 32) per_block /= 2;
    const int64_t items_per_block = int64_t(per_block) * (items_per_thread > 1 ? items_per_thread : 1);
    const int64_t blocks = (items + items_per_block - 1) / items_per_block;
    const dim3 block{unsigned(Lanes), unsigned(per_block), 1u};
    if (fused) {
      item_kernel<Lanes, true><<<unsigned(blocks), block, 0, stream>>>(items, checks, body);
    } else {
      item_kernel<Lanes, false><<<unsigned(blocks), block, 0, stream>>>(items, IndexChecks{}, body);
    }
    const cudaError_t err = cudaGetLastError();
    if (err != cudaSuccess) throw_cuda_error(err, "kernel launch");
  }

  // The maximum over each aligned group of `Group` lanes of an item's `Lanes` threads (powers of two up
  // to a warp), given to every lane of the group: a butterfly of shuffles whose offsets stay inside the
  // group. An item's lanes are Lanes consecutive threads of one warp (the block's x extent is Lanes,
  // which divides 32), and all of them take part.
  template <int Lanes, int Group = Lanes> KVF_HD static KVF_INLINE uint32_t lane_max(uint32_t value) {
    static_assert(Lanes >= 1 && Lanes <= 32 && (Lanes & (Lanes - 1)) == 0, "an item's lanes reduce within one warp");
    static_assert(Group >= 1 && Group <= Lanes && (Group & (Group - 1)) == 0, "a group is a power of two of lanes");
#if defined(__CUDA_ARCH__)
    if constexpr (Group > 1) {
      const unsigned first = (threadIdx.y * Lanes) % 32u;
      const unsigned item = Lanes == 32 ? 0xffffffffu : ((1u << Lanes) - 1u) << first;
      for (int offset = Group / 2; offset > 0; offset /= 2) {
        const uint32_t other = __shfl_xor_sync(item, value, offset, Lanes);
        value = value > other ? value : other;
      }
    }
#endif
    return value;
  }

  // Quantized writes go in 16-byte chunks per lane (quant_chunks.hpp), and a write holds its token's
  // inputs in its lanes before it reads the token's target (token_vectors.hpp).
  static constexpr bool kChunkedQuant = true;
  static constexpr bool kHoldsTokens = true;
  // Ring appends of at most this many tokens take row lengths from a scan of their targets in each item
  // (ops.hpp, write), inside their one launch: a decode step's append is then a single kernel.
  static constexpr int64_t kScannedRingTokens = 256;

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

  // K's and V's heads of one token: an append's into a pool, a gather's out of it, a lazy append's into
  // staging. Every 16-byte vector of K and of V is loaded before either is stored, so the V load does
  // not wait behind the K copy; the four regions never overlap (__restrict__). Unaligned rows or
  // converting types take copy_heads, K then V.
  template <class HExt, class DExt, class Dst, class Src>
  KVF_HD static KVF_INLINE void copy_heads_kv(TokenHeads<Dst> k_dst, TokenHeads<Dst> v_dst, TokenHeads<const Src> k_src,
                                              TokenHeads<const Src> v_src, HExt heads, DExt head_dim, int lane,
                                              int lanes) {
    if constexpr (std::is_same_v<Dst, Src>) {
      Dst* __restrict__ kd = k_dst.data;
      Dst* __restrict__ vd = v_dst.data;
      const Src* __restrict__ ks = k_src.data;
      const Src* __restrict__ vs = v_src.data;
      const uintptr_t bases = reinterpret_cast<uintptr_t>(kd) | reinterpret_cast<uintptr_t>(vd) |
                              reinterpret_cast<uintptr_t>(ks) | reinterpret_cast<uintptr_t>(vs);
      const int64_t strides =
          (k_dst.head_stride | v_dst.head_stride | k_src.head_stride | v_src.head_stride) * int64_t(sizeof(Dst));
      if ((int(head_dim) * sizeof(Dst)) % 16 == 0 && (bases & 15u) == 0 && strides % 16 == 0) {
        const int vectors = int(int(head_dim) * sizeof(Dst) / 16);  // per head
        for (int i = lane; i < int(heads) * vectors; i += lanes) {
          const int h = i / vectors, c = i % vectors;
          const uint4 k = reinterpret_cast<const uint4*>(ks + h * k_src.head_stride)[c];
          const uint4 v = reinterpret_cast<const uint4*>(vs + h * v_src.head_stride)[c];
          reinterpret_cast<uint4*>(kd + h * k_dst.head_stride)[c] = k;
          reinterpret_cast<uint4*>(vd + h * v_dst.head_stride)[c] = v;
        }
        return;
      }
    }
    copy_heads(k_dst.data, k_dst.head_stride, k_src.data, k_src.head_stride, heads, head_dim, lane, lanes);
    copy_heads(v_dst.data, v_dst.head_stride, v_src.data, v_src.head_stride, heads, head_dim, lane, lanes);
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
