// Quantization in the one source: a token's K or V into codes and its dynamic scales, and back, on the
// lanes the executor gives an item. Ops (ops.hpp) holds the sizes and addressing these read; the write,
// gather and upkeep paths build on both. The rules are in quant_codec.hpp and row_codecs.hpp.
#pragma once

#include "kvforge/detail/ops.hpp"

namespace kvforge::detail {

template <class Traits, class Exec> struct QuantOps : Ops<Traits, Exec> {
  using O = Ops<Traits, Exec>;
  using typename O::Store;
  using typename O::In;
  using typename O::Scale;
  using typename O::Chunks;
  using typename O::ChunkRegs;
  using O::D;
  using O::H;
  using O::kChunkPasses;
  using O::kGatherPasses;
  using O::kGroup;
  using O::kGroupChunks;
  using O::kGroups;
  using O::kQuant;
  using O::kScaleHeads;
  using O::kStoredDim;
  using O::kTensorScaled;
  using O::kTokenLanes;
  using O::kValues;
  using O::kZeroPoint;
  using O::chunk_group;

  // The second-level scale of (layer, K or V): 1, a constant, where the layout has none.
  KVF_HD static KVF_INLINE float tensor_scale(const ScaleRef& r, int64_t layer, int64_t kv) {
    if constexpr (kTensorScaled) return r.tensor[2 * layer + kv]; else return 1.0f;
  }
  // A group scale as stored and the tensor scale under it, as the one factor its codes take.
  KVF_HD static KVF_INLINE float scale_value(Scale stored, float tensor) {
    if constexpr (kTensorScaled) return to_float(stored) * tensor; else return to_float(stored);
  }

  // The lanes of an item that quantize a token element by element: at most a warp, so that each amax
  // is one warp's shuffle. An item wider than that (a chunked token of any granularity) leaves it to
  // its first warp; its other warps, each whole, return at once.
  static constexpr int kElementLanes = kTokenLanes < 32 ? kTokenLanes : 32;

  // One token's K or V (all heads) into codes, computing and storing its dynamic scales; a
  // per-tensor scale is only read.
  KVF_HD static KVF_INLINE void quantize_token(Store* dst, int64_t dst_head, Scale* scale, int64_t scale_head,
                                               float tensor, const In* src, int64_t src_head, int lane,
                                               int token_lanes) {
    const int lanes = token_lanes < kElementLanes ? token_lanes : kElementLanes;
    if (lane >= lanes) return;
    if constexpr (kZeroPoint) {
      quantize_zero_token(dst, dst_head, scale, scale_head, src, src_head, lane, lanes);
    } else if constexpr (kQuant == Quant::per_tensor) {
      const float s = to_float(*scale);
      for (int h = 0; h < H; ++h) encode_groups<D, D, Exec>(dst + h * dst_head, src + h * src_head, &s, lane, lanes);
    } else if constexpr (kQuant == Quant::per_token) {
      uint32_t m = 0;
      for (int h = 0; h < H; ++h) {
        const uint32_t b = row_amax<D, Exec>(src + h * src_head, lane, lanes);
        m = m > b ? m : b;
      }
      const Scale stored = dynamic_scale<Store, Scale>(Exec::template lane_max<kElementLanes>(m));
      if (lane == 0) *scale = stored;
      const float s = to_float(stored);
      for (int h = 0; h < H; ++h) encode_groups<D, D, Exec>(dst + h * dst_head, src + h * src_head, &s, lane, lanes);
    } else if constexpr (kQuant == Quant::per_group && kLanesStrideRows) {
      for (int h = 0; h < H; ++h)
        quantize_groups_striding(dst + h * dst_head, scale + h * scale_head, tensor, src + h * src_head, lane);
    } else if constexpr (kStagesWholeToken) {
      // One lane, every head's groups stage by stage: all amaxes, then all scales in loops over the
      // token's H * kGroups groups, then the codes. Loops a head's groups long (8 for NVFP4's head of
      // 128) did not vectorize, and ran each group's scale as a scalar chain.
      uint32_t amax[kTokenGroups];
      group_amaxes<H, D, kGroup, Exec>(amax, src, src_head);
      float wanted[kTokenGroups];
      for (int i = 0; i < kTokenGroups; ++i) wanted[i] = wanted_scale<Store>(amax[i], tensor);
      Scale stored[kTokenGroups];
      for (int i = 0; i < kTokenGroups; ++i) stored[i] = store_scale<Scale>(wanted[i]);
      float s[kTokenGroups];
      for (int i = 0; i < kTokenGroups; ++i) s[i] = scale_value(stored[i], tensor);
      for (int h = 0; h < H; ++h)
        for (int g = 0; g < kGroups; ++g) scale[h * scale_head + g] = stored[h * kGroups + g];
      for (int h = 0; h < H; ++h) encode_groups<D, kGroup, Exec>(dst + h * dst_head, src + h * src_head, s + h * kGroups, 0, 1);
    } else {  // per_token_head on lanes that stride a row, and one lane's tokens of over 4096 groups
      // A head's groups go stage by stage (every amax, then every scale, then every group's codes), not
      // group by group: the groups are independent, and a core overlaps them only when no group's
      // reduction, scale and division chain stands between the next one's loads (3x on a 32-value group).
      for (int h = 0; h < H; ++h) {
        const In* row = src + h * src_head;
        uint32_t amax[kGroups];
        for (int g = 0; g < kGroups; ++g) amax[g] = row_amax<kGroup, Exec>(row + g * kGroup, lane, lanes);
        float s[kGroups];
        for (int g = 0; g < kGroups; ++g) {
          const Scale stored = dynamic_scale<Store, Scale>(Exec::template lane_max<kElementLanes>(amax[g]), tensor);
          if (lane == 0) scale[h * scale_head + g] = stored;
          s[g] = scale_value(stored, tensor);
        }
        encode_groups<D, kGroup, Exec>(dst + h * dst_head, row, s, lane, lanes);
      }
    }
  }

  // A zero-point token (uint4): each group's finite range, widened to hold 0, gives its scale and zero
  // point (quant_codec.hpp), stored side by side. One lane stages the whole token as kStagesWholeToken does;
  // lanes that stride a row take a group at a time, its range one reduction over them (0 - lo, not -lo:
  // a lane's lo of +0 would give -0, whose bits exceed every positive float's).
  KVF_HD static KVF_INLINE void quantize_zero_token(Store* dst, int64_t dst_head, Scale* scale, int64_t scale_head,
                                                    const In* src, int64_t src_head, int lane, int lanes) {
    using S = decltype(Scale::scale);
    if constexpr (!kLanesStrideRows && kTokenGroups <= 4096) {
      float lo[kTokenGroups], hi[kTokenGroups];
      for (int h = 0; h < H; ++h)
        for (int g = 0; g < kGroups; ++g)
          row_range<kGroup, Exec>(src + h * src_head + g * kGroup, 0, 1, lo[h * kGroups + g], hi[h * kGroups + g]);
      S stored[kTokenGroups];
      for (int i = 0; i < kTokenGroups; ++i) stored[i] = store_scale<S>(range_scale(lo[i], hi[i]));
      float s[kTokenGroups], z[kTokenGroups];
      for (int i = 0; i < kTokenGroups; ++i) s[i] = to_float(stored[i]);
      for (int i = 0; i < kTokenGroups; ++i) z[i] = zero_point(lo[i], s[i]);
      for (int h = 0; h < H; ++h)
        for (int g = 0; g < kGroups; ++g)
          scale[h * scale_head + g] = Scale{stored[h * kGroups + g], from_float<S>(z[h * kGroups + g])};
      for (int h = 0; h < H; ++h)
        encode_zero_groups<D, kGroup, Exec>(dst + h * dst_head, src + h * src_head, s + h * kGroups, z + h * kGroups, 0, 1);
    } else {
      for (int h = 0; h < H; ++h)
        for (int g = 0; g < kGroups; ++g) {
          const In* group = src + h * src_head + g * kGroup;
          float lo, hi;
          row_range<kGroup, Exec>(group, lane, lanes, lo, hi);
          lo = -bits_float(Exec::template lane_max<kElementLanes>(float_bits(0.0f - lo)));
          hi = bits_float(Exec::template lane_max<kElementLanes>(float_bits(hi)));
          const S stored = store_scale<S>(range_scale(lo, hi));
          const float s = to_float(stored), z = zero_point(lo, s);
          if (lane == 0) scale[h * scale_head + g] = Scale{stored, from_float<S>(z)};
          encode_zero_row<kGroup, Exec>(dst + h * dst_head + g * (kGroup / 2), group, s, z, lane, lanes);
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
                                                       int64_t scale_head, float tensor, const In* src,
                                                       int64_t src_head, int lane) {
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
        } else if constexpr (kQuant == Quant::per_group) {
          // kWholeGroups: this lane holds chunk c of head h, and its group's chunks are the aligned run of
          // kGroupChunks lanes around it.
          const uint32_t m = Exec::template lane_max<Chunks::L, kGroupChunks>(chunks_amax(regs, lane, first, r));
          const Scale stored = dynamic_scale<Store, Scale>(m, tensor);
          const int h = (first + r) * Chunks::P + lane / Chunks::Lh, c = lane % Chunks::Lh;
          if (c % kGroupChunks == 0 && h < H) scale[h * scale_head + chunk_group(c)] = stored;
          s = scale_value(stored, tensor);
        }
        const ScaleDivisor divisor(s);
        Chunks::template for_each_chunk<1>(lane, first + r, [&](int, int k, int h, int c) {
          Chunks::encode(dst, dst_head, h, c, regs[r][k], divisor);
        });
      }
    }
  }

