// Row loops over one head's values, one source for both backends: a row's amax, and its codes in groups
// that share a scale, both ways. The executor says how an item's lanes share a row (Exec::row_begin,
// Exec::row_step): CUDA's lanes stride through it; the CPU's one lane takes it whole, in loops of
// constant trip counts that vectorize. The rules are quant_codec.hpp's.
#pragma once

#include <cstdint>
#include <cstring>
#include <type_traits>
#include <utility>

#include "kvforge/detail/config.hpp"
#include "kvforge/dtype.hpp"
#include "kvforge/detail/quant_codec.hpp"

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

// The amax bits of each group of G values over H rows of D (row h at src + h * src_head), in order
// (row h's group g at h * D / G + g), for one lane that takes them all. Groups of 16 or fewer (a power
// of two) go into one buffer whose neighbours are folded in pairs, G / 2 then G / 4 ... to one a group:
// each fold is a vector loop, where a loop a group reduced each group of 16 across a vector's lanes at
// several shuffles a group (NVFP4's amaxes: 0.13 -> 0.08 ns a value, one core, AVX-512). Wider groups
// take row_amax each, which was faster there from 32 values up (0.07 against 0.11 ns at 32).
template <int H, int D, int G, class Exec, class In>
KVF_HD KVF_INLINE void group_amaxes(uint32_t* amax, const In* src, int64_t src_head) {
  constexpr int n = H * D;
  if constexpr (G >= 2 && G <= 16 && (G & (G - 1)) == 0 && n <= 16384) {
    using Mag = std::conditional_t<Half16<In>::value, uint16_t, uint32_t>;
    Mag a[n], b[n / 2];
    for (int h = 0; h < H; ++h)
      for (int i = 0; i < D; ++i) {
        if constexpr (Half16<In>::value) a[h * D + i] = finite_magnitude16(src[h * src_head + i]);
        else a[h * D + i] = magnitude_bits(to_float(src[h * src_head + i]));
      }
    // Two buffers, not one folded in place, so that each fold reads what the last one wrote.
    Mag* from = a;
    Mag* to = b;
    for (int width = n; width > n / G; width /= 2) {
      for (int i = 0; i < width / 2; ++i) to[i] = from[2 * i] > from[2 * i + 1] ? from[2 * i] : from[2 * i + 1];
      Mag* t = from;
      from = to;
      to = t;
    }
    for (int i = 0; i < n / G; ++i) {
      if constexpr (Half16<In>::value) amax[i] = magnitude_bits(to_float(In{from[i]}));
      else amax[i] = from[i];
    }
  } else {
    for (int h = 0; h < H; ++h)
      for (int g = 0; g < D / G; ++g) amax[h * (D / G) + g] = row_amax<G, Exec>(src + h * src_head + g * G, 0, 1);
  }
}

// D values of a row into codes, and back, for lanes that stride the row (CUDA; a group at a time for
// encode_groups below, and the CPU's whole rows of one scale). Packed 4-bit codes go a pair (one
// stored byte) at a time.
// Stored element e of a row: one value's code, or a pair of 4-bit codes in one byte.
template <class Code, class In> KVF_HD KVF_INLINE Code encode_element(const In* row, int e, const ScaleDivisor& d) {
  if constexpr (kValuesPerElement<Code> == 2)
    return Codec<Code>::encode(d.divide(to_float(row[2 * e])), d.divide(to_float(row[2 * e + 1])));
  else
    return Codec<Code>::encode(d.divide(to_float(row[e])));
}

// Whether the executor encodes a whole row of In into Code itself (CpuExec, at a level with vectors for
// them: backends/cpu/code_rows.hpp), for one lane that takes the row whole.
template <class Exec, class Code, class In, class = void> struct EncodesCodeRows : std::false_type {};
template <class Exec, class Code, class In>
struct EncodesCodeRows<Exec, Code, In, std::void_t<decltype(Exec::encode_code_row(std::declval<Code*>(),
                                                                                  std::declval<const In*>(), 0.0f, 0))>>
    : std::bool_constant<Exec::row_step(2) == 1> {};
template <class Exec, class Code, class In> constexpr bool kExecCodeRows = EncodesCodeRows<Exec, Code, In>::value;

