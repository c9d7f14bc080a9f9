// The cache's 4-bit codes (fp4_e2m1 and int4, two a byte) against the independent reference over every
// byte and the rounding edges, and ue8m0 scales against the reference's rounding up to a power of two.
#include <random>

#include "kvforge/detail/ops.hpp"
#include "quant_reference.hpp"

namespace kvtest {
namespace {

template <class Code> void check_packed_codec(DType t) {
  for (int c = 0; c < 256; ++c) {
    const Code code{uint8_t(c)};
    // Value 0 in the low nibble, value 1 in the high one.
    ASSERT_TRUE(same_float(detail::Codec<Code>::decode(code, 0), ref_decode(t, uint8_t(c & 0xf)))) << c;
    ASSERT_TRUE(same_float(detail::Codec<Code>::decode(code, 1), ref_decode(t, uint8_t(c >> 4)))) << c;
  }
  // Every value of the grid, the midpoints between neighbours (ties), a hair either side of them, the
  // non-finite values, and every bf16 value.
  std::vector<float> probes{0.0f, INFINITY, NAN, 1e-30f, 1e30f, 3.0e38f};
  for (float edge : rounding_edges(t)) probes.push_back(edge);
  for (uint32_t bits = 0; bits < 65536; bits += 3) probes.push_back(to_float(bf16{uint16_t(bits)}));
  std::mt19937 rng(5);
  for (float p : probes)
    for (float x : {p, -p}) {
      const float other = probes[rng() % probes.size()];
      ASSERT_EQ(detail::Codec<Code>::encode(x, other).bits, uint8_t(ref_encode(t, x) | (ref_encode(t, other) << 4)))
          << dtype_name(t) << " encoding " << x << " beside " << other;
    }
}

TEST(PackedCodec, Fp4E2M1MatchesReferenceOnEveryByteAndEdge) { check_packed_codec<fp4_e2m1x2>(DType::f4e2m1); }
TEST(PackedCodec, Int4MatchesReferenceOnEveryByteAndEdge) { check_packed_codec<int4x2>(DType::i4); }

TEST(PackedCodec, RulesWrittenOut) {
  // Written out, so that a reference and kvforge agreeing on a wrong rule still fails.
  using Fp4 = detail::Codec<fp4_e2m1x2>;
  using Int4 = detail::Codec<int4x2>;
  EXPECT_EQ(Fp4::encode(1.0f, 6.0f).bits, 0x72);      // 1.0 is code 2 (low), 6.0 code 7 (high)
  EXPECT_EQ(Fp4::encode(2.5f, 1.25f).bits, 0x24);     // ties to even: 2.5 -> 2 (code 4), 1.25 -> 1 (code 2)
  EXPECT_EQ(Fp4::encode(-1e9f, -INFINITY).bits, 0xff);  // saturate to -6
  EXPECT_EQ(Fp4::encode(NAN, 0.2f).bits, 0x00);       // NaN has no code: 0; 0.2 rounds to 0
  EXPECT_EQ(Fp4::qmax, 6.0f);
  EXPECT_EQ(Int4::encode(2.5f, -2.5f).bits, 0xe2);    // 2 and -2 (0xe)
  EXPECT_EQ(Int4::encode(7.6f, -100.0f).bits, 0x97);  // saturate to 7 and -7 (0x9): the grid stays symmetric
  EXPECT_EQ(Int4::encode(NAN, 3.5f).bits, 0x40);
  EXPECT_EQ(Int4::decode(int4x2{0x9f}, 0), -1.0f);
  EXPECT_EQ(Int4::decode(int4x2{0x9f}, 1), -7.0f);
}

TEST(PackedCodec, Ue8m0ScalesRoundUpToAPowerOfTwo) {
  for (float amax : {0.0f, 1e-45f, 1e-38f, 0.3f, 1.0f, 6.0f, 31.75f, 448.0f, 1000.0f, 3.0e38f}) {
    EXPECT_EQ(to_float(detail::dynamic_scale<fp8_e4m3, ue8m0>(detail::magnitude_bits(amax))),
              ref_scale(DType::ue8m0, amax, 448.0f))
        << amax;
    EXPECT_EQ(to_float(detail::dynamic_scale<fp4_e2m1x2, ue8m0>(detail::magnitude_bits(amax))),
              ref_scale(DType::ue8m0, amax, 6.0f))
        << amax;
  }
  // Written out: 6 / 6 is exactly 1 (2^0, byte 127); 6.01 / 6 rounds up to 2; an all-zero group gets 1.
  auto stored = [](float amax) { return detail::dynamic_scale<fp4_e2m1x2, ue8m0>(detail::magnitude_bits(amax)).bits; };
  EXPECT_EQ(stored(6.0f), 127);
  EXPECT_EQ(stored(6.01f), 128);
  EXPECT_EQ(stored(0.0f), 127);
  EXPECT_TRUE(std::isnan(to_float(ue8m0{0xff})));
}

}  // namespace
}  // namespace kvtest
