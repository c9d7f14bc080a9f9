// The CUDA side of the gate before an item writes (item_gate.hpp): a block checks its launch's
// indices together, or waits for the check launch it overlaps, before any of its items writes.
#pragma once

#include "kvforge/backends/cuda/target.cuh"
#include "kvforge/detail/device_status.hpp"
#include "kvforge/detail/op_args.hpp"

namespace kvforge::detail {

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
// launches that check themselves call it, whose checks are short (CudaExec::kFusedCheckEntries an
// array): 32-bit positions keep the registers a body holds across it to a minimum.
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
}  // namespace kvforge::detail

namespace kvforge::target {

template <class Checks, class Status> KVF_HD bool gate_closed(const Checks* checks, const Status* status) {
#if defined(__CUDA_ARCH__)
  if (!checks) detail::wait_for_prior_grid();
  return checks ? detail::block_refuses(*checks, status) : status->code != 0;
#else
  (void)checks;
  return status->code != 0;
#endif
}

}  // namespace kvforge::target
