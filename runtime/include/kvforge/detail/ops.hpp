// The one source of every cache operation. Each operation is a loop over items (a token, or a
// (layer, kv, position) triple) whose body moves the rows of all heads of that item. The executor
// decides how items and lanes map to hardware: the CPU runs items on OpenMP threads with one lane,
// CUDA gives each item a group of threads that split its heads into 16-byte vectors.
//
// Traits supply compile-time constants (heads, head_dim, page_size, window, addressing, quantization)
// so that loops have fixed trip counts and divisions by page size and window are by constants.
// This file holds what every operation sizes and addresses by: lanes, extents, tiles, where a position
// lives. Quantized layouts quantize inside write (append and commit) and dequantize inside gather,
// through QuantOps (quant_ops.hpp); the rules are in quant_codec.hpp. The operations themselves are
// write_ops.hpp, gather_ops.hpp and upkeep_ops.hpp.
#pragma once

#include <cstdint>
#include <type_traits>

#include "kvforge/detail/config.hpp"
#include "kvforge/detail/part_record.hpp"
#include "kvforge/dtype.hpp"
#include "kvforge/geometry.hpp"
#include "kvforge/detail/item_gate.hpp"
#include "kvforge/detail/op_args.hpp"
#include "kvforge/detail/op_table.hpp"
#include "kvforge/detail/quant_codec.hpp"
#include "kvforge/detail/quant_chunks.hpp"
#include "kvforge/detail/row_codecs.hpp"
#include "kvforge/detail/token_vectors.hpp"

