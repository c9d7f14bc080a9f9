// Block-scaled codecs, one source for both backends: a group of values shares one scale (OCP MX v1.0's
// MXFP4 and MXFP8, NVIDIA's NVFP4, grouped int4), and 4-bit codes pack two to a byte. docs/quantization.md
// ("Block-scaled codecs") states the rules in words; tests/test_block_quant.cpp holds these functions to
// references written from each format's definition. These are whole-group codecs (and group_amax, which
// the record formats' codec, part_record.hpp, uses too); the cache kernels store 4-bit codes and group
// scales through quant.hpp's Codec and per_group granularity.
//
// Rules shared with quant.hpp: amax is over finite values; a scale is rounded up where it is stored, so
// that no finite value of its group saturates (a power of two for ue8m0, the next code for e4m3); an
// all-zero group gets scale 1; codes round to nearest, ties to even; +-inf saturates to the largest code.
// NaN: e2m1 has no NaN code, so a group holding a NaN gets a NaN scale (ue8m0 0xff, e4m3 0x7f) and
// decodes as NaN throughout, as MX defines; int4 encodes NaN as 0, as int8 does. (The cache stores a
// NaN as a 0 code in both, keeping its group's other values: quant.hpp.)
#pragma once

#include <cstdint>

#include "kvforge/detail/quant_codec.hpp"

