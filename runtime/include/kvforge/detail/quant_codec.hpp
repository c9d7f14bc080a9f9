// The quantization codecs, one source for both backends: each code type's encode and decode, the
// scale rounding and the amax helpers the write kernels use. The rules they follow
// (docs/quantization.md states them in words):
//   - amax is the largest |x| over the scale's group, taken over finite values only;
//   - a dynamic scale is amax / qmax in fp32, rounded *up* when stored as bf16 so that no value of the
//     group saturates; a group whose scale comes out 0 (all zeros) gets scale 1, so codes are 0;
//   - code = saturate(round_half_even(x / scale)); +-inf saturate to +-qmax; NaN becomes 0 in int8 and
//     NaN in fp8 (both fp8 formats have a NaN code);
//   - value = code * scale in fp32, then rounded to the input dtype (round to nearest even).
// The facts a caller needs without these (quant_max, scales_per_token) are kvforge/quant.hpp's.
#pragma once

#include <cfloat>
#include <cmath>
#include <cstdint>
#include <type_traits>

#include "kvforge/detail/config.hpp"
#include "kvforge/dtype.hpp"
#include "kvforge/quant.hpp"
#include "kvforge/vocab.hpp"

namespace kvforge {

namespace detail {

// |x| as ordered bits: for finite floats, comparing these integers compares magnitudes, so amax is an
// integer max that vectorizes without fast-math. Non-finite values count as 0.
KVF_HD KVF_INLINE uint32_t magnitude_bits(float x) {
  const uint32_t a = float_bits(x) & 0x7fffffffu;
  return a & (0u - uint32_t(a < 0x7f800000u));  // a mask, not a select: GCC 12 vectorizes only this form
}

// For 16-bit float inputs: the bits of +infinity. Magnitude bits below it are finite and ordered as
// integers, so an amax over 16-bit lanes (twice as many per vector) then one conversion of the
// maximum gives magnitude_bits of the largest finite |x|, as the 32-bit loop does.
template <class T> struct Half16 : std::false_type {};
template <> struct Half16<bf16> : std::true_type {
  static constexpr uint16_t kInfinityBits = 0x7f80;
};
template <> struct Half16<fp16> : std::true_type {
  static constexpr uint16_t kInfinityBits = 0x7c00;
};
// A 16-bit float's magnitude bits where it is finite, else 0: one term of such an amax.
template <class T> KVF_HD KVF_INLINE uint16_t finite_magnitude16(T x) {
  const uint16_t a = uint16_t(x.bits & 0x7fffu);
  return uint16_t(a & uint16_t(0u - uint16_t(a < Half16<T>::kInfinityBits)));  // a mask: GCC 12 vectorizes only this form
}

// Rounds a float of magnitude below 2^22 to the nearest integer, ties to even, by adding and
// subtracting 1.5 * 2^23 (IEEE round-to-nearest does the rounding); unlike rintf it vectorizes
// everywhere. Needs strict IEEE arithmetic: no -ffast-math, which would fold it away.
KVF_HD KVF_INLINE float round_half_even_small(float x) {
  constexpr float kMagic = 12582912.0f;
  return (x + kMagic) - kMagic;
}

// An fp8 format with E exponent bits, M mantissa bits and bias B. `MaxCode` is the largest finite
// magnitude's code; `NanCode` is the format's (positive) NaN. Both directions are selects rather
// than branches so that the CPU loops over a row vectorize.
template <int E, int M, int B, uint8_t MaxCode, uint8_t NanCode, bool HasInf> struct Fp8Format {
  KVF_HD static KVF_INLINE float decode(uint8_t c) {
    const uint32_t sign = uint32_t(c & 0x80u) << 24;
    const uint32_t mag = c & 0x7fu;
    // Normal: the exponent and mantissa fields shift into place and the exponent is rebiased.
    const float normal = bits_float(sign | ((mag << (23 - M)) + (uint32_t(127 - B) << 23)));
    // Subnormal: mant * 2^(1 - B - M), exact in fp32.
    const float sub = bits_float(float_bits(float(mag) * bits_float(uint32_t(127 + 1 - B - M) << 23)) | sign);
    const float finite = (mag >> M) == 0 ? sub : normal;
    const float special = HasInf && (mag & ((1u << M) - 1u)) == 0 ? bits_float(sign | 0x7f800000u)
                                                                   : bits_float(0x7fc00000u);
    return mag > MaxCode ? special : finite;
  }
  KVF_HD static KVF_INLINE uint8_t encode(float v) {
    const uint32_t u = float_bits(v);
    const uint32_t sign = (u >> 24) & 0x80u;
    const uint32_t a = u & 0x7fffffffu;
    // Subnormal range: scale by 2^(B - 1 + M) (exact) and round the integer half to even. Other
    // magnitudes are replaced by 0 first so that the conversion stays in range.
    const uint32_t min_normal = uint32_t(127 + 1 - B) << 23;
    const float small = a < min_normal ? bits_float(a) : 0.0f;
    const uint32_t sub = uint32_t(round_half_even_small(small * bits_float(uint32_t(127 + B - 1 + M) << 23)));
    // Normal range: round the mantissa to M bits half to even, then rebias the exponent. Values past
    // the largest finite one (and infinity) come out above MaxCode and saturate below.
    const uint32_t shift = 23 - M;
    const uint32_t r = (a + ((1u << (shift - 1)) - 1u) + ((a >> shift) & 1u)) >> shift;
    const uint32_t normal = r - (uint32_t(127 - B) << M);
    const uint32_t code = a < min_normal ? sub : (normal > MaxCode ? MaxCode : normal);
    return uint8_t(sign | (a > 0x7f800000u ? NanCode : code));
  }
};
using E4M3 = Fp8Format<4, 3, 7, 0x7e, 0x7f, false>;
using E5M2 = Fp8Format<5, 2, 15, 0x7b, 0x7f, true>;

template <class Code> struct Codec;
template <> struct Codec<int8_t> {
  static constexpr float qmax = quant_max(DType::i8);
  // Rounds first and saturates in integers: a float clamp to +-2^22 keeps the rounding trick in range
  // (NaN comes out of it as 2^22), the integer clamp to +-qmax is two vector min/max, and NaN is
  // masked to 0 last. The same codes as clamping to +-qmax in floats (tests/test_quant.cpp checks
  // every bf16 and fp16 input), in about 3/4 of the vector instructions.
  // A device converts with its own instructions (target::device_int8), held to this bit for bit by
  // tests/test_fp8_convert.cu.
  KVF_HD static KVF_INLINE int8_t encode(float v) {
    if constexpr (target::kOnDevice) {
      return target::device_int8(v);
    } else {
      constexpr float kRoundable = 4194304.0f;  // 2^22: round_half_even_small's range
      float c = v < kRoundable ? v : kRoundable;
      c = c > -kRoundable ? c : -kRoundable;
      int r = int(round_half_even_small(c));
      r = r < int(qmax) ? r : int(qmax);
      r = r > -int(qmax) ? r : -int(qmax);
      return int8_t(v == v ? r : 0);
    }
  }
  KVF_HD static KVF_INLINE float decode(int8_t c) { return float(c); }
};
// A device takes fp8 codes from its own convert (target::device_fp8_*); the host encodes in software.
// tests/test_fp8_convert.cu checks the two bit-exact over every bf16 input.
template <> struct Codec<fp8_e4m3> {
  static constexpr float qmax = quant_max(DType::f8e4m3);
  KVF_HD static KVF_INLINE fp8_e4m3 encode(float v) {
    if constexpr (target::kOnDevice) return fp8_e4m3{target::device_fp8_e4m3(v)};
    else return fp8_e4m3{E4M3::encode(v)};
  }
  KVF_HD static KVF_INLINE float decode(fp8_e4m3 c) { return E4M3::decode(c.bits); }
};
template <> struct Codec<fp8_e5m2> {
  static constexpr float qmax = quant_max(DType::f8e5m2);
  KVF_HD static KVF_INLINE fp8_e5m2 encode(float v) {
    if constexpr (target::kOnDevice) return fp8_e5m2{target::device_fp8_e5m2(v)};
    else return fp8_e5m2{E5M2::encode(v)};
  }
  KVF_HD static KVF_INLINE float decode(fp8_e5m2 c) { return E5M2::decode(c.bits); }
};

// fp4 e2m1: a sign, 2 exponent bits (bias 1) and 1 mantissa bit; magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6
// for codes 0..7, no infinity or NaN. Bit 3 is the sign.
struct E2M1 {
  static constexpr float qmax = quant_max(DType::f4e2m1);
  KVF_HD static KVF_INLINE float decode(uint8_t code) {
    const uint32_t mag = code & 7u, e = mag >> 1, m = mag & 1u;
    // e = 0: m * 0.5 (subnormal); else (1 + m/2) * 2^(e - 1), written as an fp32 bit pattern.
    const float normal = bits_float(((e + 126u) << 23) | (m << 22));
    const float v = e == 0 ? 0.5f * float(m) : normal;
    return code & 8u ? -v : v;
  }
  // Round to nearest, ties to the even code (mantissa bit 0); |x| > 6 and inf saturate to 6; NaN has no
  // code (callers give NaN groups a NaN scale, or store 0), and comes out as a signed 0 here.
  KVF_HD static KVF_INLINE uint8_t encode(float x) {
    const uint32_t bits = float_bits(x);
    const float a = bits_float(bits & 0x7fffffffu);
    // The magnitude code counts the midpoints of neighbours that a passes; at a tie the even code wins
    // (> or >=). A sum of comparisons, not a chain of selects, so that rows of it vectorize.
    const uint32_t mag = uint32_t(a > 0.25f) + uint32_t(a >= 0.75f) + uint32_t(a > 1.25f) + uint32_t(a >= 1.75f) +
                         uint32_t(a > 2.5f) + uint32_t(a >= 3.5f) + uint32_t(a > 5.0f);
    return uint8_t(((bits >> 28) & 8u) | mag);
  }
};

// The 4-bit codes as the cache stores them, two values a byte (dtype.hpp): encode takes the pair's
// quotients, decode gives value i (0: low nibble, 1: high). Neither format has a NaN code, so NaN is
// stored as 0, as int8 stores it; +-inf saturate to +-qmax.
template <> struct Codec<fp4_e2m1x2> {
  static constexpr float qmax = E2M1::qmax;
  KVF_HD static KVF_INLINE uint8_t code(float v) { return v == v ? E2M1::encode(v) : uint8_t(0); }
  KVF_HD static KVF_INLINE fp4_e2m1x2 encode(float lo, float hi) { return fp4_e2m1x2{uint8_t(code(lo) | (code(hi) << 4))}; }
  KVF_HD static KVF_INLINE float decode_nibble(uint8_t n) { return E2M1::decode(n); }
  KVF_HD static KVF_INLINE float decode(fp4_e2m1x2 c, int i) { return decode_nibble(uint8_t((c.bits >> (4 * i)) & 0xfu)); }
};
// int4: symmetric codes -7..7 (as int8 keeps its grid symmetric), two's complement nibbles.
template <> struct Codec<int4x2> {
  static constexpr float qmax = quant_max(DType::i4);
  // Clamps before rounding so that the rounding trick stays in range (NaN comes out of the clamp as 8,
  // and is masked to 0 last).
  KVF_HD static KVF_INLINE uint8_t code(float v) {
    float c = v < 8.0f ? v : 8.0f;
    c = c > -8.0f ? c : -8.0f;
    int r = int(round_half_even_small(c));
    r = r < 7 ? r : 7;
    r = r > -7 ? r : -7;
    return uint8_t((v == v ? r : 0) & 0xf);
  }
  KVF_HD static KVF_INLINE int4x2 encode(float lo, float hi) { return int4x2{uint8_t(code(lo) | (code(hi) << 4))}; }
  KVF_HD static KVF_INLINE float decode_nibble(uint8_t n) { return float(n >= 8 ? int(n) - 16 : int(n)); }
  KVF_HD static KVF_INLINE float decode(int4x2 c, int i) { return decode_nibble(uint8_t((c.bits >> (4 * i)) & 0xfu)); }
};

// uint4: asymmetric codes 0..15 around a group's zero point z (lmdeploy's int4 KV cache), two a byte as
// int4's: code = clamp(round_half_even(x / scale) + z, 0, 15), value = (code - z) * scale. The quotient is
// clamped to +-32 first, so that the rounding trick stays in range (+-inf saturate to 0 or 15); NaN takes
// z, the code of 0.
template <> struct Codec<uint4x2> {
  // Saturates in integers after rounding, as int4's code does (a float clamp to 0..15 and conversion
  // to bytes took 1.8x as long on a row).
  KVF_HD static KVF_INLINE uint8_t code(float q, float zero) {
    float c = q < 32.0f ? q : 32.0f;
    c = c > -32.0f ? c : -32.0f;
    const int z = int(zero);
    int r = int(round_half_even_small(c)) + z;
    r = r < 15 ? r : 15;
    r = r > 0 ? r : 0;
    return uint8_t(q == q ? r : z);
  }
  KVF_HD static KVF_INLINE uint4x2 encode(float lo, float hi, float zero) {
    return uint4x2{uint8_t(code(lo, zero) | (code(hi, zero) << 4))};
  }
  KVF_HD static KVF_INLINE float decode_nibble(uint8_t n, float zero) { return float(n) - zero; }
  KVF_HD static KVF_INLINE float decode(uint4x2 c, int i, float zero) {
    return decode_nibble(uint8_t((c.bits >> (4 * i)) & 0xfu), zero);
  }
};
// A zero-point group's scale, from its finite values' range [lo, hi] widened to hold 0 (lo <= 0 <= hi, so
// that 0 is a code exactly): hi / 15 - lo / 15, which cannot overflow as (hi - lo) / 15 can; 1 for a
// group of zeros. Stored rounded up (store_scale), so that the range spans at most 15 steps.
KVF_HD KVF_INLINE float range_scale(float lo, float hi) {
  const float s = hi / 15.0f - lo / 15.0f;
  return s > 0.0f ? s : 1.0f;
}
// The zero point under the stored scale s: -lo / s rounded half to even, within 0..15.
KVF_HD KVF_INLINE float zero_point(float lo, float s) {
  const float z = round_half_even_small(-lo / s < 15.0f ? -lo / s : 15.0f);
  return z > 0.0f ? z : 0.0f;
}

// x / scale for every element of a scale's group, as IEEE division rounds it, for the price of a
// product: the group takes its scale's reciprocal once, and each element's quotient x * r is put
// right by one fused step (Markstein: with r = 1/s correctly rounded and q within an ulp of x/s,
// q + (x - q*s) * r rounds to x/s exactly, as long as x - q*s does not underflow). That holds for
// |x| above about 2^-103; with s >= 2^-80 every smaller x has |x/s| < 2^-23, which every format
// encodes as a zero of x's sign, and the product keeps that sign. So the codes are always division's,
// and the quotient is too wherever a code could be nonzero. tests/test_quant.cpp checks both over
// every bf16 and fp16 input against scales of every magnitude. Scales outside [2^-80, 2^125], where
// r would lose its precision, divide. So does the CPU: its vector division is pipelined, and the
// product with its correction and sign measured 1.1-1.3x slower there (10x for fp8, whose software
// encoder then stopped vectorizing); on a GPU, division is a dozen instructions and a branch per
// element, in a kernel whose small launches are bound by each thread's chain of instructions.
struct ScaleDivisor {
  float scale;
  float reciprocal;
  bool fused;

