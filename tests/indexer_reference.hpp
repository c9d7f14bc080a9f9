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

// Keys of two tiles whose amaxes sit on and beside the scale's edges: an all-zero key and one below the
// 1e-4 floor, amaxes exactly at and just past a power of two times 448, and tiles of different scales.
inline std::vector<std::vector<float>> ref_index_edge_keys() {
  std::vector<std::vector<float>> keys;
  auto key = [&](float amax0, float amax1) {
    std::vector<float> k(256);
    for (int i = 0; i < 256; ++i) {
      const float amax = i < 128 ? amax0 : amax1;
      k[size_t(i)] = amax * float((i * 37) % 101 - 50) / 50.0f;  // reaches -amax at i % 101 == 0 ... and +amax
    }
    keys.push_back(k);
  };
  key(0.0f, 0.0f);                                 // all zero: the floor's scale, codes 0
  key(1e-6f, 3e-5f);                               // below the floor
  key(448.0f, 448.0f * 1024.0f);                   // amax / 448 a power of two exactly
  key(std::nextafter(448.0f, 1e9f), 1.0f / 64);   // just past one: the next power of two
  key(1e-4f, 2.5f);                                // at the floor
  key(-7.0f, 65504.0f);                            // a negative-led tile, an fp16-sized one
  return keys;
}

}  // namespace kvtest
