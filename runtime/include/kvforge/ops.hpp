// The one source of every cache operation. Each operation is a loop over items (a token, or a
// (layer, kv, position) triple) whose body moves the rows of all heads of that item. The executor
// decides how items and lanes map to hardware: the CPU runs items on OpenMP threads with one lane,
// CUDA gives each item a group of threads that split its heads into 16-byte vectors.
//
// Traits supply compile-time constants (heads, head_dim, page_size, window, addressing, quantization)
// so that loops have fixed trip counts and divisions by page size and window are by constants.
// Quantized layouts quantize inside write (append and commit) and dequantize inside gather; the rules
// are in quant.hpp.
#pragma once

#include <cstdint>
#include <type_traits>

#include "kvforge/config.hpp"
#include "kvforge/dtype.hpp"
#include "kvforge/geometry.hpp"
#include "kvforge/item_gate.hpp"
#include "kvforge/op_args.hpp"
#include "kvforge/op_table.hpp"
#include "kvforge/quant.hpp"
#include "kvforge/quant_chunks.hpp"
#include "kvforge/token_vectors.hpp"

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
         (int64_t(d.heads) * d.head_dim * dtype_size(d.storage) +
          int64_t(scales_per_token(d.quant, d.heads)) * dtype_size(d.scale));
}

// Lanes of a quantizing CUDA item: one logical warp (a power of two up to 32) sweeps each head's row
// in turn, so a scale's amax is one warp reduction.
template <int D> constexpr int quant_lanes() {
  int lanes = 1;
  while (lanes * 2 <= D && lanes < 32) lanes *= 2;
  return lanes;
}

// Row loops over one head's D elements. The executor says how an item's lanes share a row: on the CPU
// one thread takes it whole (begin 0, step 1, both constants the compiler sees, so the loop vectorizes);
// on CUDA the lanes stride through it.
template <int D, class Exec, class In> KVF_HD KVF_INLINE uint32_t row_amax(const In* src, int lane, int lanes) {
  if constexpr (Half16<In>::value) {
    uint16_t m = 0;
    for (int i = Exec::row_begin(lane); i < D; i += Exec::row_step(lanes)) {
      const uint16_t finite = finite_magnitude16(src[i]);
      m = m > finite ? m : finite;
    }
    return magnitude_bits(to_float(In{m}));
  } else {
    uint32_t m = 0;
    for (int i = Exec::row_begin(lane); i < D; i += Exec::row_step(lanes)) {
      const uint32_t b = magnitude_bits(to_float(src[i]));
      m = m > b ? m : b;
    }
    return m;
  }
}

template <int D, class Exec, class Code, class In>
KVF_HD KVF_INLINE void encode_row(Code* dst, const In* src, float scale, int lane, int lanes) {
  const ScaleDivisor divisor(scale);
  for (int i = Exec::row_begin(lane); i < D; i += Exec::row_step(lanes))
    dst[i] = Codec<Code>::encode(divisor.divide(to_float(src[i])));
}

template <int D, class Exec, class Out, class Code>
KVF_HD KVF_INLINE void decode_row(Out* dst, const Code* src, float scale, int lane, int lanes) {
  for (int i = Exec::row_begin(lane); i < D; i += Exec::row_step(lanes)) dst[i] = from_float<Out>(Codec<Code>::decode(src[i]) * scale);
}

