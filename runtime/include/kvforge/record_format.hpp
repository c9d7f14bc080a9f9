// A record format: a token's record, K then V of a head, as a list of named parts, each with its own
// width and dtype, codes with their own scales or values as they are (a layout spec's `records`,
// docs/specs.md "Records of named parts"). codegen's records.py places each part's bytes for a model;
// the generated traits carry that placement here, detail/part_record.hpp codes by it, and views name the
// parts by it. Plain data: no kernel code.
#pragma once

#include <cstdint>

#include "kvforge/dtype.hpp"

namespace kvforge {

// How a coded part's scale is rounded from amax / the code's largest value: kept exact (then stored in
// the scale's dtype, rounded up), or the smallest power of two at or above it (OCP MX, FlashMLA).
enum class ScaleRounding : uint8_t { exact, pow2_up };

struct RecordPart {
  const char* name;
  int values_at;  // its first value in the token's record (K then V of a head)
  int width;      // values
  DType dtype;    // codes (f8e4m3, f8e5m2, i8; f4e2m1, i4 two to a byte) or values (bf16, f16, f32)
  int bytes_at;   // its codes' first byte in the record
  int group = 0;  // values that share a scale; 0: values as they are, no scales
  DType scale_dtype = DType::f32;
  int scales_at = 0;         // its scales' first byte: in the record, or in the token's page-end entry
  bool at_page_end = false;  // scales after the page's records, a token's one after another
  ScaleRounding rounding = ScaleRounding::exact;
  float amax_floor = 0.0f;   // amax is at least this; 0: an all-zero group gets scale 1
  bool nan_group = true;     // a NaN makes its group's scale NaN (MX); false: only its own code is NaN

  constexpr bool scaled() const { return group > 0; }
  // The most a value of this part moves when coded, for a value of magnitude `value` in a group whose
  // largest is `amax`: half a step of its grid (relative 2^-4 for e4m3, 2^-3 for e5m2, a float part's
  // own rounding), or half an int8 step of amax / 127, twice that where the scale rounds up to a power of
  // two. Subnormal codes and the output's rounding are the caller's to add.
  constexpr float error_bound(float value, float amax) const {
    const float up = rounding == ScaleRounding::pow2_up ? 2.0f : 1.0f;
    switch (dtype) {
      case DType::f8e4m3: return value / 16.0f;
      case DType::f8e5m2: return value / 8.0f;
      case DType::i8: return 0.5f * up * amax / 127.0f;
      case DType::i4: return 0.5f * up * amax / 7.0f;
      case DType::f4e2m1: return value / 4.0f + 0.25f * up * amax / 6.0f;  // half of e2m1's gap 4..6, its subnormal step
      case DType::bf16: return value / 256.0f;
      case DType::f16: return value / 2048.0f;
      default: return 0.0f;
    }
  }
  constexpr int code_bytes() const { return width * dtype_size(dtype) / dtype_values(dtype); }
  constexpr int scale_bytes() const { return scaled() ? width / group * dtype_size(scale_dtype) : 0; }
};

struct RecordFormat {
  const char* name;  // the storage the layout's expansions name (flashmla_fp8, indexer_fp8, ...)
  int num_parts;
  const RecordPart* parts;  // [num_parts], in the record's order
  int values;               // of a token's record
  int record_bytes;         // in the token's rows: a head's K row holds the first half, V's the second
  int tail_bytes;           // the token's page-end scales, after the page's records (0: none)

  constexpr bool page_end_scales() const { return tail_bytes > 0; }
  // A head's K (or V) row in the pool: half of the record and its page-end scales.
  constexpr int stored_row() const { return (record_bytes + tail_bytes) / 2; }
  // The loosest of its parts' error_bound.
  constexpr float error_bound(float value, float amax) const {
    float most = 0.0f;
    for (int i = 0; i < num_parts; ++i) most = parts[i].error_bound(value, amax) > most ? parts[i].error_bound(value, amax) : most;
    return most;
  }
  // The part named `name`, or null.
  constexpr const RecordPart* part(const char* name) const {
    for (int i = 0; i < num_parts; ++i) {
      const char *a = parts[i].name, *b = name;
      while (*a && *a == *b) ++a, ++b;
      if (*a == *b) return &parts[i];
    }
    return nullptr;
  }
};

}  // namespace kvforge
