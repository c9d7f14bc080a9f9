// The read path from the one source every backend runs: a gather reads positions of a row or a page table
// into [heads, positions, head_dim] outputs, dequantizing codes. Ops (ops.hpp) and QuantOps (quant_ops.hpp) hold what it shares with
// the write path and upkeep.
#pragma once

#include "kvforge/detail/quant_ops.hpp"

namespace kvforge::detail {

template <class Traits, class Exec> struct GatherOps : QuantOps<Traits, Exec> {
  using O = QuantOps<Traits, Exec>;
  using Chunks = typename O::Chunks;
  using O::D;
  using O::dequantize_token_chunked;
  template <bool kAlignedRows> using GatheredToken = typename O::template GatheredToken<kAlignedRows>;
  using O::H;
  using O::head_dim;
  using O::heads;
  using In = typename O::In;
  using O::item_bytes;
  using O::kAddressing;
  using O::kChunkedQuant;
  using O::kLongestTile;
  using O::kQuantized;
  using O::kSplitsPoolOnVectors;
  using O::kTile;
  using O::kTokenLanes;
  using O::locate_position;
  using O::pool_rows_aligned;
  using Scale = typename O::Scale;
  using O::scale_at;
  using O::side_rows_aligned;
  using Store = typename O::Store;
  using O::tensor_scale;
  using O::walk_heads_outside;

  static void gather(const Exec& ex, const GatherArgs<Store, In>& a) {
    if constexpr (kTile > 1) {  // only an executor that takes tiles compiles these loop nests
      if constexpr (kAddressing == Addressing::contiguous && !kQuantized) {
        // A row's range read into [H, T, D] from a pool that keeps each head's positions as one run
        // ([row, head, seq, dim]): every head's range is one run on both sides, copied whole in
        // pieces of 64 KiB, as a slice copy_ does, rather than row by row.
        if (a.s.seq_or_slot == D && a.k.token_stride == D && a.v.token_stride == D) {
          const int64_t run = a.count * D;
          constexpr int64_t piece = (int64_t(64) << 10) / int64_t(sizeof(In));
          const int64_t pieces = (run + piece - 1) / piece;
          ex.for_each_item(2 * H * pieces, Fixed<1>{}, piece * int64_t(sizeof(In)), [a, run, pieces](int64_t i, int, int) {
            if (a.status->code) return;
            const int kv = int(i / (H * pieces));
            const int64_t h = (i / pieces) % H, first = (i % pieces) * piece;
            const Rows3<In>& out = kv ? a.v : a.k;
            Exec::copy_row(out.data + h * out.head_stride + first,
                           a.pool + element_offset(a.s, a.layer, kv, a.row, a.begin) + h * a.s.head + first,
                           int(run - first < piece ? run - first : piece));
          }, a.checks);
          return;
        }
      }
      if (walk_heads_outside(a.k)) {
        const int tile_items = Exec::tile_for(a.count, kLongestTile);
        const int64_t tiles = (a.count + tile_items - 1) / tile_items;
        ex.for_each_item(tiles, Fixed<1>{}, item_bytes(a.ext) * tile_items, [a, tile_items](int64_t tile, int, int) {
          if (a.status->code) return;
          const int64_t first = tile * tile_items;
          const int n = int(a.count - first < tile_items ? a.count - first : tile_items);
          const Store* src[kTile];
          const Scale* scale[2][kTile];
          const float tensor[2] = {tensor_scale(a.scales, a.layer, 0), tensor_scale(a.scales, a.layer, 1)};
          for (int j = 0; j < n; ++j) {
            int64_t unit, slot;
            locate_position(a.ext, a.row, a.pages, a.begin + first + j, unit, slot);
            src[j] = a.pool + element_offset(a.s, a.layer, 0, unit, slot);
            if constexpr (kQuantized) {
              scale[0][j] = scale_at(a.scales, a.layer, 0, unit, slot);
              scale[1][j] = scale_at(a.scales, a.layer, 1, unit, slot);
            }
          }
          const Rows3<In> out[2] = {a.k, a.v};
          for (int kv = 0; kv < 2; ++kv)
            for (int h = 0; h < H; ++h)
              for (int j = 0; j < n; ++j) {
                In* o = out[kv].data + (first + j) * out[kv].token_stride + h * out[kv].head_stride;
                const Store* row = src[j] + kv * a.s.kv + h * a.s.head;
                if constexpr (kQuantized) {
                  O::decode_head(o, row, scale[kv][j] + h * a.scales.s.head, tensor[kv], 0, 1);
                } else {
                  Exec::copy_row(o, row, head_dim(a.ext));
                }
              }
        }, a.checks);
        return;
      }
    }
    if constexpr (kSplitsPoolOnVectors) {
      if (pool_rows_aligned(a.pool, a.s) && side_rows_aligned(a.k) && side_rows_aligned(a.v))
        return gather_tokens<true>(ex, a);
    }
    gather_tokens<false>(ex, a);
  }

  // gather's items one token each, with kAlignedRows where every row of the call is whole vectors.
  template <bool kAlignedRows> static void gather_tokens(const Exec& ex, const GatherArgs<Store, In>& a) {
    ex.for_each_item(a.count, Fixed<kTokenLanes>{}, item_bytes(a.ext), gated([a] KVF_HD(int64_t j, int lane, int lanes, const ItemGate& gate) {
      // The page-table entry loads before the gate reads the status word and the launch's checks (as
      // write's target does): the pool is read only once the checks have passed the page. A
      // negative page is refused by the range's checks; here it only keeps the test whole.
      int64_t unit, slot;
      locate_position(a.ext, a.row, a.pages, a.begin + j, unit, slot);
      if (gate.closed(a.status) | (unit < 0)) return;
      const Store* src = a.pool + element_offset(a.s, a.layer, 0, unit, slot);
      const TokenHeads<In> k_out{a.k.data + j * a.k.token_stride, a.k.head_stride};
      const TokenHeads<In> v_out{a.v.data + j * a.v.token_stride, a.v.head_stride};
      if constexpr (kChunkedQuant) {
        if (kAlignedRows || (Chunks::aligned_codes(src, a.s.head, k_out.data, k_out.head_stride) &&
                             Chunks::aligned_codes(src + a.s.kv, a.s.head, v_out.data, v_out.head_stride))) {
          dequantize_token_chunked(k_out.data, k_out.head_stride, v_out.data, v_out.head_stride, src, a.s.head, a.s.kv,
                                   scale_at(a.scales, a.layer, 0, unit, slot), scale_at(a.scales, a.layer, 1, unit, slot),
                                   a.scales.s.head, tensor_scale(a.scales, a.layer, 0), tensor_scale(a.scales, a.layer, 1),
                                   lane);
          return;
        }
      }
      if constexpr (O::kRecord) {
        using R = typename O::Record;
        if constexpr (R::kTail > 0) {  // one head: the page's records, then their scales
          const auto* page = reinterpret_cast<const uint8_t*>(a.pool + element_offset(a.s, a.layer, 0, unit, 0));
          const uint8_t *record = page + slot * R::kBytes, *tail = page + O::P * R::kBytes + slot * R::kTail;
          if constexpr (O::kRecordWhole) R::decode_whole(record, record + R::kSplit, tail, k_out.data, v_out.data);
          else R::decode(record, record + R::kSplit, tail, k_out.data, v_out.data, lane, lanes);
        } else {
          const auto* record = reinterpret_cast<const uint8_t*>(src);
          for (int h = 0; h < H; ++h) {
            const uint8_t *lo = record + h * a.s.head, *hi = record + a.s.kv + h * a.s.head;
            In *first = k_out.data + h * k_out.head_stride, *second = v_out.data + h * v_out.head_stride;
            if constexpr (O::kRecordWhole) R::decode_whole(lo, hi, nullptr, first, second);
            else R::decode(lo, hi, nullptr, first, second, lane, lanes);
          }
        }
      } else if constexpr (kQuantized) {
        if constexpr (!(kChunkedQuant && kAlignedRows)) {  // the element path
          const TokenHeads<In> out[2] = {k_out, v_out};
          for (int kv = 0; kv < 2; ++kv) {
            const Scale* scale = scale_at(a.scales, a.layer, kv, unit, slot);
            const float tensor = tensor_scale(a.scales, a.layer, kv);
            for (int h = 0; h < H; ++h)
              O::decode_head(out[kv].data + h * out[kv].head_stride, src + kv * a.s.kv + h * a.s.head,
                             scale + h * a.scales.s.head, tensor, lane, lanes);
          }
        }
      } else if constexpr (std::is_same_v<Store, In>) {
        // K and V of the token in the item's lanes, then out (a write's token, the other way).
        const TokenHeads<const In> k_src{src, a.s.head}, v_src{src + a.s.kv, a.s.head};
        GatheredToken<kAlignedRows> token;
        token.load(k_src, v_src, lane);
        token.store(k_out, v_out, k_src, v_src, a.ext, lane, lanes);
      } else {
        Exec::copy_heads_kv(k_out, v_out, TokenHeads<const Store>{src, a.s.head},
                            TokenHeads<const Store>{src + a.s.kv, a.s.head}, heads(a.ext), head_dim(a.ext), lane, lanes);
      }
    }), a.checks);
  }
};

}  // namespace kvforge::detail
