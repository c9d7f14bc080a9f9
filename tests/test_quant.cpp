// Quantized storage: the codecs against the independent reference quantizer over every code and the
// rounding edges, then every quantized variant on crafted tokens (all zeros, one outlier, the
// saturation limit, non-finite values) and on random tokens against the documented accuracy bound.
#include <random>

#include "kvforge/detail/ops.hpp"
#include "quant_reference.hpp"

namespace kvtest {
namespace {

template <class Code> void check_codec(DType t) {
  for (int c = 0; c < 256; ++c) {
    Code code;
    const uint8_t byte = uint8_t(c);
    std::memcpy(&code, &byte, 1);
    ASSERT_TRUE(same_float(detail::Codec<Code>::decode(code), ref_decode(t, byte)))
        << dtype_name(t) << " code " << c << ": " << detail::Codec<Code>::decode(code) << " vs " << ref_decode(t, byte);
  }
  // Every representable value, the midpoints between neighbours (ties), a hair either side of them,
  // and random floats across the whole exponent range, both signs.
  std::vector<float> probes{0.0f, -0.0f, INFINITY, -INFINITY, NAN, 1e-30f, 1e30f, 3.0e38f};
  for (float edge : rounding_edges(t)) probes.push_back(edge);
  std::mt19937 rng(7);
  for (int i = 0; i < 20000; ++i)
    probes.push_back(std::ldexp(std::uniform_real_distribution<float>(0.5f, 1.0f)(rng),
                                std::uniform_int_distribution<int>(-30, 20)(rng)));
  // Every bf16 and every fp16 value, as a quantizer meets them divided by a scale of 1.
  for (uint32_t bits = 0; bits < 65536; ++bits) {
    probes.push_back(to_float(bf16{uint16_t(bits)}));
    probes.push_back(to_float(fp16{uint16_t(bits)}));
  }
  for (float p : probes)
    for (float x : {p, -p}) {
      ASSERT_EQ(code_byte(detail::Codec<Code>::encode(x)), ref_encode(t, x)) << dtype_name(t) << " encoding " << x;
    }
}

TEST(Codec, Fp8E4M3MatchesReferenceOnEveryCodeAndEdge) { check_codec<fp8_e4m3>(DType::f8e4m3); }
TEST(Codec, Fp8E5M2MatchesReferenceOnEveryCodeAndEdge) { check_codec<fp8_e5m2>(DType::f8e5m2); }
TEST(Codec, Int8MatchesReferenceOnEveryCodeAndEdge) { check_codec<int8_t>(DType::i8); }

TEST(Codec, RoundsHalfToEvenAndSaturates) {
  // Written out, so that a reference and kvforge agreeing on a wrong rule still fails.
  EXPECT_EQ(detail::Codec<int8_t>::encode(2.5f), 2);
  EXPECT_EQ(detail::Codec<int8_t>::encode(3.5f), 4);
  EXPECT_EQ(detail::Codec<int8_t>::encode(-2.5f), -2);
  EXPECT_EQ(detail::Codec<int8_t>::encode(126.9f), 127);
  EXPECT_EQ(detail::Codec<int8_t>::encode(1000.0f), 127);
  EXPECT_EQ(detail::Codec<int8_t>::encode(-INFINITY), -127);
  EXPECT_EQ(detail::Codec<int8_t>::encode(NAN), 0);
  EXPECT_EQ(detail::Codec<fp8_e4m3>::encode(448.0f).bits, 0x7e);
  EXPECT_EQ(detail::Codec<fp8_e4m3>::encode(1e9f).bits, 0x7e);
  EXPECT_EQ(detail::Codec<fp8_e4m3>::encode(-INFINITY).bits, 0xfe);
  EXPECT_EQ(detail::Codec<fp8_e4m3>::encode(1.0625f).bits, 0x38);  // tie between 1 and 1.125 -> even (1)
  EXPECT_EQ(detail::Codec<fp8_e5m2>::encode(INFINITY).bits, 0x7b);  // saturates to 57344, not inf
  EXPECT_EQ(detail::Codec<fp8_e5m2>::encode(1.125f).bits, 0x3c);    // tie between 1 and 1.25 -> even (1)
}

TEST(Codec, DynamicScaleIsAmaxOverQmaxRoundedUpAndNeverZero) {
  for (float amax : {0.0f, 1e-45f, 0.3f, 1.0f, 31.75f, 1000.0f, 3.0e38f}) {
    EXPECT_EQ(to_float(detail::dynamic_scale<int8_t, float>(detail::magnitude_bits(amax))), ref_scale(DType::f32, amax, 127.0f))
        << amax;
    EXPECT_EQ(to_float(detail::dynamic_scale<int8_t, bf16>(detail::magnitude_bits(amax))), ref_scale(DType::bf16, amax, 127.0f))
        << amax;
    EXPECT_EQ(to_float(detail::dynamic_scale<fp8_e4m3, bf16>(detail::magnitude_bits(amax))),
              ref_scale(DType::bf16, amax, 448.0f))
        << amax;
  }
  EXPECT_EQ(to_float(detail::dynamic_scale<int8_t, float>(0)), 1.0f);
  // A bf16 scale never rounds below amax / qmax, so the largest value never saturates.
  const float s = to_float(detail::dynamic_scale<int8_t, bf16>(detail::magnitude_bits(0.3f)));
  EXPECT_GE(s, 0.3f / 127.0f);
  EXPECT_LE(std::fabs(0.3f / s), 127.0f);
}

// The quantizers divide by a scale through its reciprocal and one fused correction (ScaleDivisor).
// Over every bf16 and every fp16 value, against dynamic scales of random groups (fp32 and bf16-rounded)
// and scales at the ends of the range where the divisor falls back to division, it must give IEEE
// division's quotient bit for bit wherever that could make a nonzero code (|x / s| >= 2^-20), and
// below that a value of the same sign that is as small: the same code in every format.
TEST(Codec, ScaleDivisorGivesTheIeeeQuotient) {
  std::vector<float> scales{1.0f, 0.5f, 3.0f, 1e-3f, 0x1p-80f, 0x1.fffffep-81f, 0x1p-60f, 1e-20f, 0x1p125f,
                            0x1.000002p125f, 1e-40f, 3.0e38f, 1.0f / 127.0f, 1.0f / 448.0f, 1.0f / 57344.0f};
  std::mt19937 rng(11);
  for (int i = 0; i < 200; ++i) {
    const float amax = std::ldexp(std::uniform_real_distribution<float>(0.5f, 1.0f)(rng),
                                  std::uniform_int_distribution<int>(-120, 120)(rng));
    const uint32_t bits = detail::magnitude_bits(amax);
    scales.push_back(to_float(detail::dynamic_scale<int8_t, float>(bits)));
    scales.push_back(to_float(detail::dynamic_scale<int8_t, bf16>(bits)));
    scales.push_back(to_float(detail::dynamic_scale<fp8_e4m3, bf16>(bits)));
    scales.push_back(to_float(detail::dynamic_scale<fp8_e5m2, float>(bits)));
  }
  int fused = 0;
  for (float s : scales) {
    const detail::ScaleDivisor divisor(s);
    fused += divisor.fused;
    for (uint32_t bits = 0; bits < 65536; ++bits)
      for (float x : {to_float(bf16{uint16_t(bits)}), to_float(fp16{uint16_t(bits)})}) {
        const float want = x / s;
        // divide() as this build's cores take it, and the fused path itself wherever it applies.
        for (float got : {divisor.divide(x), divisor.fused ? divisor.fused_quotient(x) : want}) {
          if (!(std::fabs(want) < 0x1p-20f)) {
            ASSERT_TRUE(same_float(got, want)) << x << " / " << s << ": " << got << " vs " << want;
          } else {
            ASSERT_TRUE(std::fabs(got) < 0x1p-19f && std::signbit(got) == std::signbit(want))
                << x << " / " << s << ": " << got << " vs " << want;
          }
          ASSERT_EQ(code_byte(detail::Codec<int8_t>::encode(got)), code_byte(detail::Codec<int8_t>::encode(want)));
          ASSERT_EQ(detail::Codec<fp8_e4m3>::encode(got).bits, detail::Codec<fp8_e4m3>::encode(want).bits);
          ASSERT_EQ(detail::Codec<fp8_e5m2>::encode(got).bits, detail::Codec<fp8_e5m2>::encode(want).bits);
        }
      }
  }
  // Both paths ran: the ends of the range divide, the rest take the product.
  EXPECT_GT(fused, int(scales.size()) / 2);
  EXPECT_LT(fused, int(scales.size()));
  EXPECT_TRUE(detail::ScaleDivisor(0x1p-80f).fused);
  EXPECT_FALSE(detail::ScaleDivisor(0x1.fffffep-81f).fused);
  EXPECT_FALSE(detail::ScaleDivisor(3.0e38f).fused);
}

std::vector<Case> quantized_cases() {
  std::vector<Case> out;
  for (const Case& c : all_cases())
    if (c.entry->descriptor->quantized()) out.push_back(c);
  return out;
}

// Appends `tokens` ([T][kv][H*D] floats, rounded to the input dtype first) to layer `layer` of a small
// cache at positions 0..T-1 of sequence 0, gathers them back and returns [T][kv][H*D].
class QuantHarness {
 public:
  QuantHarness(const VariantEntry& e, Device device) : d_(*e.descriptor), arena_(device) {
    CacheConfig cfg;
    cfg.device = device;
    cfg.rows = 1;
    cfg.max_seq_len = d_.addressing == Addressing::contiguous ? 64 : 0;
    cfg.pages = d_.paged() ? (64 + d_.page_size - 1) / d_.page_size + 1 : 0;
    cfg.max_staged_tokens = 64;
    cache_ = e.create(cfg);
    // Pages in reverse, so page order and physical order differ.
    for (int64_t p = cfg.pages - 1; p > 0; --p) pages_.push_back(int32_t(p));
  }

