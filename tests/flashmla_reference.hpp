// FlashMLA's fp8 MLA record, encoded here from its README's description ("FP8 KV cache"), for a latent of
// L values (a multiple of 128) and R RoPE values: L e4m3 codes; one fp32 scale per 128 of them, the
// smallest power of two >= amax / 448; then the R RoPE values as bf16, rounded to nearest even. 656 bytes
// for DeepSeek-V3 (L 512, R 64). Written with quant_reference.hpp's code values and frexp rounding, not
// kvforge's codecs; finite inputs.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "quant_reference.hpp"

namespace kvtest {

struct RefRecord {
  std::vector<uint8_t> bytes;   // the record
  std::vector<float> gathered;  // [L + R]: what it reads back as, in `input`'s precision
};

// The record's bytes by the format's arithmetic, independent of kvforge's own size formula.
inline int ref_record_bytes(int L, int R) { return L + 4 * (L / 128) + 2 * R; }

// e4m3's code for v: the nearest of its finite values, ties to the even code, saturating at 448. The
// values of codes 0..0x7e rise with the code, so a binary search over them finds the two candidates (the
// registry tests encode every value of every record this way, and a linear search took seconds).
inline uint8_t ref_e4m3_nearest(float v) {
  static const std::vector<float> grid = [] {
    std::vector<float> g;
    for (int c = 0; c < 0x7f; ++c) g.push_back(ref_decode(DType::f8e4m3, uint8_t(c)));
    return g;
  }();
  const uint8_t sign = std::signbit(v) ? 0x80 : 0;
  const float a = std::fabs(v);
  if (a >= grid.back()) return uint8_t(sign | 0x7e);
  const size_t hi = size_t(std::lower_bound(grid.begin(), grid.end(), a) - grid.begin());
  if (hi == 0) return sign;
  const float below = a - grid[hi - 1], above = grid[hi] - a;
  const size_t c = below < above ? hi - 1 : above < below ? hi : (hi % 2 == 0 ? hi : hi - 1);
  return uint8_t(sign | c);
}

// A tile of 128 values over scale s: its e4m3 codes, and what they read back as in `input`'s precision.
inline void ref_code_tile(const float* x, float s, DType input, uint8_t* codes, float* gathered) {
  for (int i = 0; i < 128; ++i) {
    codes[i] = ref_e4m3_nearest(x[i] / s);
    gathered[i] = round_to(input, ref_decode(DType::f8e4m3, codes[i]) * s);
  }
}

inline RefRecord ref_flashmla_record(const std::vector<float>& latent, int L, int R, DType input) {
  RefRecord out;
  out.bytes.assign(size_t(ref_record_bytes(L, R)), 0);
  out.gathered.resize(size_t(L + R));
  for (int t = 0; t < L / 128; ++t) {
    float amax = 0.0f;
    for (int i = 0; i < 128; ++i) amax = std::max(amax, std::fabs(latent[size_t(t * 128 + i)]));
    double scale = 1.0;  // an all-zero tile keeps scale 1
    if (amax > 0) {
      scale = std::ldexp(1.0, -127);
      while (scale < double(amax) / 448.0) scale *= 2;
    }
    const float s = float(scale);
    ref_code_tile(&latent[size_t(t * 128)], s, input, &out.bytes[size_t(t * 128)], &out.gathered[size_t(t * 128)]);
    std::memcpy(&out.bytes[size_t(L + 4 * t)], &s, 4);
  }
  for (int i = 0; i < R; ++i) {
    const float b = round_to(DType::bf16, latent[size_t(L + i)]);
    uint32_t u;
    std::memcpy(&u, &b, 4);
    const uint16_t bits = uint16_t(u >> 16);
    std::memcpy(&out.bytes[size_t(L + L / 32 + 2 * i)], &bits, 2);
    out.gathered[size_t(L + i)] = round_to(input, b);
  }
  return out;
}

}  // namespace kvtest