// Traits whose sizes are given at run time (the generic path, RuntimeTraits in runtime/src/generic.cpp) say so with
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
  // Dynamic scales one token holds per K or V.
  static constexpr int kScalesPerToken = scales_per_token(kQuant, H);
  // Runtime-sized traits run on the CPU, where an item is one lane.
  static constexpr int kLanes = kRuntime ? 1 : kQuantized ? quant_lanes<D>() : item_lanes<Store, H, D>();
  // An executor that moves 16-byte vectors per lane (CUDA) quantizes a token in chunks of them
  // (quant_chunks.hpp), with the lanes that layout asks for; the CPU takes whole rows. A token spreads
  // over as many lanes as a float token's, up to kMaxItemLanes: for llama3-8b one chunk of K and one
  // of V a lane, and a decode's few tokens over that many threads. A per-head scale reduces inside its
  // head's group of lanes, a per-token scale over all of them (Exec::item_max).
  using Chunks = QuantChunks<Store, In, H, D, kMaxItemLanes>;
  static constexpr bool kChunkedQuant = Exec::kChunkedQuant && kQuantized && !kRuntime && Chunks::kUsable;
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
  // (Exec::tile_for says how many); executors whose item already spans all heads (CUDA) take 1.
  static constexpr int kTile = positions_inside_heads<Traits>() ? Exec::kTileItems : 1;

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

  // The lanes of an item that quantize a token element by element: at most a warp, so that each amax
  // is one warp's shuffle. An item wider than that (a chunked token of any granularity) leaves it to
  // its first warp; its other warps, each whole, return at once.
  static constexpr int kElementLanes = kTokenLanes < 32 ? kTokenLanes : 32;

  // One token's K or V (all heads) into codes, computing and storing its dynamic scales; a
  // per-tensor scale is only read.
  KVF_HD static KVF_INLINE void quantize_token(Store* dst, int64_t dst_head, Scale* scale, int64_t scale_head,
                                               const In* src, int64_t src_head, int lane, int token_lanes) {
    const int lanes = token_lanes < kElementLanes ? token_lanes : kElementLanes;
    if (lane >= lanes) return;
    if constexpr (kQuant == Quant::per_tensor) {
      const float s = to_float(*scale);
      for (int h = 0; h < H; ++h) encode_row<D, Exec>(dst + h * dst_head, src + h * src_head, s, lane, lanes);
    } else if constexpr (kQuant == Quant::per_token) {
      uint32_t m = 0;
      for (int h = 0; h < H; ++h) {
        const uint32_t b = row_amax<D, Exec>(src + h * src_head, lane, lanes);
        m = m > b ? m : b;
      }
      const Scale stored = dynamic_scale<Store, Scale>(Exec::template lane_max<kElementLanes>(m));
      if (lane == 0) *scale = stored;
      const float s = to_float(stored);
      for (int h = 0; h < H; ++h) encode_row<D, Exec>(dst + h * dst_head, src + h * src_head, s, lane, lanes);
    } else {
      for (int h = 0; h < H; ++h) {
        const Scale stored =
            dynamic_scale<Store, Scale>(Exec::template lane_max<kElementLanes>(row_amax<D, Exec>(src + h * src_head, lane, lanes)));
        if (lane == 0) scale[h * scale_head] = stored;
        encode_row<D, Exec>(dst + h * dst_head, src + h * src_head, to_float(stored), lane, lanes);
      }
    }
  }

  // A lane's chunks of passes [first, first + kChunkPasses) of one token's K or V.
  KVF_HD static KVF_INLINE void load_chunks(ChunkRegs& regs, const In* src, int64_t src_head, int lane, int first) {
    Chunks::template for_each_chunk<kChunkPasses>(
        lane, first, [&](int r, int k, int h, int c) { regs[r][k] = Chunks::load(src, src_head, h, c); });
  }

  // The largest magnitude among a lane's chunks of pass `first + r`.
  KVF_HD static KVF_INLINE uint32_t chunks_amax(const ChunkRegs& regs, int lane, int first, int r) {
    uint32_t m = 0;
    Chunks::template for_each_chunk<1>(lane, first + r, [&](int, int k, int, int) {
      const uint32_t b = Chunks::amax(regs[r][k]);
      m = m > b ? m : b;
    });
    return m;
  }

  // quantize_token in 16-byte chunks: loads, a reduction per scale over the lanes that hold its group,
  // then packed code stores. With Chunks::kPreload the caller has loaded `regs` (K's and V's both,
  // before either is stored); otherwise each pass loads its own (a per-token scale reads twice).
  KVF_HD static KVF_INLINE void quantize_token_chunked(ChunkRegs& regs, Store* dst, int64_t dst_head, Scale* scale,
                                                       int64_t scale_head, const In* src, int64_t src_head, int lane) {
    float token_scale = 1.0f;
    if constexpr (kQuant == Quant::per_tensor) {
      token_scale = to_float(*scale);
    } else if constexpr (kQuant == Quant::per_token) {
      uint32_t m = 0;
      for (int first = 0; first < Chunks::Q; first += kChunkPasses) {
        if constexpr (!Chunks::kPreload) load_chunks(regs, src, src_head, lane, first);
        KVF_UNROLL
        for (int r = 0; r < kChunkPasses; ++r) {
          const uint32_t b = chunks_amax(regs, lane, first, r);
          m = m > b ? m : b;
        }
      }
      const Scale stored = dynamic_scale<Store, Scale>(Exec::template item_max<Chunks::L>(m));
      if (lane == 0) *scale = stored;
      token_scale = to_float(stored);
    }
    for (int first = 0; first < Chunks::Q; first += kChunkPasses) {
      if constexpr (!Chunks::kPreload) load_chunks(regs, src, src_head, lane, first);
      KVF_UNROLL
      for (int r = 0; r < kChunkPasses; ++r) {
        float s = token_scale;
        if constexpr (kQuant == Quant::per_token_head) {
          const uint32_t m = Exec::template lane_max<Chunks::L, Chunks::Lh>(chunks_amax(regs, lane, first, r));
          const Scale stored = dynamic_scale<Store, Scale>(m);
          const int h = (first + r) * Chunks::P + lane / Chunks::Lh;
          if (lane % Chunks::Lh == 0 && h < H) scale[h * scale_head] = stored;
          s = to_float(stored);
        }
        const ScaleDivisor divisor(s);
        Chunks::template for_each_chunk<1>(lane, first + r, [&](int, int k, int h, int c) {
          Chunks::encode(dst, dst_head, h, c, regs[r][k], divisor);
        });
      }
    }
  }

  // A token's K and V codes back to values in 16-byte chunks (the CUDA gather): every code chunk of K
  // and of V this lane holds is loaded before any value is stored, a pass at a time where they do not
  // all fit.
  KVF_HD static KVF_INLINE void dequantize_token_chunked(In* k_out, int64_t k_head, In* v_out, int64_t v_head,
                                                         const Store* codes, int64_t code_head, int64_t code_kv,
                                                         const Scale* k_scale, const Scale* v_scale, int64_t scale_head,
                                                         int lane) {
    using Codes = typename Chunks::Codes;
    for (int first = 0; first < Chunks::Q; first += kGatherPasses) {
      Codes held[2][kGatherPasses][Chunks::K];
      Chunks::template for_each_chunk<kGatherPasses>(lane, first, [&](int r, int k, int h, int c) {
        held[0][r][k] = Chunks::load_codes(codes, code_head, h, c);
        held[1][r][k] = Chunks::load_codes(codes + code_kv, code_head, h, c);
      });
      Chunks::template for_each_chunk<kGatherPasses>(lane, first, [&](int r, int k, int h, int c) {
        Chunks::decode(k_out, k_head, h, c, held[0][r][k], to_float(k_scale[h * scale_head]));
        Chunks::decode(v_out, v_head, h, c, held[1][r][k], to_float(v_scale[h * scale_head]));
      });
    }
  }

  // Moves a token's dynamic scales (K or V), for copies that keep codes as they are.
  KVF_HD static KVF_INLINE void copy_scales(Scale* dst, int64_t dst_head, const Scale* src, int64_t src_head, int lane) {
    if (lane != 0) return;
    for (int h = 0; h < kScalesPerToken; ++h) dst[h * dst_head] = src[h * src_head];
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
            }
            ++n;
          }
          for (int kv = 0; kv < 2; ++kv) {
            const int64_t in_head = kv ? a.v.head_stride : a.k.head_stride;
            if constexpr (kQuantized) {
              quantize_tile(dst, kv * a.s.kv, a.s.head, scale[kv], a.scales.s.head, src[kv], in_head, n);
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
          quantize_token_chunked(k_regs, dst, a.s.head, scale_at(a.scales, layer, 0, unit, slot), a.scales.s.head, k,
                                 a.k.head_stride, lane);
          quantize_token_chunked(v_regs, dst + a.s.kv, a.s.head, scale_at(a.scales, layer, 1, unit, slot),
                                 a.scales.s.head, v, a.v.head_stride, lane);
          return;
        }
      }
      if constexpr (kQuantized) {
        if constexpr (!(kChunkedQuant && kAlignedRows)) {  // the element path
          quantize_token(dst, a.s.head, scale_at(a.scales, layer, 0, unit, slot), a.scales.s.head, k, a.k.head_stride,
                         lane, lanes);
          quantize_token(dst + a.s.kv, a.s.head, scale_at(a.scales, layer, 1, unit, slot), a.scales.s.head, v,
                         a.v.head_stride, lane, lanes);
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

  // K or V of n tokens into codes, head by head (the tile path of write): each token's scale first
  // where one scale covers all its heads, then every head's row of every token.
  static void quantize_tile(Store* const* dst, int64_t dst_kv, int64_t dst_head, Scale* const* scale,
                            int64_t scale_head, const In* const* src, int64_t src_head, int n) {
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
        float s = token_scale[j];
        if constexpr (kQuant == Quant::per_token_head) {
          const Scale stored = dynamic_scale<Store, Scale>(row_amax<D, Exec>(src[j] + h * src_head, 0, 1));
          scale[j][h * scale_head] = stored;
          s = to_float(stored);
        }
        encode_row<D, Exec>(dst[j] + dst_kv + h * dst_head, src[j] + h * src_head, s, 0, 1);
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
        a.tokens, Fixed<kStageLanes>{}, item_bytes<In>(a.ext),
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
                  decode_row<D, Exec>(o, row, to_float(scale[kv][j][h * a.scales.s.head]), 0, 1);
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
                                   a.scales.s.head, lane);
          return;
        }
      }
      if constexpr (kQuantized) {
        if constexpr (!(kChunkedQuant && kAlignedRows)) {  // the element path
          const TokenHeads<In> out[2] = {k_out, v_out};
          for (int kv = 0; kv < 2; ++kv) {
            const Scale* scale = scale_at(a.scales, a.layer, kv, unit, slot);
            for (int h = 0; h < H; ++h)
              decode_row<D, Exec>(out[kv].data + h * out[kv].head_stride, src + kv * a.s.kv + h * a.s.head,
                                  to_float(scale[h * a.scales.s.head]), lane, lanes);
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

  static void zero_row(const Exec& ex, const ZeroRowArgs<Store>& a) {
    const int64_t items = int64_t(a.layers) * 2 * a.positions;
    ex.for_each_item(items, Fixed<kLanes>{}, item_bytes(a.ext), [a] KVF_HD(int64_t i, int lane, int lanes) {
      const int64_t pos = i % a.positions;
      const int64_t lk = i / a.positions;
      Exec::zero_heads(a.pool + element_offset(a.s, lk / 2, lk % 2, a.row, pos), a.s.head, heads(a.ext), head_dim(a.ext),
                       lane, lanes);
      if constexpr (kScalesPerToken > 0) {
        Scale* scale = scale_at(a.scales, lk / 2, lk % 2, a.row, pos);
        if (lane == 0)
          for (int h = 0; h < kScalesPerToken; ++h) scale[h * a.scales.s.head] = Scale{};
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
      const auto d = head_dim(a.ext);
      Exec::copy_heads(a.scratch + i * int(h) * int(d), int(d), src, a.s.head, h, d, lane, lanes);
      if constexpr (kScalesPerToken > 0)
        copy_scales(static_cast<Scale*>(a.scale_scratch) + i * kScalesPerToken, 1,
                    scale_at(a.scales, a.layer, kv, a.beam[r], pos), a.scales.s.head, lane);
    });
    ex.for_each_item(items, Fixed<kLanes>{}, item_bytes(a.ext), [a] KVF_HD(int64_t i, int lane, int lanes) {
      if (a.status->code) return;
      const int64_t pos = i % a.positions;
      const int64_t kv = (i / a.positions) % 2;
      const int64_t r = i / (2 * a.positions);
      Store* dst = a.pool + element_offset(a.s, a.layer, kv, r, pos);
      const auto h = heads(a.ext);
      const auto d = head_dim(a.ext);
      Exec::copy_heads(dst, a.s.head, a.scratch + i * int(h) * int(d), int(d), h, d, lane, lanes);
      if constexpr (kScalesPerToken > 0)
        copy_scales(scale_at(a.scales, a.layer, kv, r, pos), a.scales.s.head,
                    static_cast<const Scale*>(a.scale_scratch) + i * kScalesPerToken, 1, lane);
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
    return int64_t(layers) * 2 * int(page_size(e)) * int(heads(e)) * int(head_dim(e)) * int64_t(sizeof(Store));
  }

  // Page operations on an executor that takes whole blocks (the CPU): where one page's rows of one
  // (layer, K or V) are a dense [slot, head, dim] or [head, slot, dim] block of the pool, the block is
  // copied whole (its scales, few, slot by slot) rather than row by row.
  static constexpr bool kPageBlocks = Exec::kTileItems > 1 && !kRuntime && kAddressing == Addressing::paged;
  static constexpr int64_t kPageBlock = int64_t(H) * P * D;  // elements of one such block
  static bool slots_outside_heads_dense(const Strides& s) { return s.head == D && s.seq_or_slot == int64_t(H) * D; }
  static bool page_block_dense(const Strides& s) {
    return kPageBlock <= (int64_t(1) << 28) &&
           (slots_outside_heads_dense(s) || (s.seq_or_slot == D && s.head == int64_t(P) * D));
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
      const auto d = head_dim(a.ext);
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
    Scale* packed_scales = reinterpret_cast<Scale*>(packed + packed_codes_bytes(a.ext, a.layers)) + row * kScalesPerToken;
    Scale* pooled_scales = scale_at(a.scales, layer, kv, page, slot);
    if (a.to_packed) {
      copy_scales(packed_scales, 1, pooled_scales, a.scales.s.head, lane);
    } else {
      copy_scales(pooled_scales, a.scales.s.head, packed_scales, 1, lane);
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
                         head_dim(a.ext), lane, lanes);
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
  using O = Ops<Traits, Exec>;
  using Store = typename Traits::storage_t;
  using In = typename Traits::input_t;
  OpTable<Traits> t{};
  t.write = [](const Launch& l, const WriteArgs<Store, In>& a) { O::write(Exec::from(l), a); };
  t.stage = [](const Launch& l, const StageArgs<In>& a) { O::stage(Exec::from(l), a); };
  t.gather = [](const Launch& l, const GatherArgs<Store, In>& a) { O::gather(Exec::from(l), a); };
  t.zero_row = [](const Launch& l, const ZeroRowArgs<Store>& a) { O::zero_row(Exec::from(l), a); };
  t.reorder_layer = [](const Launch& l, const ReorderArgs<Store>& a) { O::reorder_layer(Exec::from(l), a); };
  t.reorder_lengths = [](const Launch& l, const ReorderArgs<Store>& a) { O::reorder_lengths(Exec::from(l), a); };
  t.copy_pages = [](const Launch& l, const CopyPagesArgs<Store>& a) { O::copy_pages(Exec::from(l), a); };
  t.move_pages = [](const Launch& l, const MovePagesArgs<Store>& a) { O::move_pages(Exec::from(l), a); };
  t.check_indices = check_indices;
  return t;
}

}  // namespace kvforge::detail