  int64_t hd() const { return int64_t(d_.heads) * d_.head_dim; }
  float tensor_scale(int kv) const { return kv == 0 ? 0.03125f : 0.5f; }

  std::vector<std::vector<float>> round_trip(int layer, std::vector<std::vector<float>> tokens) {
    if (d_.takes_tensor_scale()) cache_->set_tensor_scale(layer, tensor_scale(0), tensor_scale(1));
    const int64_t T = int64_t(tokens.size()) / 2;
    const int es = dtype_size(d_.input);
    std::vector<unsigned char> k(size_t(T * hd() * es)), v(k.size());
    for (auto& t : tokens)
      for (float& x : t) x = round_to(d_.input, x);
    for (int64_t t = 0; t < T; ++t)
      for (int64_t i = 0; i < hd(); ++i) {
        write_input(tokens[size_t(2 * t)][size_t(i)], k.data() + (t * hd() + i) * es);
        write_input(tokens[size_t(2 * t + 1)][size_t(i)], v.data() + (t * hd() + i) * es);
      }
    std::vector<int32_t> rows(static_cast<size_t>(T), 0), positions(static_cast<size_t>(T));
    std::vector<int64_t> slots(static_cast<size_t>(T));
    for (int64_t t = 0; t < T; ++t) {
      positions[size_t(t)] = int32_t(t);
      if (d_.paged()) slots[size_t(t)] = int64_t(pages_[size_t(t / d_.page_size)]) * d_.page_size + t % d_.page_size;
    }
    const TokenTargets targets = d_.paged() ? TokenTargets::paged(arena_.index(slots))
                                            : TokenTargets::row_positions(arena_.index(rows), arena_.index(positions));
    cache_->append(layer, TensorView::contiguous(arena_.put(k), d_.input, arena_.device(), T, d_.heads, d_.head_dim),
                   TensorView::contiguous(arena_.put(v), d_.input, arena_.device(), T, d_.heads, d_.head_dim), targets);
    cache_->commit();
    GatherRange range;
    range.row = 0;
    range.begin = 0;
    range.end = T;
    if (d_.paged()) range.pages = arena_.index(pages_);
    const int64_t bytes = T * hd() * es;
    void* ko = arena_.zeros(bytes);
    void* vo = arena_.zeros(bytes);
    cache_->gather(layer, range, TensorView::contiguous(ko, d_.input, arena_.device(), d_.heads, T, d_.head_dim),
                   TensorView::contiguous(vo, d_.input, arena_.device(), d_.heads, T, d_.head_dim));
    cache_->synchronize();
    const auto kh = arena_.fetch(ko, bytes), vh = arena_.fetch(vo, bytes);
    std::vector<std::vector<float>> out(tokens.size(), std::vector<float>(size_t(hd())));
    for (int64_t t = 0; t < T; ++t)
      for (int h = 0; h < d_.heads; ++h)
        for (int x = 0; x < d_.head_dim; ++x) {
          const int64_t at = ((h * T + t) * d_.head_dim + x) * es;  // gather is [H, T, D]
          out[size_t(2 * t)][size_t(h * d_.head_dim + x)] = load_as(d_.input, kh.data() + at);
          out[size_t(2 * t + 1)][size_t(h * d_.head_dim + x)] = load_as(d_.input, vh.data() + at);
        }
    last_tokens_ = tokens;
    return out;
  }

