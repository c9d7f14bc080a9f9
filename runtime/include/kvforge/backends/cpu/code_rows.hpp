// A row of values into 8-bit codes (int8, fp8 e4m3 or e5m2) under one scale, and back, in the vectors of
// a CPU level: AVX-512 (int8) or AVX2 at levels 4 and 3, the portable loop at level 2. The codes are Codec's
// (quant_codec.hpp) of x / scale, bit for bit, with the quotient IEEE division's as the portable loop
// takes it:
//   - int8: the quotient clamped to +-127 with NaN kept (max and min in the operand order that passes a
//     NaN through), converted rounding half to even (the default MXCSR mode, which Codec's rounding
//     trick assumes too); NaN converts to the one code below -127, which becomes 0;
//   - fp8: Fp8Format::encode's integer steps, one 32-bit lane a value, then packed to bytes.
// The values back are Codec's decode times the scale, bit for bit (decode below says how).
// tests/test_code_rows.cpp holds every level this CPU runs to the independent reference quantizer over
// every bf16 and fp16 input and fp32's specials, at scales of every magnitude.
//
// Why by hand: GCC vectorizes Codec's portable loop, but keeps int8's clamps in integers and narrows
// 32-bit lanes to bytes through masks and permutes, about twice the instructions of the saturating packs
// here (an int8 append ran at 0.1x a copy of its bytes; fp8, 4x int8's time a value).
//
// Every function is a template on the level, so that files compiled for different levels never share
// a symbol (exec_cpu.hpp says why).
#pragma once

#include <cstdint>
#include <type_traits>

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "kvforge/detail/quant_codec.hpp"

namespace kvforge::detail::code_rows {

// The inputs the vector loops read: bf16 (a shift), fp16 (F16C's exact convert) and fp32.
template <class In> inline constexpr bool kVectorInput =
    std::is_same_v<In, bf16> || std::is_same_v<In, fp16> || std::is_same_v<In, float>;
// The codes they write.
template <class Code> inline constexpr bool kVectorCode =
    std::is_same_v<Code, int8_t> || std::is_same_v<Code, fp8_e4m3> || std::is_same_v<Code, fp8_e5m2>;
// An fp8 code type's format.
template <class Code> struct FormatOf;
template <> struct FormatOf<fp8_e4m3> { using type = E4M3; };
template <> struct FormatOf<fp8_e5m2> { using type = E5M2; };

#if defined(__AVX512F__) && defined(__AVX512BW__)
// GCC 12 warns inside its own avx512fintrin.h that the undefined vector its zero-extends start from
// "may be used uninitialized": every lane is written. Off for these functions only.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
// 16 values as fp32.
template <int Level, class In> KVF_INLINE __m512 load16(const In* src) {
  if constexpr (std::is_same_v<In, float>) {
    return _mm512_loadu_ps(src);
  } else if constexpr (std::is_same_v<In, bf16>) {
    const __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src)));
    return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
  } else {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src)));
  }
}
// 16 int8 codes of src / scale.
template <int Level, class In> KVF_INLINE __m128i int8_codes16(const In* src, __m512 scale) {
  const __m512 q = _mm512_div_ps(load16<Level>(src), scale);
  const __m512 clamped = _mm512_min_ps(_mm512_set1_ps(127.0f), _mm512_max_ps(_mm512_set1_ps(-127.0f), q));
  const __m128i c = _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(clamped));  // NaN: INT_MIN, then -128
  return _mm_andnot_si128(_mm_cmpeq_epi8(c, _mm_set1_epi8(-128)), c);
}
#pragma GCC diagnostic pop
#endif

