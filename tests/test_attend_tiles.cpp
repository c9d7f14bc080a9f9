// Attention's block products and exponentials in the CPU level's vectors (backends/cpu/attend_tiles.hpp,
// CpuExec's attend_scores, attend_exp_sum and attend_accumulate) at each level this CPU runs, against plain loops in double:
// every tile shape and tail the loops split into (rows past a multiple of 4, keys past a multiple of 2
// and 4, widths past a multiple of 16 and 32), strides wider than the rows, and nothing written outside
// the tile. A width that is not a whole number of 8-lane vectors returns false with nothing written.
//
// Tolerance: e^x is attend_exp's, within |x| 2^-24 (the rounding of x log2 e) plus 2 ulp of e^x, relative
// (4 allowed), and 0 where e^x is below fp32's smallest normal. An fp32 sum of n products, in any order, is within n * 2^-24 * sum |term| of the exact sum
// (Higham's gamma_n bound, to first order); the test allows (n + 2) * 2^-24 * sum |term|.
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <string>
#include <vector>

#include "exec_cpu_levels.hpp"
#include "kvforge/cpu_level.hpp"

namespace kvtest {
namespace {

using Scores = bool (*)(float*, int, const float*, int, const float*, int, int, int, int);
using Accumulate = bool (*)(float*, int, const float*, int, const float*, int, int, int, int);
using ExpSum = bool (*)(float*, int, float, float&);

struct Level {
  int level;
  Scores scores;
  Accumulate accumulate;
  ExpSum exp_sum;
};

constexpr float kSentinel = 1234.5f;

std::vector<float> random_values(size_t n, std::mt19937& rng) {
  std::uniform_real_distribution<float> d(-2.0f, 2.0f);
  std::vector<float> v(n);
  for (auto& x : v) x = d(rng);
  return v;
}

class AttendTiles : public ::testing::TestWithParam<Level> {
 protected:
  void SetUp() override {
    if (kvforge::cpu_level_supported() < GetParam().level)
      GTEST_SKIP() << "this CPU does not run x86-64-v" << GetParam().level << " (it runs up to v"
                   << kvforge::cpu_level_supported() << "), so that level's tiles cannot run here";
  }
};

TEST_P(AttendTiles, ScoresAreEveryRowsDotProductWithEveryKey) {
  std::mt19937 rng(7);
  for (int kw : {8, 16, 24, 64, 72, 128, 192, 256, 576})
    for (int rows : {1, 2, 3, 4, 5, 7, 8, 13, 64})
      for (int nb : {1, 2, 3, 4, 5, 31, 32}) {
        const int qs = kw + 3, ks = kw + 5, ss = nb + 2;  // strides wider than the rows, not vector multiples
        const auto q = random_values(size_t(rows) * qs, rng), keys = random_values(size_t(nb) * ks, rng);
        std::vector<float> got(size_t(rows) * ss, kSentinel);
        ASSERT_TRUE(GetParam().scores(got.data(), ss, q.data(), qs, keys.data(), ks, rows, nb, kw)) << "kw " << kw;
        for (int r = 0; r < rows; ++r)
          for (int j = 0; j < ss; ++j) {
            const std::string where = "v" + std::to_string(GetParam().level) + " kw " + std::to_string(kw) + " rows " +
                                      std::to_string(rows) + " nb " + std::to_string(nb) + " at (" + std::to_string(r) +
                                      ", " + std::to_string(j) + ")";
            if (j >= nb) {
              ASSERT_EQ(got[r * ss + j], kSentinel) << where << ": written past the block";
              continue;
            }
            double exact = 0.0, magnitude = 0.0;
            for (int e = 0; e < kw; ++e) {
              exact += double(q[r * qs + e]) * keys[j * ks + e];
              magnitude += std::fabs(double(q[r * qs + e]) * keys[j * ks + e]);
            }
            ASSERT_NEAR(got[r * ss + j], exact, (kw + 2) * 0x1p-24 * magnitude) << where;
          }
      }
}

TEST_P(AttendTiles, AccumulateAddsEveryRowsWeightedValues) {
  std::mt19937 rng(11);
  for (int vw : {8, 16, 24, 40, 64, 128, 192, 512})
    for (int rows : {1, 2, 3, 4, 5, 7, 8, 13, 64})
      for (int nb : {1, 2, 3, 31, 32}) {
        const int as = vw + 3, ws = nb + 1, vs = vw + 5;
        const auto w = random_values(size_t(rows) * ws, rng), values = random_values(size_t(nb) * vs, rng);
        auto acc = random_values(size_t(rows) * as, rng);
        for (int r = 0; r < rows; ++r)
          for (int e = vw; e < as; ++e) acc[r * as + e] = kSentinel;
        const auto before = acc;
        ASSERT_TRUE(GetParam().accumulate(acc.data(), as, w.data(), ws, values.data(), vs, rows, nb, vw)) << "vw " << vw;
        for (int r = 0; r < rows; ++r)
          for (int e = 0; e < as; ++e) {
            const std::string where = "v" + std::to_string(GetParam().level) + " vw " + std::to_string(vw) + " rows " +
                                      std::to_string(rows) + " nb " + std::to_string(nb) + " at (" + std::to_string(r) +
                                      ", " + std::to_string(e) + ")";
            if (e >= vw) {
              ASSERT_EQ(acc[r * as + e], kSentinel) << where << ": written past the row";
              continue;
            }
            double exact = before[r * as + e], magnitude = std::fabs(exact);
            for (int j = 0; j < nb; ++j) {
              exact += double(w[r * ws + j]) * values[j * vs + e];
              magnitude += std::fabs(double(w[r * ws + j]) * values[j * vs + e]);
            }
            ASSERT_NEAR(acc[r * as + e], exact, (nb + 3) * 0x1p-24 * magnitude) << where;
          }
      }
}

TEST_P(AttendTiles, ExponentialsAndTheirSumAreEToTheScoreLessTheMaximum) {
  std::mt19937 rng(17);
  std::uniform_real_distribution<float> below(0.0f, 100.0f);
  for (int n : {1, 2, 7, 8, 9, 15, 16, 17, 31, 32}) {
    for (float m : {0.0f, 3.5f, -20.0f, 1e4f}) {
      std::vector<float> s(n + 3, kSentinel);
      for (int j = 0; j < n; ++j) s[j] = j % 5 == 4 ? -INFINITY : j % 7 == 3 ? m : m - below(rng);
      const auto before = s;
      float sum = -1.0f;
      ASSERT_TRUE(GetParam().exp_sum(s.data(), n, m, sum));
      double exact_sum = 0.0, sum_tolerance = 0.0;
      for (int j = 0; j < n + 3; ++j) {
        const std::string where = "v" + std::to_string(GetParam().level) + " n " + std::to_string(n) + " m " +
                                  std::to_string(m) + " at " + std::to_string(j);
        if (j >= n) {
          ASSERT_EQ(s[j], kSentinel) << where << ": written past the row";
          continue;
        }
        const double x = double(before[j] - m);  // the difference in fp32, as the kernel takes it
        const double want = x < -87.0 ? 0.0 : std::exp(x);
        // Relative: the rounding of x log2(e) (|x| 2^-24) and the polynomial's 4 ulp; absolute: where e^x
        // is near fp32's smallest normal, 0 is allowed too.
        const double tolerance = (want > 0.0 ? (std::fabs(x) * 0x1p-24 + 4 * 0x1p-23) * want : 0.0) + 0x1p-125;
        ASSERT_NEAR(s[j], want, tolerance) << where << " x " << x;
        exact_sum += want;
        sum_tolerance += tolerance + n * 0x1p-24 * want;
      }
      EXPECT_NEAR(sum, exact_sum, sum_tolerance) << "n " << n << " m " << m;
    }
  }
  std::vector<float> s{0.0f, NAN, -1.0f};
  float sum = 0.0f;
  ASSERT_TRUE(GetParam().exp_sum(s.data(), 3, 0.0f, sum));
  EXPECT_TRUE(std::isnan(s[1])) << "a NaN score must stay NaN";
  EXPECT_TRUE(std::isnan(sum)) << "and make the sum NaN, as the reference's softmax would";
}

TEST_P(AttendTiles, WidthsOfPartVectorsAreLeftToThePortableLoops) {
  std::mt19937 rng(13);
  for (int width : {1, 7, 12, 100, 130}) {
    const auto q = random_values(size_t(4) * width, rng), keys = random_values(size_t(4) * width, rng);
    std::vector<float> scores(16, kSentinel), acc(size_t(4) * width, kSentinel);
    EXPECT_FALSE(GetParam().scores(scores.data(), 4, q.data(), width, keys.data(), width, 4, 4, width)) << width;
    EXPECT_FALSE(GetParam().accumulate(acc.data(), width, scores.data(), 4, keys.data(), width, 4, 4, width)) << width;
    for (float s : scores) EXPECT_EQ(s, kSentinel) << "width " << width << ": scores written";
    for (float x : acc) EXPECT_EQ(x, kSentinel) << "width " << width << ": outputs written";
  }
}

INSTANTIATE_TEST_SUITE_P(Levels, AttendTiles,
                         ::testing::Values(Level{3, attend_scores_v3, attend_accumulate_v3, attend_exp_sum_v3},
                                           Level{4, attend_scores_v4, attend_accumulate_v4, attend_exp_sum_v4}),
                         [](const auto& info) { return "v" + std::to_string(info.param.level); });

}  // namespace
}  // namespace kvtest
