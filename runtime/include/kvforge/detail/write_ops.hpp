// The write path from the one source every backend runs: an append or commit writes tokens into their
// slots (quantizing where the layout stores codes), and a lazy layout's append stages them first. Ops
// (ops.hpp) holds the sizes and addressing, QuantOps (quant_ops.hpp) the quantizers, it shares with the
// read path and upkeep.
#pragma once

#include "kvforge/detail/quant_ops.hpp"

namespace kvforge::detail {

template <class Traits, class Exec> struct WriteOps : QuantOps<Traits, Exec> {
  using O = QuantOps<Traits, Exec>;
  using ChunkRegs = typename O::ChunkRegs;
  using Chunks = typename O::Chunks;
  using O::D;
  using O::H;
  using O::head_dim;
  using O::heads;
  using In = typename O::In;
  using O::item_bytes;
  using O::kAddressing;
  using O::kChunkedQuant;
  using O::kGroup;
  using O::kGroups;
  using O::kLongestTile;
  using O::kQuant;
  using O::kQuantized;
  using O::kSplitsOnVectors;
  using O::kSplitsPoolOnVectors;
  using O::kStageLanes;
  using O::kTile;
  using O::load_chunks;
  using O::locate_position;
  using O::page_size;
  using O::pool_rows_aligned;
  using O::quantize_token;
  using O::quantize_token_chunked;
  using Scale = typename O::Scale;
  using O::scale_at;
  using O::scale_value;
  using O::side_rows_aligned;
  template <bool kAlignedRows> using StagedToken = typename O::template StagedToken<kAlignedRows>;
  using Store = typename O::Store;
  using O::tensor_scale;
  using O::W;
  using O::walk_heads_outside;
  using O::window;
  using WriteLanes = typename O::WriteLanes;
  template <bool kAlignedRows> using WrittenToken = typename O::template WrittenToken<kAlignedRows>;

  static void write(const Exec& ex, const WriteArgs<Store, In>& a) {
    const int64_t items = int64_t(a.num_layers) * a.tokens;
    // A short ring append finds each row's new length by reading all its targets in every item
    // (write_target), rather than in a pass of its own: one launch on CUDA.
    // (The run-time terms come first, so that the flag is never a constant the lambdas need not capture.)
    const bool scan_ring = a.num_layers == 1 && a.tokens <= Exec::kScannedRingTokens && kAddressing == Addressing::ring;
    // The targets' checks go with the operation's first launch.
    IndexChecks checks = a.checks;
    if constexpr (kAddressing == Addressing::ring) {
      if (!scan_ring) {
        // A ring keeps only a row's last W positions. Record each row's new length first, so that a
        // position this same append pushes out of the window is never written: two positions of one
        // row that share a cell (a prefill longer than the window) would otherwise race on a GPU.
        ex.for_each_item(
            items, Fixed<1>{}, 8,
            [a] KVF_HD(int64_t i, int, int) {
              if (a.status->code) return;
              const int l = int(i / a.tokens);
              const int64_t t = i - l * a.tokens, target = l * a.target_layer_stride + t;
              const int32_t r = a.rows[target], p = a.positions[target];
              const NextEntry next = next_entry(a, t + 1 < a.tokens ? target + 1 : -1);
              if (r >= 0 && p >= 0 && !next_token_records(next, r, p))
                Exec::atomic_max(&a.row_length[r], p + 1);
            },
            checks);
        checks = IndexChecks{};
      }
    }
    if constexpr (kTile > 1) {  // only an executor that takes tiles compiles this loop nest
      if (walk_heads_outside(a.k)) {
        const int tile_items = Exec::tile_for(items, kLongestTile);
        const int64_t tiles = (items + tile_items - 1) / tile_items;
        ex.for_each_item(tiles, Fixed<1>{}, item_bytes(a.ext) * tile_items, [a, items, tile_items, scan_ring](int64_t tile, int, int) {
          if (a.status->code) return;
          Store* dst[kTile];
          const In* src[2][kTile];
          Scale* scale[2][kTile];
          float tensor[2][kTile];
          int n = 0;
          for (int64_t i = tile * tile_items; i < items && i < (tile + 1) * tile_items; ++i) {
            WritePlace w = write_source(a, i);
            const bool writes = write_target(a, scan_ring, w);
            record_length(a, w, 0);
            if (!writes) continue;
            dst[n] = a.pool + element_offset(a.s, w.layer, 0, w.unit, w.slot);
            src[0][n] = w.k;
            src[1][n] = w.v;
            if constexpr (kQuantized) {
              scale[0][n] = scale_at(a.scales, w.layer, 0, w.unit, w.slot);
              scale[1][n] = scale_at(a.scales, w.layer, 1, w.unit, w.slot);
              tensor[0][n] = tensor_scale(a.scales, w.layer, 0);
              tensor[1][n] = tensor_scale(a.scales, w.layer, 1);
            }
            ++n;
          }
          for (int kv = 0; kv < 2; ++kv) {
            const int64_t in_head = kv ? a.v.head_stride : a.k.head_stride;
            if constexpr (kQuantized) {
              quantize_tile(dst, kv * a.s.kv, a.s.head, scale[kv], a.scales.s.head, tensor[kv], src[kv], in_head, n);
            } else {
              for (int h = 0; h < H; ++h)
                for (int j = 0; j < n; ++j)
                  Exec::copy_row(dst[j] + kv * a.s.kv + h * a.s.head, src[kv][j] + h * in_head, head_dim(a.ext));
            }
          }
        }, checks);
        return;
      }
    }
    if constexpr (kSplitsPoolOnVectors) {
      if (pool_rows_aligned(a.pool, a.s) && side_rows_aligned(a.k, a.input_layer_stride) &&
          side_rows_aligned(a.v, a.input_layer_stride))
        return write_tokens<true>(ex, a, checks, scan_ring);
    }
    write_tokens<false>(ex, a, checks, scan_ring);
  }

  // write's items one token each (every executor but a tiling CPU walk), with kAlignedRows where every
  // row of the call is whole vectors (kSplitsPoolOnVectors).
  template <bool kAlignedRows>
  static void write_tokens(const Exec& ex, const WriteArgs<Store, In>& a, const IndexChecks& checks, bool scan_ring) {
    const int64_t items = int64_t(a.num_layers) * a.tokens;
    ex.for_each_item(items, WriteLanes{}, item_bytes(a.ext), gated([a, scan_ring] KVF_HD(int64_t i, int lane, int lanes, const ItemGate& gate) {
      // The target, (where the executor holds tokens in its lanes) the inputs, the status word and
      // the launch's own index checks all load together, none waiting for another (ItemGate): on a
      // GPU, one wait on memory before the stores rather than three in a row.
      WritePlace w = write_source(a, i);
      const TokenHeads<const In> k_in{w.k, a.k.head_stride}, v_in{w.v, a.v.head_stride};
      [[maybe_unused]] WrittenToken<kAlignedRows> token;
      [[maybe_unused]] ChunkRegs k_regs, v_regs;
      [[maybe_unused]] bool chunks_held = false;
      if constexpr (!kQuantized) {
        token.load(k_in, v_in, lane);
      } else if constexpr (kChunkedQuant && Chunks::kPreload) {
        chunks_held = kAlignedRows || (Chunks::inputs_aligned(k_in.data, k_in.head_stride) &&
                                       Chunks::inputs_aligned(v_in.data, v_in.head_stride));
        if (chunks_held) {
          load_chunks(k_regs, k_in.data, k_in.head_stride, lane, 0);
          load_chunks(v_regs, v_in.data, v_in.head_stride, lane, 0);
        }
      }
      // A ring's target reads its row's length at a row index that only the checks make safe.
      constexpr bool kTargetReadsRows = kAddressing == Addressing::ring;
      bool writes = !kTargetReadsRows && write_target(a, scan_ring, w);
      if (gate.closed(a.status)) return;
      if constexpr (kTargetReadsRows) writes = write_target(a, scan_ring, w);
      record_length(a, w, lane);
      if (!writes) return;
      const int layer = w.layer;
      const int64_t unit = w.unit, slot = w.slot;
      const In *k = w.k, *v = w.v;
      Store* dst = a.pool + element_offset(a.s, layer, 0, unit, slot);
      if constexpr (kChunkedQuant) {
        const bool loaded = !Chunks::kPreload || chunks_held;
        if (kAlignedRows || (loaded && Chunks::aligned(k, a.k.head_stride, dst, a.s.head) &&
                             Chunks::aligned(v, a.v.head_stride, dst + a.s.kv, a.s.head))) {
          quantize_token_chunked(k_regs, dst, a.s.head, scale_at(a.scales, layer, 0, unit, slot), a.scales.s.head,
                                 tensor_scale(a.scales, layer, 0), k, a.k.head_stride, lane);
          quantize_token_chunked(v_regs, dst + a.s.kv, a.s.head, scale_at(a.scales, layer, 1, unit, slot),
                                 a.scales.s.head, tensor_scale(a.scales, layer, 1), v, a.v.head_stride, lane);
          return;
        }
      }
      if constexpr (O::kRecord) {
        using R = typename O::Record;
        if constexpr (R::kTail > 0) {  // one head (the spec's check): the page's records, then their scales
          auto* page = reinterpret_cast<uint8_t*>(a.pool + element_offset(a.s, layer, 0, unit, 0));
          uint8_t *record = page + slot * R::kBytes, *tail = page + O::P * R::kBytes + slot * R::kTail;
          if constexpr (O::kRecordWhole) R::encode_whole(k, v, record, record + R::kSplit, tail);
          else R::template encode<Exec, O::kTokenLanes>(k, v, record, record + R::kSplit, tail, lane);
        } else {
          auto* record = reinterpret_cast<uint8_t*>(dst);
          for (int h = 0; h < H; ++h) {
            uint8_t *lo = record + h * a.s.head, *hi = record + a.s.kv + h * a.s.head;
            if constexpr (O::kRecordWhole) R::encode_whole(k + h * a.k.head_stride, v + h * a.v.head_stride, lo, hi, nullptr);
            else R::template encode<Exec, O::kTokenLanes>(k + h * a.k.head_stride, v + h * a.v.head_stride, lo, hi, nullptr,
                                                          lane);
          }
        }
      } else if constexpr (kQuantized) {
        if constexpr (!(kChunkedQuant && kAlignedRows)) {  // the element path
          quantize_token(dst, a.s.head, scale_at(a.scales, layer, 0, unit, slot), a.scales.s.head,
                         tensor_scale(a.scales, layer, 0), k, a.k.head_stride, lane, lanes);
          quantize_token(dst + a.s.kv, a.s.head, scale_at(a.scales, layer, 1, unit, slot), a.scales.s.head,
                         tensor_scale(a.scales, layer, 1), v, a.v.head_stride, lane, lanes);
        }
      } else {
        token.store(TokenHeads<Store>{dst, a.s.head}, TokenHeads<Store>{dst + a.s.kv, a.s.head}, k_in, v_in, a.ext, lane,
                    lanes);
      }
    }), checks);
  }

  // Where one item of a write goes, and its K and V input. write_source fills what the item's index
  // alone gives (no load); write_target reads the target. `row` >= 0 where the item raises that row's
  // length to `length` (record_length).
  struct WritePlace {
    int64_t target = 0;     // its entry in the targets
    int layer = 0;          // the pool layer it writes
    const In* k = nullptr;  // its inputs
    const In* v = nullptr;
    int64_t unit = 0, slot = 0;
    int32_t row = -1, length = 0;
    int64_t next = -1;      // the same layer's next token's entry, or -1
  };

  // The same layer's next token's row and position (entry `next`; -1 where there is none). A token
  // loads it beside its own, not after: the two entries share a cache line, and on a GPU a load that
  // waited for the token's own row would be a second trip to memory before the item may write.
  struct NextEntry {
    int32_t row = -1, position = -1;
  };
  KVF_HD static KVF_INLINE NextEntry next_entry(const WriteArgs<Store, In>& a, int64_t next) {
    NextEntry e;
    if (next >= 0) e.row = a.rows[next], e.position = a.positions[next];
    return e;
  }
  // Whether that next token goes to row r (>= 0) at position p or later: it then raises the row's
  // length at least as far, so this one need not. A prefill then raises each row's length once rather
  // than once per token, which on a GPU is thousands of atomics on one word.
  KVF_HD static KVF_INLINE bool next_token_records(const NextEntry& next, int32_t r, int32_t p) {
    return next.row == r && next.position >= p;
  }

  // Item i of a write: layer i / tokens, token i % tokens.
  KVF_HD static KVF_INLINE WritePlace write_source(const WriteArgs<Store, In>& a, int64_t i) {
    const int l = a.num_layers == 1 ? 0 : int(i / a.tokens);  // an append divides by nothing
    const int64_t t = i - l * a.tokens;
    WritePlace w;
    w.target = l * a.target_layer_stride + t;
    w.next = t + 1 < a.tokens ? w.target + 1 : -1;
    w.layer = a.first_layer + l;
    w.k = a.k.data + l * a.input_layer_stride + t * a.k.token_stride;
    w.v = a.v.data + l * a.input_layer_stride + t * a.v.token_stride;
    return w;
  }

  // Where item w goes. False where it writes nothing: padding, or a ring position already out of its
  // window. It only reads, so that an item can load its target before it knows whether it may write.
  // With `scan_ring`, a ring item takes its row's new length from all of the append's targets and
  // records its own position: a row's length then only grows toward what every item computes,
  // whatever order they run in.
  KVF_HD static KVF_INLINE bool write_target(const WriteArgs<Store, In>& a, bool scan_ring, WritePlace& w) {
    if constexpr (kAddressing == Addressing::paged) {
      const int64_t s = a.slots[w.target];
      if (s < 0) return false;
      w.unit = s / page_size(a.ext);
      w.slot = s % page_size(a.ext);
    } else {
      const int32_t r = a.rows[w.target];
      const int32_t p = a.positions[w.target];
      const NextEntry next = next_entry(a, w.next);
      if (r < 0 || p < 0) return false;
      if constexpr (kAddressing == Addressing::ring) {
        int32_t length = a.row_length[r];
        if (scan_ring) {
          for (int64_t other = 0; other < a.tokens; ++other)
            if (a.rows[other] == r && a.positions[other] >= length) length = a.positions[other] + 1;
          w.row = r, w.length = p + 1;
        }
        if (p < length - window(a.ext)) return false;  // already out of the window: never readable
      } else if (a.row_length) {
        w.row = r, w.length = p + 1;
      }
      if (w.row >= 0 && next_token_records(next, r, p)) w.row = -1;
      locate_position(a.ext, r, nullptr, p, w.unit, w.slot);
    }
    return true;
  }

  // A write item's one side effect besides its K and V: its row's length (one lane of the item).
  KVF_HD static KVF_INLINE void record_length(const WriteArgs<Store, In>& a, const WritePlace& w, int lane) {
    if (lane == 0 && w.row >= 0) Exec::atomic_max(&a.row_length[w.row], w.length);
  }

  // K or V of n tokens into codes (the tile path of write). A zero-point token is staged whole, as one
  // lane's quantize_token does; the others go head by head.
  static void quantize_tile(Store* const* dst, int64_t dst_kv, int64_t dst_head, Scale* const* scale,
                            int64_t scale_head, const float* tensor, const In* const* src, int64_t src_head, int n) {
    if constexpr (O::kZeroPoint) {
      for (int j = 0; j < n; ++j)
        O::quantize_zero_token(dst[j] + dst_kv, dst_head, scale[j], scale_head, src[j], src_head, 0, 1);
    } else {
      quantize_tile_heads(dst, dst_kv, dst_head, scale, scale_head, tensor, src, src_head, n);
    }
  }
  // Each token's scale first where one scale covers all its heads, then every head's row of every token.
  static void quantize_tile_heads(Store* const* dst, int64_t dst_kv, int64_t dst_head, Scale* const* scale,
                                  int64_t scale_head, const float* tensor, const In* const* src, int64_t src_head,
                                  int n) {
    float token_scale[kTile > 1 ? kTile : 1];
    for (int j = 0; j < n; ++j) {
      if constexpr (kQuant == Quant::per_tensor) {
        token_scale[j] = to_float(*scale[j]);
      } else if constexpr (kQuant == Quant::per_token) {
        uint32_t m = 0;
        for (int h = 0; h < H; ++h) {
          const uint32_t b = row_amax<D, Exec>(src[j] + h * src_head, 0, 1);
          m = m > b ? m : b;
        }
        const Scale stored = dynamic_scale<Store, Scale>(m);
        *scale[j] = stored;
        token_scale[j] = to_float(stored);
      }
    }
    for (int h = 0; h < H; ++h)
      for (int j = 0; j < n; ++j) {
        const In* row = src[j] + h * src_head;
        float s[kGroups];
        for (int g = 0; g < kGroups; ++g) {  // every group's scale before any group's codes (quantize_token)
          s[g] = token_scale[j];
          if constexpr (kQuant == Quant::per_token_head || kQuant == Quant::per_group) {
            const Scale stored = dynamic_scale<Store, Scale>(row_amax<kGroup, Exec>(row + g * kGroup, 0, 1), tensor[j]);
            scale[j][h * scale_head + g] = stored;
            s[g] = scale_value(stored, tensor[j]);
          }
        }
        encode_groups<D, kGroup, Exec>(dst[j] + dst_kv + h * dst_head, row, s, 0, 1);
      }
  }

  // A lazy append: the tokens and their targets into staging, for commit() to write.
  static void stage(const Exec& ex, const StageArgs<In>& a) {
    if constexpr (kSplitsOnVectors) {
      // Staging rows are whole vectors (kSplitsOnVectors): only its bases can be off.
      if (side_rows_aligned(a.k_in) && side_rows_aligned(a.v_in) && rows_on_boundary<In>(a.k_stage, {}, 16) &&
          rows_on_boundary<In>(a.v_stage, {}, 16))
        return stage_tokens<true>(ex, a);
    }
    stage_tokens<false>(ex, a);
  }
  template <bool kAlignedRows> static void stage_tokens(const Exec& ex, const StageArgs<In>& a) {
    ex.for_each_item(
        a.tokens, Fixed<kStageLanes>{}, O::template item_bytes<In>(a.ext),
        gated([a] KVF_HD(int64_t t, int lane, int lanes, const ItemGate& gate) {
          // The targets, (as a write's) the tokens, the status word and the launch's checks load
          // together. A paged layout stages slots; the others rows and positions.
          const StagedTargets& to = a.targets;
          constexpr bool kSlots = kAddressing == Addressing::paged;
          const bool copies_targets = lane == 0;
          const int64_t slot = kSlots && copies_targets ? to.slots[t] : -1;
          const int32_t row = !kSlots && copies_targets ? to.rows[t] : -1;
          const int32_t position = !kSlots && copies_targets ? to.positions[t] : -1;
          const TokenHeads<const In> k_in{a.k_in.data + t * a.k_in.token_stride, a.k_in.head_stride};
          const TokenHeads<const In> v_in{a.v_in.data + t * a.v_in.token_stride, a.v_in.head_stride};
          StagedToken<kAlignedRows> token;
          token.load(k_in, v_in, lane);
          if (gate.closed(a.status)) return;
          const int d = int(head_dim(a.ext));
          const int64_t stage_row = int64_t(int(heads(a.ext))) * d;
          token.store(TokenHeads<In>{a.k_stage + t * stage_row, d}, TokenHeads<In>{a.v_stage + t * stage_row, d}, k_in, v_in,
                      a.ext, lane, lanes);
          if (!copies_targets) return;
          if constexpr (kSlots) {
            to.slots_stage[t] = slot;
          } else {
            to.rows_stage[t] = row;
            to.positions_stage[t] = position;
          }
        }),
        a.checks);
  }
};

}  // namespace kvforge::detail
