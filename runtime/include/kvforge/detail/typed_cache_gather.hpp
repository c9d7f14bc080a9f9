// TypedCache's gather (typed_cache.hpp declares the class): a sequence's positions of one layer,
// dequantized into K and V of the input dtype.
#pragma once

#include <algorithm>
#include <string>

#include "kvforge/detail/typed_cache.hpp"

namespace kvforge {

template <class Traits>
void TypedCache<Traits>::gather(int layer, const GatherRange& range, const TensorView& k_out,
                                const TensorView& v_out) {
  detail::check_layer(layer, layers());
  if (range.begin < 0) throw OutOfRangeError("range.begin", range.begin, 0, INT64_MAX);
  if (range.end < range.begin) throw OutOfRangeError("range.end", range.end, range.begin, INT64_MAX);
  const int64_t count = range.end - range.begin;
  detail::check_tensor("k_out", k_out, {heads(), count, head_dim()}, dtype_of<input_t>::value, config_.device);
  detail::check_tensor("v_out", v_out, {heads(), count, head_dim()}, dtype_of<input_t>::value, config_.device);
  detail::IndexChecks checks;  // run by the gather itself, or below where it reads nothing
  if constexpr (addressing == Addressing::paged) {
    const int64_t pages_needed = (range.end + page_size() - 1) / page_size();
    detail::check_index_view("range.pages", range.pages, DType::i32, pages_needed, config_.device);
    if (count > 0) {
      // Only the pages the range touches must be valid: a sliding-window sequence's earlier entries
      // are -1 once their pages are freed.
      const int64_t first = range.begin / page_size();
      IndexView touched = range.pages;
      touched.data = static_cast<const int32_t*>(range.pages.data) + first;
      touched.size = pages_needed - first;
      checks.add(index_check(touched, touched.size, 0, capacity_.pages, false, detail::kCheckPages));
    }
  } else {
    check_row(range.row);
    if constexpr (addressing == Addressing::ring) {
      if (!on_cpu()) {
        // On the device, against the row's length where it lives: reading it back would synchronize,
        // and a captured graph could not hold the gather. The length must lie in [end, begin + window].
        const IndexView length{row_length_.as<int32_t>() + range.row, DType::i32, config_.device, 1};
        checks.add(index_check(length, 1, range.end, count > 0 ? range.begin + window() + 1 : INT64_MAX, false,
                               detail::kCheckRingLength));
      } else {
        const int64_t length = row_length(range.row);
        const int64_t oldest = std::max<int64_t>(0, length - window());
        if (range.begin > length)  // no end would do: name the begin
          throw OutOfRangeError("range.begin", range.begin, 0, length + 1, -1,
                                "row " + std::to_string(range.row) + " holds positions below " + std::to_string(length));
        if (range.end > length)
          throw OutOfRangeError("range.end", range.end, range.begin, length + 1, -1,
                                "row " + std::to_string(range.row) + " holds positions below " + std::to_string(length));
        if (count > 0 && range.begin < oldest)
          throw OutOfRangeError("range.begin", range.begin, oldest, length, -1,
                                "positions before " + std::to_string(oldest) + " have left the ring's window of " +
                                    std::to_string(window()));
      }
    } else {
      if (range.begin > capacity_.positions)  // no end would do: name the begin
        throw OutOfRangeError("range.begin", range.begin, 0, capacity_.positions + 1, -1,
                              "the cache holds max_seq_len=" + std::to_string(capacity_.positions) + " positions per row");
      if (range.end > capacity_.positions)
        throw OutOfRangeError("range.end", range.end, range.begin, capacity_.positions + 1, -1,
                              "the cache holds max_seq_len=" + std::to_string(capacity_.positions) + " positions per row");
    }
  }
  if (count == 0) {
    check_indices(checks);
    return;
  }
  detail::GatherArgs<storage_t, input_t> a{};
  a.pool = pool_.as<const storage_t>();
  a.s = geometry_.strides;
  a.scales = scale_ref();
  a.k = {static_cast<input_t*>(k_out.data), k_out.stride[1], k_out.stride[0]};  // [heads, tokens, head_dim]
  a.v = {static_cast<input_t*>(v_out.data), v_out.stride[1], v_out.stride[0]};
  a.layer = layer;
  a.row = range.row;
  a.pages = static_cast<const int32_t*>(range.pages.data);
  a.begin = range.begin;
  a.count = count;
  a.status = status();
  a.ext = extents();
  a.checks = checks;
  ops_->gather(launch(), a);
}

}  // namespace kvforge
