// Row and page upkeep from the one source every backend runs: zeroing a row, reordering rows for beam
// search, copying pages (copy-on-write) and moving pages to and from their packed form (offload). Ops
// (ops.hpp) and QuantOps (quant_ops.hpp) hold what they share with the write and read paths: sizes,
// addressing, scales. Also
// make_op_table, which fills a backend's table from both.
#pragma once

#include "kvforge/detail/attend/attend_ops.hpp"
#include "kvforge/detail/executor.hpp"
#include "kvforge/detail/gather_ops.hpp"
#include "kvforge/detail/write_ops.hpp"

namespace kvforge::detail {

template <class Traits, class Exec> struct UpkeepOps : QuantOps<Traits, Exec> {
  using O = QuantOps<Traits, Exec>;
  using typename O::Scale;
  using typename O::Store;
  using O::copy_scales;
  using O::kStoredDim;
  using O::H;
  using O::stored_dim;
  using O::heads;
  using O::item_bytes;
  using O::kAddressing;
  using O::kLanes;
  using O::kRuntime;
  using O::kScalesPerToken;
  using O::P;
  using O::page_size;
  using O::scale_at;

  static void zero_row(const Exec& ex, const ZeroRowArgs<Store>& a) {
    const int64_t items = int64_t(a.layers) * 2 * a.positions;
    ex.for_each_item(items, Fixed<kLanes>{}, item_bytes(a.ext), [a] KVF_HD(int64_t i, int lane, int lanes) {
      const int64_t pos = i % a.positions;
      const int64_t lk = i / a.positions;
      Exec::zero_heads(a.pool + element_offset(a.s, lk / 2, lk % 2, a.row, pos), a.s.head, heads(a.ext), stored_dim(a.ext),
                       lane, lanes);
      if constexpr (kScalesPerToken > 0) {
        Scale* scale = scale_at(a.scales, lk / 2, lk % 2, a.row, pos);
        if (lane == 0)
          for (int h = 0; h < O::kScaleHeads; ++h)
            for (int g = 0; g < O::kGroups; ++g) scale[h * a.scales.s.head + g] = Scale{};
      }
    });
  }

  // One layer of a reorder: scratch[r] = old row beam[r]; then row r = scratch[r].
  static void reorder_layer(const Exec& ex, const ReorderArgs<Store>& a) {
    const int64_t items = a.rows * 2 * a.positions;
    ex.for_each_item(items, Fixed<kLanes>{}, item_bytes(a.ext), [a] KVF_HD(int64_t i, int lane, int lanes) {
      if (a.status->code) return;
      const int64_t pos = i % a.positions;
      const int64_t kv = (i / a.positions) % 2;
      const int64_t r = i / (2 * a.positions);
      const Store* src = a.pool + element_offset(a.s, a.layer, kv, a.beam[r], pos);
      const auto h = heads(a.ext);
      const auto d = stored_dim(a.ext);
      Exec::copy_heads(a.scratch + i * int(h) * int(d), int(d), src, a.s.head, h, d, lane, lanes);
      if constexpr (kScalesPerToken > 0)
        copy_scales(static_cast<Scale*>(a.scale_scratch) + i * kScalesPerToken, O::kPackedScaleHead,
                    scale_at(a.scales, a.layer, kv, a.beam[r], pos), a.scales.s.head, lane);
    });
    ex.for_each_item(items, Fixed<kLanes>{}, item_bytes(a.ext), [a] KVF_HD(int64_t i, int lane, int lanes) {
      if (a.status->code) return;
      const int64_t pos = i % a.positions;
      const int64_t kv = (i / a.positions) % 2;
      const int64_t r = i / (2 * a.positions);
      Store* dst = a.pool + element_offset(a.s, a.layer, kv, r, pos);
      const auto h = heads(a.ext);
      const auto d = stored_dim(a.ext);
      Exec::copy_heads(dst, a.s.head, a.scratch + i * int(h) * int(d), int(d), h, d, lane, lanes);
      if constexpr (kScalesPerToken > 0)
        copy_scales(scale_at(a.scales, a.layer, kv, r, pos), a.scales.s.head,
                    static_cast<const Scale*>(a.scale_scratch) + i * kScalesPerToken, O::kPackedScaleHead, lane);
    });
  }

  static void reorder_lengths(const Exec& ex, const ReorderArgs<Store>& a) {
    ex.for_each_item(a.rows, Fixed<1>{}, 4, [a] KVF_HD(int64_t r, int, int) {
      if (a.status->code) return;
      a.length_scratch[r] = a.row_length[a.beam[r]];
    });
    ex.for_each_item(a.rows, Fixed<1>{}, 4, [a] KVF_HD(int64_t r, int, int) {
      if (a.status->code) return;
      a.row_length[r] = a.length_scratch[r];
    });
  }

  // Page operations run one item per (page, layer, kv, slot), the slot moving fastest.
  struct PageItem {
    int64_t slot, kv, layer, index;
  };
  KVF_HD static KVF_INLINE PageItem page_item(const Extents& e, int64_t i, int layers) {
    const auto p = page_size(e);
    return {i % p, (i / p) % 2, (i / (2 * p)) % layers, i / (2 * p * layers)};
  }

  KVF_HD static KVF_INLINE int64_t packed_codes_bytes(const Extents& e, int layers) {
    return int64_t(layers) * 2 * int(page_size(e)) * int(heads(e)) * int(stored_dim(e)) * int64_t(sizeof(Store));
  }

  // Page operations on an executor that takes whole blocks (the CPU): where one page's rows of one
  // (layer, K or V) are a dense [slot, head, dim] or [head, slot, dim] block of the pool, the block is
  // copied whole (its scales, few, slot by slot) rather than row by row.
  static constexpr bool kPageBlocks = Exec::kTileItems > 1 && !kRuntime && kAddressing == Addressing::paged;
  static constexpr int64_t kPageBlock = int64_t(H) * P * kStoredDim;  // elements of one such block
  static bool slots_outside_heads_dense(const Strides& s) {
    return s.head == kStoredDim && s.seq_or_slot == int64_t(H) * kStoredDim;
  }
  static bool page_block_dense(const Strides& s) {
    return kPageBlock <= (int64_t(1) << 28) &&
           (slots_outside_heads_dense(s) || (s.seq_or_slot == kStoredDim && s.head == int64_t(P) * kStoredDim));
  }

  static void move_pages(const Exec& ex, const MovePagesArgs<Store>& a) {
    if constexpr (kPageBlocks) {
      // The packed form is [slot, head, dim] per (layer, K or V), so only that pool order moves whole.
      if (slots_outside_heads_dense(a.s) && page_block_dense(a.s)) {
        ex.for_each_item(a.count * a.layers * 2, Fixed<1>{}, kPageBlock * int64_t(sizeof(Store)), [a](int64_t i, int, int) {
          if (a.status->code) return;
          const int64_t kv = i % 2, layer = (i / 2) % a.layers, j = i / (2 * a.layers);
          unsigned char* packed = a.packed + j * a.packed_page_bytes;
          Store* packed_codes = reinterpret_cast<Store*>(packed) + (layer * 2 + kv) * kPageBlock;
          Store* pooled = a.pool + element_offset(a.s, layer, kv, a.pages[j], 0);
          if (a.to_packed) {
            Exec::copy_row(packed_codes, pooled, int(kPageBlock));
          } else {
            Exec::copy_row(pooled, packed_codes, int(kPageBlock));
          }
          if constexpr (kScalesPerToken > 0)
            for (int slot = 0; slot < P; ++slot)
              move_scales(a, packed, (layer * 2 + kv) * P + slot, layer, kv, a.pages[j], slot, 0);
        });
        return;
      }
    }
    if constexpr (kAddressing == Addressing::paged) {
      const int64_t items = a.count * a.layers * 2 * int(page_size(a.ext));
      ex.for_each_item(items, Fixed<kLanes>{}, item_bytes(a.ext), [a] KVF_HD(int64_t i, int lane, int lanes) {
        if (a.status->code) return;
        const PageItem it = page_item(a.ext, i, a.layers);
        const int64_t slot = it.slot, kv = it.kv, layer = it.layer, j = it.index;
        const int64_t page = a.pages[j];
        const int64_t row = (layer * 2 + kv) * int(page_size(a.ext)) + slot;  // within the packed page
        const auto h = heads(a.ext);
      const auto d = stored_dim(a.ext);
        unsigned char* packed = a.packed + j * a.packed_page_bytes;
        Store* packed_codes = reinterpret_cast<Store*>(packed) + row * int(h) * int(d);
        Store* pooled = a.pool + element_offset(a.s, layer, kv, page, slot);
        if (a.to_packed) {
          Exec::copy_heads(packed_codes, int(d), pooled, a.s.head, h, d, lane, lanes);
        } else {
          Exec::copy_heads(pooled, a.s.head, packed_codes, int(d), h, d, lane, lanes);
        }
        if constexpr (kScalesPerToken > 0) move_scales(a, packed, row, layer, kv, page, slot, lane);
      });
    }
  }

  // The dynamic scales of packed row `row` ((layer * 2 + kv) * page_size + slot, after the packed
  // page's codes) to or from their place in the pool.
  KVF_HD static KVF_INLINE void move_scales(const MovePagesArgs<Store>& a, unsigned char* packed, int64_t row,
                                            int64_t layer, int64_t kv, int64_t page, int64_t slot, int lane) {
    unsigned char* packed_scales = packed + packed_codes_bytes(a.ext, a.layers) + row * kScalesPerToken * int64_t(sizeof(Scale));
    Scale* pooled_scales = scale_at(a.scales, layer, kv, page, slot);
    if (a.to_packed) {
      copy_scales(packed_scales, O::kPackedScaleHead, pooled_scales, a.scales.s.head, lane);
    } else {
      copy_scales(pooled_scales, a.scales.s.head, packed_scales, O::kPackedScaleHead, lane);
    }
  }

  static void copy_pages(const Exec& ex, const CopyPagesArgs<Store>& a) {
    if constexpr (kPageBlocks) {
      if (page_block_dense(a.s)) {
        ex.for_each_item(a.count * a.layers * 2, Fixed<1>{}, kPageBlock * int64_t(sizeof(Store)), [a](int64_t i, int, int) {
          if (a.status->code) return;
          const int64_t kv = i % 2, layer = (i / 2) % a.layers, pair = i / (2 * a.layers);
          const int64_t from = a.pairs[2 * pair], to = a.pairs[2 * pair + 1];
          Exec::copy_row(a.pool + element_offset(a.s, layer, kv, to, 0), a.pool + element_offset(a.s, layer, kv, from, 0),
                         int(kPageBlock));
          if constexpr (kScalesPerToken > 0)
            for (int slot = 0; slot < P; ++slot)
              copy_scales(scale_at(a.scales, layer, kv, to, slot), a.scales.s.head,
                          scale_at(a.scales, layer, kv, from, slot), a.scales.s.head, 0);
        });
        return;
      }
    }
    if constexpr (kAddressing == Addressing::paged) {  // only paged layouts have pages to copy
      const int64_t items = a.count * a.layers * 2 * int(page_size(a.ext));
      ex.for_each_item(items, Fixed<kLanes>{}, item_bytes(a.ext), [a] KVF_HD(int64_t i, int lane, int lanes) {
        if (a.status->code) return;
        const PageItem it = page_item(a.ext, i, a.layers);
        const int64_t slot = it.slot, kv = it.kv, layer = it.layer, pair = it.index;
        Exec::copy_heads(a.pool + element_offset(a.s, layer, kv, a.pairs[2 * pair + 1], slot), a.s.head,
                         a.pool + element_offset(a.s, layer, kv, a.pairs[2 * pair], slot), a.s.head, heads(a.ext),
                         stored_dim(a.ext), lane, lanes);
        if constexpr (kScalesPerToken > 0)
          copy_scales(scale_at(a.scales, layer, kv, a.pairs[2 * pair + 1], slot), a.scales.s.head,
                      scale_at(a.scales, layer, kv, a.pairs[2 * pair], slot), a.scales.s.head, lane);
      });
    }
  }
};

// Fills a backend's table from this one source run on its executor, which it builds from a Launch.
template <class Traits, class Exec>
OpTable<Traits> make_op_table(void (*check_indices)(const Launch&, const IndexChecks&)) {
  static_assert(check_executor<Exec>());
  using Store = typename Traits::storage_t;
  using In = typename Traits::input_t;
  OpTable<Traits> t{};
#define KVFORGE_KERNEL_FILL(name, job, ...) \
  t.name = [](const Launch& l, const __VA_ARGS__& a) { job<Traits, Exec>::name(Exec::from(l), a); };
  KVFORGE_KERNELS(KVFORGE_KERNEL_FILL)
#undef KVFORGE_KERNEL_FILL
  t.check_indices = check_indices;
  return t;
}

}  // namespace kvforge::detail