template <int D, class Exec, class Code, class In>
KVF_HD KVF_INLINE void encode_row(Code* dst, const In* src, float scale, int lane, int lanes) {
  if constexpr (kExecCodeRows<Exec, Code, In>) {
    Exec::encode_code_row(dst, src, scale, D);
    return;
  }
  const ScaleDivisor divisor(scale);
  for (int e = Exec::row_begin(lane); e < D / kValuesPerElement<Code>; e += Exec::row_step(lanes))
    dst[e] = encode_element<Code>(src, e, divisor);
}

// Whether the executor decodes a whole row of Code into fp32 itself (CpuExec::decode_code_row), for one
// lane that takes the row whole.
template <class Exec, class Code, class Out, class = void> struct DecodesCodeRows : std::false_type {};
template <class Exec, class Code>
struct DecodesCodeRows<Exec, Code, float,
                       std::void_t<decltype(Exec::decode_code_row(std::declval<float*>(), std::declval<const Code*>(), 0.0f, 0))>>
    : std::bool_constant<Exec::row_step(2) == 1> {};

template <int D, class Exec, class Out, class Code>
KVF_HD KVF_INLINE void decode_row(Out* dst, const Code* src, float scale, int lane, int lanes) {
  if constexpr (DecodesCodeRows<Exec, Code, Out>::value) {
    Exec::decode_code_row(dst, src, scale, D);
  } else if constexpr (kValuesPerElement<Code> == 2) {
    for (int p = Exec::row_begin(lane); p < D / 2; p += Exec::row_step(lanes)) {
      dst[2 * p] = from_float<Out>(Codec<Code>::decode(src[p], 0) * scale);
      dst[2 * p + 1] = from_float<Out>(Codec<Code>::decode(src[p], 1) * scale);
    }
  } else {
    for (int i = Exec::row_begin(lane); i < D; i += Exec::row_step(lanes)) dst[i] = from_float<Out>(Codec<Code>::decode(src[i]) * scale);
  }
}

// Whether one lane takes a head's row of D values in groups of G whole (the CPU, Exec::row_step 1) and
// is better served by one loop over the row than a loop a group: where there are several groups, or
// 4-bit codes to pack (a pair a step stops the loop vectorizing).
template <int D, int G, class Exec, class Code> constexpr bool kWholeRowLoop =
    Exec::row_step(2) == 1 && (G < D || kValuesPerElement<Code> == 2);

// Each value's group scale laid out beside it: broadcasts, where `s[i / G]` would be a scalar loop.
template <int D, int G> KVF_HD KVF_INLINE void spread_scales(float (&scale)[D], const float* s) {
  for (int g = 0; g < D / G; ++g)
    for (int i = 0; i < G; ++i) scale[g * G + i] = s[g];
}

// A row's 4-bit codes, one a byte, packed two a byte (value 2p in the low nibble of byte p), and back: as
// 16-bit words, a vector loop, where a pair at a time stopped the loop vectorizing.
template <int D, class Code> KVF_HD KVF_INLINE void pack_nibbles(Code* dst, const uint8_t (&code)[D]) {
  for (int p = 0; p < D / 2; ++p) {
    uint16_t pair;
    std::memcpy(&pair, code + 2 * p, 2);  // value 2p in the low byte
    dst[p] = Code{uint8_t((pair & 0xfu) | ((pair >> 4) & 0xf0u))};
  }
}
template <int D, class Code> KVF_HD KVF_INLINE void unpack_nibbles(uint8_t (&code)[D], const Code* src) {
  for (int p = 0; p < D / 2; ++p) {
    const uint16_t b = src[p].bits;
    const uint16_t pair = uint16_t((b & 0xfu) | ((b & 0xf0u) << 4));  // value 2p in the low byte
    std::memcpy(code + 2 * p, &pair, 2);
  }
}

