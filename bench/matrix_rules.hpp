// What both matrix benches (kvforge_bench on the CPU, kvforge_cuda_bench on a GPU) count alike: the
// bytes an operation moves, and the input values they feed it. bench/report.py prints the rule.
#pragma once

#include <cstdint>
#include <cstring>
#include <random>
#include <string_view>

#include "kvforge/kvforge.hpp"

namespace kvforge_bench {

inline int64_t layer_token_bytes(const kvforge::VariantDescriptor& d) { return d.bytes_per_token / d.layers; }
inline int64_t input_token_bytes(const kvforge::VariantDescriptor& d) {
  return int64_t(2) * d.heads * d.head_dim * kvforge::dtype_size(d.input);
}

// Layers one append step writes: a lazy variant stages every layer and commits once, as an engine
// drives it; an eager one is measured one layer at a time.
inline int layers_per_append(const kvforge::VariantDescriptor& d) {
  return d.update == kvforge::UpdateMode::lazy ? d.layers : 1;
}

// Everything read plus everything written, at the types stored. An append (`append_decode`,
// `append_prefill`) of n tokens: the K and V input, each token's 8-byte target, and the codes and
// scales written, for every layer its step writes. A gather of n positions: the codes and scales
// read and the K and V output written.
inline int64_t bytes_moved(const kvforge::VariantDescriptor& d, std::string_view op, int64_t n) {
  if (op == "gather") return n * (layer_token_bytes(d) + input_token_bytes(d));
  return n * (input_token_bytes(d) + 8 + layer_token_bytes(d)) * layers_per_append(d);
}

// Small random values, finite in every 16-bit input dtype: bf16 or fp16 bit patterns of |x| < 2.
inline void fill_small_values(unsigned char* out, size_t bytes, std::mt19937& rng) {
  for (size_t i = 0; i + 1 < bytes; i += 2) {
    const uint16_t bits = uint16_t(0x3000 + rng() % 0x0c00) | (rng() & 1 ? 0x8000 : 0);
    std::memcpy(out + i, &bits, 2);
  }
}

}  // namespace kvforge_bench
