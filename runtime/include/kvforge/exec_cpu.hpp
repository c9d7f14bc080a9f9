// The CPU executor: items run on OpenMP threads; each body moves whole rows with memcpy, which the
// compiler turns into vector loads and stores for the compile-time row length.
#pragma once

#include <cstdint>

#include "kvforge/op_args.hpp"

namespace kvforge::detail {

struct CpuExec {
  // The default below which a parallel region costs more than it saves (Tuning::cpu_parallel_bytes).
  static constexpr int64_t kParallelBytes = 1 << 16;
  int64_t parallel_bytes = kParallelBytes;
  int chunk_items = 0;  // 0: one even chunk per thread

  template <class Body> void for_each_item(int64_t items, int /*lanes*/, int64_t item_bytes, Body body) const {
    const bool parallel = items * item_bytes >= parallel_bytes;
    if (chunk_items > 0) {
#pragma omp parallel for schedule(dynamic, chunk_items) if (parallel)
      for (int64_t i = 0; i < items; ++i) body(i, 0, 1);
    } else {
#pragma omp parallel for schedule(static) if (parallel)
      for (int64_t i = 0; i < items; ++i) body(i, 0, 1);
    }
  }

  // An item is one thread here, so its lanes' maximum is its own value.
  template <int Lanes> static uint32_t lane_max(uint32_t value) { return value; }

  static void atomic_max(int32_t* target, int32_t value) {
    int32_t seen = __atomic_load_n(target, __ATOMIC_RELAXED);
    while (seen < value &&
           !__atomic_compare_exchange_n(target, &seen, value, true, __ATOMIC_RELAXED, __ATOMIC_RELAXED)) {
    }
  }
};


}  // namespace kvforge::detail