  // The stored scale (or a zero-point layout's zero point) of (layer, position t, kv, head, group), read
  // through the raw view attention kernels use: a head's groups are adjacent, as the view documents.
  float stored_scale(int layer, int64_t t, int kv, int h, int group = 0) { return stored_entry(layer, t, kv, h, group, false); }
  float stored_zero(int layer, int64_t t, int kv, int h, int group = 0) { return stored_entry(layer, t, kv, h, group, true); }
  float stored_entry(int layer, int64_t t, int kv, int h, int group, bool zero) {
    const LayerView v = cache_->view(layer);
    EXPECT_EQ(v.scale_groups, ref_groups(d_));
    const int64_t unit = d_.paged() ? pages_[size_t(t / d_.page_size)] : 0;
    const int64_t slot = d_.paged() ? t % d_.page_size : t;
    const int64_t at =
        unit * v.scale_strides.row_or_page + slot * v.scale_strides.seq_or_slot + h * v.scale_strides.head + group;
    const int ss = dtype_size(v.scale_dtype);
    const auto bytes = arena_.fetch(static_cast<const unsigned char*>(kv ? v.v_scales : v.k_scales) + at * ss, ss);
    return zero ? load_zero(v.scale_dtype, bytes.data()) : load_scale(v.scale_dtype, bytes.data());
  }

