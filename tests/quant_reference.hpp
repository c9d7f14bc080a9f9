// An independent reference quantizer, written from the rules in docs/quantization.md with different
// means than runtime/include/kvforge/detail/quant_codec.hpp: fp8 codes are decoded with ldexp and
// encoded by a nearest-value search over the format's table, int8 by nearbyint, and input-dtype
// rounding by frexp/ldexp.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "support.hpp"

namespace kvtest {

struct Fp8Spec {
  int exp_bits, mant_bits, bias;
  bool has_inf;
};
// Equal as values, NaN equal to NaN.
inline bool same_float(float a, float b) { return (std::isnan(a) && std::isnan(b)) || a == b; }

// A one-byte code's bits.
template <class Code> uint8_t code_byte(Code c) {
  uint8_t b;
  std::memcpy(&b, &c, 1);
  return b;
}

inline Fp8Spec fp8_spec(DType t) { return t == DType::f8e4m3 ? Fp8Spec{4, 3, 7, false} : Fp8Spec{5, 2, 15, true}; }

// Whether a code is an integer (int8, int4, uint4) rather than a float format.
inline bool integer_code(DType t) { return t == DType::i8 || t == DType::i4 || t == DType::u4; }

// The value of a code (for 4-bit formats, a nibble 0..15; uint4's before its zero point is taken off);
// NaN where the format says NaN.
inline float ref_decode(DType t, uint8_t code) {
  if (t == DType::u4) return float(code);
  if (t == DType::i8) return float(int8_t(code));
  if (t == DType::i4) return float(code >= 8 ? int(code) - 16 : int(code));  // two's complement nibble
  if (t == DType::f4e2m1) {
    // OCP e2m1: sign in bit 3, a 2-bit exponent of bias 1, a 1-bit mantissa; exponent 0 is subnormal.
    const int sign = code & 8 ? -1 : 1, e = (code >> 1) & 3, m = code & 1;
    return sign * (e == 0 ? 0.5f * m : std::ldexp(1.0f + 0.5f * m, e - 1));
  }
  const Fp8Spec f = fp8_spec(t);
  const int sign = code & 0x80 ? -1 : 1;
  const int e = (code >> f.mant_bits) & ((1 << f.exp_bits) - 1);
  const int m = code & ((1 << f.mant_bits) - 1);
  const int top = (1 << f.exp_bits) - 1;
  if (f.has_inf && e == top) return m == 0 ? sign * INFINITY : NAN;
  if (!f.has_inf && e == top && m == (1 << f.mant_bits) - 1) return NAN;
  if (e == 0) return sign * std::ldexp(float(m), 1 - f.bias - f.mant_bits);
  return sign * std::ldexp(float(m + (1 << f.mant_bits)), e - f.bias - f.mant_bits);
}

inline int ref_code_count(DType t) { return t == DType::f4e2m1 || t == DType::i4 || t == DType::u4 ? 16 : 256; }

// ref_decode of every code, worked out once a dtype: the nearest-value searches run over these.
inline float ref_decoded(DType t, uint8_t code) {
  static const std::vector<std::vector<float>> tables = [] {
    std::vector<std::vector<float>> out(256);
    for (DType d : {DType::i8, DType::i4, DType::f4e2m1, DType::f8e4m3, DType::f8e5m2})
      for (int c = 0; c < ref_code_count(d); ++c) out[size_t(d)].push_back(ref_decode(d, uint8_t(c)));
    return out;
  }();
  return tables[size_t(t)][code];
}

inline float ref_qmax(DType t) {
  if (t == DType::i8) return 127.0f;
  if (t == DType::i4) return 7.0f;  // kvforge keeps the grid symmetric, as int8's 127
  if (t == DType::u4) return 15.0f;  // the codes' span, around a group's zero point
  float best = 0;
  for (int c = 0; c < ref_code_count(t) / 2; ++c)
    if (std::isfinite(ref_decode(t, uint8_t(c)))) best = std::max(best, ref_decode(t, uint8_t(c)));
  return best;
}

// Round half to even and saturate; int8, int4 and fp4 NaN -> 0 (they have no NaN code), fp8 NaN -> the
// format's NaN. 4-bit codes come back as a nibble.
inline uint8_t ref_encode(DType t, float v) {
  if (integer_code(t)) {
    if (std::isnan(v)) return 0;
    const float q = ref_qmax(t);
    const float r = std::nearbyint(std::clamp(v, -q, q));
    return uint8_t(int8_t(r)) & (t == DType::i4 ? 0xf : 0xff);
  }
  const bool fp4 = t == DType::f4e2m1;
  if (fp4 && std::isnan(v)) return 0;
  const uint8_t sign_bit = fp4 ? 0x8 : 0x80, sign = std::signbit(v) ? sign_bit : 0;
  if (std::isnan(v)) return uint8_t(sign | 0x7f);
  const float a = std::fabs(v);
  const uint8_t max_code = fp4 ? 0x7 : t == DType::f8e4m3 ? 0x7e : 0x7b;
  if (a >= ref_decoded(t, max_code)) return uint8_t(sign | max_code);  // saturate
  uint8_t best = 0;
  for (int c = 1; c < ref_code_count(t) / 2; ++c) {
    const float value = ref_decoded(t, uint8_t(c));
    if (!std::isfinite(value)) continue;
    const float d = std::fabs(value - a), bd = std::fabs(ref_decoded(t, best) - a);
    // Nearest, ties to the even code (the one whose last mantissa bit is 0).
    if (d < bd || (d == bd && (c & 1) == 0)) best = uint8_t(c);
  }
  return uint8_t(sign | best);
}

// The values where a code's rounding can go wrong: every finite value of a format's non-negative grid
// (codes 0 .. ref_code_count / 2 - 1), the midpoints between neighbours (ties), and a hair either side
// of each midpoint.
inline std::vector<float> rounding_edges(DType t) {
  std::vector<float> grid, out;
  for (int c = 0; c < ref_code_count(t) / 2; ++c)
    if (std::isfinite(ref_decode(t, uint8_t(c)))) grid.push_back(ref_decode(t, uint8_t(c)));
  std::sort(grid.begin(), grid.end());
  for (size_t i = 0; i < grid.size(); ++i) {
    out.push_back(grid[i]);
    const float next = i + 1 < grid.size() ? grid[i + 1] : grid[i] * 1.25f;
    const float mid = (grid[i] + next) / 2;
    out.insert(out.end(), {mid, std::nextafter(mid, 0.0f), std::nextafter(mid, INFINITY)});
  }
  return out;
}

// Nearest-even rounding of a float to a narrower float dtype, through frexp/ldexp.
inline float round_to(DType t, float x) {
  if (t == DType::f32 || !std::isfinite(x) || x == 0.0f) return x;
  const int bits = t == DType::bf16 ? 8 : 11;             // significant bits
  const int min_exp = t == DType::bf16 ? -126 : -14;       // smallest normal exponent
  int e;
  std::frexp(x, &e);                                       // |x| = m 2^e, m in [0.5, 1)
  const int quantum = std::max(e - bits, min_exp - bits + 1);
  const float r = std::ldexp(std::nearbyint(std::ldexp(x, -quantum)), quantum);
  if (t == DType::f16 && std::fabs(r) > 65504.0f) return std::copysign(INFINITY, x);
  return r;
}

// A dynamic scale as stored: amax / qmax (over a second-level tensor scale, where the layout has one),
// or 1 when that is 0; bf16 scales round up, ue8m0 ones to the next power of two in [2^-127, 2^127]
// (OCP MX's E8M0), and e4m3 ones to the next value of its grid within [2^-9, 448] (NVFP4's).
inline float ref_scale(DType scale_dtype, float amax, float qmax, float tensor = 1.0f) {
  float s = amax / qmax / tensor;
  if (!(s > 0.0f)) s = 1.0f;
  if (scale_dtype == DType::f8e4m3) {
    float up = ref_qmax(DType::f8e4m3);  // a scale past the largest value saturates its group
    for (int c = 1; c < 0x7f; ++c)
      if (ref_decode(DType::f8e4m3, uint8_t(c)) >= s) {
        up = ref_decode(DType::f8e4m3, uint8_t(c));
        break;
      }
    return up;
  }
  if (scale_dtype == DType::ue8m0) {
    int e;
    const float m = std::frexp(s, &e);  // s = m 2^e, m in [0.5, 1)
    const int p = std::clamp(m == 0.5f ? e - 1 : e, -127, 127);
    return std::ldexp(1.0f, p);
  }
  if (scale_dtype == DType::bf16) {
    uint32_t u;
    std::memcpy(&u, &s, 4);
    uint32_t lo = u & 0xffff0000u;
    float down;
    std::memcpy(&down, &lo, 4);
    if (down < s) lo += 0x10000u;
    std::memcpy(&s, &lo, 4);
  }
  return s;
}

// A zero-point group (uint4 storage), from the rule in docs/quantization.md with plain loops in doubles:
// its finite values' range widened to hold 0, a scale of hi / 15 - lo / 15 (1 if that is 0) rounded up to
// the scale dtype, the zero point -lo / scale rounded half to even within 0..15, and codes
// clamp(round(x / scale) + zero, 0, 15), NaN taking the zero point. Quotients are fp32's, as the rule's.
struct RefZeroGroup {
  float scale, zero;
};
inline RefZeroGroup ref_zero_group(DType value_dtype, const float* x, int n) {
  float lo = 0.0f, hi = 0.0f;
  for (int i = 0; i < n; ++i)
    if (std::isfinite(x[i])) lo = std::min(lo, x[i]), hi = std::max(hi, x[i]);
  const float wanted = hi / 15.0f - lo / 15.0f;  // in fp32, as the rule states it
  const float scale = ref_scale(value_dtype, wanted > 0.0f ? wanted : 1.0f, 1.0f);
  const float zero_quotient = -lo / scale;  // in fp32, as the rule states it
  const double zero = std::clamp(std::nearbyint(double(zero_quotient)), 0.0, 15.0);
  return {scale, float(zero)};
}
inline uint8_t ref_zero_code(float x, RefZeroGroup g) {
  if (std::isnan(x)) return uint8_t(g.zero);
  const float q = x / g.scale;  // in fp32, as the rule states it
  if (std::isinf(q)) return q > 0 ? 15 : 0;
  return uint8_t(std::clamp(std::nearbyint(double(q)) + double(g.zero), 0.0, 15.0));
}

// Scales of one head's row: head_dim / group for per_group, else 1.
inline int ref_groups(const VariantDescriptor& d) { return d.quant == Quant::per_group ? d.head_dim / d.quant_group : 1; }

// One token's K or V ([heads][dim] values) as the cache should hold and return it.
struct RefToken {
  std::vector<uint8_t> codes;   // [heads][dim]
  std::vector<float> scales;    // [heads][groups] (the same value repeated for per_token and per_tensor)
  std::vector<float> gathered;  // [heads][dim], in the input dtype's precision
  std::vector<float> zeros;     // [heads][groups], zero-point layouts (uint4) only
};

// tensor_scale: a per_tensor layout's scale, or a tensor-scaled per_group layout's second level.
inline RefToken ref_quantize(const VariantDescriptor& d, const std::vector<float>& x, float tensor_scale) {
  const int H = d.heads, D = d.head_dim;
  const float qmax = ref_qmax(d.storage);
  RefToken out;
  out.codes.resize(size_t(H) * D);
  out.gathered.resize(size_t(H) * D);
  const int groups = ref_groups(d), width = D / groups;
  out.scales.resize(size_t(H) * groups);
  // The largest finite |x| over heads [h0, h1), elements [i0, i1) of each.
  auto amax_of = [&](int h0, int h1, int i0, int i1) {
    float m = 0;
    for (int h = h0; h < h1; ++h)
      for (int i = i0; i < i1; ++i)
        if (std::isfinite(x[size_t(h) * D + i])) m = std::max(m, std::fabs(x[size_t(h) * D + i]));
    return m;
  };
  if (d.storage == DType::u4) {
    out.zeros.resize(out.scales.size());
    for (int h = 0; h < H; ++h)
      for (int g = 0; g < groups; ++g) {
        const float* group = x.data() + size_t(h) * D + size_t(g) * width;
        const RefZeroGroup z = ref_zero_group(scale_value_dtype(d.scale), group, width);
        out.scales[size_t(h) * groups + g] = z.scale;
        out.zeros[size_t(h) * groups + g] = z.zero;
        for (int i = 0; i < width; ++i) {
          const size_t at = size_t(h) * D + size_t(g) * width + i;
          out.codes[at] = ref_zero_code(x[at], z);
          out.gathered[at] = round_to(d.input, (float(out.codes[at]) - z.zero) * z.scale);
        }
      }
    return out;
  }
  for (int h = 0; h < H; ++h)
    for (int g = 0; g < groups; ++g) {
      float& stored = out.scales[size_t(h) * groups + g];
      const float under = d.tensor_scaled ? tensor_scale : 1.0f;
      if (d.quant == Quant::per_tensor) stored = tensor_scale;
      else if (d.quant == Quant::per_token) stored = ref_scale(d.scale, amax_of(0, H, 0, D), qmax);
      else stored = ref_scale(d.scale, amax_of(h, h + 1, g * width, (g + 1) * width), qmax, under);
      const float scale = stored * under;  // the factor the group's codes take
      for (int i = g * width; i < (g + 1) * width; ++i) {
        const size_t at = size_t(h) * D + i;
        out.codes[at] = ref_encode(d.storage, x[at] / scale);
        out.gathered[at] = round_to(d.input, ref_decode(d.storage, out.codes[at]) * scale);
      }
    }
  return out;
}

// A stored scale's value; a ue8m0 byte e is 2^(e - 127), an e4m3 byte its fp8 value, a zero-point
// entry's first value (its zero point is the second: load_zero).
inline float load_scale(DType t, const void* src) {
  t = scale_value_dtype(t);
  if (t == DType::ue8m0) return std::ldexp(1.0f, int(*static_cast<const uint8_t*>(src)) - 127);
  if (t == DType::f8e4m3) return ref_decode(t, *static_cast<const uint8_t*>(src));
  return t == DType::f32 ? load_as(DType::f32, src) : load_as(DType::bf16, src);
}

inline float load_zero(DType t, const void* src) {
  return load_scale(t, static_cast<const char*>(src) + dtype_size(scale_value_dtype(t)));
}

}  // namespace kvtest