#if defined(__AVX2__) && defined(__F16C__)
// 8 values as fp32.
template <int Level, class In> KVF_INLINE __m256 load8(const In* src) {
  if constexpr (std::is_same_v<In, float>) {
    return _mm256_loadu_ps(src);
  } else if constexpr (std::is_same_v<In, bf16>) {
    const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
  } else {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src)));
  }
}
// 8 quotients' int8 codes as int32, clamped to +-127 (NaN: INT_MIN).
template <int Level, class In> KVF_INLINE __m256i int8_words8(const In* src, __m256 scale) {
  const __m256 q = _mm256_div_ps(load8<Level>(src), scale);
  return _mm256_cvtps_epi32(_mm256_min_ps(_mm256_set1_ps(127.0f), _mm256_max_ps(_mm256_set1_ps(-127.0f), q)));
}
// 8 quotients' fp8 codes, one a 32-bit lane: Fp8Format::encode step for step.
template <int Level, int E, int M, int B, uint8_t MaxCode, uint8_t NanCode, bool HasInf, class In>
KVF_INLINE __m256i fp8_words8(Fp8Format<E, M, B, MaxCode, NanCode, HasInf>, const In* src, __m256 scale) {
  const __m256i u = _mm256_castps_si256(_mm256_div_ps(load8<Level>(src), scale));
  const __m256i sign = _mm256_and_si256(_mm256_srli_epi32(u, 24), _mm256_set1_epi32(0x80));
  const __m256i a = _mm256_and_si256(u, _mm256_set1_epi32(0x7fffffff));  // a >= 0 as int32: signed compares order it
  // Subnormal range: the magnitude times 2^(B - 1 + M), rounded half to even by the convert.
  const __m256i below = _mm256_cmpgt_epi32(_mm256_set1_epi32(int32_t(uint32_t(127 + 1 - B) << 23)), a);
  const __m256 small = _mm256_and_ps(_mm256_castsi256_ps(a), _mm256_castsi256_ps(below));
  const __m256i sub = _mm256_cvtps_epi32(_mm256_mul_ps(small, _mm256_set1_ps(bits_float(uint32_t(127 + B - 1 + M) << 23))));
  // Normal range: the mantissa rounded to M bits half to even, the exponent rebiased, saturated.
  constexpr int kShift = 23 - M;
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(a, kShift), _mm256_set1_epi32(1));
  const __m256i r = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(a, _mm256_set1_epi32((1 << (kShift - 1)) - 1)), odd), kShift);
  const __m256i normal =
      _mm256_min_epu32(_mm256_sub_epi32(r, _mm256_set1_epi32(int32_t(uint32_t(127 - B) << M))), _mm256_set1_epi32(MaxCode));
  const __m256i code = _mm256_blendv_epi8(normal, sub, below);
  const __m256i nan = _mm256_cmpgt_epi32(a, _mm256_set1_epi32(0x7f800000));
  return _mm256_or_si256(sign, _mm256_blendv_epi8(code, _mm256_set1_epi32(NanCode), nan));
}
// 32 codes: the saturating packs interleave the 128-bit halves, which one permute puts back in order.
template <int Level, class Code, class In> KVF_INLINE __m256i codes32(const In* src, __m256 scale) {
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  if constexpr (std::is_same_v<Code, int8_t>) {
    const __m256i a = _mm256_packs_epi32(int8_words8<Level>(src, scale), int8_words8<Level>(src + 8, scale));
    const __m256i b = _mm256_packs_epi32(int8_words8<Level>(src + 16, scale), int8_words8<Level>(src + 24, scale));
    const __m256i c = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(a, b), order);
    return _mm256_andnot_si256(_mm256_cmpeq_epi8(c, _mm256_set1_epi8(-128)), c);
  } else {  // codes 0..255: the unsigned packs keep them
    const typename FormatOf<Code>::type f;
    const __m256i a = _mm256_packus_epi32(fp8_words8<Level>(f, src, scale), fp8_words8<Level>(f, src + 8, scale));
    const __m256i b = _mm256_packus_epi32(fp8_words8<Level>(f, src + 16, scale), fp8_words8<Level>(f, src + 24, scale));
    return _mm256_permutevar8x32_epi32(_mm256_packus_epi16(a, b), order);
  }
}

// 16 codes as fp32 values times `unit`, for decode below (vectors without NaN codes): an fp8 code
// is the top byte of a 16-bit word, which F16C converts exactly (subnormals too):
//   - e5m2 is fp16's top byte (the same exponent bias), so the word is the value;
//   - e4m3's word s eeee mmm 00000000, shifted right arithmetically by 1 with bit 14 cleared, is the
//     fp16 s 0 eeee mmm 0000000: the value times 2^(7 - 15), which `unit` takes back (decode below);
//   - int8 converts through int32.
template <int Level, class Code> KVF_INLINE void values16(float* dst, __m128i codes, __m256 unit) {
  if constexpr (std::is_same_v<Code, int8_t>) {
    const __m256 lo = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(codes));
    const __m256 hi = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(codes, 8)));
    _mm256_storeu_ps(dst, _mm256_mul_ps(lo, unit));
    _mm256_storeu_ps(dst + 8, _mm256_mul_ps(hi, unit));
  } else {
    __m128i lo = _mm_unpacklo_epi8(_mm_setzero_si128(), codes), hi = _mm_unpackhi_epi8(_mm_setzero_si128(), codes);
    if constexpr (std::is_same_v<Code, fp8_e4m3>) {
      const __m128i keep = _mm_set1_epi16(int16_t(0xbfff));
      lo = _mm_and_si128(_mm_srai_epi16(lo, 1), keep);
      hi = _mm_and_si128(_mm_srai_epi16(hi, 1), keep);
    }
    _mm256_storeu_ps(dst, _mm256_mul_ps(_mm256_cvtph_ps(lo), unit));
    _mm256_storeu_ps(dst + 8, _mm256_mul_ps(_mm256_cvtph_ps(hi), unit));
  }
}
// Whether any of 16 fp8 codes is NaN, which the fp16 form above would not keep as Codec's NaN (e4m3's
// 0x7f is a finite fp16) or not as its bits (e5m2's NaNs keep their payloads): those take Codec.
template <class Code> KVF_INLINE bool any_nan16(__m128i codes) {
  const __m128i mag = _mm_and_si128(codes, _mm_set1_epi8(0x7f));
  if constexpr (std::is_same_v<Code, int8_t>) {
    return false;
  } else if constexpr (std::is_same_v<Code, fp8_e4m3>) {
    return _mm_movemask_epi8(_mm_cmpeq_epi8(mag, _mm_set1_epi8(0x7f))) != 0;
  } else {
    return _mm_movemask_epi8(_mm_cmpgt_epi8(mag, _mm_set1_epi8(0x7c))) != 0;
  }
}
#endif