  const VariantDescriptor& d_;
  Arena arena_;
  std::unique_ptr<Cache> cache_;
  std::vector<int32_t> pages_;
  std::vector<std::vector<float>> last_tokens_;

 private:
  void write_input(float x, unsigned char* dst) const {
    if (d_.input == DType::f32) {
      std::memcpy(dst, &x, 4);
    } else {
      // round_to already made x exact in the input dtype; its top bits are the encoding for bf16, and
      // fp16 goes through kvforge's converter (tested exhaustively in test_dtype.cpp).
      const uint16_t bits = d_.input == DType::bf16 ? uint16_t(float_bits(x) >> 16) : fp16_from_float(x).bits;
      std::memcpy(dst, &bits, 2);
    }
  }
};

class EveryQuantizedVariant : public testing::TestWithParam<Case> {};

TEST_P(EveryQuantizedVariant, EdgeCasesMatchTheReferenceQuantizer) {
  KVTEST_REQUIRE_DEVICE(GetParam().device);
  QuantHarness q(*GetParam().entry, GetParam().device);
  const VariantDescriptor& d = q.d_;
  const size_t n = size_t(q.hd());
  std::mt19937 rng(3);
  std::normal_distribution<float> small(0.0f, 0.01f);
  std::vector<std::vector<float>> tokens;
  // 0: all zeros.
  tokens.push_back(std::vector<float>(n, 0.0f));
  tokens.push_back(std::vector<float>(n, 0.0f));
  // 1: small values and one large outlier.
  for (int kv = 0; kv < 2; ++kv) {
    std::vector<float> t(n);
    for (float& x : t) x = small(rng);
    t[n / 3] = kv ? -1024.0f : 1024.0f;
    tokens.push_back(t);
  }
  // 2: at and beyond the saturation limit of a per-tensor scale (a dynamic scale fits them exactly).
  for (int kv = 0; kv < 2; ++kv) {
    const float limit = ref_qmax(d.storage) * q.tensor_scale(kv);
    std::vector<float> t(n);
    for (size_t i = 0; i < n; ++i) t[i] = (i % 4 == 0 ? limit : i % 4 == 1 ? -limit : i % 4 == 2 ? 2 * limit : -0.5f * limit);
    tokens.push_back(t);
  }
  // 3: non-finite values among finite ones.
  for (int kv = 0; kv < 2; ++kv) {
    std::vector<float> t(n);
    for (size_t i = 0; i < n; ++i) t[i] = float(int(i % 7) - 3);
    t[0] = NAN;
    t[1] = INFINITY;
    t[2] = -INFINITY;
    tokens.push_back(t);
  }
  const int layer = d.layers - 1;
  const auto got = q.round_trip(layer, tokens);
  for (size_t t = 0; t < tokens.size(); ++t) {
    const int kv = int(t % 2);
    const RefToken want = ref_quantize(d, q.last_tokens_[t], q.tensor_scale(kv));
    for (size_t i = 0; i < n; ++i)
      ASSERT_TRUE(same_float(got[t][i], want.gathered[i]))
          << d.name << " token " << t / 2 << " kv " << kv << " element " << i << " (input " << q.last_tokens_[t][i]
          << "): got " << got[t][i] << ", want " << want.gathered[i];
    const int groups = ref_groups(d);
    for (int h = 0; h < d.heads; ++h)
      for (int g = 0; g < groups; ++g) {
        EXPECT_EQ(q.stored_scale(layer, int64_t(t / 2), kv, h, g), want.scales[size_t(h * groups + g)])
            << d.name << " token " << t / 2 << " kv " << kv << " head " << h << " group " << g;
        if (is_zero_point_scale(d.scale)) {
          EXPECT_EQ(q.stored_zero(layer, int64_t(t / 2), kv, h, g), want.zeros[size_t(h * groups + g)])
              << d.name << " token " << t / 2 << " kv " << kv << " head " << h << " group " << g;
        }
      }
  }
  // The documented rules, spelled out for the cases that matter most.
  for (size_t i = 0; i < n; ++i) EXPECT_EQ(got[0][i], 0.0f) << "an all-zero token reads back as zeros";
  if (d.quant != Quant::per_tensor) {
    EXPECT_EQ(q.stored_scale(layer, 0, 0, 0), 1.0f) << "an all-zero token's scale is 1, not 0 or NaN";
    EXPECT_FALSE(std::isnan(got[6][3])) << "a finite value next to NaN and inf stays finite";
  }
  const bool no_nan_code = integer_code(d.storage) || d.storage == DType::f4e2m1;
  EXPECT_EQ(std::isnan(got[6][0]), !no_nan_code) << "NaN is stored as NaN in fp8 and as 0 in int8, int4, uint4 and fp4";
  if (no_nan_code) {
    EXPECT_EQ(got[6][0], 0.0f);
  }
  EXPECT_GT(got[6][1], 0.0f);
  EXPECT_TRUE(std::isfinite(got[6][1])) << "+inf saturates";
}

// Half the spacing of the code grid around y = |x| / scale, for a value that does not saturate.
float half_spacing(DType code, float y) {
  if (integer_code(code)) return 0.5f;
  // fp4 e2m1 spaces its grid as a float format of 1 mantissa bit and bias 1 does.
  const Fp8Spec f = code == DType::f4e2m1 ? Fp8Spec{2, 1, 1, false} : fp8_spec(code);
  int e;
  std::frexp(y, &e);  // y in [2^(e-1), 2^e)
  return std::ldexp(1.0f, std::max(e - 1, 1 - f.bias) - f.mant_bits - 1);
}

float half_ulp(DType t, float y) {
  if (t == DType::f32 || y == 0.0f) return 0.0f;
  int e;
  std::frexp(y, &e);
  return std::ldexp(1.0f, std::max(e, t == DType::bf16 ? -125 : -13) - (t == DType::bf16 ? 8 : 11) - 1);
}

TEST_P(EveryQuantizedVariant, GatheredValuesStayWithinTheDocumentedBound) {
  KVTEST_REQUIRE_DEVICE(GetParam().device);
  QuantHarness q(*GetParam().entry, GetParam().device);
  const VariantDescriptor& d = q.d_;
  const size_t n = size_t(q.hd());
  std::mt19937 rng(11);
  std::vector<std::vector<float>> tokens;
  const int count = d.addressing == Addressing::ring ? std::min(24, d.window) : 24;
  for (int t = 0; t < count; ++t)
    for (int kv = 0; kv < 2; ++kv) {
      // Magnitudes from 1e-3 to 1e2 per token, heavy-tailed within it; per-tensor scales are set so
      // that nothing saturates (the saturated case is in EdgeCases).
      const float magnitude = d.quant == Quant::per_tensor ? 0.25f * ref_qmax(d.storage) * q.tensor_scale(kv)
                                                           : std::pow(10.0f, float(t % 6) - 3.0f);
      std::student_t_distribution<float> dist(3.0f);
      std::vector<float> x(n);
      for (float& v : x) v = std::clamp(dist(rng), -4.0f, 4.0f) * magnitude / 4.0f;
      tokens.push_back(x);
    }
  const auto got = q.round_trip(0, tokens);
  double worst = 0;  // the largest error as a share of its bound
  for (size_t t = 0; t < tokens.size(); ++t) {
    const int kv = int(t % 2);
    for (int h = 0; h < d.heads; ++h) {
      for (int i = 0; i < d.head_dim; ++i) {
        const float s = q.stored_scale(0, int64_t(t / 2), kv, h, i / (d.head_dim / ref_groups(d)));
        const size_t at = size_t(h * d.head_dim + i);
        const float x = q.last_tokens_[t][at];
        // |x - code * s| <= s * half grid spacing; fp32 arithmetic adds a few ulps, and rounding the
        // result to the input dtype adds half an ulp of it.
        const float quant_bound = s * half_spacing(d.storage, std::fabs(x) / s);
        const float bound = quant_bound * (1 + 1e-5f) + half_ulp(d.input, std::fabs(x) + quant_bound) + 1e-30f;
        const float err = std::fabs(got[t][at] - x);
        ASSERT_LE(err, bound) << d.name << " token " << t / 2 << " kv " << kv << " head " << h << " dim " << i
                              << ": input " << x << ", got " << got[t][at] << ", scale " << s;
        worst = std::max(worst, double(err) / bound);
      }
    }
  }
  RecordProperty("worst_error_share_of_bound", std::to_string(worst));
}

INSTANTIATE_TEST_SUITE_P(Registry, EveryQuantizedVariant, testing::ValuesIn(quantized_cases()), case_name);

}  // namespace
}  // namespace kvtest
