// DeepSeek-V3.2's sparse-attention indexer keys in fp8, placed in their page as vLLM and SGLang place
// them (vLLM's indexer_k_quant_and_cache with scale_fmt "ue8m0"; SGLang's NSA index buffer). A page of P
// keys of W values (W a multiple of 128; 128 in DeepSeek-V3.2, 132 bytes a key) is
//   [0, P * W)                   key s's W e4m3 codes at s * W
//   [P * W, P * W + P * W / 32)  key s's fp32 scales at P * W + s * W / 32, one per 128 of its values
// A scale is the smallest power of two >= max(amax, 1e-4) / 448 (vLLM computes exp2f(ceilf(log2f(.)))),
// so dividing by it is exact and no finite value saturates; a code is x / scale rounded to the nearest
// e4m3 value, ties to even. The rules are block_quant.hpp's otherwise (amax over finite values).
// kvforge keeps a key as K then V of one head of D = W / 2 values; the cache's write and gather call
// encode and decode per token with the page's start and the token's slot (write_ops.hpp, gather_ops.hpp),
// and every other operation moves whole pages. tests/indexer_reference.hpp encodes the same pages from
// vLLM's formula.
#pragma once

#include <cstdint>
#include <cstring>

#include "kvforge/detail/block_quant.hpp"

namespace kvforge::detail {

template <int W> struct IndexerRecord {
  static_assert(W > 0 && W % kIndexerTile == 0, "an index key is scaled in tiles of 128");
  static constexpr int kTiles = W / kIndexerTile;
  static constexpr int kBytes = indexer_record_bytes(W);
  static constexpr int kHalf = kBytes / 2;  // a key's stored row, K's or V's: the pool's size, not a place
  static constexpr int D = W / 2;

  // Key `slot`'s codes [W] and scales [kTiles] in the page of P keys that starts at `page`.
  KVF_HD static KVF_INLINE uint8_t* codes(uint8_t* page, int64_t slot) { return page + slot * W; }
  KVF_HD static KVF_INLINE uint8_t* scales(uint8_t* page, int64_t P, int64_t slot) {
    return page + P * W + slot * 4 * kTiles;
  }
  KVF_HD static KVF_INLINE const uint8_t* codes(const uint8_t* page, int64_t slot) { return page + slot * W; }
  KVF_HD static KVF_INLINE const uint8_t* scales(const uint8_t* page, int64_t P, int64_t slot) {
    return page + P * W + slot * 4 * kTiles;
  }

  // The scale of a tile whose largest finite magnitude is `amax`.
  KVF_HD static KVF_INLINE float scale_of(float amax) {
    const float floor = 1e-4f;
    return UE8M0::decode(UE8M0::encode_up((amax > floor ? amax : floor) / Codec<fp8_e4m3>::qmax));
  }

  // Value i of the key whose halves are `first` [D] and `second` [D].
  template <class In> KVF_HD static KVF_INLINE float value(const In* first, const In* second, int i) {
    return to_float(i < D ? first[i] : second[i - D]);
  }

  // key halves [D] + [D] -> its codes [W] and scales [kTiles] on an item's Lanes lanes (CUDA): a tile's
  // amax is one reduction over them (Exec::lane_max, which every lane reaches), then lane l codes values
  // l, l + Lanes, ... of the tile, and lane 0 stores its scale. A tile of 128 takes 4 values a lane of a
  // warp, where one lane coded it whole while 31 waited.
  template <class Exec, int Lanes, class In>
  KVF_HD static KVF_INLINE void encode(const In* first, const In* second, uint8_t* code, uint8_t* scale, int lane) {
    for (int t = 0; t < kTiles; ++t) {
      uint32_t m = 0;
      for (int i = lane; i < kIndexerTile; i += Lanes) {
        const uint32_t b = magnitude_bits(value(first, second, t * kIndexerTile + i));
        m = m > b ? m : b;
      }
      const float s = scale_of(bits_float(Exec::template lane_max<Lanes>(m)));
      for (int i = lane; i < kIndexerTile; i += Lanes)
        code[t * kIndexerTile + i] = E4M3::encode(value(first, second, t * kIndexerTile + i) / s);
      if (lane == 0) std::memcpy(scale + 4 * t, &s, 4);
    }
  }

  // encode on one lane (the CPU), through a copy of the key on the stack: its loops then run over
  // contiguous values and vectorize.
  template <class In>
  KVF_HD static KVF_INLINE void encode_whole(const In* first, const In* second, uint8_t* code, uint8_t* scale) {
    float x[W];
    for (int i = 0; i < D; ++i) x[i] = to_float(first[i]);
    for (int i = 0; i < D; ++i) x[D + i] = to_float(second[i]);
    float s[kTiles];
    for (int t = 0; t < kTiles; ++t) {
      bool nan;
      s[t] = scale_of(bits_float(group_amax<kIndexerTile>(x + t * kIndexerTile, nan)));
      for (int i = 0; i < kIndexerTile; ++i) code[t * kIndexerTile + i] = E4M3::encode(x[t * kIndexerTile + i] / s[t]);
    }
    std::memcpy(scale, s, 4 * kTiles);
  }

  // codes [W] and scales [kTiles] -> key halves, value = code * scale in fp32, rounded to Out; lanes as
  // encode's, a value each.
  template <class Out>
  KVF_HD static KVF_INLINE void decode(const uint8_t* code, const uint8_t* scale, Out* first, Out* second, int lane,
                                       int lanes) {
    for (int i = lane; i < W; i += lanes) {
      float s;
      std::memcpy(&s, scale + 4 * (i / kIndexerTile), 4);
      (i < D ? first[i] : second[i - D]) = from_float<Out>(E4M3::decode(code[i]) * s);
    }
  }

  template <class Out>
  KVF_HD static KVF_INLINE void decode_whole(const uint8_t* code, const uint8_t* scale, Out* first, Out* second) {
    float s[kTiles];
    std::memcpy(s, scale, 4 * kTiles);
    Out x[W];
    for (int t = 0; t < kTiles; ++t)
      for (int i = 0; i < kIndexerTile; ++i)
        x[t * kIndexerTile + i] = from_float<Out>(E4M3::decode(code[t * kIndexerTile + i]) * s[t]);
    std::memcpy(first, x, sizeof(Out) * D);
    std::memcpy(second, x + D, sizeof(Out) * D);
  }
};

}  // namespace kvforge::detail