namespace kvforge::detail {

// The most lanes one CUDA item (one token) takes: a block of the default size.
inline constexpr int kMaxItemLanes = 256;

// Lanes a CUDA item uses: one per 16-byte vector of every head, capped at kMaxItemLanes.
template <class Store, int H, int D> constexpr int item_lanes() {
  constexpr int bytes = D * int(sizeof(Store));
  constexpr int per_head = bytes % 16 == 0 ? bytes / 16 : D;
  constexpr int lanes = H * per_head;
  return lanes > kMaxItemLanes ? kMaxItemLanes : lanes;
}

// Bytes one page of every layer takes when packed for offload: codes, then their dynamic scales.
inline int64_t packed_page_bytes(const VariantDescriptor& d) {
  return int64_t(d.layers) * 2 * d.page_size *
         (int64_t(d.heads) * d.stored_dim() * dtype_size(d.storage) +
          int64_t(scales_per_token(d.quant, d.heads, d.scale_groups())) * dtype_size(d.scale));
}

// Lanes of a quantizing CUDA item: one logical warp (a power of two up to 32) sweeps each head's row
// in turn, so a scale's amax is one warp reduction.
template <int D> constexpr int quant_lanes() {
  int lanes = 1;
  while (lanes * 2 <= D && lanes < 32) lanes *= 2;
  return lanes;
}

// Traits whose sizes are given at run time (the generic path, RuntimeTraits in runtime/src/caches/generic.cpp) say so with
// `runtime_extents = true`; generated traits fix them as constants. CuTe's idea: one layout type,
// each extent static or dynamic.
template <class T, class = void> struct has_runtime_extents : std::false_type {};
template <class T>
struct has_runtime_extents<T, std::void_t<decltype(T::runtime_extents)>> : std::bool_constant<T::runtime_extents> {};

// Where a layout keeps one head's consecutive positions adjacent ([.., head, seq|slot, dim]), and
// whether a page holds all its heads so ([page, .., head, slot, dim], FlashInfer's HND).
template <class Traits> constexpr int axis_index(Axis a) {
  for (int i = 0; i < int(sizeof(Traits::axes) / sizeof(Traits::axes[0])); ++i)
    if (Traits::axes[i] == a) return i;
  return -1;
}
template <class Traits> constexpr bool positions_inside_heads() {
  if constexpr (has_runtime_extents<Traits>::value) {
    return false;
  } else {
    const int head = axis_index<Traits>(Axis::head);
    return axis_index<Traits>(Axis::seq) > head || axis_index<Traits>(Axis::slot) > head;
  }
}
template <class Traits> constexpr bool page_holds_head_runs() {
  if constexpr (has_runtime_extents<Traits>::value || Traits::addressing != Addressing::paged) {
    return false;
  } else {
    return axis_index<Traits>(Axis::page) < axis_index<Traits>(Axis::head) && positions_inside_heads<Traits>();
  }
}

template <class Traits> constexpr Extents fixed_extents() {
  if constexpr (has_runtime_extents<Traits>::value) {
    return Extents{};
  } else {
    return Extents{Traits::heads, Traits::head_dim, Traits::page_size, Traits::window};
  }
}

template <class Traits, class Exec> struct Ops {
  using Store = typename Traits::storage_t;
  using In = typename Traits::input_t;
  static constexpr bool kRuntime = has_runtime_extents<Traits>::value;
  // The compile-time sizes (0 for runtime-sized traits, which read Extents instead).
  static constexpr int H = fixed_extents<Traits>().heads;
  static constexpr int D = fixed_extents<Traits>().head_dim;
  static constexpr int P = fixed_extents<Traits>().page_size;
  static constexpr int W = fixed_extents<Traits>().window;
  static constexpr Addressing kAddressing = Traits::addressing;
  using Scale = typename Traits::scale_t;
  static constexpr Quant kQuant = Traits::quant;
  static constexpr bool kQuantized = kQuant != Quant::none;
  static_assert(!(kRuntime && kQuantized), "runtime-sized traits store floats; quantizing needs a generated variant");
  // Values of a head's row that share one scale, and the scales of a row: a per_group layout's group, a
  // whole row otherwise (per_token_head is per_group with one group a row). A head's groups are
  // adjacent in the scales (dim is every layout's last axis): group g of head h is at h * head + g.
  static constexpr int kGroup = kQuant == Quant::per_group ? quant_group_of<Traits>::value : D;
  static_assert(kQuant != Quant::per_group || (kGroup > 0 && D % kGroup == 0), "groups tile a head's row");
  static constexpr int kGroups = kQuant == Quant::per_group ? D / kGroup : 1;
  // A per_group layout may scale its groups under a second-level fp32 scale per layer and K/V (NVFP4):
  // a value is code * group scale * tensor scale.
  static constexpr bool kTensorScaled = tensor_scaled_of<Traits>::value;
  static_assert(!kTensorScaled || kQuant == Quant::per_group, "a tensor scale sits under group scales");
  // Dynamic scales one token holds per K or V: kScaleHeads heads of kGroups each.
  static constexpr int kScalesPerToken = scales_per_token(kQuant, H, kGroups);
  static constexpr int kScaleHeads = kScalesPerToken / kGroups;
  // Asymmetric 4-bit codes (uint4): a scale entry is a group's scale and zero point (ScaleZero).
  static constexpr bool kZeroPoint = std::is_same_v<Store, uint4x2>;
  static_assert(!kZeroPoint || kQuant == Quant::per_token_head || kQuant == Quant::per_group,
                "a zero point is a head's group's");
  // Values one stored element holds (2 for packed 4-bit codes), and the stored elements of a head's row:
  // what the pool's rows, copies and pages count, where inputs count D.
  static constexpr int kValues = kValuesPerElement<Store>;
  static_assert(D % kValues == 0 && kGroup % kValues == 0, "packed codes fill whole elements");
  // Records of named parts (part_record.hpp: FlashMLA's fp8 record, an fp8 index key, a spec's own): a
  // head's K and V rows are the two halves of one record, which write encodes and gather decodes whole
  // (a part or a group may cross from K into V); every other operation moves its bytes. Scales placed at
  // the page's end follow the page's records, so such a token's K and V rows name no bytes of their own:
  // the pool sizes a page by them. Scales are the record's, so the layout is not `kQuantized`.
  static constexpr bool kRecord = std::is_same_v<Store, record_byte>;
  using Record = PartRecord<std::conditional_t<kRecord, Traits, NoRecordTraits>>;
  static constexpr int kStoredDim = kRecord ? Record::kRow : D / kValues;
  // Records coded whole on one lane (the CPU), or byte by byte over a warp (CUDA).
  static constexpr bool kRecordWhole = Exec::row_step(2) == 1;
  // Runtime-sized traits run on the CPU, where an item is one lane. A record's item is a warp: a coded
  // part's groups each over a run of its lanes (PartRecord::group_lanes), its float values over all.
  static constexpr int kLanes = kRuntime    ? 1
                                : kRecord    ? 32
                                : kQuantized ? quant_lanes<kStoredDim>()
                                             : item_lanes<Store, H, D>();
  // An executor that moves 16-byte vectors per lane (CUDA) quantizes a token in chunks of them
  // (quant_chunks.hpp), with the lanes that layout asks for; the CPU takes whole rows. A token spreads
  // over as many lanes as a float token's, up to kMaxItemLanes: for llama3-8b one chunk of K and one
  // of V a lane, and a decode's few tokens over that many threads. A per-head scale reduces inside its
  // head's group of lanes, a per-token scale over all of them (Exec::item_max).
  using Chunks = QuantChunks<Store, In, H, D, kMaxItemLanes>;
  // A per_group scale reduces over the lanes that hold its group's chunks: consecutive lanes where each
  // lane holds one chunk of a head (Chunks::kWholeGroups). Other per_group shapes take the element path.
  // Packed 4-bit codes take the element path too.
  static constexpr bool kChunkedQuant = Exec::kChunkedQuant && kQuantized && !kRuntime && Chunks::kUsable &&
                                        kValues == 1 && (kQuant != Quant::per_group || Chunks::kWholeGroups);
  static constexpr int kGroupChunks = kQuant == Quant::per_group ? kGroup / Chunks::V : 1;  // chunks of a group
  // The group of chunk c of a head's row (0 where a row has one scale).
  KVF_HD static KVF_INLINE int chunk_group(int c) {
    if constexpr (kQuant == Quant::per_group) return c / kGroupChunks; else return 0;
  }
  static constexpr int kTokenLanes = kChunkedQuant ? Chunks::L : kLanes;  // lanes of a token of write or gather
  static constexpr int kChunkPasses = Chunks::kPreload ? Chunks::Q : 1;  // passes one lane holds at once
  using ChunkRegs = Vec16[kChunkPasses][Chunks::K];
  // Passes a gather's lane holds at once. Without a reduction to wait for, it holds fewer than a write:
  // four chunks a side of a 3-head, 24-wide fp16 token, decoded to 16 bytes each, spilled 108 bytes
  // under a prefill launch's 64 registers (ptxas), and a pass at a time spills 16.
  static constexpr int kGatherPasses = Chunks::Q * Chunks::K <= 2 ? Chunks::Q : 1;
  // A written token whose scale's reduction spans more than a warp (per-token) runs as a block of its
  // own, whose barrier its warps meet at (Exec::item_max).
  using WriteLanes = std::conditional_t<kChunkedQuant && kQuant == Quant::per_token && (Chunks::L > 32),
                                        BlockItem<kTokenLanes>, Fixed<kTokenLanes>>;
  static constexpr int kStageLanes = kRuntime ? 1 : item_lanes<In, H, D>();  // lanes of a staged token

  // A float token's K and V in an item's `Lanes` lanes, on their way into `Dst` rows. Where the
  // executor holds tokens in its lanes (CUDA) and the rows allow 16-byte accesses, the item loads them
  // before it knows where they go (token_vectors.hpp), so that its target and the status word load
  // alongside; it stores them after. Otherwise it copies them straight from the inputs at the store.
  // With kAlignedRows (the host found every row of the call whole 16-byte vectors) it tests nothing
  // and has no element path to fall back to.
  template <class Dst, int Lanes, bool kAlignedRows> struct FloatToken {
    using Vectors = TokenVectors<In, H, D, Lanes>;
    static constexpr bool kHolds = Exec::kHoldsTokens && !kRuntime && std::is_same_v<Dst, In> && Vectors::kHeld;
    Vectors vectors;
    bool held = false;

    KVF_HD KVF_INLINE void load(TokenHeads<const In> k, TokenHeads<const In> v, int lane) {
      if constexpr (kHolds) {
        held = kAlignedRows || (Vectors::aligned(k.data, k.head_stride) && Vectors::aligned(v.data, v.head_stride));
        if (held) vectors.load(k, v, lane);
      }
    }
    KVF_HD KVF_INLINE void store(TokenHeads<Dst> k_out, TokenHeads<Dst> v_out, TokenHeads<const In> k,
                                 TokenHeads<const In> v, const Extents& e, int lane, int lanes) const {
      if constexpr (kHolds && kAlignedRows) {
        vectors.store(k_out, v_out, lane);
      } else {
        if constexpr (kHolds) {
          if (held && Vectors::aligned(k_out.data, k_out.head_stride) && Vectors::aligned(v_out.data, v_out.head_stride)) {
            vectors.store(k_out, v_out, lane);
            return;
          }
        }
        Exec::copy_heads_kv(k_out, v_out, k, v, heads(e), head_dim(e), lane, lanes);
      }
    }
  };
  template <bool kAlignedRows> using WrittenToken = FloatToken<Store, kTokenLanes, kAlignedRows>;  // an append's or commit's
  template <bool kAlignedRows> using StagedToken = FloatToken<In, kStageLanes, kAlignedRows>;      // a lazy append's
  template <bool kAlignedRows> using GatheredToken = FloatToken<In, kTokenLanes, kAlignedRows>;    // a gather's, Store = In

  // An executor that holds tokens in its lanes (CUDA) compiles write, stage and gather twice: for calls
  // whose every row is whole aligned 16-byte vectors (whole code chunks, where quantized), as the host
  // finds once per call (rows_on_boundary), a body with no element-by-element path; and the full one
  // for the rest. That path's registers would otherwise be every launch's: 64 a thread for a bf16
  // append where the vector path needs 32, half the threads an SM can hold, and spills besides.
  // kSplitsOnVectors: stage's two bodies; kSplitsPoolOnVectors: write's and gather's, whose vector path
  // needs the pool to store the input type, or whole chunks of codes.
  static constexpr bool kSplitsOnVectors = Exec::kHoldsTokens && !kRuntime && TokenVectors<In, H, D, 1>::kWhole;
  static constexpr bool kSplitsPoolOnVectors = kSplitsOnVectors && (kChunkedQuant || std::is_same_v<Store, In>);
  // Whether every pool row starts where the vector path needs: on a 16-byte vector, or on one chunk's
  // codes.
  static bool pool_rows_aligned(const Store* pool, const Strides& s) {
    return rows_on_boundary(pool, {s.layer, s.kv, s.row_or_page, s.seq_or_slot, s.head},
                            kChunkedQuant ? Chunks::kCodeBytes : 16);
  }
  // The same of a [T, H, D] side (an input or a gather's output), with the stride between layers of a
  // commit's staged inputs.
  template <class T> static bool side_rows_aligned(const Rows3<T>& r, int64_t layer_stride = 0) {
    return rows_on_boundary(r.data, {r.token_stride, r.head_stride, layer_stride}, 16);
  }
  // The most tokens one work item of write and gather takes when it walks a tile head by head
  // (Exec::tile_for says how many); executors whose item already spans all heads (CUDA) take 1, and so
  // does a FlashMLA record, which is coded a token at a time.
  static constexpr int kTile = positions_inside_heads<Traits>() && !kRecord ? Exec::kTileItems : 1;

  // The loop order, from both sides' strides: walk a tile of tokens head by head where the pool
  // keeps a head's positions adjacent and so does the other side ([H, T, D] tensors: a gather's output
  // for attention), or where a page holds all its heads that way (the tile is then one block of the
  // pool, as it is one block of a [T, H, D] input). Otherwise token by token, which keeps a [T, H, D]
  // side contiguous: with heads far apart in the pool ([row, head, seq, dim] from [T, H, D]), a tile
  // walked by heads measured slower. The innermost loop then always runs along the longer
  // contiguous run of the two sides (bench/RESULTS.md, section 8).
  template <class T> static bool walk_heads_outside(const Rows3<T>& other_side) {
    return page_holds_head_runs<Traits>() || other_side.head_stride > other_side.token_stride;
  }
  // A tile spans at most four pages: a head's run in the pool ends with its page, and pages lie
  // anywhere, so longer tiles only lengthen the other side's runs. Measured on FlashInfer's HND
  // (16-slot pages): 64-token tiles beat 16 on a prefill and 256 on a gather from a 1 GiB pool.
  static constexpr int kLongestTile = kAddressing == Addressing::paged && 4 * P < kTile ? 4 * P : kTile;

  // The sizes an op loops over: Fixed constants for generated traits, the args' Extents otherwise.
  KVF_HD static KVF_INLINE auto heads(const Extents& e) {
    if constexpr (kRuntime) return e.heads; else return Fixed<H>{};
  }
  KVF_HD static KVF_INLINE auto head_dim(const Extents& e) {
    if constexpr (kRuntime) return e.head_dim; else return Fixed<D>{};
  }
  // Stored elements of a head's row in the pool (runtime-sized traits store floats, one value each).
  KVF_HD static KVF_INLINE auto stored_dim(const Extents& e) {
    if constexpr (kRuntime) return e.head_dim; else return Fixed<kStoredDim>{};
  }
  KVF_HD static KVF_INLINE auto page_size(const Extents& e) {
    if constexpr (kRuntime) return e.page_size; else return Fixed<P>{};
  }
  KVF_HD static KVF_INLINE auto window(const Extents& e) {
    if constexpr (kRuntime) return e.window; else return Fixed<W>{};
  }
  // Bytes of one item's rows, all heads, in element type T: the CPU's parallel threshold counts them.
  template <class T = Store> static int64_t item_bytes(const Extents& e) {
    return int64_t(int(heads(e))) * int(head_dim(e)) * int64_t(sizeof(T));
  }

  KVF_HD static KVF_INLINE Scale* scale_at(const ScaleRef& r, int64_t layer, int64_t kv, int64_t unit, int64_t slot) {
    return static_cast<Scale*>(r.base) + element_offset(r.s, layer, kv, unit, slot);
  }
  // Where position `pos` of a sequence lives: (row or page, seq index or slot).
  KVF_HD static KVF_INLINE void locate_position(const Extents& e, int64_t row, const int32_t* pages, int64_t pos,
                                                int64_t& unit, int64_t& slot) {
    if constexpr (kAddressing == Addressing::paged) {
      unit = pages[pos / page_size(e)];
      slot = pos % page_size(e);
    } else if constexpr (kAddressing == Addressing::ring) {
      unit = row;
      slot = pos % window(e);
    } else {
      (void)e;
      (void)pages;
      unit = row;
      slot = pos;
    }
  }
};

}  // namespace kvforge::detail
