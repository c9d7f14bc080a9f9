// Quantization's facts, for callers and for the spec's arithmetic: how many scales a token holds and
// the largest code of each quantized storage dtype. The codecs that follow them, for both backends,
// are detail/quant_codec.hpp's (docs/quantization.md states the rules in words).
#pragma once

#include <cstdint>

#include "kvforge/dtype.hpp"
#include "kvforge/vocab.hpp"

namespace kvforge {

// Dynamic scales one token holds for its K (or its V) in one layer: `groups` per head for per_group (a
// head's row split into that many groups). A per_tensor scale is per layer, not per token, so it counts
// 0 here.
constexpr int scales_per_token(Quant q, int heads, int groups) {
  return q == Quant::per_group ? heads * groups : q == Quant::per_token_head ? heads : q == Quant::per_token ? 1 : 0;
}

// The largest code magnitude of a quantized storage dtype (0 for the others): a dynamic scale is
// amax / quant_max, and a per-tensor scale s holds values up to s * quant_max.
constexpr float quant_max(DType t) {
  switch (t) {
    case DType::i8: return 127.0f;           // symmetric: -127..127
    case DType::f8e4m3: return 448.0f;       // OCP e4m3's largest finite value
    case DType::f8e5m2: return 57344.0f;     // OCP e5m2's
    case DType::f4e2m1: return 6.0f;         // OCP e2m1's
    case DType::i4: return 7.0f;             // symmetric: -7..7
    case DType::u4: return 15.0f;            // the codes' span; a value is (code - zero) * scale
    default: return 0.0f;
  }
}

// How far above amax / quant_max a dynamic scale stored in `scale` may land, as it rounds up: to the
// next power of two (ue8m0), to the next e4m3 value (at most 1/8 above, for a normal e4m3 scale), or
// exactly (fp32, bf16 round to nearest, which the codec's saturation covers).
constexpr float scale_round_up(DType scale) {
  return scale == DType::ue8m0 ? 2.0f : scale == DType::f8e4m3 ? 1.125f : 1.0f;
}

}  // namespace kvforge