  // Whether an item's lanes stride a head's row (CUDA's element path), not one lane taking it whole.
  static constexpr bool kLanesStrideRows = Exec::row_step(2) != 1;
  // A token's groups of scale, over all its heads; one lane stages them all at once where their amaxes
  // and scales fit 64 KiB of stack (the default specs' largest token has 64: NVFP4 on mistral_7b).
  static constexpr int kTokenGroups = H * kGroups;
  static constexpr bool kStagesWholeToken =
      !kLanesStrideRows && kTokenGroups <= 4096 && (kQuant == Quant::per_group || kQuant == Quant::per_token_head);
  static constexpr int kGroupElems = kGroup / kValues;  // stored elements of a group
  // The largest finite magnitude's bits of stored element e's values, and their codes.
  KVF_HD static KVF_INLINE uint32_t element_amax(const In* row, int e) {
    uint32_t m = magnitude_bits(to_float(row[e * kValues]));
    if constexpr (kValues == 2) {
      const uint32_t b = magnitude_bits(to_float(row[2 * e + 1]));
      m = m > b ? m : b;
    }
    return m;
  }

  // One head's row of a per_group token on lanes that stride it: lane l takes stored element
  // pass * lanes + l, so a pass holds whole groups in aligned runs of kGroupElems lanes, and a group's
  // amax is one reduction over its run (a group wider than a pass takes its passes first). A lane holds
  // only its own element's group, where holding every group's amax and scale (8 a head for NVFP4)
  // spilled 56 bytes.
  KVF_HD static KVF_INLINE void quantize_groups_striding(Store* dst, Scale* scale, float tensor, const In* row, int lane) {
    constexpr int L = kElementLanes;
    if constexpr (kGroupElems <= L) {
      for (int first = 0; first < kStoredDim; first += L) {
        const int e = first + lane;
        const bool inside = e < kStoredDim;  // the same for a whole run: the row is whole groups
        const uint32_t m = Exec::template lane_max<L, kGroupElems>(inside ? element_amax(row, e) : 0u);
        if (!inside) continue;
        const Scale stored = dynamic_scale<Store, Scale>(m, tensor);
        if (e % kGroupElems == 0) scale[e / kGroupElems] = stored;
        dst[e] = encode_element<Store>(row, e, ScaleDivisor(scale_value(stored, tensor)));
      }
    } else {
      for (int g = 0; g < kGroups; ++g) {
        uint32_t m = 0;
        for (int e = g * kGroupElems + lane; e < (g + 1) * kGroupElems; e += L) {
          const uint32_t b = element_amax(row, e);
          m = m > b ? m : b;
        }
        const Scale stored = dynamic_scale<Store, Scale>(Exec::template lane_max<L>(m), tensor);
        if (lane == 0) scale[g] = stored;
        const ScaleDivisor divisor(scale_value(stored, tensor));
        for (int e = g * kGroupElems + lane; e < (g + 1) * kGroupElems; e += L) dst[e] = encode_element<Store>(row, e, divisor);
      }
    }
  }