namespace kvforge::detail {

// 4-bit codes two to a byte: element 2i in the low nibble of byte i, 2i + 1 in the high nibble (PyTorch's
// float4_e2m1fn_x2, NVFP4 and MXFP4 as NVIDIA and AMD store them).
KVF_HD KVF_INLINE uint8_t nibble(const uint8_t* packed, int i) { return uint8_t((packed[i >> 1] >> ((i & 1) * 4)) & 0xfu); }
KVF_HD KVF_INLINE void put_nibble(uint8_t* packed, int i, uint8_t code) {
  uint8_t& b = packed[i >> 1];
  b = uint8_t((i & 1) ? (b & 0x0fu) | (code << 4) : (b & 0xf0u) | (code & 0xfu));
}

// A group's amax as two integer maxima, so that a loop of them vectorizes (a flag or'ed with `v != v`
// kept it scalar), and so that lanes holding parts of a group combine theirs by two maxima too: `amax`
// of the finite values' magnitude bits, `raw` of every value's; the group holds a NaN where raw passes
// infinity's bits.
struct AmaxBits {
  uint32_t amax = 0, raw = 0;
  KVF_HD KVF_INLINE void fold(float v) {
    const uint32_t a = float_bits(v) & 0x7fffffffu, b = magnitude_bits(v);
    raw = raw > a ? raw : a;
    amax = amax > b ? amax : b;
  }
  KVF_HD KVF_INLINE bool nan() const { return raw > 0x7f800000u; }
};

// The amax bits of a group and whether it holds a NaN.
template <int G, class In> KVF_HD KVF_INLINE uint32_t group_amax(const In* x, bool& nan) {
  AmaxBits m;
  for (int i = 0; i < G; ++i) m.fold(to_float(x[i]));
  nan = m.nan();
  return m.amax;
}

// MXFP4: G values (32 in MX) as e2m1 codes with a ue8m0 scale. packed: G / 2 bytes.
template <int G, class In> KVF_HD KVF_INLINE uint8_t quantize_mxfp4(const In* x, uint8_t* packed) {
  bool nan;
  const float amax = bits_float(group_amax<G>(x, nan));
  const uint8_t e = nan ? uint8_t(255) : amax > 0.0f ? UE8M0::encode_up(amax / E2M1::qmax) : uint8_t(127);
  const float scale = UE8M0::decode(e);
  for (int i = 0; i < G; ++i) put_nibble(packed, i, E2M1::encode(to_float(x[i]) / scale));
  return e;
}
template <int G, class Out> KVF_HD KVF_INLINE void dequantize_mxfp4(const uint8_t* packed, uint8_t e, Out* x) {
  const float scale = UE8M0::decode(e);
  for (int i = 0; i < G; ++i) x[i] = from_float<Out>(E2M1::decode(nibble(packed, i)) * scale);
}

// MXFP8: G values as e4m3 codes with a ue8m0 scale.
template <int G, class In> KVF_HD KVF_INLINE uint8_t quantize_mxfp8(const In* x, uint8_t* codes) {
  bool nan;
  const float amax = bits_float(group_amax<G>(x, nan));
  const uint8_t e = nan ? uint8_t(255) : amax > 0.0f ? UE8M0::encode_up(amax / Codec<fp8_e4m3>::qmax) : uint8_t(127);
  const float scale = UE8M0::decode(e);
  for (int i = 0; i < G; ++i) codes[i] = E4M3::encode(to_float(x[i]) / scale);
  return e;
}
template <int G, class Out> KVF_HD KVF_INLINE void dequantize_mxfp8(const uint8_t* codes, uint8_t e, Out* x) {
  const float scale = UE8M0::decode(e);
  for (int i = 0; i < G; ++i) x[i] = from_float<Out>(E4M3::decode(codes[i]) * scale);
}

// NVFP4: 16 values as e2m1 codes with an e4m3 block scale, over a per-tensor fp32 scale `tensor_scale`
// (> 0): value = code * block_scale * tensor_scale. The block scale is amax / 6 / tensor_scale rounded
// up to an e4m3 value; a block past 448 * tensor_scale * 6 saturates. Returns the block scale's code.
template <class In> KVF_HD KVF_INLINE uint8_t quantize_nvfp4(const In* x, float tensor_scale, uint8_t* packed) {
  bool nan;
  const float amax = bits_float(group_amax<16>(x, nan));
  const uint8_t s = nan ? uint8_t(0x7f) : amax > 0.0f ? e4m3_scale_up(amax / E2M1::qmax / tensor_scale) : uint8_t(0x38);
  const float scale = E4M3::decode(s) * tensor_scale;  // 0x38 is 1.0
  for (int i = 0; i < 16; ++i) put_nibble(packed, i, E2M1::encode(to_float(x[i]) / scale));
  return s;
}
template <class Out> KVF_HD KVF_INLINE void dequantize_nvfp4(const uint8_t* packed, uint8_t s, float tensor_scale, Out* x) {
  const float scale = E4M3::decode(s) * tensor_scale;
  for (int i = 0; i < 16; ++i) x[i] = from_float<Out>(E2M1::decode(nibble(packed, i)) * scale);
}

// int4, symmetric: codes -7..7 in two's complement nibbles, scale amax / 7 (fp32, or bf16 rounded up).
template <int G, class Scale, class In> KVF_HD KVF_INLINE Scale quantize_int4(const In* x, uint8_t* packed) {
  bool nan;
  const float s = bits_float(group_amax<G>(x, nan)) / 7.0f;
  const Scale stored = store_scale<Scale>(s > 0.0f ? s : 1.0f);
  const float scale = to_float(stored);
  for (int i = 0; i < G; ++i) put_nibble(packed, i, Codec<int4x2>::code(to_float(x[i]) / scale));
  return stored;
}
template <int G, class Scale, class Out> KVF_HD KVF_INLINE void dequantize_int4(const uint8_t* packed, Scale scale, Out* x) {
  const float s = to_float(scale);
  for (int i = 0; i < G; ++i) x[i] = from_float<Out>(Codec<int4x2>::decode_nibble(nibble(packed, i)) * s);
}

// int4, asymmetric (lmdeploy's): a group of G values as a `uint4` cache stores it (quant.hpp's
// Codec<uint4x2>, range_scale and zero_point), with an fp32 scale and a 0..15 zero point: the finite
// range widened to hold 0 (so 0 is a code exactly) in 15 steps, value = (code - zero) * scale. An
// all-zero group gets scale 1, and NaN encodes as the zero point.
template <int G, class In> KVF_HD KVF_INLINE float quantize_int4_asymmetric(const In* x, uint8_t* packed, uint8_t& zero) {
  float lo = 0.0f, hi = 0.0f;
  for (int i = 0; i < G; ++i) {
    const float v = to_float(x[i]);
    if (v - v == 0.0f) {  // finite
      lo = v < lo ? v : lo;
      hi = v > hi ? v : hi;
    }
  }
  const float scale = range_scale(lo, hi);
  const float z = zero_point(lo, scale);
  zero = uint8_t(z);
  for (int i = 0; i < G; ++i) put_nibble(packed, i, Codec<uint4x2>::code(to_float(x[i]) / scale, z));
  return scale;
}
template <int G, class Out> KVF_HD KVF_INLINE void dequantize_int4_asymmetric(const uint8_t* packed, float scale, uint8_t zero, Out* x) {
  for (int i = 0; i < G; ++i) x[i] = from_float<Out>(Codec<uint4x2>::decode_nibble(nibble(packed, i), float(zero)) * scale);
}

}  // namespace kvforge::detail
