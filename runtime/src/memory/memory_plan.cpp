#include "kvforge/memory_plan.hpp"

#include <algorithm>
#include <string>

#include "kvforge/backend.hpp"
#include "kvforge/collective.hpp"

namespace kvforge {

int64_t MemoryPlan::max_len_for_batch(int64_t batch) const {
  if (batch <= 0) throw OutOfRangeError("batch", batch, 1, INT64_MAX);
  return pages / batch * page_size;
}

CacheConfig MemoryPlan::config(void* stream) const {
  CacheConfig c;
  c.pages = pages;
  c.stream = stream;
  return c;
}

MemoryPlan plan_memory(const VariantDescriptor& d, const MemoryRequest& r) {
  if (!d.paged()) throw UnsupportedError(std::string(d.name) + ": memory planning counts pages; this layout has none");
  MemoryPlan p;
  p.page_size = d.page_size;
  p.page_bytes = d.bytes_per_token * d.page_size;
  const int64_t scales = d.tensor_scale_bytes();
  const std::pair<const char*, int64_t> state_fields[] = {
      {"state_slot_bytes", r.state_slot_bytes}, {"state_slots", r.state_slots}, {"state_checkpoints", r.state_checkpoints}};
  for (const auto& [name, value] : state_fields)
    if (value < 0 || value > (int64_t(1) << 40)) throw OutOfRangeError(name, value, 0, (int64_t(1) << 40) + 1);
  const int64_t records = r.state_slots + r.state_checkpoints;
  if (r.state_slot_bytes > 0 && records > (int64_t(1) << 60) / r.state_slot_bytes)
    throw OutOfRangeError("state_slot_bytes", r.state_slot_bytes, 0, (int64_t(1) << 60) / records + 1, -1,
                          "bytes of a slot, times the slots and checkpoints, beyond 2^60");
  p.state_bytes = r.state_slot_bytes * records;
  const int64_t fixed = scales + p.state_bytes;  // what the memory holds besides the pages
  if (r.mode == PlanMode::allocate) {
    if (r.pages <= 0) throw OutOfRangeError("pages", r.pages, 1, INT32_MAX);
    p.pages = r.pages;
  } else {
    int64_t available;
    if (r.device == Device::cpu) {
      if (r.budget_bytes <= 0)
        throw ArgumentError("budget_bytes", "the CPU has no free-memory figure to reserve from; give a positive budget");
      available = r.budget_bytes;
    } else {
      available = backend(r.device).free_memory();
    }
    if (r.reserve_bytes < 0) throw OutOfRangeError("reserve_bytes", r.reserve_bytes, 0, available + 1);
    const int64_t usable = available - r.reserve_bytes - fixed;
    p.pages = std::min<int64_t>(usable > 0 ? usable / p.page_bytes : 0, INT32_MAX);
    if (p.pages <= 0) {
      // Name what ran short: the reserve where one page would fit without it, else the memory itself.
      const bool reserve_short = r.reserve_bytes > 0 && available - fixed >= p.page_bytes;
      const char* short_of = reserve_short ? "reserve_bytes" : r.device == Device::cpu ? "budget_bytes" : "free_memory";
      throw CapacityError(short_of, p.page_bytes + r.reserve_bytes + fixed, available);
    }
  }
  p.pool_bytes = p.pages * p.page_bytes + scales;
  p.tokens = p.pages * d.page_size;
  return p;
}

MemoryPlan plan_memory(const VariantDescriptor& d, const MemoryRequest& r, Transport& ranks) {
  // A rank whose own plan fails still joins the agreement, so that every rank raises its error together.
  MemoryPlan p = collectively(ranks, [&] { return plan_memory(d, r); });
  // Every rank plans, then all take the smallest, so that they schedule the same capacity.
  const int64_t pages = ranks.all_min(p.pages);
  p.pool_bytes -= (p.pages - pages) * p.page_bytes;
  p.pages = pages;
  p.tokens = pages * d.page_size;
  return p;
}

}  // namespace kvforge
