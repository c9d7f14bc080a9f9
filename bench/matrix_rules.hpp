// What both matrix benches (kvforge_bench on the CPU, kvforge_cuda_bench on a GPU) count alike: the
// bytes an operation moves, and the input values they feed it. bench/report.py prints the rule.
#pragma once

#include <cstdint>
#include <cstring>
#include <map>
#include <random>
#include <string>
#include <string_view>
#include <tuple>
#include <vector>

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

// The variants the CUDA bench times: for every layout and (storage, input) pair of 16-bit input that
// stores bf16 or codes of another dtype (FlashMLA's records and index keys included), one variant at a real model's size: llama3-8b's
// where the pair has one (the CPU bench's model), else the widest head of a model that is not a test
// model (tiny*), else the widest of the test models'. Every storage family and record kind gets a row,
// and a new spec gets one with no edit.
inline std::vector<const kvforge::VariantEntry*> timed_variants(const kvforge::Registry& reg) {
  std::map<std::string, const kvforge::VariantEntry*> chosen;
  auto rank = [](const kvforge::VariantDescriptor& d) {
    const std::string model = d.model;
    const int kind = model == "llama3_8b" ? 2 : model.rfind("tiny", 0) == 0 ? 0 : 1;
    return std::make_tuple(kind, int64_t(d.heads) * d.record_width(), d.bytes_per_token);
  };
  for (const kvforge::VariantEntry& e : reg.variants()) {
    const kvforge::VariantDescriptor& d = *e.descriptor;
    if (d.is_hybrid() || kvforge::dtype_size(d.input) != 2 || !(d.storage == kvforge::DType::bf16 || d.storage != d.input))
      continue;
    const std::string key = std::string(d.layout) + "/" + std::string(d.storage_name()) + "/" +
                            std::string(kvforge::dtype_name(d.input));
    auto [at, fresh] = chosen.emplace(key, &e);
    if (!fresh && rank(d) > rank(*at->second->descriptor)) at->second = &e;
  }
  std::vector<const kvforge::VariantEntry*> out;
  for (const auto& [key, e] : chosen) out.push_back(e);
  return out;
}

// Small random values, finite in every 16-bit input dtype: bf16 or fp16 bit patterns of |x| < 2.
inline void fill_small_values(unsigned char* out, size_t bytes, std::mt19937& rng) {
  for (size_t i = 0; i + 1 < bytes; i += 2) {
    const uint16_t bits = uint16_t(0x3000 + rng() % 0x0c00) | (rng() & 1 ? 0x8000 : 0);
    std::memcpy(out + i, &bits, 2);
  }
}

}  // namespace kvforge_bench
