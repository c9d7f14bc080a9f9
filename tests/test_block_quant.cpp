// Block-scaled codecs (block_quant.hpp) and FlashMLA's 656-byte record (part_record.hpp's codec over its format; its reference
// encoder is flashmla_reference.hpp's), each against a reference written from the format's definition:
// value tables, nearest-value searches with ties to the even code, powers of two found by doubling. Every e2m1 code and every bf16 input, every ue8m0
// code, every e4m3 scale, and groups at the scale edges (zeros, subnormals, 2^127, inf, NaN).
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "emulated_lanes.hpp"
#include "flashmla_reference.hpp"
#include "record_traits.hpp"

namespace kvforge::detail {
namespace {

// OCP MX v1.0, table of FP4 (E2M1) values: codes 0..7 are these magnitudes, bit 3 the sign.
constexpr float kE2M1[8] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f};

// The nearest magnitude in `table`, ties to the even index; past the last, the last (saturation).
int nearest(const float* table, int n, float a) {
  if (a >= table[n - 1]) return n - 1;
  int best = 0;
  for (int i = 1; i < n; ++i) {
    const double d = std::fabs(double(a) - table[i]), bd = std::fabs(double(a) - table[best]);
    if (d < bd || (d == bd && i % 2 == 0)) best = i;
  }
  return best;
}

uint8_t ref_e2m1(float x) { return uint8_t((std::signbit(x) ? 8 : 0) | nearest(kE2M1, 8, std::fabs(x))); }

// Every finite e4m3 magnitude, from the OCP definition: bias 7, 3 mantissa bits, subnormals at exponent 0;
// code 0x7f is NaN.
std::vector<float> e4m3_table() {
  std::vector<float> t;
  for (int c = 0; c < 0x7f; ++c) {
    const int e = c >> 3, m = c & 7;
    t.push_back(e == 0 ? std::ldexp(float(m), -9) : std::ldexp(1.0f + float(m) / 8.0f, e - 7));
  }
  return t;
}
uint8_t ref_e4m3(float x) {
  static const std::vector<float> t = e4m3_table();
  return uint8_t((std::signbit(x) ? 0x80 : 0) | nearest(t.data(), int(t.size()), std::fabs(x)));
}

// The smallest power of two >= s as a ue8m0 exponent, within [2^-127, 2^127].
int ref_ue8m0_up(float s) {
  int e = 0;
  while (e < 254 && std::ldexp(1.0, e - 127) < double(s)) ++e;
  return e;
}

float bf16_value(uint16_t b) { return bits_float(uint32_t(b) << 16); }

TEST(E2M1, EveryCodeDecodesToTheTableAndBack) {
  for (int c = 0; c < 16; ++c) {
    const float want = (c & 8 ? -1.0f : 1.0f) * kE2M1[c & 7];
    EXPECT_EQ(E2M1::decode(uint8_t(c)), want) << c;
    EXPECT_EQ(std::signbit(E2M1::decode(uint8_t(c))), bool(c & 8)) << c;
    EXPECT_EQ(E2M1::encode(want), c) << c;
  }
}

TEST(E2M1, EveryBf16InputRoundsToTheNearestCodeTiesToEvenAndSaturates) {
  for (uint32_t b = 0; b < 0x10000; ++b) {
    const float x = bf16_value(uint16_t(b));
    if (std::isnan(x)) continue;  // no code: the group's scale carries NaN (MxGroups below)
    ASSERT_EQ(E2M1::encode(x), ref_e2m1(x)) << x;
  }
  for (float tie : {0.25f, 0.75f, 1.25f, 1.75f, 2.5f, 3.5f, 5.0f})  // every midpoint, both neighbours' sides
    EXPECT_EQ(E2M1::encode(tie), ref_e2m1(tie)) << tie;
}

TEST(UE8M0, EveryCodeAndEveryScaleEdge) {
  for (int e = 0; e < 255; ++e) EXPECT_EQ(double(UE8M0::decode(uint8_t(e))), std::ldexp(1.0, e - 127)) << e;
  EXPECT_TRUE(std::isnan(UE8M0::decode(255)));
  std::vector<float> scales = {std::numeric_limits<float>::denorm_min(), 0x1p-127f, 0x1.000002p-127f, 0x1p-126f,
                               0x1.000002p-126f, 1.0f, 1.0000001f, 0x1p127f, 0x1.000002p127f,
                               std::numeric_limits<float>::max()};
  for (uint32_t b = 1; b < 0x7f80; ++b) scales.push_back(bf16_value(uint16_t(b)));  // every positive finite bf16
  for (float s : scales) {
    ASSERT_EQ(int(UE8M0::encode_up(s)), ref_ue8m0_up(s)) << s;
    if (ref_ue8m0_up(s) < 254) {
      ASSERT_GE(UE8M0::decode(UE8M0::encode_up(s)), s);  // rounded up: nothing saturates
    }
  }
}

TEST(E4m3Scale, RoundsUpToTheNextValueForEveryInput) {
  const std::vector<float> t = e4m3_table();
  // The first code whose value is >= s, searched in the table; 448's where none is.
  auto next_up = [&t](float s) {
    for (int c = 1; c < 0x7f; ++c)
      if (t[size_t(c)] >= s) return c;
    return 0x7e;
  };
  for (uint32_t b = 1; b < 0x7f80; ++b) {
    const float s = bf16_value(uint16_t(b));
    ASSERT_EQ(int(e4m3_scale_up(s)), next_up(s)) << s;
  }
  // fp32 scales whose low mantissa bits (which no bf16 has) alone lift them past a code.
  std::mt19937 rng(5);
  for (int i = 0; i < 200000; ++i) {
    const float s = std::ldexp(std::uniform_real_distribution<float>(1.0f, 2.0f)(rng), int(rng() % 30) - 20);
    const int want = next_up(s);
    ASSERT_EQ(int(e4m3_scale_up(s)), want) << s;
    ASSERT_EQ(int(e4m3_scale_up(std::nextafter(t[size_t(want)], 0.0f))), want) << t[size_t(want)];
  }
}

// Groups at the edges of the scales, and random ones.
std::vector<std::vector<float>> groups(int n) {
  std::mt19937 rng(11);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  const float inf = std::numeric_limits<float>::infinity();
  std::vector<std::vector<float>> out;
  for (float magnitude : {0.0f, 1e-40f, 1e-30f, 1.0f, 3.0f, 1e30f, 3e38f}) {
    std::vector<float> g(static_cast<size_t>(n));
    for (auto& v : g) v = normal(rng) * magnitude;
    out.push_back(g);
  }
  const size_t size = static_cast<size_t>(n);
  std::vector<float> with_inf(size, 0.5f), with_nan(size, -2.0f), ties(size);
  with_inf[3] = -inf;
  with_nan[5] = std::nanf("");
  for (int i = 0; i < n; ++i) ties[size_t(i)] = (i % 7 - 3) * 0.75f;  // midpoints at scale 1 (amax 2.25)
  out.push_back(with_inf), out.push_back(with_nan), out.push_back(ties);
  return out;
}

float finite_amax(const std::vector<float>& g) {
  float m = 0.0f;
  for (float v : g)
    if (std::isfinite(v)) m = std::max(m, std::fabs(v));
  return m;
}
bool has_nan(const std::vector<float>& g) {
  for (float v : g)
    if (std::isnan(v)) return true;
  return false;
}

TEST(MxGroups, Mxfp4AndMxfp8MatchTheDefinitionCodeForCodeAndPackLowNibbleFirst) {
  for (const auto& g : groups(32)) {
    uint8_t packed[16] = {}, codes[32];
    const uint8_t e4 = quantize_mxfp4<32>(g.data(), packed), e8 = quantize_mxfp8<32>(g.data(), codes);
    const float amax = finite_amax(g);
    const int want4 = has_nan(g) ? 255 : amax > 0 ? ref_ue8m0_up(amax / 6.0f) : 127;
    const int want8 = has_nan(g) ? 255 : amax > 0 ? ref_ue8m0_up(amax / 448.0f) : 127;
    ASSERT_EQ(int(e4), want4) << amax;
    ASSERT_EQ(int(e8), want8) << amax;
    if (has_nan(g)) {
      float back[32];
      dequantize_mxfp4<32>(packed, e4, back);
      for (float v : back) EXPECT_TRUE(std::isnan(v));  // MX: a NaN scale makes the whole block NaN
      continue;
    }
    const float s4 = float(std::ldexp(1.0, want4 - 127)), s8 = float(std::ldexp(1.0, want8 - 127));
    float back4[32], back8[32];
    dequantize_mxfp4<32>(packed, e4, back4);
    dequantize_mxfp8<32>(codes, e8, back8);
    for (int i = 0; i < 32; ++i) {
      const uint8_t c4 = ref_e2m1(g[size_t(i)] / s4);
      ASSERT_EQ((packed[i / 2] >> (4 * (i % 2))) & 0xf, c4) << i;  // element 2k low, 2k + 1 high
      ASSERT_EQ(codes[i], ref_e4m3(g[size_t(i)] / s8)) << i;
      ASSERT_EQ(back4[i], (c4 & 8 ? -1.0f : 1.0f) * kE2M1[c4 & 7] * s4);
      if (std::isfinite(g[size_t(i)])) {
        // The stated bound: half the widest gap between neighbouring codes, times the scale. A scale
        // past FLT_MAX / 6 (a group's amax above about 2^127) takes the top codes past fp32: inf.
        if (6.0 * s4 <= std::numeric_limits<float>::max()) {
          ASSERT_LE(std::fabs(back4[i] - g[size_t(i)]), 1.0f * s4) << g[size_t(i)];
        } else {
          ASSERT_TRUE(std::fabs(back4[i] - g[size_t(i)]) <= 1.0f * s4 || std::isinf(back4[i])) << g[size_t(i)];
        }
        if (448.0 * s8 <= std::numeric_limits<float>::max()) {
          ASSERT_LE(std::fabs(back8[i] - g[size_t(i)]), 16.0f * s8) << g[size_t(i)];
        }
      }
    }
  }
}

TEST(Nvfp4, BlockScalesRoundUpOverTheTensorScaleAndCodesMatch) {
  const std::vector<float> t = e4m3_table();
  for (float tensor_scale : {1.0f, 1.0f / 2688.0f, 0.37f}) {
    for (const auto& g : groups(16)) {
      uint8_t packed[8] = {};
      const uint8_t s = quantize_nvfp4(g.data(), tensor_scale, packed);
      if (has_nan(g)) {
        EXPECT_EQ(s, 0x7f);
        continue;
      }
      const float amax = finite_amax(g);
      int want = 0x38;  // 1.0 for an all-zero block
      if (amax > 0) {
        want = 0x7e;
        for (int c = 1; c < 0x7f; ++c)
          if (t[size_t(c)] >= amax / 6.0f / tensor_scale) {
            want = c;
            break;
          }
      }
      ASSERT_EQ(int(s), want) << amax << " over " << tensor_scale;
      const float scale = t[size_t(want)] * tensor_scale;
      float back[16];
      dequantize_nvfp4(packed, s, tensor_scale, back);
      for (int i = 0; i < 16; ++i) {
        const uint8_t c = ref_e2m1(g[size_t(i)] / scale);
        ASSERT_EQ((packed[i / 2] >> (4 * (i % 2))) & 0xf, c) << i;
        ASSERT_EQ(back[i], (c & 8 ? -1.0f : 1.0f) * kE2M1[c & 7] * scale);
      }
    }
  }
}

TEST(Int4, SymmetricAndAsymmetricCodesMatchTheDefinition) {
  for (const auto& g : groups(32)) {
    uint8_t packed[16] = {};
    const float scale = quantize_int4<32, float>(g.data(), packed);
    const float amax = finite_amax(g);
    ASSERT_EQ(scale, amax > 0 ? amax / 7.0f : 1.0f);
    float back[32];
    dequantize_int4<32>(packed, scale, back);
    for (int i = 0; i < 32; ++i) {
      const float x = g[size_t(i)];
      const int want = std::isnan(x) ? 0 : int(std::max(-7.0f, std::min(7.0f, std::nearbyint(x / scale))));
      const int got = (packed[i / 2] >> (4 * (i % 2))) & 0xf;
      ASSERT_EQ(got >= 8 ? got - 16 : got, want) << x;
      ASSERT_EQ(back[i], float(want) * scale);
    }
    // A range past FLT_MAX has a finite scale, but (code - zero) * scale can round past FLT_MAX, to inf.
    if (amax > 1e37f) continue;
    uint8_t zero = 0;
    const float a_scale = quantize_int4_asymmetric<32>(g.data(), packed, zero);
    float lo = 0, hi = 0;
    for (float v : g)
      if (std::isfinite(v)) lo = std::min(lo, v), hi = std::max(hi, v);
    ASSERT_EQ(a_scale, hi > lo ? hi / 15.0f - lo / 15.0f : 1.0f);  // in two quotients: no overflow past FLT_MAX
    ASSERT_EQ(int(zero), int(std::max(0.0f, std::min(15.0f, std::nearbyint(-lo / a_scale)))));
    dequantize_int4_asymmetric<32>(packed, a_scale, zero, back);
    for (int i = 0; i < 32; ++i) {
      const float x = g[size_t(i)];
      const float q = std::isnan(x) ? float(zero) : std::max(0.0f, std::min(15.0f, std::nearbyint(x / a_scale) + zero));
      ASSERT_EQ((packed[i / 2] >> (4 * (i % 2))) & 0xf, int(q)) << x;
      if (std::isfinite(x)) {
        ASSERT_LE(std::fabs(back[i] - x), 0.5f * a_scale * 1.0001f) << x;
      }
    }
  }
}

TEST(FlashMlaRecord, ByteExactAgainstTheDescribedFormatAndBackWithinItsBound) {
  using Record = PartRecord<kvtest::FlashMlaTraits<512, 64>>;  // DeepSeek-V3's
  static_assert(Record::kBytes == 656, "FlashMLA's record is 656 bytes");
  std::mt19937 rng(5);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (float spread : {1.0f, 1e-3f, 300.0f, 0.0f}) {
    std::vector<float> latent(576);
    for (int i = 0; i < 576; ++i) latent[size_t(i)] = normal(rng) * spread * (i < 128 ? 1e-4f : 1.0f);
    uint8_t record[656];
    ASSERT_TRUE(kvtest::EmulatedLanes::run(32, [&](int lane) {  // as the CUDA write codes it: a warp
      Record::encode<kvtest::EmulatedCudaExec, 32>(latent.data(), latent.data() + Record::D, record, record + Record::kSplit,
                                                   nullptr, lane);
    }));
    const std::vector<uint8_t> want = kvtest::ref_flashmla_record(latent, 512, 64, DType::f32).bytes;
    ASSERT_EQ(0, std::memcmp(record, want.data(), 656)) << "spread " << spread;
    float back[576];
    Record::decode(record, record + Record::kSplit, nullptr, back, back + Record::D, 0, 1);
    for (int i = 0; i < 576; ++i) {
      float scale = 1.0f;
      if (i < 512) std::memcpy(&scale, record + 512 + 4 * (i / 128), 4);
      // e4m3 keeps 3 mantissa bits: half an ulp is 1/16 of the value, and the scale's subnormal step.
      const float bound = i < 512 ? std::max(std::fabs(latent[size_t(i)]) / 16.0f, std::ldexp(scale, -10))
                                  : std::fabs(latent[size_t(i)]) / 256.0f;
      ASSERT_LE(std::fabs(back[i] - latent[size_t(i)]), bound) << i;
    }
  }
}

// The forms the cache's kernels code a record in: CUDA's, a warp's lanes in runs of 16 a tile (its amax
// one reduction over the run), each lane its RoPE values and bytes, on emulated lanes here; and the
// CPU's, whole on one lane. Both give the reference's
// bytes and read them back as the one-lane form does, for a tile that crosses from K's half into V's.
TEST(FlashMlaRecord, LaneSplitAndWholeFormsGiveTheSameBytesAndValues) {
  using Record = PartRecord<kvtest::FlashMlaTraits<256, 32>>;  // tiny_mla_tiles: halves of 144 values, 164 bytes
  std::mt19937 rng(9);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> latent(288);
  for (int i = 0; i < 288; ++i) latent[size_t(i)] = normal(rng) * (i < 128 ? 1e-3f : 20.0f);
  const std::vector<uint8_t> want = kvtest::ref_flashmla_record(latent, 256, 32, DType::f32).bytes;
  const float* k = latent.data();
  const float* v = latent.data() + Record::D;
  std::vector<uint8_t> split(size_t(Record::kBytes), 0xee), whole(size_t(Record::kBytes), 0xee);
  static_assert(Record::group_lanes<0, 32>() == 16, "two tiles of 128 over a warp: 16 lanes a tile");
  ASSERT_TRUE(kvtest::EmulatedLanes::run(32, [&](int lane) {
    Record::encode<kvtest::EmulatedCudaExec, 32>(k, v, split.data(), split.data() + Record::kSplit, nullptr, lane);
  }));
  Record::encode_whole(k, v, whole.data(), whole.data() + Record::kSplit, nullptr);
  ASSERT_EQ(split, want);
  ASSERT_EQ(whole, want);
  std::vector<float> one(288), lanes(288, -1.0f), at_once(288, -1.0f);
  Record::decode(want.data(), want.data() + Record::kSplit, nullptr, one.data(), one.data() + Record::D, 0, 1);
  for (int lane = 0; lane < 32; ++lane)
    Record::decode(want.data(), want.data() + Record::kSplit, nullptr, lanes.data(), lanes.data() + Record::D, lane, 32);
  Record::decode_whole(want.data(), want.data() + Record::kSplit, nullptr, at_once.data(), at_once.data() + Record::D);
  EXPECT_EQ(lanes, one);
  EXPECT_EQ(at_once, one);
}

}  // namespace
}  // namespace kvforge::detail
