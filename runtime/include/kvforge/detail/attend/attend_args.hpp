// The argument block of the attend kernel (attend_ops.hpp), filled by TypedCache::attend
// (typed_cache_attend.hpp) once every argument has passed its checks.
#pragma once

#include <cstdint>

#include "kvforge/detail/op_args.hpp"

namespace kvforge::detail {

// Query rows an attend item holds on each backend (before AttendShape::max_rows narrows them for wide
// rows): the CPU's a tile of queries times the query heads of a KV head (16 prefill queries of llama3-8b's
// four, a decode's 4); CUDA's run an item on one thread, its tiles in local memory, so few.
inline constexpr int kAttendRowsCpu = 64;
inline constexpr int kAttendRowsCuda = 4;

// How a launch cuts the work: an item is (sequence, tile of its queries, KV head, chunk of that head's
// query heads, split of the positions). Planned on the host (attend_plan in typed_cache_attend.hpp).
struct AttendPlan {
  int batch = 0;          // B
  int query_tiles = 0;    // tiles of the longest sequence's queries
  int query_tile = 1;     // queries a tile holds
  int head_chunk = 1;     // query heads of one KV head an item takes
  int head_chunks = 1;    // group / head_chunk
  int splits = 1;         // splits of the positions; > 1: partials to `partial`, then a merge
  int64_t items() const { return int64_t(batch) * query_tiles * head_chunks * splits; }  // times KV heads
};

template <class Store, class In> struct AttendArgs {
  const Store* pool;
  Strides s;
  ScaleRef scales;
  int layer;
  Rows3<const In> q;   // [T, q_heads, key width]
  Rows3<In> out;       // [T, q_heads, value width]
  float* lse;          // [T, q_heads] (token stride lse_token_stride, head stride 1), or null
  int64_t lse_token_stride;
  const int32_t* query_start;  // [B + 1]
  const int32_t* lengths;      // [B]
  const int32_t* positions;    // [T] or null: the newest positions
  const int32_t* begins;       // [B] or null: the first position each sequence sees
  const int32_t* rows;         // [B]: contiguous and ring
  const int32_t* page_table;   // [B, max_pages]: paged
  int64_t max_pages;
  int q_heads;
  int group;  // query heads a KV head serves: q_heads / heads
  float scale;
  float softcap;  // 0: none
  int window;     // 0: none
  bool causal;
  const float* sinks;  // [q_heads] or null
  AttendPlan plan;
  // With plan.splits > 1: [items, rows, value width + 2] fp32, each row's unnormalized output, its
  // running maximum and its sum, merged by the second pass.
  float* partial;
  const DeviceStatus* status;
  Extents ext = {};
  IndexChecks checks = {};
};

}  // namespace kvforge::detail
