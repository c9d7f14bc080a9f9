// The CUDA executor: each item gets `Lanes` threads (a compile-time constant) of a block that holds
// as many items as fit. Include only from .cu files.
#pragma once

#include "kvforge/backends/cuda/target.cuh"  // first: kernel code compiles for the device

#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "kvforge/dtype.hpp"
#include "kvforge/errors.hpp"
#include "kvforge/backends/cuda/gate.cuh"
#include "kvforge/detail/item_gate.hpp"
#include "kvforge/detail/op_args.hpp"
#include "kvforge/detail/op_table.hpp"
#include "kvforge/vocab.hpp"

namespace kvforge::detail {

void throw_cuda_error(cudaError_t err, const char* what);
// Device-side index validation (backend_cuda.cu), every check in one launch: no host read, so graph
// capture stays legal.
void check_indices_on_device(void* stream, const IndexChecks& checks);

// A block is Lanes x items: an item's lanes are threadIdx.x and its place in the block threadIdx.y,
// so neither needs a division, and a body inlined here sees its lane count as a constant. A thread
// takes items a grid apart, several where the launch asks for it (Tuning::cuda_items_per_thread).
// With `Checked`, the launch checks every index of `checks` itself, and a failure writes nothing
// anywhere without a check launch of its own: a plain body runs once its block has found them all
// good; a gated body (item_gate.hpp) gets one item per thread and the block's verdict from its gate,
// after it has issued its own loads. Without, a launch may overlap the check launch before it
// (CudaExec::launch), and waits for it before it reads the status word: a gated body at its gate, a
// plain one before anything.
// A launch that checks its own indices (a decode step's) runs blocks of at most this many threads, or
// one item where an item has more lanes, and its kernel is compiled for that. Under the bound of 1024,
// ptxas held a row layout's decode append to 32 registers by spilling the K it had loaded: a local
// store that waits for the load, so that the checks' loads issued only once K had arrived.
template <int Lanes> constexpr int checked_block_threads() { return Lanes > 256 ? Lanes : 256; }

template <int Lanes, bool Checked, class Body>
__global__ void __launch_bounds__(Checked ? checked_block_threads<Lanes>() : tunables::cuda_block_threads.hi)
    item_kernel(int64_t items, IndexChecks checks, Body body) {
  const int64_t first = int64_t(blockIdx.x) * blockDim.y + threadIdx.y;
  if constexpr (IsGated<Body>::value) {
    const ItemGate gate{Checked ? &checks : nullptr};
    if constexpr (Checked) {
      if (first < items) body.body(first, int(threadIdx.x), Lanes, gate); else (void)gate.closed(checks.check[0].status);
      return;
    }
    const int64_t stride = int64_t(gridDim.x) * blockDim.y;
    for (int64_t item = first; item < items; item += stride) body.body(item, int(threadIdx.x), Lanes, gate);
  } else {
    if constexpr (Checked) {
      if (block_refuses(checks)) return;
    } else {
      wait_for_prior_grid();
    }
    const int64_t stride = int64_t(gridDim.x) * blockDim.y;
    for (int64_t item = first; item < items; item += stride) body(item, int(threadIdx.x), Lanes);
  }
}

struct CudaExec {
  cudaStream_t stream;
  int block_threads;        // Tuning::cuda_block_threads
  int items_per_thread = 1; // Tuning::cuda_items_per_thread

  // An item is one token: its lanes already cover all heads, coalesced along head_dim.
  static constexpr int kTileItems = 1;
  // Index checks whose arrays hold at most this many entries each run inside the operation's launch
  // (every block reads them all: 256 slots, or 256 rows and 256 positions, are 2 KiB, next to a decode
  // token's 4 KiB or more of K and V per block). So a decode step of up to 256 tokens is one launch on
  // every layout; a row layout's once counted its rows and positions together, and took two launches
  // (and twice the host's enqueue time) past 128 tokens. Longer ones, a prefill's, get launches of
  // their own, whose cost the prefill's copy hides.
  static constexpr int64_t kFusedCheckEntries = 256;

  static CudaExec from(const Launch& l) {
    return CudaExec{static_cast<cudaStream_t>(l.stream), int(l.tuning.cuda_block_threads), int(l.tuning.cuda_items_per_thread)};
  }

