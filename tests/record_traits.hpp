// The two record formats the default specs define (flashmla_paged.yaml's flashmla_fp8, vllm_indexer.yaml's
// indexer_fp8) placed for any widths, as traits for detail::PartRecord: the tests that run its codec
// outside a cache use these. Each placement is written here from the format's own definition (FlashMLA's
// README, vLLM's indexer_k_quant_and_cache), and the bytes it codes are held to flashmla_reference.hpp and
// indexer_reference.hpp; the registry tests hold the generated placement to the same references.
#pragma once

#include "kvforge/detail/part_record.hpp"

namespace kvtest {

using kvforge::DType;
using kvforge::RecordPart;
using kvforge::ScaleRounding;

// A latent of L values (e4m3, an fp32 power-of-two scale a tile of 128, in the record) and R RoPE values in bf16.
template <int L, int R> struct FlashMlaTraits {
  static constexpr int record_values = L + R, record_bytes = L + L / 32 + 2 * R, record_tail_bytes = 0;
  static constexpr RecordPart record_parts[] = {
      {"latent", 0, L, DType::f8e4m3, 0, 128, DType::f32, L, false, ScaleRounding::pow2_up, 0.0f, true},
      {"rope", L, R, DType::bf16, L + L / 32}};
};

// A key of W values: e4m3 codes in the record, an fp32 power-of-two scale a tile of 128 (amax at least
// 1e-4) after the page's records, a NaN its own code's.
template <int W> struct IndexKeyTraits {
  static constexpr int record_values = W, record_bytes = W, record_tail_bytes = W / 32;
  static constexpr RecordPart record_parts[] = {
      {"key", 0, W, DType::f8e4m3, 0, 128, DType::f32, 0, true, ScaleRounding::pow2_up, 1e-4f, false}};
};

}  // namespace kvtest
