// Element types. fp16 and bf16 are plain 16-bit carriers with conversions that compile for host and
// device alike, so the CPU backend rounds exactly as the CUDA backend does. The 8-bit storage types
// (int8, fp8_e4m3, fp8_e5m2) hold quantization codes; detail/quant_codec.hpp turns them into values
// with a scale. Public and plain: the conversions take only detail/qualifiers.hpp, no target.
#pragma once

#include <cstdint>
#include <cstring>
#include <string_view>
#include <type_traits>

#include "kvforge/detail/qualifiers.hpp"

namespace kvforge {

enum class DType : uint8_t {
  // record: a byte of a token's record of named parts (record_format.hpp). 12 was an fp8 index key's byte
  // before index keys became a record format; the numbers after it stay as transfers and files wrote them.
  f32, f16, bf16, i32, i64, i8, f8e4m3, f8e5m2, ue8m0, f4e2m1, i4, record, u4 = 13, bf16_zero, f32_zero
};

struct fp16 {
  uint16_t bits;
};
struct bf16 {
  uint16_t bits;
};
// OCP fp8 formats: e4m3 has no infinity and one NaN per sign (max 448); e5m2 is IEEE-like (max 57344).
struct fp8_e4m3 {
  uint8_t bits;
};
struct fp8_e5m2 {
  uint8_t bits;
};
// 4-bit codes, two to a byte: value 2i in the low nibble of byte i, 2i + 1 in the high one (PyTorch's
// float4_e2m1fn_x2, and NVFP4 and MXFP4 as NVIDIA and AMD store them). A stored element of these types
// is one byte holding two values (dtype_values); a row of D values is D / 2 of them.
struct fp4_e2m1x2 {  // OCP fp4 e2m1: magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6; no infinity or NaN
  uint8_t bits;
};
struct int4x2 {  // two's complement, -8..7 (kvforge stores -7..7)
  uint8_t bits;
};
// Asymmetric 4-bit codes 0..15, read as (code - zero) * scale with their group's zero point (lmdeploy's
// int4 KV cache). A layout that stores them keeps each group's scale and zero together (ScaleZero).
struct uint4x2 {
  uint8_t bits;
};
// A byte of a token's record of named parts (record_format.hpp: FlashMLA's fp8 record, DeepSeek-V3.2's
// fp8 index key, any format a layout spec writes). A head's K row holds the record's first half of bytes
// and V's its second (RecordFormat::stored_row).
struct record_byte {
  uint8_t bits;
};
// The scale entry of a zero-point layout: a group's scale and its zero point (a whole number 0..15 held in
// the scale's type), side by side, as lmdeploy keeps its `scales_zeros` ([..., 2]). Only a scale, never
// storage; the entry is one element of the scale buffer, so every size and copy takes it whole.
template <class S> struct ScaleZero {
  S scale;
  S zero;
};
// Whether a scale dtype is a zero-point entry (ScaleZero), and the dtype of its two values (bf16 for
// bf16_zero; any other dtype is its own).
constexpr bool is_zero_point_scale(DType t) { return t == DType::bf16_zero || t == DType::f32_zero; }
constexpr DType scale_value_dtype(DType t) {
  return t == DType::bf16_zero ? DType::bf16 : t == DType::f32_zero ? DType::f32 : t;
}
// OCP MX's scale type: a bare exponent, the value 2^(bits - 127); 0xff is NaN. Only a scale, never
// storage.
struct ue8m0 {
  uint8_t bits;
};

constexpr int dtype_size(DType t) {
  switch (t) {
    case DType::f32: return 4;
    case DType::f16: return 2;
    case DType::bf16: return 2;
    case DType::i32: return 4;
    case DType::i64: return 8;
    case DType::i8: return 1;
    case DType::f8e4m3: return 1;
    case DType::f8e5m2: return 1;
    case DType::ue8m0: return 1;
    case DType::f4e2m1: return 1;  // two values
    case DType::i4: return 1;      // two values
    case DType::record: return 1;       // a byte of a record
    case DType::u4: return 1;           // two values
    case DType::bf16_zero: return 4;    // a bf16 scale and a bf16 zero point
    case DType::f32_zero: return 8;     // an fp32 scale and an fp32 zero point
  }
  return 0;
}

constexpr std::string_view dtype_name(DType t) {
  switch (t) {
    case DType::f32: return "fp32";
    case DType::f16: return "fp16";
    case DType::bf16: return "bf16";
    case DType::i32: return "int32";
    case DType::i64: return "int64";
    case DType::i8: return "int8";
    case DType::f8e4m3: return "fp8_e4m3";
    case DType::f8e5m2: return "fp8_e5m2";
    case DType::ue8m0: return "ue8m0";
    case DType::f4e2m1: return "fp4_e2m1";
    case DType::i4: return "int4";
    case DType::record: return "record";
    case DType::u4: return "uint4";
    case DType::bf16_zero: return "bf16_zero";
    case DType::f32_zero: return "fp32_zero";
  }
  return "?";
}

template <class T> struct dtype_of;
template <> struct dtype_of<float> { static constexpr DType value = DType::f32; };
template <> struct dtype_of<fp16> { static constexpr DType value = DType::f16; };
template <> struct dtype_of<bf16> { static constexpr DType value = DType::bf16; };
template <> struct dtype_of<int32_t> { static constexpr DType value = DType::i32; };
template <> struct dtype_of<int64_t> { static constexpr DType value = DType::i64; };
template <> struct dtype_of<int8_t> { static constexpr DType value = DType::i8; };
template <> struct dtype_of<fp8_e4m3> { static constexpr DType value = DType::f8e4m3; };
template <> struct dtype_of<fp8_e5m2> { static constexpr DType value = DType::f8e5m2; };
template <> struct dtype_of<ue8m0> { static constexpr DType value = DType::ue8m0; };
template <> struct dtype_of<fp4_e2m1x2> { static constexpr DType value = DType::f4e2m1; };
template <> struct dtype_of<int4x2> { static constexpr DType value = DType::i4; };
template <> struct dtype_of<record_byte> { static constexpr DType value = DType::record; };
template <> struct dtype_of<uint4x2> { static constexpr DType value = DType::u4; };
template <> struct dtype_of<ScaleZero<bf16>> { static constexpr DType value = DType::bf16_zero; };
template <> struct dtype_of<ScaleZero<float>> { static constexpr DType value = DType::f32_zero; };

// Values one stored element holds: 2 for the 4-bit types, else 1. Rows of D values take
// D / dtype_values elements of dtype_size bytes.
constexpr int dtype_values(DType t) { return t == DType::f4e2m1 || t == DType::i4 || t == DType::u4 ? 2 : 1; }
template <class T> inline constexpr int kValuesPerElement = dtype_values(dtype_of<T>::value);

// Stored elements of one head's row of head_dim values: head_dim / dtype_values, or for a record format
// `record_row`, its RecordFormat::stored_row. The one formula for a row's width in the pool.
constexpr int stored_row(DType storage, int head_dim, int record_row) {
  return storage == DType::record ? record_row : head_dim / dtype_values(storage);
}

constexpr bool is_quantized(DType t) {
  return t == DType::i8 || t == DType::f8e4m3 || t == DType::f8e5m2 || t == DType::f4e2m1 || t == DType::i4 ||
         t == DType::u4 || t == DType::record;
}

KVF_HD KVF_INLINE uint32_t float_bits(float f) {
  uint32_t u;
  memcpy(&u, &f, 4);
  return u;
}
KVF_HD KVF_INLINE float bits_float(uint32_t u) {
  float f;
  memcpy(&f, &u, 4);
  return f;
}

KVF_HD KVF_INLINE float to_float(float x) { return x; }

KVF_HD KVF_INLINE float to_float(bf16 x) { return bits_float(uint32_t(x.bits) << 16); }
// 2^(bits - 127): 0 is 2^-127, an fp32 subnormal; 0xff is NaN.
KVF_HD KVF_INLINE float to_float(ue8m0 x) {
  if (x.bits == 0xff) return bits_float(0x7fc00000u);
  return x.bits == 0 ? bits_float(0x00400000u) : bits_float(uint32_t(x.bits) << 23);
}

// Round to nearest even; NaN stays NaN (quiet), infinities stay infinite. Written as a select, not a
// branch, so that loops over rows vectorize.
KVF_HD KVF_INLINE bf16 bf16_from_float(float f) {
  const uint32_t u = float_bits(f);
  const uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  const uint32_t quiet_nan = (u >> 16) | 0x0040u;
  return bf16{uint16_t((u & 0x7fffffffu) > 0x7f800000u ? quiet_nan : rounded)};
}

KVF_HD KVF_INLINE float to_float(fp16 x) {
  const uint32_t sign = uint32_t(x.bits & 0x8000u) << 16;
  const uint32_t exp = (x.bits >> 10) & 0x1fu;
  uint32_t mant = x.bits & 0x3ffu;
  if (exp == 0x1f) return bits_float(sign | 0x7f800000u | (mant << 13));  // inf / nan
  if (exp != 0) return bits_float(sign | ((exp + 112u) << 23) | (mant << 13));
  if (mant == 0) return bits_float(sign);
  // Subnormal half: renormalize.
  int e = -1;
  do {
    ++e;
    mant <<= 1;
  } while ((mant & 0x400u) == 0);
  return bits_float(sign | (uint32_t(112 - e) << 23) | ((mant & 0x3ffu) << 13));
}

// Round to nearest even with subnormals, overflow to infinity, NaN kept quiet.
KVF_HD KVF_INLINE fp16 fp16_from_float(float f) {
  const uint32_t u = float_bits(f);
  const uint16_t sign = uint16_t((u >> 16) & 0x8000u);
  const uint32_t a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return fp16{uint16_t(sign | 0x7e00u)};
  if (a >= 0x477ff000u) return fp16{uint16_t(sign | 0x7c00u)};  // rounds to >= 65520: inf
  if (a < 0x38800000u) {                                         // below the smallest normal half
    if (a < 0x33000000u) return fp16{sign};                      // below half the smallest subnormal
    const uint32_t exp = a >> 23;
    const uint32_t mant = (a & 0x7fffffu) | 0x800000u;
    const uint32_t shift = 126u - exp;  // 14..24
    uint32_t half = mant >> shift;
    const uint32_t rem = mant & ((1u << shift) - 1u);
    const uint32_t mid = 1u << (shift - 1u);
    if (rem > mid || (rem == mid && (half & 1u))) ++half;
    return fp16{uint16_t(sign | half)};
  }
  uint32_t r = a + 0xfffu + ((a >> 13) & 1u);
  r -= 0x38000000u;  // rebias 127 -> 15
  return fp16{uint16_t(sign | (r >> 13))};
}

template <class To> KVF_HD KVF_INLINE To from_float(float f);
template <> KVF_HD KVF_INLINE float from_float<float>(float f) { return f; }
template <> KVF_HD KVF_INLINE bf16 from_float<bf16>(float f) { return bf16_from_float(f); }
template <> KVF_HD KVF_INLINE fp16 from_float<fp16>(float f) { return fp16_from_float(f); }

// Same-type conversion is a bit copy: no rounding, NaN payloads kept.
template <class To, class From> KVF_HD KVF_INLINE To convert(From x) {
  if constexpr (sizeof(To) == sizeof(From) && std::is_same_v<To, From>) {
    return x;
  } else {
    return from_float<To>(to_float(x));
  }
}

// One element of a float dtype (fp32, fp16, bf16) in untyped memory, for code that handles tensors by
// DType: stored with round to nearest even, loaded exactly.
inline void store_float(DType t, float x, void* dst) {
  if (t == DType::f16) {
    const fp16 h = fp16_from_float(x);
    memcpy(dst, &h, 2);
  } else if (t == DType::bf16) {
    const bf16 b = bf16_from_float(x);
    memcpy(dst, &b, 2);
  } else {
    memcpy(dst, &x, 4);
  }
}
inline float load_float(DType t, const void* src) {
  if (t == DType::f16 || t == DType::bf16) {
    uint16_t bits;
    memcpy(&bits, src, 2);
    return t == DType::f16 ? to_float(fp16{bits}) : to_float(bf16{bits});
  }
  float x;
  memcpy(&x, src, 4);
  return x;
}

}  // namespace kvforge
