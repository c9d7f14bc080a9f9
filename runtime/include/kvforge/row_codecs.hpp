// Row loops over one head's values, one source for both backends: a row's amax, and its codes in groups
// that share a scale, both ways. The executor says how an item's lanes share a row (Exec::row_begin,
// Exec::row_step): CUDA's lanes stride through it; the CPU's one lane takes it whole, in loops of
// constant trip counts that vectorize. The rules are quant.hpp's.
#pragma once

#include <cstdint>
#include <cstring>

#include "kvforge/config.hpp"
#include "kvforge/dtype.hpp"
#include "kvforge/quant.hpp"

namespace kvforge::detail {

// The largest finite magnitude's bits over a row of D values.
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

// D values of a row into codes, and back. Packed 4-bit codes go a pair (one stored byte) at a time.
template <int D, class Exec, class Code, class In>
KVF_HD KVF_INLINE void encode_row(Code* dst, const In* src, float scale, int lane, int lanes) {
  const ScaleDivisor divisor(scale);
  if constexpr (Codec<Code>::values == 2 && Exec::row_step(2) == 1) {
    // One lane takes the row (the CPU): every value's code, then the pairs packed as 16-bit words,
    // each loop a vector one.
    uint8_t code[D];
    for (int i = 0; i < D; ++i) code[i] = Codec<Code>::code(divisor.divide(to_float(src[i])));
    for (int p = 0; p < D / 2; ++p) {
      uint16_t pair;
      std::memcpy(&pair, code + 2 * p, 2);  // value 2p in the low byte
      dst[p] = Code{uint8_t((pair & 0xfu) | ((pair >> 4) & 0xf0u))};
    }
  } else if constexpr (Codec<Code>::values == 2) {
    for (int p = Exec::row_begin(lane); p < D / 2; p += Exec::row_step(lanes))
      dst[p] = Codec<Code>::encode(divisor.divide(to_float(src[2 * p])), divisor.divide(to_float(src[2 * p + 1])));
  } else {
    for (int i = Exec::row_begin(lane); i < D; i += Exec::row_step(lanes))
      dst[i] = Codec<Code>::encode(divisor.divide(to_float(src[i])));
  }
}

// A head's row of D values in groups of G, group g with scale s[g]. Lanes that stride the row (CUDA)
// take a group at a time. One lane that takes the row whole (the CPU) divides it in one loop by each
// value's group scale, laid out beside it: a loop of D, which vectorizes whole, where a loop a group
// of 16 or 32 ran in 128-bit pieces at a third of the speed.
template <int D, int G, class Exec, class Code, class In>
KVF_HD KVF_INLINE void encode_groups(Code* dst, const In* src, const float* s, int lane, int lanes) {
  if constexpr (Exec::row_step(2) == 1 && G < D) {
    float scale[D];
    for (int g = 0; g < D / G; ++g)
      for (int i = 0; i < G; ++i) scale[g * G + i] = s[g];  // broadcasts: i / G would be a scalar loop
    if constexpr (Codec<Code>::values == 2) {
      uint8_t code[D];
      for (int i = 0; i < D; ++i) code[i] = Codec<Code>::code(to_float(src[i]) / scale[i]);
      for (int p = 0; p < D / 2; ++p) {
        uint16_t pair;
        std::memcpy(&pair, code + 2 * p, 2);  // value 2p in the low byte
        dst[p] = Code{uint8_t((pair & 0xfu) | ((pair >> 4) & 0xf0u))};
      }
    } else {
      for (int i = 0; i < D; ++i) dst[i] = Codec<Code>::encode(to_float(src[i]) / scale[i]);
    }
  } else {
    for (int g = 0; g < D / G; ++g) encode_row<G, Exec>(dst + g * (G / Codec<Code>::values), src + g * G, s[g], lane, lanes);
  }
}

template <int D, class Exec, class Out, class Code>
KVF_HD KVF_INLINE void decode_row(Out* dst, const Code* src, float scale, int lane, int lanes) {
  if constexpr (Codec<Code>::values == 2) {
    for (int p = Exec::row_begin(lane); p < D / 2; p += Exec::row_step(lanes)) {
      dst[2 * p] = from_float<Out>(Codec<Code>::decode(src[p], 0) * scale);
      dst[2 * p + 1] = from_float<Out>(Codec<Code>::decode(src[p], 1) * scale);
    }
  } else {
    for (int i = Exec::row_begin(lane); i < D; i += Exec::row_step(lanes)) dst[i] = from_float<Out>(Codec<Code>::decode(src[i]) * scale);
  }
}

// decode_row over a head's row of D values in groups of G, group g with scale s[g]; one lane that takes
// the row whole (the CPU) decodes it in one loop, each value's group scale laid out beside it, and
// unpacks 4-bit codes a byte (two values) at a time first, as encode_groups packs them.
template <int D, int G, class Exec, class Out, class Code>
KVF_HD KVF_INLINE void decode_groups(Out* dst, const Code* src, const float* s, int lane, int lanes) {
  constexpr bool kPacked = Codec<Code>::values == 2;
  if constexpr (Exec::row_step(2) == 1 && (G < D || kPacked)) {
    float scale[D];
    for (int g = 0; g < D / G; ++g)
      for (int i = 0; i < G; ++i) scale[g * G + i] = s[g];
    if constexpr (kPacked) {
      uint8_t code[D];
      for (int p = 0; p < D / 2; ++p) {
        const uint16_t b = reinterpret_cast<const uint8_t*>(src)[p];
        const uint16_t pair = uint16_t((b & 0xfu) | ((b & 0xf0u) << 4));  // value 2p in the low byte
        std::memcpy(code + 2 * p, &pair, 2);
      }
      for (int i = 0; i < D; ++i) dst[i] = from_float<Out>(Codec<Code>::decode_nibble(code[i]) * scale[i]);
    } else {
      for (int i = 0; i < D; ++i) dst[i] = from_float<Out>(Codec<Code>::decode(src[i]) * scale[i]);
    }
  } else {
    for (int g = 0; g < D / G; ++g)
      decode_row<G, Exec>(dst + g * G, src + g * (G / Codec<Code>::values), s[g], lane, lanes);
  }
}

}  // namespace kvforge::detail
