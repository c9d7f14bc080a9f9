// A third executor, built only in the tests: one thread, items taken last to first, every row moved
// one value at a time, one item per token (the tile CUDA takes), and ring appends that never scan
// their targets. It proves the backend seam: it is these files, and the generic path's kernels come
// from its tables (generic_path.hpp's Tables) with no other file changed; the registry's reference
// tests then run on it (test_serial_exec.cpp). Its choices differ from CpuExec's wherever the
// contract leaves room, so a body that leans on CpuExec's order or tiles fails here.
#pragma once

#include <cstdint>
#include <cstring>

#include "kvforge/detail/checks.hpp"
#include "kvforge/detail/executor.hpp"
#include "kvforge/detail/op_args.hpp"
#include "kvforge/detail/op_table.hpp"
#include "kvforge/detail/upkeep_ops.hpp"

namespace kvtest {

using kvforge::detail::Fixed;
using kvforge::detail::IndexChecks;
using kvforge::detail::Launch;
using kvforge::detail::TokenHeads;

struct SerialExec {
  static SerialExec from(const Launch&) { return {}; }

  // Every item once, last to first, on the calling thread; one lane each, whatever CUDA would give it.
  template <int Lanes, class Body>
  void for_each_item(int64_t items, Fixed<Lanes>, int64_t /*item_bytes*/, Body body,
                     const IndexChecks& checks = IndexChecks{}) const {
    kvforge::detail::check_indices_on_host(checks);
    for (int64_t i = items - 1; i >= 0; --i) body(i, 0, 1);
  }

  template <int Lanes, int Group = Lanes> static uint32_t lane_max(uint32_t value) { return value; }
  template <int Lanes> static uint32_t item_max(uint32_t value) { return value; }
  static constexpr int kTileItems = 1;
  static constexpr bool kChunkedQuant = false;
  static constexpr bool kHoldsTokens = false;
  static constexpr int64_t kScannedRingTokens = 0;
  static constexpr int kAttendRows = kvforge::detail::kAttendRowsCpu;  // the host plans the CPU's tiles
  static constexpr int kAttendBlock = 5;  // blocks that end inside a page

  static constexpr int row_begin(int /*lane*/) { return 0; }
  static constexpr int row_step(int /*lanes*/) { return 1; }

  template <class DExt, class Dst, class Src> static void copy_row(Dst* dst, const Src* src, DExt d) {
    for (int i = 0; i < int(d); ++i) dst[i] = kvforge::convert<Dst>(src[i]);
  }
  template <class HExt, class DExt, class Dst, class Src>
  static void copy_heads(Dst* dst, int64_t dst_head_stride, const Src* src, int64_t src_head_stride, HExt heads,
                         DExt head_dim, int /*lane*/, int /*lanes*/) {
    for (int h = 0; h < int(heads); ++h) copy_row(dst + h * dst_head_stride, src + h * src_head_stride, head_dim);
  }
  // V before K: the contract does not order them.
  template <class HExt, class DExt, class Dst, class Src>
  static void copy_heads_kv(TokenHeads<Dst> k_dst, TokenHeads<Dst> v_dst, TokenHeads<const Src> k_src,
                            TokenHeads<const Src> v_src, HExt heads, DExt head_dim, int lane, int lanes) {
    copy_heads(v_dst.data, v_dst.head_stride, v_src.data, v_src.head_stride, heads, head_dim, lane, lanes);
    copy_heads(k_dst.data, k_dst.head_stride, k_src.data, k_src.head_stride, heads, head_dim, lane, lanes);
  }
  template <class HExt, class DExt, class Dst>
  static void zero_heads(Dst* dst, int64_t dst_head_stride, HExt heads, DExt head_dim, int /*lane*/, int /*lanes*/) {
    for (int h = 0; h < int(heads); ++h)
      for (int i = 0; i < int(head_dim); ++i) std::memset(static_cast<void*>(dst + h * dst_head_stride + i), 0, sizeof(Dst));
  }
  static void atomic_max(int32_t* target, int32_t value) {
    if (*target < value) *target = value;
  }
};

// The serial executor's op tables, in the CPU's slot: its memory is the host's.
struct SerialTables {
  template <class T> static kvforge::detail::OpTables<T> of() {
    static const kvforge::detail::OpTable<T> serial = kvforge::detail::make_op_table<T, SerialExec>(
        [](const Launch&, const IndexChecks& c) { kvforge::detail::check_indices_on_host(c); });
    kvforge::detail::OpTables<T> tables{};
    tables[size_t(kvforge::Device::cpu)] = &serial;
    return tables;
  }
};

}  // namespace kvtest
