// fp16 and bf16 conversions against properties checked with an independent decoder (support.hpp):
// exact decode of every half and bfloat16, round trips, and round-to-nearest-even on random floats.
#include <cmath>
#include <random>

#include "support.hpp"

namespace kvtest {
namespace {

float decode16(DType t, uint16_t bits) { return load_as(t, &bits); }

TEST(Dtype, EveryFp16DecodesExactlyAndRoundTrips) {
  for (uint32_t b = 0; b < 65536; ++b) {
    const float want = decode16(DType::f16, uint16_t(b));
    const float got = to_float(fp16{uint16_t(b)});
    if (std::isnan(want)) {
      ASSERT_TRUE(std::isnan(got)) << b;
      ASSERT_TRUE(std::isnan(to_float(fp16_from_float(got))));
      continue;
    }
    ASSERT_EQ(got, want) << "bits " << b;
    ASSERT_EQ(fp16_from_float(got).bits, uint16_t(b)) << "bits " << b;
  }
}

TEST(Dtype, EveryBf16RoundTrips) {
  for (uint32_t b = 0; b < 65536; ++b) {
    const float f = to_float(bf16{uint16_t(b)});
    if (std::isnan(f)) {
      ASSERT_TRUE(std::isnan(to_float(bf16_from_float(f))));
      continue;
    }
    ASSERT_EQ(f, decode16(DType::bf16, uint16_t(b)));
    ASSERT_EQ(bf16_from_float(f).bits, uint16_t(b));
  }
}

// The chosen code is a nearest one, and on a tie its last bit is even.
template <class T> void check_nearest_even(DType t, T (*encode)(float), float lo, float hi) {
  std::mt19937 rng(3);
  std::uniform_real_distribution<float> mag(lo, hi);
  for (int i = 0; i < 200000; ++i) {
    const float f = (rng() & 1 ? -1.0f : 1.0f) * std::exp2(mag(rng));
    const uint16_t code = encode(f).bits;
    const double got = decode16(t, code);
    if (std::isinf(got)) continue;
    for (int step : {-1, 1}) {
      const uint16_t other = uint16_t(code + step);
      const double alt = decode16(t, other);
      if (std::isnan(alt) || ((other ^ code) & 0x8000)) continue;
      const double e_got = std::fabs(double(f) - got), e_alt = std::fabs(double(f) - alt);
      ASSERT_LE(e_got, e_alt) << f;
      if (e_got == e_alt) {
        ASSERT_EQ(code & 1, 0) << "tie must round to even: " << f;
      }
    }
  }
}

TEST(Dtype, Fp16RoundsToNearestEven) { check_nearest_even<fp16>(DType::f16, fp16_from_float, -26.0f, 15.9f); }
TEST(Dtype, Bf16RoundsToNearestEven) { check_nearest_even<bf16>(DType::bf16, bf16_from_float, -130.0f, 127.0f); }

TEST(Dtype, Fp16OverflowAndSpecials) {
  EXPECT_EQ(fp16_from_float(65504.0f).bits, 0x7bff);
  EXPECT_EQ(fp16_from_float(65520.0f).bits, 0x7c00);  // halfway to the next binade rounds up to inf
  EXPECT_EQ(fp16_from_float(-INFINITY).bits, 0xfc00);
  EXPECT_TRUE(std::isnan(to_float(fp16_from_float(NAN))));
  EXPECT_EQ(fp16_from_float(std::ldexp(1.0f, -25)).bits, 0);       // exactly half the smallest subnormal: even
  EXPECT_EQ(fp16_from_float(std::ldexp(1.5f, -25)).bits, 1);
}

}  // namespace
}  // namespace kvtest
