// The CPU's vector row encoder of 8-bit codes (backends/cpu/code_rows.hpp: int8, fp8 e4m3 and e5m2) at
// each level this CPU runs, against the independent reference quantizer (quant_reference.hpp) of
// value / scale: every bf16 and every fp16 input, fp32's specials and neighbours of int8's rounding ties
// and of fp8's largest and smallest values, over scales of every magnitude, in rows whose lengths leave
// a tail past the last whole vector; and its way back (every code times those scales, against the
// reference's decode times the scale).
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <vector>

#include "exec_cpu_levels.hpp"
#include "kvforge/cpu_level.hpp"
#include "quant_reference.hpp"

namespace kvtest {
namespace {

using Encoder = void (*)(DType, DType, void*, const void*, float, int);

constexpr DType kCodes[] = {DType::i8, DType::f8e4m3, DType::f8e5m2};

using Decoder = void (*)(DType, float*, const void*, float, int);

struct Level {
  int level;
  Encoder encode;
  Decoder decode;
};

// Every value of a 16-bit type, as its raw words, and the same values in fp32.
std::vector<uint16_t> every_word() {
  std::vector<uint16_t> w(65536);
  for (uint32_t b = 0; b < 65536; ++b) w[b] = uint16_t(b);
  return w;
}

std::vector<float> scales_of_every_magnitude() {
  std::vector<float> s{1.0f, 0.5f, 3.0f, 1.0f / 127.0f, 1e-3f, 0x1p-80f, 0x1p-126f, 1e-40f, 0x1p125f, 3.0e38f, 0.0371f};
  std::mt19937 rng(5);
  for (int i = 0; i < 24; ++i) {
    const float amax = std::ldexp(std::uniform_real_distribution<float>(0.5f, 1.0f)(rng),
                                  std::uniform_int_distribution<int>(-100, 100)(rng));
    s.push_back(amax / 127.0f);
    s.push_back(to_float(bf16{uint16_t((float_bits(amax / 127.0f) >> 16) + 1)}));  // a bf16 scale rounded up
  }
  return s;
}

void expect_reference(const Level& l, DType code, DType in, const void* src, const std::vector<float>& x, float scale) {
  const int n = int(x.size());
  std::vector<uint8_t> got(n + 1, 0x55);
  l.encode(code, in, got.data(), src, scale, n);
  for (int i = 0; i < n; ++i) {
    const uint8_t want = ref_encode(code, x[i] / scale);
    ASSERT_EQ(got[i], want) << "v" << l.level << " " << dtype_name(code) << " from " << dtype_name(in) << ": value "
                            << x[i] << " / " << scale << " at " << i << " of " << n;
  }
  ASSERT_EQ(got[n], 0x55) << "v" << l.level << ": wrote past the row's " << n << " values";
}

class CodeRows : public ::testing::TestWithParam<Level> {
 protected:
  void SetUp() override {
    if (cpu_level_supported() < GetParam().level)
      GTEST_SKIP() << "this CPU does not run x86-64-v" << GetParam().level << " (it runs up to v" << cpu_level_supported()
                   << "), so that level's vector loop cannot run here";
  }
};

TEST_P(CodeRows, EveryBf16AndFp16InputMatchesTheReferenceQuantizer) {
  const std::vector<uint16_t> words = every_word();
  for (DType in : {DType::bf16, DType::f16}) {
    std::vector<float> x(words.size());
    for (size_t i = 0; i < words.size(); ++i)
      x[i] = in == DType::bf16 ? to_float(bf16{words[i]}) : to_float(fp16{words[i]});
    // Every scale for int8; for fp8, whose reference searches the format's table for each value, the
    // fixed ones and the first few random ones: every magnitude still, in a third of the 13 s all took.
    const std::vector<float> scales = scales_of_every_magnitude();
    for (DType code : kCodes)
      for (size_t k = 0; k < (code == DType::i8 ? scales.size() : 15); ++k)
        expect_reference(GetParam(), code, in, words.data(), x, scales[k]);
  }
}

TEST_P(CodeRows, Fp32SpecialsTiesAndTailsMatchTheReferenceQuantizer) {
  std::vector<float> x{0.0f, -0.0f, INFINITY, -INFINITY, NAN, -NAN, 1e-45f, 3.0e38f, -3.0e38f, 127.0f, -127.0f,
                       127.5f, -127.5f, 128.0f, -128.0f, 0.5f, 1.5f, 2.5f, -0.5f, -2.5f};
  for (int k = -128; k <= 128; ++k)
    for (float h : {-0.5f, 0.5f}) {
      const float tie = float(k) + h;
      x.push_back(tie);
      x.push_back(std::nextafter(tie, INFINITY));
      x.push_back(std::nextafter(tie, -INFINITY));
    }
  // fp8's saturation and subnormal edges: e4m3's 448 and 2^-9, e5m2's 57344 and 2^-16, a hair either side.
  for (float edge : {448.0f, 464.0f, 480.0f, 57344.0f, 61440.0f, 0x1p-9f, 0x1p-10f, 0x1p-6f, 0x1p-16f, 0x1p-17f, 0x1p-14f})
    for (float v : {edge, std::nextafter(edge, 0.0f), std::nextafter(edge, INFINITY)}) {
      x.push_back(v);
      x.push_back(-v);
    }
  std::mt19937 rng(9);
  for (int i = 0; i < 4000; ++i) x.push_back(std::normal_distribution<float>(0.0f, 40.0f)(rng));
  for (float s : {1.0f, 0.5f, 3.0f, 1e-3f, 1e30f, 1e-30f})
    for (int n : {0, 1, 7, 15, 16, 17, 31, 33, 63, 128, int(x.size())}) {
      const std::vector<float> row(x.begin(), x.begin() + n);
      for (DType code : kCodes) expect_reference(GetParam(), code, DType::f32, row.data(), row, s);
    }
}

// Every code, in rows that put each code at every place of a vector (a row of 256 codes shifted by 1 to
// 17) and past the last whole vector, with and without NaN codes among them: the value is the
// reference's decode times the scale, rounded once in fp32 (as Codec's), NaN for NaN.
TEST_P(CodeRows, EveryCodeDecodesToTheReferenceValueTimesTheScale) {
  std::vector<float> scales = scales_of_every_magnitude();
  for (float s : {-2.0f, 0x1p119f, 0x1p120f, 3.4e38f, INFINITY, NAN, 0.0f, -0.0f}) scales.push_back(s);
  for (DType code : kCodes) {
    std::vector<uint8_t> codes;
    for (int rep = 0; rep < 3; ++rep)
      for (int c = 0; c < 256; ++c) codes.push_back(uint8_t(c * 7 + rep));  // 7 is odd: every byte, in a new order
    std::vector<uint8_t> finite;  // the codes without the format's NaNs: rows that keep to the vector loop
    for (uint8_t c : codes)
      if (!std::isnan(ref_decode(code, c))) finite.push_back(c);
    for (const std::vector<uint8_t>* row : {&codes, &finite})
      for (float scale : scales)
        for (int first = 0; first <= 17; first += 17)
          for (int n : {0, 1, 15, 16, 17, 33, int(row->size()) - first}) {
            std::vector<float> got(n + 1, 1234.5f);
            GetParam().decode(code, got.data(), row->data() + first, scale, n);
            for (int i = 0; i < n; ++i) {
              const uint8_t c = (*row)[first + i];
              const float want = ref_decode(code, c) * scale;
              ASSERT_TRUE(same_float(got[i], want))
                  << "v" << GetParam().level << " " << dtype_name(code) << " code " << int(c) << " times " << scale
                  << ": got " << got[i] << ", want " << want << " (at " << i << " of " << n << ")";
            }
            ASSERT_EQ(got[n], 1234.5f) << "v" << GetParam().level << ": wrote past the row's " << n << " values";
          }
  }
}

INSTANTIATE_TEST_SUITE_P(Levels, CodeRows,
                         ::testing::Values(Level{3, encode_code_row_v3, decode_code_row_v3},
                                           Level{4, encode_code_row_v4, decode_code_row_v4}),
                         [](const auto& info) { return "v" + std::to_string(info.param.level); });

}  // namespace
}  // namespace kvtest
