// FlashMLA's fp8 MLA record (its README, "FP8 KV cache"; DeepSeek-V3.2's sparse kernels read it), for a
// latent of L values (kv_lora_rank, a multiple of 128) and R RoPE values; 656 bytes for DeepSeek-V3's
// L = 512, R = 64:
//   [0, L)              the latent values as e4m3 codes
//   [L, L + L / 32)     an fp32 scale per 128 latent values: the smallest power of two >= amax / 448
//                       (an MXFP8 scale, stored as fp32), so division is exact and nothing saturates
//   [L + L / 32, end)   the R RoPE values as bf16, not quantized
// The rules are block_quant.hpp's. kvforge keeps an MLA record as K then V of one head of D = (L + R) / 2
// values, so a token's latent comes as two halves (value i < D from K, the rest from V) and its record
// goes out as two halves of bytes (K's row and V's row of the pool, each kBytes / 2). The cache's write
// and gather call encode and decode per token (write_ops.hpp, gather_ops.hpp); tests/test_block_quant.cpp
// holds every form to an encoder written from the format's description (tests/flashmla_reference.hpp).
#pragma once

#include <cstdint>
#include <cstring>

#include "kvforge/detail/block_quant.hpp"

namespace kvforge::detail {

template <int L, int R> struct FlashMlaRecord {
  static_assert(L > 0 && L % kFlashMlaTile == 0, "FlashMLA scales the latent in tiles of 128");
  static_assert((L + R) % 2 == 0, "kvforge holds the record as K and V halves of one width");
  static constexpr int kTiles = L / kFlashMlaTile;
  static constexpr int kBytes = flashmla_record_bytes(L, R);
  static constexpr int kHalf = kBytes / 2;  // bytes of each of the two rows that hold a record
  static constexpr int D = (L + R) / 2;     // values of each half of a latent
  static constexpr int kScalesAt = flashmla_scales_at(L), kRopeAt = flashmla_rope_at(L);

  // Value i of the latent whose halves are `first` [D] and `second` [D].
  template <class In> KVF_HD static KVF_INLINE float value(const In* first, const In* second, int i) {
    return to_float(i < D ? first[i] : second[i - D]);
  }
  // Byte j of the record whose halves are `lo` [kHalf] and `hi` [kHalf].
  KVF_HD static KVF_INLINE uint8_t& byte(uint8_t* lo, uint8_t* hi, int j) { return j < kHalf ? lo[j] : hi[j - kHalf]; }
  KVF_HD static KVF_INLINE uint8_t byte(const uint8_t* lo, const uint8_t* hi, int j) {
    return j < kHalf ? lo[j] : hi[j - kHalf];
  }
  KVF_HD static KVF_INLINE void put(uint8_t* lo, uint8_t* hi, int at, const void* from, int n) {
    for (int j = 0; j < n; ++j) byte(lo, hi, at + j) = static_cast<const uint8_t*>(from)[j];
  }

  // latent halves [D] + [D] -> record halves [kHalf] + [kHalf]. Lane `lane` of `lanes` takes tiles
  // lane, lane + lanes, ... and the RoPE values likewise; each lane's bytes are its own.
  template <class In>
  KVF_HD static KVF_INLINE void encode(const In* first, const In* second, uint8_t* lo, uint8_t* hi, int lane, int lanes) {
    for (int t = lane; t < kTiles; t += lanes) {
      float x[kFlashMlaTile];
      uint8_t codes[kFlashMlaTile];
      for (int i = 0; i < kFlashMlaTile; ++i) x[i] = value(first, second, t * kFlashMlaTile + i);
      const float scale = UE8M0::decode(quantize_mxfp8<kFlashMlaTile>(x, codes));
      put(lo, hi, t * kFlashMlaTile, codes, kFlashMlaTile);
      put(lo, hi, kScalesAt + 4 * t, &scale, 4);
    }
    for (int i = lane; i < R; i += lanes) {
      const uint16_t b = from_float<bf16>(value(first, second, L + i)).bits;
      put(lo, hi, kRopeAt + 2 * i, &b, 2);
    }
  }

  // encode on one lane (the CPU), through a copy of the latent and of the record on the stack: its loops
  // then run over contiguous values and vectorize, where the byte-by-byte form branches on every byte.
  template <class In>
  KVF_HD static KVF_INLINE void encode_whole(const In* first, const In* second, uint8_t* lo, uint8_t* hi) {
    float x[L + R];
    for (int i = 0; i < D; ++i) x[i] = to_float(first[i]);
    for (int i = 0; i < D; ++i) x[D + i] = to_float(second[i]);
    uint8_t record[kBytes];
    for (int t = 0; t < kTiles; ++t) {
      const float scale = UE8M0::decode(quantize_mxfp8<kFlashMlaTile>(x + t * kFlashMlaTile, record + t * kFlashMlaTile));
      std::memcpy(record + kScalesAt + 4 * t, &scale, 4);
    }
    uint16_t rope[R > 0 ? R : 1];
    for (int i = 0; i < R; ++i) rope[i] = from_float<bf16>(x[L + i]).bits;
    std::memcpy(record + kRopeAt, rope, 2 * R);
    std::memcpy(lo, record, kHalf);
    std::memcpy(hi, record + kHalf, kHalf);
  }

  // record halves -> latent halves, value = code * scale in fp32, rounded to Out; lanes as encode's.
  template <class Out>
  KVF_HD static KVF_INLINE void decode(const uint8_t* lo, const uint8_t* hi, Out* first, Out* second, int lane, int lanes) {
    for (int i = lane; i < L + R; i += lanes) {
      float v;
      if (i < L) {
        uint8_t s[4];
        for (int j = 0; j < 4; ++j) s[j] = byte(lo, hi, kScalesAt + 4 * (i / kFlashMlaTile) + j);
        float scale;
        std::memcpy(&scale, s, 4);
        v = E4M3::decode(byte(lo, hi, i)) * scale;
      } else {
        bf16 b;
        b.bits = uint16_t(byte(lo, hi, kRopeAt + 2 * (i - L)) | (byte(lo, hi, kRopeAt + 2 * (i - L) + 1) << 8));
        v = to_float(b);
      }
      (i < D ? first[i] : second[i - D]) = from_float<Out>(v);
    }
  }

  // decode on one lane, through copies on the stack as encode_whole's.
  template <class Out>
  KVF_HD static KVF_INLINE void decode_whole(const uint8_t* lo, const uint8_t* hi, Out* first, Out* second) {
    uint8_t record[kBytes];
    std::memcpy(record, lo, kHalf);
    std::memcpy(record + kHalf, hi, kHalf);
    Out x[L + R];
    for (int t = 0; t < kTiles; ++t) {
      float scale;
      std::memcpy(&scale, record + kScalesAt + 4 * t, 4);
      for (int i = 0; i < kFlashMlaTile; ++i)
        x[t * kFlashMlaTile + i] = from_float<Out>(E4M3::decode(record[t * kFlashMlaTile + i]) * scale);
    }
    uint16_t rope[R > 0 ? R : 1];
    std::memcpy(rope, record + kRopeAt, 2 * R);
    for (int i = 0; i < R; ++i) x[L + i] = from_float<Out>(to_float(bf16{rope[i]}));
    std::memcpy(first, x, sizeof(Out) * D);
    std::memcpy(second, x + D, sizeof(Out) * D);
  }
};

inline constexpr int kFlashMlaLatent = 512, kFlashMlaRope = 64;
inline constexpr int kFlashMlaRecordBytes = flashmla_record_bytes(kFlashMlaLatent, kFlashMlaRope);
using DeepSeekV3Record = FlashMlaRecord<kFlashMlaLatent, kFlashMlaRope>;

// latent: [576] (512 latent values, then 64 RoPE) -> record: [656] bytes.
template <class In> KVF_HD KVF_INLINE void encode_flashmla_record(const In* latent, uint8_t* record) {
  DeepSeekV3Record::encode(latent, latent + DeepSeekV3Record::D, record, record + DeepSeekV3Record::kHalf, 0, 1);
}

// record: [656] bytes -> latent: [576].
template <class Out> KVF_HD KVF_INLINE void decode_flashmla_record(const uint8_t* record, Out* latent) {
  DeepSeekV3Record::decode(record, record + DeepSeekV3Record::kHalf, latent, latent + DeepSeekV3Record::D, 0, 1);
}

}  // namespace kvforge::detail