// A head's row of D values in groups of G, group g with scale s[g]. Lanes that stride the row take a
// group at a time (encode_row). One lane that takes it whole divides it in one loop by each value's
// group scale: a loop of D, which vectorizes whole, where a loop a group of 16 or 32 ran in 128-bit
// pieces at a third of the speed; 4-bit codes are then packed as 16-bit words, a vector loop too.
template <int D, int G, class Exec, class Code, class In>
KVF_HD KVF_INLINE void encode_groups(Code* dst, const In* src, const float* s, int lane, int lanes) {
  if constexpr (kExecCodeRows<Exec, Code, In> && G >= 32) {  // a group of at least one AVX2 vector
    for (int g = 0; g < D / G; ++g) Exec::encode_code_row(dst + g * G, src + g * G, s[g], G);
  } else if constexpr (kWholeRowLoop<D, G, Exec, Code>) {
    float scale[D];
    spread_scales<D, G>(scale, s);
    if constexpr (kValuesPerElement<Code> == 2) {
      uint8_t code[D];
      for (int i = 0; i < D; ++i) code[i] = Codec<Code>::code(to_float(src[i]) / scale[i]);
      pack_nibbles<D>(dst, code);
    } else {
      for (int i = 0; i < D; ++i) dst[i] = Codec<Code>::encode(to_float(src[i]) / scale[i]);
    }
  } else {
    for (int g = 0; g < D / G; ++g)
      encode_row<G, Exec>(dst + g * (G / kValuesPerElement<Code>), src + g * G, s[g], lane, lanes);
  }
}

// encode_groups' way back: one loop over a whole row, 4-bit codes unpacked a byte (two values) at a
// time first.
template <int D, int G, class Exec, class Out, class Code>
KVF_HD KVF_INLINE void decode_groups(Out* dst, const Code* src, const float* s, int lane, int lanes) {
  if constexpr (DecodesCodeRows<Exec, Code, Out>::value && G >= 16) {  // a group of at least one vector
    for (int g = 0; g < D / G; ++g) Exec::decode_code_row(dst + g * G, src + g * G, s[g], G);
  } else if constexpr (kWholeRowLoop<D, G, Exec, Code>) {
    float scale[D];
    spread_scales<D, G>(scale, s);
    if constexpr (kValuesPerElement<Code> == 2) {
      uint8_t code[D];
      unpack_nibbles<D>(code, src);
      for (int i = 0; i < D; ++i) dst[i] = from_float<Out>(Codec<Code>::decode_nibble(code[i]) * scale[i]);
    } else {
      for (int i = 0; i < D; ++i) dst[i] = from_float<Out>(Codec<Code>::decode(src[i]) * scale[i]);
    }
  } else {
    for (int g = 0; g < D / G; ++g)
      decode_row<G, Exec>(dst + g * G, src + g * (G / kValuesPerElement<Code>), s[g], lane, lanes);
  }
}

// ---- zero-point codes (uint4): a group's range, not its amax, and codes around its zero point ----

// A float's bits as an int32 that orders as the float does (-0 just below +0), and back; inf and NaN
// map to 0, +0's. A range over these is an integer min and max, which vectorizes where a float one does
// not without -ffinite-math-only: a bf16 head's uint4 codes took 2.7 ns a value on one core (AVX-512)
// with float min and max, and take 0.33 with these in 16-bit lanes (int4's amax and codes: 0.28).
KVF_HD KVF_INLINE int32_t ordered_finite(float x) {
  const int32_t b = int32_t(float_bits(x));
  const int32_t k = b ^ ((b >> 31) & 0x7fffffff);
  return k & (0 - int32_t((b & 0x7fffffff) < 0x7f800000));  // a mask, not a select, as magnitude_bits
}
KVF_HD KVF_INLINE float from_ordered(int32_t k) { return bits_float(uint32_t(k ^ ((k >> 31) & 0x7fffffff))); }

// The same for a 16-bit float's bits (bf16, fp16): twice the lanes a vector, as row_amax's Half16 path.
template <class In> KVF_HD KVF_INLINE int16_t ordered_finite16(In x) {
  const int16_t b = int16_t(x.bits);
  const int16_t k = int16_t(b ^ ((b >> 15) & 0x7fff));
  return int16_t(k & int16_t(0 - int16_t((b & 0x7fff) < Half16<In>::kInfinityBits)));
}
template <class In> KVF_HD KVF_INLINE float from_ordered16(int16_t k) {
  return to_float(In{uint16_t(k ^ ((k >> 15) & 0x7fff))});
}

