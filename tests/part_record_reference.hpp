// Records of named parts (record_format.hpp), encoded here from docs/specs.md's rules ("Records of named
// parts") for any format: the parts' bytes one after another in their order, a coded part's codes then
// (scales in the record) its scales, page-end scales after the page's records, a token's in the order of
// its parts. Offsets come from this file's own sums over the parts' widths and dtypes, not from the
// placement codegen wrote (ref_place holds the two equal); codes from quant_reference.hpp's grids and
// searches, not kvforge's codecs; finite inputs.
//
// FlashMLA's fp8 record and DeepSeek-V3.2's fp8 index key are held to their own references instead
// (flashmla_reference.hpp, indexer_reference.hpp, written from FlashMLA's README and vLLM's kernel):
// ref_record picks those by the format's name, so a spec that changed either format fails against them.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "flashmla_reference.hpp"
#include "indexer_reference.hpp"
#include "kvforge/descriptor.hpp"

namespace kvtest {

using kvforge::RecordFormat;
using kvforge::RecordPart;
using kvforge::ScaleRounding;

// Bytes of one element of a part's codes or values, and of its scales, by the dtypes' definitions; a
// part's codes in all (4-bit codes two to a byte).
inline int ref_element_bytes(DType t) {
  return t == DType::f32 ? 4 : t == DType::bf16 || t == DType::f16 ? 2 : 1;
}
inline bool ref_nibbles(DType t) { return t == DType::f4e2m1 || t == DType::i4; }
inline int ref_code_bytes(const RecordPart& p) { return ref_nibbles(p.dtype) ? p.width / 2 : p.width * ref_element_bytes(p.dtype); }

struct RefPlace {
  std::vector<int> bytes_at, scales_at;  // per part; scales_at in the record or in the page-end entry
  int record_bytes = 0, tail_bytes = 0;
};
inline RefPlace ref_place(const RecordFormat& f) {
  RefPlace out;
  for (int i = 0; i < f.num_parts; ++i) {
    const RecordPart& p = f.parts[i];
    out.bytes_at.push_back(out.record_bytes);
    out.record_bytes += ref_code_bytes(p);
    const int scales = p.group ? p.width / p.group * ref_element_bytes(p.scale_dtype) : 0;
    int& end = p.at_page_end ? out.tail_bytes : out.record_bytes;
    out.scales_at.push_back(p.group ? end : 0);
    end += scales;
  }
  return out;
}

// The nearest code of an fp8 grid to v (ties to the even code), saturating at its largest finite value.
inline uint8_t ref_fp8_nearest(DType t, float v) {
  if (t == DType::f8e4m3) return ref_e4m3_nearest(v);
  const uint8_t sign = std::signbit(v) ? 0x80 : 0;
  const float a = std::fabs(v);
  int best = 0;
  for (int c = 1; c <= 0x7b; ++c) {  // e5m2's finite codes, rising with their values
    const float d = std::fabs(ref_decode(t, uint8_t(c)) - a), e = std::fabs(ref_decode(t, uint8_t(best)) - a);
    if (d < e || (d == e && c % 2 == 0)) best = c;
  }
  return uint8_t(sign | best);
}

// The stored scale for `s` in the scale's dtype: fp32 as it is, bf16's smallest value >= s, ue8m0's
// exponent of the power of two s already is. Returns its bytes' value.
inline float ref_store_scale(DType t, float s, uint8_t* at) {
  if (t == DType::ue8m0) {
    int e;
    std::frexp(s, &e);  // s = 0.5 * 2^e for a power of two
    at[0] = uint8_t(e - 1 + 127);
    return s;
  }
  if (t == DType::bf16) {  // bf16 values are the floats whose low 16 bits are 0: s's, or the next one up
    uint32_t u;
    std::memcpy(&u, &s, 4);
    const uint32_t up = (u & 0xffff0000u) + ((u & 0xffffu) ? 0x10000u : 0u);
    const uint16_t bits = uint16_t(up >> 16);
    std::memcpy(at, &bits, 2);
    float b;
    std::memcpy(&b, &up, 4);
    return b;
  }
  std::memcpy(at, &s, 4);
  return s;
}

// The bits of r, a value of the 16-bit float dtype t: bf16 is a float's top half; fp16 by its fields
// (sign, exponent biased by 15, 10 mantissa bits; subnormals in steps of 2^-24).
inline uint16_t ref_half_bits(DType t, float r) {
  uint32_t u;
  std::memcpy(&u, &r, 4);
  if (t == DType::bf16) return uint16_t(u >> 16);
  const uint16_t sign = std::signbit(r) ? 0x8000 : 0;
  const float a = std::fabs(r);
  if (std::isnan(r)) return uint16_t(sign | 0x7e00);
  if (std::isinf(r)) return uint16_t(sign | 0x7c00);
  if (a < std::ldexp(1.0f, -14)) return uint16_t(sign | uint16_t(a / std::ldexp(1.0f, -24)));
  int e;
  const float m = std::frexp(a, &e);  // a = m * 2^e, m in [0.5, 1)
  return uint16_t(sign | uint16_t((e - 1 + 15) << 10) | uint16_t((m * 2 - 1) * 1024));
}

// Any format's record of `values` (K's, then V's), and what it reads back as in `input`'s precision.
inline RefRecord ref_part_record(const RecordFormat& f, const std::vector<float>& values, DType input) {
  const RefPlace place = ref_place(f);
  RefRecord out;
  out.bytes.assign(size_t(place.record_bytes + place.tail_bytes), 0);
  out.gathered.resize(values.size());
  int first = 0;
  for (int i = 0; i < f.num_parts; ++i) {
    const RecordPart& p = f.parts[i];
    const float* x = values.data() + first;
    float* back = out.gathered.data() + first;
    uint8_t* bytes = out.bytes.data() + place.bytes_at[size_t(i)];
    if (!p.group) {
      for (int j = 0; j < p.width; ++j) {
        const float r = round_to(p.dtype, x[j]);
        back[j] = round_to(input, r);
        if (p.dtype == DType::f32) {
          std::memcpy(bytes + 4 * j, &r, 4);
        } else {
          const uint16_t bits = ref_half_bits(p.dtype, r);
          std::memcpy(bytes + 2 * j, &bits, 2);
        }
      }
    } else {
      const float qmax = p.dtype == DType::i8 ? 127.0f : p.dtype == DType::i4 ? 7.0f : p.dtype == DType::f4e2m1 ? 6.0f
                         : p.dtype == DType::f8e4m3 ? 448.0f : 57344.0f;
      uint8_t* scales = out.bytes.data() + (p.at_page_end ? place.record_bytes : 0) + place.scales_at[size_t(i)];
      for (int g = 0; g < p.width / p.group; ++g) {
        float amax = 0.0f;
        for (int j = 0; j < p.group; ++j) amax = std::max(amax, std::fabs(x[g * p.group + j]));
        const float a = std::max(amax, p.amax_floor);
        float s = 1.0f;
        if (a > 0 && p.rounding == ScaleRounding::pow2_up) {
          double up = std::ldexp(1.0, -127);
          while (up < double(a / qmax)) up *= 2;
          s = float(up);
        } else if (a > 0) {
          s = a / qmax;
        }
        s = ref_store_scale(p.scale_dtype, s, scales + g * ref_element_bytes(p.scale_dtype));
        for (int j = 0; j < p.group; ++j) {
          const int at = g * p.group + j;
          const float q = x[at] / s;
          float decoded;
          if (p.dtype == DType::i8 || p.dtype == DType::i4) {  // the nearest integer, ties to even, saturating
            const float n = std::max(-qmax, std::min(qmax, std::nearbyint(q)));
            const uint8_t code = uint8_t(int8_t(n));
            if (p.dtype == DType::i8) bytes[at] = code;
            else bytes[at / 2] = uint8_t(bytes[at / 2] | ((code & 0xf) << (4 * (at % 2))));
            decoded = n;
          } else if (p.dtype == DType::f4e2m1) {  // the nearest of e2m1's values (ref_encode: ties to the even code)
            const uint8_t code = ref_encode(DType::f4e2m1, q);
            bytes[at / 2] = uint8_t(bytes[at / 2] | (code << (4 * (at % 2))));
            decoded = ref_decode(DType::f4e2m1, code);
          } else {
            bytes[at] = ref_fp8_nearest(p.dtype, q);
            decoded = ref_decode(p.dtype, bytes[at]);
          }
          back[at] = round_to(input, decoded * s);
        }
      }
    }
    first += p.width;
  }
  return out;
}

// The reference of a variant's record: FlashMLA's and the index key's own, any other format's from its parts.
inline RefRecord ref_record(const VariantDescriptor& d, const std::vector<float>& values) {
  const std::string name = d.record_format->name;
  if (name == "flashmla_fp8") return ref_flashmla_record(values, d.mla_kv_lora_rank, d.mla_rope_dim, d.input);
  if (name == "indexer_fp8") return ref_index_key(values, d.input);
  return ref_part_record(*d.record_format, values, d.input);
}

// Where byte j of key `slot`'s bytes (the reference's order: the record, then its page-end scales) lies
// in its page of P records, for a format whose scales follow the page's records.
inline int64_t ref_page_byte(const RecordFormat& f, int64_t P, int64_t slot, int64_t j) {
  const RefPlace place = ref_place(f);
  return j < place.record_bytes ? slot * place.record_bytes + j
                                : P * place.record_bytes + slot * place.tail_bytes + (j - place.record_bytes);
}

}  // namespace kvtest
