// TypedCache's attend (typed_cache.hpp declares the class): every argument checked on the host, the work
// planned (attend_plan), then the attend kernel of the cache's device (attend/attend_ops.hpp).
#pragma once

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "kvforge/detail/attend/attend_ops.hpp"
#include "kvforge/detail/typed_cache.hpp"

namespace kvforge {

namespace detail {

// The widths of a query's and an output's rows: the key's and value's spans of a token's record.
inline int attend_key_width(const VariantDescriptor& d) {
  return d.mla() ? d.mla_kv_lora_rank + d.mla_rope_dim : d.split_widths() ? d.k_head_dim : d.head_dim;
}
inline int attend_value_width(const VariantDescriptor& d) {
  return d.mla() ? d.mla_kv_lora_rank : d.split_widths() ? d.v_head_dim : d.head_dim;
}

// How many items a launch should have, and how a KV head's query heads and a sequence's queries tile
// the rows an item holds (max_rows). Splits share a sequence's positions between items where too few
// items would leave workers idle, no split under `min_split` positions.
inline AttendPlan attend_plan(int batch, int heads, int group, int64_t max_query_len, int64_t max_kv_len,
                              int max_rows, int workers, int64_t min_split) {
  AttendPlan p;
  p.batch = batch;
  p.head_chunk = 1;
  for (int c = std::min(group, max_rows); c >= 1; --c)
    if (group % c == 0) {
      p.head_chunk = c;
      break;
    }
  p.head_chunks = group / p.head_chunk;
  p.query_tile = std::max(1, max_rows / p.head_chunk);
  p.query_tiles = int(std::max<int64_t>(1, (max_query_len + p.query_tile - 1) / p.query_tile));
  const int64_t items = p.items() * heads;
  const int64_t wanted = 2 * int64_t(workers);
  if (items < wanted && max_kv_len >= 2 * min_split)
    p.splits = int(std::min<int64_t>((wanted + items - 1) / items, max_kv_len / min_split));
  return p;
}

}  // namespace detail

template <class Traits>
void TypedCache<Traits>::attend(int layer, const TensorView& q, const AttendBatch& batch, const AttendOptions& options,
                                const TensorView& out, const TensorView& lse) {
  using Shape = detail::AttendShape<Traits>;
  const VariantDescriptor& d = desc();
  detail::check_layer(layer, layers());
  if constexpr (runtime_sized) {
    if (head_dim() > Shape::kMaxRuntimeDim)
      throw UnsupportedError(std::string(d.name) + ": attend on the generic path takes head_dim up to " +
                             std::to_string(Shape::kMaxRuntimeDim) + ", this cache has " + std::to_string(head_dim()) +
                             "; a generated variant (kvforge.variant) takes any");
  }
  const int kw = detail::attend_key_width(d), vw = detail::attend_value_width(d);
  const int64_t tokens = q.shape[0], q_heads = q.shape[1];
  if (q_heads < 1 || q_heads % heads() != 0)
    throw ShapeError("q", "has " + std::to_string(q_heads) + " query heads, which must be a positive multiple of the "
                          "cache's " + std::to_string(heads()) + " KV heads (the query heads a KV head serves)");
  detail::check_tensor("q", q, {tokens, q_heads, kw}, dtype_of<input_t>::value, config_.device);
  detail::check_tensor("out", out, {tokens, q_heads, vw}, dtype_of<input_t>::value, config_.device);
  if (lse.data) detail::check_tensor("lse", lse, {tokens, q_heads, 1}, DType::f32, config_.device);
  if (lse.data && lse.stride[1] != 1)
    throw ShapeError("lse", "its query heads must be adjacent (stride 1), got " + std::to_string(lse.stride[1]));
  if (!(std::isfinite(options.scale) && options.scale >= 0.0f))
    throw ArgumentError("options.scale", "must be finite and >= 0 (0: 1 / sqrt(" + std::to_string(kw) + "))");
  if (!(std::isfinite(options.softcap) && options.softcap >= 0.0f))
    throw ArgumentError("options.softcap", "must be finite and >= 0 (0: none)");
  if (options.window < 0) throw OutOfRangeError("options.window", options.window, 0, INT32_MAX, -1, "0: no window");
  if (addressing == Addressing::ring && options.window > window())
    throw OutOfRangeError("options.window", options.window, 0, window() + 1, -1,
                          "a ring of window " + std::to_string(window()) + " holds no more positions");
  if (options.sinks.data) detail::check_tensor("options.sinks", options.sinks, {1, 1, q_heads}, DType::f32, config_.device);
  detail::check_index_view("batch.query_start", batch.query_start, DType::i32, 1, config_.device);
  const int64_t sequences = batch.query_start.size - 1;
  detail::check_index_view("batch.lengths", batch.lengths, DType::i32, sequences, config_.device, sequences);
  if (batch.positions.size > 0 || batch.positions.data)
    detail::check_index_view("batch.positions", batch.positions, DType::i32, tokens, config_.device, tokens);
  if (batch.begins.size > 0 || batch.begins.data)
    detail::check_index_view("batch.begins", batch.begins, DType::i32, sequences, config_.device, sequences);
  if constexpr (addressing == Addressing::paged) {
    if (batch.max_pages < 1 && sequences > 0)
      throw OutOfRangeError("batch.max_pages", batch.max_pages, 1, INT32_MAX, -1, "the page table's row length");
    detail::check_index_view("batch.page_table", batch.page_table, DType::i32, sequences * batch.max_pages,
                             config_.device);
  } else {
    detail::check_index_view("batch.rows", batch.rows, DType::i32, sequences, config_.device, sequences);
  }
  if (batch.max_query_len < 0) throw OutOfRangeError("batch.max_query_len", batch.max_query_len, 0, INT64_MAX);
  if (batch.max_kv_len < 0) throw OutOfRangeError("batch.max_kv_len", batch.max_kv_len, 0, INT64_MAX);
  // The most positions a sequence can hold here.
  const int64_t capacity = addressing == Addressing::paged ? batch.max_pages * page_size()
                           : addressing == Addressing::ring ? INT32_MAX
                                                            : capacity_.positions;
  int64_t max_query = batch.max_query_len, max_kv = batch.max_kv_len;
  detail::IndexChecks checks;
  if (on_cpu()) {
    // Every entry read here, before the launch: a refused call writes nothing.
    const auto* starts = static_cast<const int32_t*>(batch.query_start.data);
    const auto* lengths = static_cast<const int32_t*>(batch.lengths.data);
    const auto* positions = static_cast<const int32_t*>(batch.positions.data);
    const auto* rows = static_cast<const int32_t*>(batch.rows.data);
    const auto* begins = batch.begins.size > 0 ? static_cast<const int32_t*>(batch.begins.data) : nullptr;
    const auto* table = static_cast<const int32_t*>(batch.page_table.data);
    if (starts[0] != 0) throw OutOfRangeError("batch.query_start", starts[0], 0, 1, 0, "the first sequence's queries start at 0");
    if (starts[sequences] != tokens)
      throw OutOfRangeError("batch.query_start", starts[sequences], tokens, tokens + 1, sequences,
                            "the last entry is the number of queries, q's " + std::to_string(tokens));
    int64_t longest_query = 0, longest_kv = 0;
    for (int64_t b = 0; b < sequences; ++b) {
      if (starts[b + 1] < starts[b])
        throw OutOfRangeError("batch.query_start", starts[b + 1], starts[b], tokens + 1, b + 1, "entries never decrease");
      const int64_t n = starts[b + 1] - starts[b], length = lengths[b];
      if (length < 1 || length > capacity)
        throw OutOfRangeError("batch.lengths", length, 1, capacity + 1, b,
                              length < 1 ? "a sequence attends over at least one position"
                                         : "sequence " + std::to_string(b) + "'s positions pass what its " +
                                               (addressing == Addressing::paged ? "page table" : "row") + " holds");
      if (begins && (begins[b] < 0 || begins[b] >= length))
        throw OutOfRangeError("batch.begins", begins[b], 0, length, b,
                              "sequence " + std::to_string(b) + " begins at one of its " + std::to_string(length) + " positions");
      int64_t lowest = length - 1;  // the oldest position any of its queries sees
      for (int64_t i = 0; i < n; ++i) {
        int64_t p = length - 1;
        if (options.causal) {
          p = positions ? int64_t(positions[starts[b] + i]) : length - n + i;
          if (p < 0 || p >= length)
            throw OutOfRangeError(positions ? "batch.positions" : "batch.query_start", positions ? p : n,
                                  positions ? 0 : 0, positions ? length : length + 1, positions ? starts[b] + i : b + 1,
                                  positions ? "a query's position is one of its sequence's " + std::to_string(length)
                                            : "sequence " + std::to_string(b) + " has more queries than positions");
        }
        // A query before its sequence's begin (a left pad's own query) sees nothing: its row is zeros
        // and its lse is -inf, as HF's padded rows are ignored downstream.
        int64_t lo = options.window > 0 ? std::max<int64_t>(0, p - options.window + 1) : 0;
        if (begins) lo = std::max<int64_t>(lo, begins[b]);
        if (lo <= p) lowest = std::min(lowest, lo);
      }
      if (n == 0) continue;
      if constexpr (addressing == Addressing::paged) {
        const int32_t* pages = table + b * batch.max_pages;
        for (int64_t pg = lowest / page_size(); pg <= (length - 1) / page_size(); ++pg)
          if (pages[pg] < 0 || pages[pg] >= capacity_.pages)
            throw OutOfRangeError("batch.page_table", pages[pg], 0, capacity_.pages, b * batch.max_pages + pg,
                                  "sequence " + std::to_string(b) + "'s page " + std::to_string(pg) + " holds positions it reads");
      } else {
        if (rows[b] < 0 || rows[b] >= capacity_.rows) throw OutOfRangeError("batch.rows", rows[b], 0, capacity_.rows, b);
        if constexpr (addressing == Addressing::ring) {
          const int64_t held = row_length(rows[b]), oldest = std::max<int64_t>(0, held - window());
          if (length > held)
            throw OutOfRangeError("batch.lengths", length, 1, held + 1, b,
                                  "row " + std::to_string(rows[b]) + " holds positions below " + std::to_string(held));
          if (lowest < oldest)
            throw OutOfRangeError("batch.lengths", length, 1, held + 1, b,
                                  "its queries read position " + std::to_string(lowest) + ", which has left the ring's window of " +
                                      std::to_string(window()) + " (give options.window <= " + std::to_string(window()) + ")");
        }
      }
      longest_query = std::max(longest_query, n);
      longest_kv = std::max(longest_kv, length);
    }
    if (max_query > 0 && max_query < longest_query)
      throw OutOfRangeError("batch.max_query_len", max_query, longest_query, INT64_MAX, -1, "a sequence has more queries");
    if (max_kv > 0 && max_kv < longest_kv)
      throw OutOfRangeError("batch.max_kv_len", max_kv, longest_kv, INT64_MAX, -1, "a sequence holds more positions");
    max_query = longest_query, max_kv = longest_kv;
  } else {
    // On the device, inside the launch: the lengths against the capacity, and every page or row.
    if (max_query == 0) max_query = tokens;
    if (max_kv == 0) max_kv = addressing == Addressing::ring ? window() : capacity;
    checks.add(index_check(batch.lengths, sequences, 1, capacity + 1, false, detail::kCheckPositions));
    if constexpr (addressing == Addressing::paged)
      checks.add(index_check(batch.page_table, sequences * batch.max_pages, 0, capacity_.pages, true, detail::kCheckPageList));
    else
      checks.add(index_check(batch.rows, sequences, 0, capacity_.rows, false, detail::kCheckRows));
  }
  if (tokens == 0 || sequences == 0) return;
  const int group = int(q_heads / heads());
  const int max_rows = Shape::max_rows(on_cpu() ? detail::kAttendRowsCpu : detail::kAttendRowsCuda);
  const int workers = on_cpu() ? cpu_threads() : 4 * 132;
  const detail::AttendPlan plan =
      detail::attend_plan(int(sequences), heads(), group, max_query, max_kv, max_rows, workers, 256);
  detail::AttendArgs<storage_t, input_t> a{};
  a.pool = pool_.as<const storage_t>();
  a.s = geometry_.strides;
  a.scales = scale_ref();
  a.layer = layer;
  a.q = {static_cast<const input_t*>(q.data), q.stride[0], q.stride[1]};
  a.out = {static_cast<input_t*>(out.data), out.stride[0], out.stride[1]};
  a.lse = static_cast<float*>(lse.data);
  a.lse_token_stride = lse.stride[0];
  a.query_start = static_cast<const int32_t*>(batch.query_start.data);
  a.lengths = static_cast<const int32_t*>(batch.lengths.data);
  a.positions = batch.positions.size > 0 ? static_cast<const int32_t*>(batch.positions.data) : nullptr;
  a.begins = batch.begins.size > 0 ? static_cast<const int32_t*>(batch.begins.data) : nullptr;
  a.rows = addressing == Addressing::paged ? nullptr : static_cast<const int32_t*>(batch.rows.data);
  a.page_table = addressing == Addressing::paged ? static_cast<const int32_t*>(batch.page_table.data) : nullptr;
  a.max_pages = batch.max_pages;
  a.q_heads = int(q_heads);
  a.group = group;
  a.scale = options.scale > 0.0f ? options.scale : 1.0f / std::sqrt(float(kw));
  a.softcap = options.softcap;
  a.window = options.window;
  a.causal = options.causal;
  a.sinks = static_cast<const float*>(options.sinks.data);
  a.plan = plan;
  if (plan.splits > 1) {
    const int64_t bytes = plan.items() * heads() * max_rows * int64_t(vw + 2) * int64_t(sizeof(float));
    if (attend_partial_.bytes() < bytes) attend_partial_ = Buffer(*backend_, bytes);
    a.partial = attend_partial_.as<float>();
  }
  a.status = status();
  a.ext = extents();
  a.checks = checks;
  ops_->attend(launch(), a);
}

}  // namespace kvforge