// The values a level's loop takes at once for Code: 1 where it has none (the portable loop does the row).
template <int Level, class Code> constexpr int width() {
#if defined(__AVX512F__) && defined(__AVX512BW__)
  if (Level >= 4 && std::is_same_v<Code, int8_t>) return 16;
#endif
#if defined(__AVX2__) && defined(__F16C__)
  if (Level >= 3) return 32;
#endif
  return 1;
}

// n values of src into codes of x / scale at dst: whole vectors first, the rest one at a time.
template <int Level, class Code, class In> KVF_INLINE void encode(Code* dst, const In* src, float scale, int n) {
  constexpr int W = width<Level, Code>();
  int i = 0;
#if defined(__AVX512F__) && defined(__AVX512BW__)
  if constexpr (W == 16) {
    const __m512 s = _mm512_set1_ps(scale);
    for (; i + 16 <= n; i += 16) _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i), int8_codes16<Level>(src + i, s));
  }
#endif
#if defined(__AVX2__) && defined(__F16C__)
  if constexpr (W == 32) {
    const __m256 s = _mm256_set1_ps(scale);
    for (; i + 32 <= n; i += 32) _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + i), codes32<Level, Code>(src + i, s));
  }
#endif
  for (; i < n; ++i) dst[i] = Codec<Code>::encode(to_float(src[i]) / scale);
}

// The codes a level's loop takes at once on the way back: 1 where it has none.
template <int Level, class Code> constexpr int decode_width() {
#if defined(__AVX2__) && defined(__F16C__)
  if (Level >= 3 && kVectorCode<Code>) return 16;
#endif
  return 1;
}

// n codes at src back into values times `scale` at dst: Codec<Code>::decode(c) * scale, bit for bit.
// e4m3's fp16 form is its value times 2^-8 (values16), exact; one multiply by scale * 2^8 rounds
// value * scale once, as the portable loop does, wherever scale * 2^8 is finite (the multiply by 2^8 is
// exact, subnormal scales too). Past that (|scale| > 2^119, no scale an amax gives; or a NaN scale) an
// e4m3 row takes Codec one value at a time, as the tail does (int8 and e5m2 multiply once by the scale
// itself, as Codec's decode does), and so does a vector with a NaN code.
template <int Level, class Code> KVF_INLINE void decode(float* dst, const Code* src, float scale, int n) {
  constexpr int W = decode_width<Level, Code>();
  int i = 0;
#if defined(__AVX2__) && defined(__F16C__)
  if constexpr (W == 16) {
    constexpr float kFp16Unit = std::is_same_v<Code, fp8_e4m3> ? 256.0f : 1.0f;  // 2^(15 - 7) for e4m3
    const float unit = scale * kFp16Unit;
    if (unit - unit == 0.0f || kFp16Unit == 1.0f) {  // finite (or nothing to fold)
      const __m256 u = _mm256_set1_ps(unit);
      for (; i + 16 <= n; i += 16) {
        const __m128i codes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i));
        if (any_nan16<Code>(codes)) {
          for (int e = i; e < i + 16; ++e) dst[e] = Codec<Code>::decode(src[e]) * scale;
        } else {
          values16<Level, Code>(dst + i, codes, u);
        }
      }
    }
  }
#endif
  for (; i < n; ++i) dst[i] = Codec<Code>::decode(src[i]) * scale;
}

}  // namespace kvforge::detail::code_rows
