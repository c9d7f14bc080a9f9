// FlashMLA's fp8 MLA record, 656 bytes a token (its README, "FP8 KV cache"; DeepSeek-V3.2's sparse
// kernels read it):
//   [0, 512)    the 512 latent values as e4m3 codes
//   [512, 528)  4 fp32 scales, one per 128 latent values: the smallest power of two >= amax / 448
//               (an MXFP8 scale, stored as fp32), so division is exact and nothing saturates
//   [528, 656)  the 64 RoPE values as bf16, not quantized
// The rules are block_quant.hpp's. tests/test_block_quant.cpp holds both directions to an encoder
// written from the format's description.
#pragma once

#include <cstdint>
#include <cstring>

#include "kvforge/detail/block_quant.hpp"

namespace kvforge::detail {

inline constexpr int kFlashMlaLatent = 512, kFlashMlaRope = 64, kFlashMlaTile = 128;
inline constexpr int kFlashMlaRecordBytes = kFlashMlaLatent + 4 * (kFlashMlaLatent / kFlashMlaTile) + 2 * kFlashMlaRope;

// latent: [576] (512 latent values, then 64 RoPE) -> record: [656] bytes.
template <class In> KVF_HD KVF_INLINE void encode_flashmla_record(const In* latent, uint8_t* record) {
  for (int t = 0; t < kFlashMlaLatent / kFlashMlaTile; ++t) {
    const uint8_t e = quantize_mxfp8<kFlashMlaTile>(latent + t * kFlashMlaTile, record + t * kFlashMlaTile);
    const float scale = UE8M0::decode(e);
    std::memcpy(record + kFlashMlaLatent + 4 * t, &scale, 4);
  }
  for (int i = 0; i < kFlashMlaRope; ++i) {
    const uint16_t b = from_float<bf16>(to_float(latent[kFlashMlaLatent + i])).bits;
    std::memcpy(record + kFlashMlaLatent + 16 + 2 * i, &b, 2);
  }
}

// record: [656] bytes -> latent: [576], value = code * scale in fp32, rounded to Out.
template <class Out> KVF_HD KVF_INLINE void decode_flashmla_record(const uint8_t* record, Out* latent) {
  for (int t = 0; t < kFlashMlaLatent / kFlashMlaTile; ++t) {
    float scale;
    std::memcpy(&scale, record + kFlashMlaLatent + 4 * t, 4);
    for (int i = 0; i < kFlashMlaTile; ++i)
      latent[t * kFlashMlaTile + i] = from_float<Out>(E4M3::decode(record[t * kFlashMlaTile + i]) * scale);
  }
  for (int i = 0; i < kFlashMlaRope; ++i) {
    bf16 b;
    std::memcpy(&b.bits, record + kFlashMlaLatent + 16 + 2 * i, 2);
    latent[kFlashMlaLatent + i] = from_float<Out>(to_float(b));
  }
}

}  // namespace kvforge::detail