// The finite range of a row of D values, widened to hold 0: lo <= 0 <= hi. Inf and NaN count as 0.
template <int D, class Exec, class In>
KVF_HD KVF_INLINE void row_range(const In* src, int lane, int lanes, float& lo, float& hi) {
  if constexpr (Half16<In>::value) {
    int16_t l = 0, h = 0;
    for (int i = Exec::row_begin(lane); i < D; i += Exec::row_step(lanes)) {
      const int16_t k = ordered_finite16(src[i]);
      l = k < l ? k : l;
      h = k > h ? k : h;
    }
    lo = from_ordered16<In>(l);
    hi = from_ordered16<In>(h);
  } else {
    int32_t l = 0, h = 0;
    for (int i = Exec::row_begin(lane); i < D; i += Exec::row_step(lanes)) {
      const int32_t k = ordered_finite(to_float(src[i]));
      l = k < l ? k : l;
      h = k > h ? k : h;
    }
    lo = from_ordered(l);
    hi = from_ordered(h);
  }
}

// A group's codes on lanes that stride it: stored element e holds values 2e (low nibble) and 2e + 1.
template <int G, class Exec, class In>
KVF_HD KVF_INLINE void encode_zero_row(uint4x2* dst, const In* src, float s, float z, int lane, int lanes) {
  for (int e = Exec::row_begin(lane); e < G / 2; e += Exec::row_step(lanes))
    dst[e] = Codec<uint4x2>::encode(to_float(src[2 * e]) / s, to_float(src[2 * e + 1]) / s, z);
}
template <int G, class Exec, class Out>
KVF_HD KVF_INLINE void decode_zero_row(Out* dst, const uint4x2* src, float s, float z, int lane, int lanes) {
  for (int e = Exec::row_begin(lane); e < G / 2; e += Exec::row_step(lanes)) {
    dst[2 * e] = from_float<Out>(Codec<uint4x2>::decode(src[e], 0, z) * s);
    dst[2 * e + 1] = from_float<Out>(Codec<uint4x2>::decode(src[e], 1, z) * s);
  }
}

// Each value's group scale and zero point laid out beside it, for one lane's loops over a whole row.
template <int D, int G> struct SpreadZeroGroups {
  float scale[D], zero[D];
  KVF_HD SpreadZeroGroups(const float* s, const float* z) {
    spread_scales<D, G>(scale, s);
    spread_scales<D, G>(zero, z);
  }
};

// A head's row of D values in groups of G, group g with scale s[g] and zero point z[g]. One lane that
// takes the row whole runs it as encode_groups does: every code in one loop, with each value's scale and
// zero laid out beside it, then the pairs packed as 16-bit words.
template <int D, int G, class Exec, class In>
KVF_HD KVF_INLINE void encode_zero_groups(uint4x2* dst, const In* src, const float* s, const float* z, int lane,
                                          int lanes) {
  if constexpr (Exec::row_step(2) == 1) {
    const SpreadZeroGroups<D, G> at(s, z);
    uint8_t code[D];
    for (int i = 0; i < D; ++i) code[i] = Codec<uint4x2>::code(to_float(src[i]) / at.scale[i], at.zero[i]);
    pack_nibbles<D>(dst, code);
  } else {
    for (int g = 0; g < D / G; ++g) encode_zero_row<G, Exec>(dst + g * (G / 2), src + g * G, s[g], z[g], lane, lanes);
  }
}
template <int D, int G, class Exec, class Out>
KVF_HD KVF_INLINE void decode_zero_groups(Out* dst, const uint4x2* src, const float* s, const float* z, int lane,
                                          int lanes) {
  if constexpr (Exec::row_step(2) == 1) {
    const SpreadZeroGroups<D, G> at(s, z);
    uint8_t code[D];
    unpack_nibbles<D>(code, src);
    for (int i = 0; i < D; ++i) dst[i] = from_float<Out>(Codec<uint4x2>::decode_nibble(code[i], at.zero[i]) * at.scale[i]);
  } else {
    for (int g = 0; g < D / G; ++g) decode_zero_row<G, Exec>(dst + g * G, src + g * (G / 2), s[g], z[g], lane, lanes);
  }
}

}  // namespace kvforge::detail