  KVF_HD explicit ScaleDivisor(float s)
      : scale(s), reciprocal(1.0f / s), fused(s >= 0x1p-80f && s <= 0x1p125f) {}

  KVF_HD KVF_INLINE float divide(float x) const {
    if constexpr (target::kOnDevice) {
      if (fused) return fused_quotient(x);
    }
    return x / scale;
  }

  // Every x[i] /= scale, with one test of `fused` for all of them: a chunk's quotients are then one
  // straight run of FMAs on the device rather than a branch per element.
  template <int N> KVF_HD KVF_INLINE void divide_all(float (&x)[N]) const {
    if constexpr (target::kOnDevice) {
      if (fused) {
        KVF_UNROLL
        for (int i = 0; i < N; ++i) x[i] = fused_quotient(x[i]);
        return;
      }
    }
    KVF_UNROLL
    for (int i = 0; i < N; ++i) x[i] = x[i] / scale;
  }

  // The product and its correction; only for `fused` scales.
  KVF_HD KVF_INLINE float fused_quotient(float x) const {
    const float q = x * reciprocal;
    const float corrected = fmaf(fmaf(-q, scale, x), reciprocal, q);
    // An infinite product (x = inf, or a finite x whose quotient overflows) and a NaN stay as they
    // are: the correction would turn them into NaN. The sign is x's (the correction of -0 is +0).
    return fabsf(q) <= FLT_MAX ? copysignf(corrected, q) : q;
  }
};

// ue8m0: an unsigned power of two 2^(e - 127) for e in 0..254; 255 is NaN (dtype.hpp's to_float).
struct UE8M0 {
  KVF_HD static KVF_INLINE float decode(uint8_t e) { return to_float(ue8m0{e}); }
  // The smallest power of two >= s (s > 0, finite), within [2^-127, 2^127]; a larger s gets 2^127 and its
  // group saturates.
  KVF_HD static KVF_INLINE uint8_t encode_up(float s) {
    const uint32_t u = float_bits(s);
    const uint32_t e = (u >> 23) + ((u & 0x7fffffu) ? 1u : 0u);
    // Selects, not returns: a token's scales are computed in one loop that vectorizes (quant_ops.hpp).
    return uint8_t(u > 0x7f000000u ? 254u      // above 2^127
                   : u <= 0x00400000u ? 0u     // at most 2^-127 (a subnormal)
                   : u < 0x00800000u ? 1u      // between 2^-127 and 2^-126
                                     : e);
  }
};

// An e4m3 scale rounded up: the smallest e4m3 value >= s (s > 0), at most 448, whose group then
// saturates. NVFP4's block scales take this.
// In bits, with no decode: e4m3 codes ascend with their values, so a normal s takes the code of its
// exponent and top 3 mantissa bits, plus one where any bit below them is set; a subnormal one (below
// 2^-6) the next multiple of 2^-9, at least 1 (a scale of 0 would lose the group). A group's scales
// are computed a few at a time in an append's inner loop, where a decode and compare cost 1.7x.
KVF_HD KVF_INLINE uint8_t e4m3_scale_up(float s) {
  const uint32_t u = float_bits(s);
  const bool subnormal = u < 0x3c800000u;                 // below 2^-6
  const float steps = (subnormal ? s : 0.0f) * 512.0f;    // exact: a power-of-two scaling far from underflow
  const float nearest = round_half_even_small(steps);
  // The ceiling in floats: a float-to-integer conversion beside the compare kept GCC from vectorizing.
  const uint32_t up = uint32_t(int32_t(nearest < steps ? nearest + 1.0f : nearest));
  const uint32_t normal = ((u >> 20) - ((127u - 7u) << 3)) + ((u & 0xfffffu) ? 1u : 0u);
  const uint32_t code = subnormal ? (up > 1u ? up : 1u) : normal;
  // 448 and above (and infinity) saturate. Selects, not returns, as UE8M0::encode_up.
  return uint8_t(u >= 0x43e00000u || code > 0x7eu ? 0x7eu : code);
}

// A scale as stored, rounded up in magnitude so that amax / stored <= qmax.
template <class Scale> KVF_HD KVF_INLINE Scale store_scale(float s);
template <> KVF_HD KVF_INLINE float store_scale<float>(float s) { return s; }
template <> KVF_HD KVF_INLINE bf16 store_scale<bf16>(float s) {
  const uint32_t u = float_bits(s);
  return bf16{uint16_t((u >> 16) + ((u & 0xffffu) ? 1u : 0u))};
}
template <> KVF_HD KVF_INLINE ue8m0 store_scale<ue8m0>(float s) { return ue8m0{UE8M0::encode_up(s)}; }
template <> KVF_HD KVF_INLINE fp8_e4m3 store_scale<fp8_e4m3>(float s) { return fp8_e4m3{e4m3_scale_up(s)}; }

// The stored scale for a group whose amax has magnitude bits `amax_bits`, relative to a second-level
// per-tensor scale `tensor` (NVFP4's; 1 where a layout has none): the group's values are then
// code * stored * tensor.
// In two steps, the scale wanted and the scale stored, for loops over many groups: GCC vectorizes
// each step's loop, and not one loop of both.
template <class Code> KVF_HD KVF_INLINE float wanted_scale(uint32_t amax_bits, float tensor = 1.0f) {
  const float s = bits_float(amax_bits) / Codec<Code>::qmax / tensor;
  return s > 0.0f ? s : 1.0f;
}
template <class Code, class Scale> KVF_HD KVF_INLINE Scale dynamic_scale(uint32_t amax_bits, float tensor = 1.0f) {
  return store_scale<Scale>(wanted_scale<Code>(amax_bits, tensor));
}

}  // namespace detail

// An e4m3 value as a scale (NVFP4's block scales); codes of fp8 storage decode through Codec.
KVF_HD KVF_INLINE float to_float(fp8_e4m3 x) { return detail::E4M3::decode(x.bits); }

}  // namespace kvforge
