// The gate an item body passes before it writes: the status word and the call's index checks, read
// at once with the body's own loads (ItemGate). Executors call gated bodies; ops.hpp writes them.
#pragma once

#include <cstdint>

#include "kvforge/config.hpp"
#include "kvforge/device_status.hpp"
#include "kvforge/op_args.hpp"

namespace kvforge::detail {

#if defined(__CUDACC__)
// Records a failed check in the status word; the first failure to claim it records itself.
__device__ inline void record_index_failure(const IndexCheckArgs& a, int64_t i, int64_t value) {
  if (atomicCAS(&a.status->code, 0, a.code) == 0) {
    a.status->index = i;
    a.status->value = value;
    a.status->lo = a.lo;
    a.status->hi = a.hi;
  }
}

// Whether any index of `checks` fails, decided by a whole CUDA block: each thread checks a share and
// every thread gets the answer. Block 0 records a failure, so it is recorded once per launch. Only
// launches that check themselves call it, whose checks are short (CudaExec::kFusedCheckEntries): 32-bit
// positions keep the registers a body holds across it to a minimum.
// The status word, where given, joins the verdict: read after the checks' loads have issued, it is
// not held, or spilled, across them.
__device__ inline bool block_refuses(const IndexChecks& checks, const DeviceStatus* status = nullptr) {
  const int thread = int(threadIdx.y * blockDim.x + threadIdx.x), threads = int(blockDim.x * blockDim.y);
  bool failed = false;
  KVF_UNROLL
  for (int c = 0; c < kMaxIndexChecks; ++c)
    for (int i = thread; c < checks.count && i < int(checks.check[c].count); i += threads) {
      int64_t value;
      if (!index_passes(checks.check[c], i, value)) {
        failed = true;
        if (blockIdx.x == 0) record_index_failure(checks.check[c], i, value);
      }
    }
  if (status && status->code != 0) failed = true;
  return __syncthreads_or(failed) != 0;
}

// Waits until the grid this one was launched to overlap has finished and its writes are visible; at
// once where there is none. Only launches made with programmatic stream serialization overlap.
__device__ KVF_INLINE void wait_for_prior_grid() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

// Lets the launch after this one, where it asked to overlap, start now: it still waits for this
// grid's end at its own wait_for_prior_grid.
__device__ KVF_INLINE void let_next_grid_start() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}
#endif

// The one gate before an item body writes. A body given one (through gated()) first issues every
// load that needs no checked index (its inputs, its targets' entries), then asks closed() once,
// together with every other thread of its block, and writes nothing if it says so. closed() reads
// the status word, after the checks of this call, so that on a GPU the body's loads, the status word
// and the checks' loads are all in flight at once: one wait on memory where there were three.
struct ItemGate {
  // The checks this block runs itself (CUDA, calls short enough); null where they ran before the
  // launch, or run in a CUDA launch just before it that this one may overlap (wait_for_prior_grid).
  const IndexChecks* checks = nullptr;

  KVF_HD KVF_INLINE bool closed(const DeviceStatus* status) const {
#if defined(__CUDA_ARCH__)
    if (!checks) wait_for_prior_grid();
    return checks ? block_refuses(*checks, status) : status->code != 0;
#else
    return status->code != 0;
#endif
  }
};

// An item body that takes an ItemGate: body(item, lane, lanes, gate). Called as a plain body, its gate
// only reads the status word, so that executors that check before they loop (the CPU's) run it
// unchanged.
template <class Body> struct Gated {
  Body body;
  KVF_HD KVF_INLINE void operator()(int64_t item, int lane, int lanes) const { body(item, lane, lanes, ItemGate{}); }
};
template <class Body> Gated<Body> gated(Body body) { return Gated<Body>{body}; }
template <class Body> struct IsGated { static constexpr bool value = false; };
template <class Body> struct IsGated<Gated<Body>> { static constexpr bool value = true; };

}  // namespace kvforge::detail
