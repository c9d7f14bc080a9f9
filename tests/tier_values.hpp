// What the tier tests write and read back: K/V values that are a function of (token id, position, layer,
// head, dim) alone, so a block promoted into any page must read back the same. Shared by test_tiers.cpp
// (CPU) and test_tiers_cuda.cpp.
#pragma once

#include <gtest/gtest.h>

#include <cstdint>
#include <vector>

#include "kvforge/kvforge.hpp"

namespace kvtest {

// K (kv 0) or V (kv 1) of a token; exact in fp32.
inline float tier_value(int32_t token, int64_t pos, int layer, int head, int dim, int kv) {
  return float((token * 131 + pos * 7 + layer * 3 + head * 5 + dim + kv * 1000) % 4093) * 0.25f;
}

// A prompt of `blocks` full pages and one token more (the last token is always computed).
inline std::vector<int32_t> tier_prompt(int seed, int blocks, int P) {
  std::vector<int32_t> t;
  for (int i = 0; i < blocks * P + 1; ++i) t.push_back(seed * 1000 + i);
  return t;
}

// Layer `layer`'s K and V, [T, heads, head_dim], of positions [cached, cached + T) of `prompt`.
inline void tier_inputs(const kvforge::VariantDescriptor& d, const std::vector<int32_t>& prompt, int64_t cached, int64_t T,
                        int layer, std::vector<float>& k, std::vector<float>& v) {
  k.resize(size_t(T * d.heads * d.head_dim));
  v.resize(k.size());
  for (int64_t t = 0; t < T; ++t)
    for (int h = 0; h < d.heads; ++h)
      for (int x = 0; x < d.head_dim; ++x) {
        const int64_t pos = cached + t, at = (t * d.heads + h) * d.head_dim + x;
        k[size_t(at)] = tier_value(prompt[size_t(pos)], pos, layer, h, x, 0);
        v[size_t(at)] = tier_value(prompt[size_t(pos)], pos, layer, h, x, 1);
      }
}

// A gather of layer `layer`, [heads, n, head_dim] each, against the values written for `prompt`.
inline void expect_tier_layer(const kvforge::VariantDescriptor& d, const std::vector<int32_t>& prompt, int layer,
                              const std::vector<float>& k, const std::vector<float>& v) {
  const int64_t n = int64_t(prompt.size());
  for (int h = 0; h < d.heads; ++h)
    for (int64_t p = 0; p < n; ++p)
      for (int x = 0; x < d.head_dim; ++x) {
        const size_t at = size_t((h * n + p) * d.head_dim + x);
        ASSERT_EQ(k[at], tier_value(prompt[size_t(p)], p, layer, h, x, 0)) << d.name << " layer " << layer << " position " << p;
        ASSERT_EQ(v[at], tier_value(prompt[size_t(p)], p, layer, h, x, 1)) << d.name << " layer " << layer << " position " << p;
      }
}

}  // namespace kvtest
