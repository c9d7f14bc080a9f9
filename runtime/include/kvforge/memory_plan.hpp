// Memory planning for paged variants: how many pages, from a fixed count or from the memory there is,
// before anything is allocated. See docs/memory.md.
#pragma once

#include <cstdint>

#include "kvforge/cache.hpp"
#include "kvforge/transport.hpp"

namespace kvforge {

// How many pages a paged variant gets, before anything is allocated.
enum class PlanMode : uint8_t {
  allocate,  // a fixed page count
  reserve,   // the pages that fit into free memory (the device's, or the CPU budget), less a reserve
};

struct MemoryRequest {
  PlanMode mode = PlanMode::allocate;
  Device device = Device::cpu;
  int64_t pages = 0;          // allocate
  int64_t reserve_bytes = 0;  // reserve: memory to leave free
  int64_t budget_bytes = 0;   // reserve on the CPU: the memory kvforge may use (the CPU has no "free")
  // A hybrid model's linear layers: a StatePool of `state_slots` slots and `state_checkpoints`
  // checkpoints of `state_slot_bytes` each (StatePool::slot_bytes()), on the same device. Reserve
  // takes them from the memory before the pages; all three >= 0.
  int64_t state_slot_bytes = 0;
  int64_t state_slots = 0;
  int64_t state_checkpoints = 0;
};

struct MemoryPlan {
  int64_t pages = 0;
  int64_t page_bytes = 0;   // one page of every layer, codes and scales
  int64_t pool_bytes = 0;   // pages * page_bytes, plus fixed per-tensor scales
  int64_t state_bytes = 0;  // the StatePool the request named: (slots + checkpoints) * slot bytes
  int64_t tokens = 0;       // how many tokens fit
  int32_t page_size = 0;
  // The longest sequence each of `batch` sequences can reach at once (whole pages each).
  int64_t max_len_for_batch(int64_t batch) const;
  CacheConfig config(void* stream = nullptr) const;
};

MemoryPlan plan_memory(const VariantDescriptor& d, const MemoryRequest& r);
// The same plan agreed across ranks: each plans its own, and all take the smallest page count (a
// collective: every rank of `ranks` must call it), as DeepSpeed all-reduces its block count with MIN.
// Where any rank's own plan fails, every rank raises that rank's error (collective.hpp), named
// "rank R of N: ...": none is left waiting.
MemoryPlan plan_memory(const VariantDescriptor& d, const MemoryRequest& r, Transport& ranks);

}  // namespace kvforge