  // A token's K and V codes back to values in 16-byte chunks (the CUDA gather): every code chunk of K
  // and of V this lane holds is loaded before any value is stored, a pass at a time where they do not
  // all fit.
  KVF_HD static KVF_INLINE void dequantize_token_chunked(In* k_out, int64_t k_head, In* v_out, int64_t v_head,
                                                         const Store* codes, int64_t code_head, int64_t code_kv,
                                                         const Scale* k_scale, const Scale* v_scale, int64_t scale_head,
                                                         float k_tensor, float v_tensor, int lane) {
    using Codes = typename Chunks::Codes;
    for (int first = 0; first < Chunks::Q; first += kGatherPasses) {
      Codes held[2][kGatherPasses][Chunks::K];
      Chunks::template for_each_chunk<kGatherPasses>(lane, first, [&](int r, int k, int h, int c) {
        held[0][r][k] = Chunks::load_codes(codes, code_head, h, c);
        held[1][r][k] = Chunks::load_codes(codes + code_kv, code_head, h, c);
      });
      Chunks::template for_each_chunk<kGatherPasses>(lane, first, [&](int r, int k, int h, int c) {
        const int64_t at = h * scale_head + chunk_group(c);
        Chunks::decode(k_out, k_head, h, c, held[0][r][k], scale_value(k_scale[at], k_tensor));
        Chunks::decode(v_out, v_head, h, c, held[1][r][k], scale_value(v_scale[at], v_tensor));
      });
    }
  }