  // What the launches ask of the current device, read once per device.
  struct DeviceFacts {
    int sms = 1;                        // streaming multiprocessors
    bool overlaps_prior_grid = false;   // programmatic dependent launch: sm_90 and later
  };
  static const DeviceFacts& device_facts() {
    static DeviceFacts facts[64];
    static bool known[64] = {};
    int device = 0;
    if (cudaGetDevice(&device) != cudaSuccess || device < 0 || device >= 64) {
      static const DeviceFacts unknown;
      return unknown;
    }
    if (!known[device]) {
      int sms = 0, major = 0;
      cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
      cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device);
      facts[device] = DeviceFacts{sms > 0 ? sms : 1, major >= 9};
      known[device] = true;
    }
    return facts[device];
  }

  // One item_kernel launch. One that follows a check launch (`after_checks`) may start while that
  // still runs, where the device allows it: its blocks issue their loads and wait at their gates
  // (wait_for_prior_grid), so that the check launch's time hides behind them rather than adding to
  // the call's. Only after our own check kernel: its predecessors had all finished when it began, so
  // everything but its status word is already in place, and it asks for the overlap itself.
  template <int Lanes, bool Checked, class Body>
  void launch(int64_t blocks, dim3 block, int64_t items, const IndexChecks& checks, const Body& body,
              bool after_checks) const {
    if (after_checks && device_facts().overlaps_prior_grid) {
      cudaLaunchConfig_t config{};
      config.gridDim = dim3{unsigned(blocks), 1u, 1u};
      config.blockDim = block;
      config.stream = stream;
      cudaLaunchAttribute overlap[1];
      overlap[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
      overlap[0].val.programmaticStreamSerializationAllowed = 1;
      config.attrs = overlap;
      config.numAttrs = 1;
      const cudaError_t err = cudaLaunchKernelEx(&config, item_kernel<Lanes, Checked, Body>, items, checks, body);
      if (err != cudaSuccess) throw_cuda_error(err, "kernel launch");
      return;
    }
    item_kernel<Lanes, Checked><<<unsigned(blocks), block, 0, stream>>>(items, checks, body);
    const cudaError_t err = cudaGetLastError();
    if (err != cudaSuccess) throw_cuda_error(err, "kernel launch");
  }

  // Runs body(item, lane, Lanes) for every item, after `checks` (fused into the launch where short); a
  // gated body (item_gate.hpp) gets its gate as well. A BlockItem runs one item a block.
  template <int Lanes, class Body>
  void for_each_item(int64_t items, Fixed<Lanes>, int64_t /*item_bytes*/, Body body,
                     const IndexChecks& checks = IndexChecks{}) const {
    run_items<Lanes>(items, body, checks, false);
  }
  template <int Lanes, class Body>
  void for_each_item(int64_t items, BlockItem<Lanes>, int64_t /*item_bytes*/, Body body,
                     const IndexChecks& checks = IndexChecks{}) const {
    run_items<Lanes>(items, body, checks, true);
  }
  template <int Lanes, class Body>
  void run_items(int64_t items, const Body& body, const IndexChecks& checks, bool block_per_item) const {
    static_assert(Lanes >= 1 && Lanes <= tunables::cuda_block_threads.hi, "an item's lanes fit one block");
    const bool fused = checks.count > 0 && items > 0 && checks.longest() <= kFusedCheckEntries;
    if (!fused && checks.count > 0) check_indices_on_device(stream, checks);
    if (items <= 0) return;
    int per_block = Lanes >= block_threads || block_per_item ? 1 : block_threads / Lanes;
    if (fused && per_block * Lanes > checked_block_threads<Lanes>()) per_block = checked_block_threads<Lanes>() / Lanes;
    // A launch too small to give every SM a block (a decode step's append) takes smaller blocks, down
    // to one warp, so that more SMs issue its loads and stores. An item keeps its lanes (a quantized
    // item's warp reduction is unchanged).
    const int64_t sms = device_facts().sms;
    while (per_block > 1 && (items + per_block - 1) / per_block < sms && (per_block / 2) * Lanes >= 32) per_block /= 2;
    // A gated body in a checking launch takes one item per thread: its gate is a barrier of the block.
    const bool one_each = fused && IsGated<Body>::value;
    const int64_t items_per_block = int64_t(per_block) * (items_per_thread > 1 && !one_each ? items_per_thread : 1);
    const int64_t blocks = (items + items_per_block - 1) / items_per_block;
    const dim3 block{unsigned(Lanes), unsigned(per_block), 1u};
    if (fused) {
      launch<Lanes, true>(blocks, block, items, checks, body, false);
    } else {
      launch<Lanes, false>(blocks, block, items, IndexChecks{}, body, checks.count > 0);
    }
  }

  // The maximum over each aligned group of `Group` lanes of an item's `Lanes` threads (powers of two,
  // a group at most a warp), given to every lane of the group: a butterfly of shuffles whose offsets
  // stay inside the group. An item's lanes are Lanes consecutive threads of a block whose x extent is
  // Lanes: part of one warp where Lanes divides 32, whole warps where 32 divides Lanes. All of the
  // warp's lanes in the item take part.
  template <int Lanes, int Group = Lanes> KVF_HD static KVF_INLINE uint32_t lane_max(uint32_t value) {
    static_assert(Lanes >= 1 && (Lanes & (Lanes - 1)) == 0, "an item's lanes are a power of two");
    static_assert(Group >= 1 && Group <= Lanes && Group <= 32 && (Group & (Group - 1)) == 0,
                  "a group is a power of two of lanes inside one warp");
#if defined(__CUDA_ARCH__)
    if constexpr (Group > 1) {
      constexpr int kWarpLanes = Lanes < 32 ? Lanes : 32;  // the item's lanes in this thread's warp
      const unsigned first = (threadIdx.y * Lanes) % 32u;
      const unsigned item = kWarpLanes == 32 ? 0xffffffffu : ((1u << kWarpLanes) - 1u) << first;
      for (int offset = Group / 2; offset > 0; offset /= 2) {
        const uint32_t other = __shfl_xor_sync(item, value, offset, kWarpLanes);
        value = value > other ? value : other;
      }
    }
#endif
    return value;
  }

  // The maximum over all `Lanes` lanes of an item, given to each: lane_max within a warp. An item wider
  // than a warp (a per-token scale over a 128-lane token) runs as a block of its own (BlockItem), and
  // its warps' maxima meet in shared memory behind the block's barrier: the item takes every early
  // return whole, so all of its threads reach it or none. (A named barrier per item would let items
  // share a block, but an id known only at run time reserves all 16 of the block's, which can cap the
  // blocks an SM holds.)
  template <int Lanes> KVF_HD static KVF_INLINE uint32_t item_max(uint32_t value) {
    if constexpr (Lanes <= 32) {
      return lane_max<Lanes>(value);
    } else {
      static_assert(Lanes % 32 == 0 && Lanes <= tunables::cuda_block_threads.hi, "a wide item is whole warps of one block");
#if defined(__CUDA_ARCH__)
      if (blockDim.y != 1) __trap();  // launched as Fixed, not BlockItem: other items would share the barrier
      __shared__ uint32_t warp_max[Lanes / 32];
      value = lane_max<Lanes, 32>(value);
      if (threadIdx.x % 32u == 0) warp_max[threadIdx.x / 32u] = value;
      __syncthreads();
      uint32_t m = 0;
      KVF_UNROLL
      for (int w = 0; w < Lanes / 32; ++w) m = m > warp_max[w] ? m : warp_max[w];
      __syncthreads();  // every warp has read before any writes its slot again
      return m;
#else
      return value;
#endif
    }
  }

  // Quantized writes go in 16-byte chunks per lane (quant_chunks.hpp), and a write holds its token's
  // inputs in its lanes before it reads the token's target (token_vectors.hpp).
  static constexpr bool kChunkedQuant = true;
  static constexpr bool kHoldsTokens = true;
  // Ring appends of at most this many tokens take row lengths from a scan of their targets in each item
  // (ops.hpp, write), inside their one launch: a decode step's append is then a single kernel.
  static constexpr int64_t kScannedRingTokens = 256;
  // Attention (attend/attend_ops.hpp) runs an item on one thread here, its tiles in local memory: few
  // rows and a short block keep that small (an MLA item's 4 x 576 queries, 9 KiB).
  static constexpr int kAttendRows = kAttendRowsCuda;
  static constexpr int kAttendBlock = 4;

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
        // Per head; at least 1 wherever this branch runs. Saying so keeps nvcc from folding a division by
        // zero into the dead branch of a head under 16 bytes, and warning about it.
        const int bytes = int(head_dim) * int(sizeof(Dst)), vectors = bytes < 16 ? 1 : bytes / 16;
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
