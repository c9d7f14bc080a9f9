// The prefix cache's policy and events, as Python sees them: retention ranges from tuples, and KV
// events as dictionaries named and shaped as vLLM's (vllm/distributed/kv_events.py), which
// kvforge.kv_events serializes.
#pragma once

#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <string>
#include <vector>

#include "kvforge/hybrid.hpp"
#include "kvforge/sequence_manager.hpp"

namespace kvforge {

namespace nb = nanobind;

// (begin, end, priority[, seconds]) per range.
inline std::vector<RetentionRange> retention_ranges(nb::handle ranges) {
  if (!nb::isinstance<nb::sequence>(ranges) || nb::isinstance<nb::str>(ranges))
    throw ArgumentError("ranges", "expected a list of (begin, end, priority[, seconds]) tuples");
  std::vector<RetentionRange> out;
  const nb::sequence items = nb::borrow<nb::sequence>(ranges);
  for (size_t i = 0; i < nb::len(items); ++i) {
    const nb::handle item = items[i];
    const std::string name = "ranges[" + std::to_string(i) + "]";
    const bool shaped = nb::isinstance<nb::sequence>(item) && !nb::isinstance<nb::str>(item) &&
                        (nb::len(item) == 3 || nb::len(item) == 4);
    if (!shaped) throw ArgumentError(name, "expected (begin, end, priority[, seconds])");
    RetentionRange r;
    try {
      r.begin = nb::cast<int64_t>(item[0]);
      r.end = nb::cast<int64_t>(item[1]);
      r.priority = nb::cast<int>(item[2]);
      if (nb::len(item) == 4) r.seconds = nb::cast<double>(item[3]);
    } catch (const nb::cast_error&) {
      throw ArgumentError(name, "expected integers begin, end and priority, and a number of seconds");
    }
    out.push_back(r);
  }
  return out;
}

inline nb::dict event_fields(const KvEvent& e) {
  nb::dict f;
  nb::object none = nb::none();
  switch (e.kind) {
    case KvEvent::Kind::block_stored: {
      f["type"] = "BlockStored";
      f["block_hashes"] = nb::cast(e.block_hashes);
      f["parent_block_hash"] = e.parent_block_hash ? nb::cast(*e.parent_block_hash) : none;
      f["token_ids"] = nb::cast(e.token_ids);
      f["block_size"] = e.block_size;
      f["lora_id"] = none;
      f["medium"] = e.medium;
      f["lora_name"] = none;
      // The salt every hash chains, per block, so that a consumer can recompute the hashes.
      nb::list extra;
      for (size_t i = 0; i < e.block_hashes.size(); ++i) extra.append(nb::make_tuple(e.salt));
      f["extra_keys"] = e.salt ? nb::object(extra) : none;
      break;
    }
    case KvEvent::Kind::block_removed:
      f["type"] = "BlockRemoved";
      f["block_hashes"] = nb::cast(e.block_hashes);
      f["medium"] = e.medium;
      break;
    case KvEvent::Kind::all_blocks_cleared:
      f["type"] = "AllBlocksCleared";
      break;
  }
  if (e.kind != KvEvent::Kind::all_blocks_cleared) f["group_idx"] = e.group >= 0 ? nb::cast(e.group) : none;
  return f;
}

inline nb::list event_list(const std::vector<KvEvent>& events) {
  nb::list out;
  for (const KvEvent& e : events) out.append(event_fields(e));
  return out;
}

}  // namespace kvforge