  // Moves a token's dynamic scales (K or V), for copies that keep codes as they are. A packed copy's
  // scales are dense: head stride kGroups (kPackedScaleHead). An entry at a time by bytes: a packed
  // page's scales follow its codes, whose bytes need not be a multiple of a scale's (int8 codes of an
  // odd row before fp32 scales), so neither side may be read as an aligned Scale.
  static constexpr int64_t kPackedScaleHead = kGroups;
  KVF_HD static KVF_INLINE void copy_scales(void* dst, int64_t dst_head, const void* src, int64_t src_head, int lane) {
    if (lane != 0) return;
    for (int h = 0; h < kScaleHeads; ++h)
      for (int g = 0; g < kGroups; ++g)
        memcpy(static_cast<unsigned char*>(dst) + (h * dst_head + g) * int64_t(sizeof(Scale)),
               static_cast<const unsigned char*>(src) + (h * src_head + g) * int64_t(sizeof(Scale)), sizeof(Scale));
  }

  // A row of one head decoded with its scales: group g of the row with scale[g] (under `tensor`).
  template <class Out>
  KVF_HD static KVF_INLINE void decode_head(Out* dst, const Store* src, const Scale* scale, float tensor, int lane,
                                            int lanes) {
    if constexpr (kZeroPoint) {
      float s[kGroups], z[kGroups];
      for (int g = 0; g < kGroups; ++g) s[g] = to_float(scale[g].scale);
      for (int g = 0; g < kGroups; ++g) z[g] = to_float(scale[g].zero);
      decode_zero_groups<D, kGroup, Exec>(dst, src, s, z, lane, lanes);
    } else if constexpr (kQuant == Quant::per_group && kLanesStrideRows) {  // each lane its own elements' group
      for (int e = Exec::row_begin(lane); e < kStoredDim; e += Exec::row_step(lanes)) {
        const float s = scale_value(scale[e / kGroupElems], tensor);
        if constexpr (kValues == 2) {
          dst[2 * e] = from_float<Out>(Codec<Store>::decode(src[e], 0) * s);
          dst[2 * e + 1] = from_float<Out>(Codec<Store>::decode(src[e], 1) * s);
        } else {
          dst[e] = from_float<Out>(Codec<Store>::decode(src[e]) * s);
        }
      }
    } else {
      float s[kGroups];
      for (int g = 0; g < kGroups; ++g) s[g] = scale_value(scale[g], tensor);
      decode_groups<D, kGroup, Exec>(dst, src, s, lane, lanes);
    }
  }
};

}  // namespace kvforge::detail
