// DeepSeek-V3.2's fp8 index keys in their page, encoded here from vLLM's indexer_k_quant_and_cache (its
// kernel's offsets, with scale_fmt "ue8m0") and SGLang's NSA index buffer, for keys of W values (a
// multiple of 128) in pages of P: key s's e4m3 codes at byte s * W of its page, then after the page's
// P * W code bytes its fp32 scales at P * W + s * W / 32, one per 128 values: the smallest power of two
// >= max(amax, 1e-4) / 448. Written with flashmla_reference.hpp's e4m3 search, not kvforge's codecs;
// finite inputs.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "flashmla_reference.hpp"

namespace kvtest {

// A key's bytes as vLLM writes them (codes, then scales; not one run in the page) and its read-back.
inline RefRecord ref_index_key(const std::vector<float>& key, DType input) {
  const int W = int(key.size()), tiles = W / 128;
  RefRecord out;
  out.bytes.assign(size_t(W + 4 * tiles), 0);
  out.gathered.resize(size_t(W));
  for (int t = 0; t < tiles; ++t) {
    float amax = 0.0f;
    for (int i = 0; i < 128; ++i) amax = std::max(amax, std::fabs(key[size_t(t * 128 + i)]));
    double scale = std::ldexp(1.0, -127);
    while (scale < double(std::max(amax, 1e-4f)) / 448.0) scale *= 2;
    const float s = float(scale);
    ref_code_tile(&key[size_t(t * 128)], s, input, &out.bytes[size_t(t * 128)], &out.gathered[size_t(t * 128)]);
    std::memcpy(&out.bytes[size_t(W + 4 * t)], &s, 4);
  }
  return out;
}

// Where byte j of key `slot`'s bytes (ref_index_key's order) lies in its page of P keys of W values.
inline int64_t ref_index_key_byte(int64_t P, int64_t W, int64_t slot, int64_t j) {
  return j < W ? slot * W + j : P * W + slot * (W / 32) + (j - W);
}

}  // namespace kvtest
