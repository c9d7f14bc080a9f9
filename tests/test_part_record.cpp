// The codec of records of named parts (detail/part_record.hpp) over formats of every option a spec can
// give (code dtypes e4m3, e5m2, int8, and e2m1 and int4 two to a byte; scales fp32, bf16 and ue8m0; exact and power-of-two rounding; an
// amax floor; NaN by group or by value; scales in the record or after the page's records; float parts in
// bf16, fp16 and fp32), against tests/part_record_reference.hpp, which encodes from the rules in words:
//   - the one-lane form (the CPU's) and the lane-split form (CUDA's, on emulated lanes: a warp's 32, and
//     4 and 1, where a run of lanes shares a group, a lane takes a group, or takes them all) give the
//     reference's bytes, for records whose parts and groups cross from K's half into V's;
//   - both decodes read them back as the reference says, in fp32 and in bf16;
//   - groups at the scale edges: zeros, below the floor, amax exactly at a power of two times qmax and
//     just past it, subnormal and huge values.
// The registry tests hold the generated variants' pools to the same reference through every operation.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "emulated_lanes.hpp"
#include "part_record_reference.hpp"
#include "record_traits.hpp"

namespace kvtest {
namespace {

using kvforge::detail::PartRecord;

// A bf16 part, then K-side codes in int8 per 8 (exact fp32 scales, a NaN its own code), then e5m2 per 8
// under ue8m0 scales: 64 values, halves of 32, so the int8 part crosses from K's half into V's.
struct CodesTraits {
  static constexpr int record_values = 64, record_bytes = 2 * 16 + 24 + 4 * 3 + 24 + 3, record_tail_bytes = 0;
  static constexpr RecordPart record_parts[] = {
      {"first", 0, 16, DType::bf16, 0},
      {"k", 16, 24, DType::i8, 32, 8, DType::f32, 56, false, ScaleRounding::exact, 0.0f, false},
      {"v", 40, 24, DType::f8e5m2, 68, 8, DType::ue8m0, 92, false, ScaleRounding::pow2_up, 0.0f, true}};
};

// An MLA-like latent in e4m3 per 32 under bf16 scales (exact, rounded up) with a floor, and an fp16 part.
struct LatentTraits {
  static constexpr int record_values = 96, record_bytes = 64 + 2 * 2 + 2 * 32, record_tail_bytes = 0;
  static constexpr RecordPart record_parts[] = {
      {"latent", 0, 64, DType::f8e4m3, 0, 32, DType::bf16, 64, false, ScaleRounding::exact, 1e-3f, true},
      {"rope", 64, 32, DType::f16, 68}};
};

// An fp32 part, then e4m3 codes whose fp32 scales follow the page's records (vLLM's form, two groups).
struct PageEndTraits {
  static constexpr int record_values = 64, record_bytes = 4 * 32 + 32, record_tail_bytes = 8;
  static constexpr RecordPart record_parts[] = {
      {"plain", 0, 32, DType::f32, 0},
      {"codes", 32, 32, DType::f8e4m3, 128, 16, DType::f32, 0, true, ScaleRounding::pow2_up, 1e-4f, false}};
};

// 4-bit codes, two a byte: e2m1 per 16 under ue8m0 scales (MXFP4's codes and scale, the MX NaN rule), then
// int4 per 8 under bf16 scales; 48 values, halves of 24, so the e2m1 part's last group crosses into V's half.
struct NibbleTraits {
  static constexpr int record_values = 48, record_bytes = 16 + 2 + 8 + 2 * 2, record_tail_bytes = 0;
  static constexpr RecordPart record_parts[] = {
      {"codes", 0, 32, DType::f4e2m1, 0, 16, DType::ue8m0, 16, false, ScaleRounding::pow2_up, 0.0f, true},
      {"ints", 32, 16, DType::i4, 18, 8, DType::bf16, 26, false, ScaleRounding::exact, 0.0f, false}};
};

// The runtime form of traits, as a descriptor carries it.
template <class T> RecordFormat format_of() {
  return RecordFormat{"test", int(std::size(T::record_parts)), T::record_parts, T::record_values, T::record_bytes,
                      T::record_tail_bytes};
}

// Records of values at the scale edges and random ones of many magnitudes.
std::vector<std::vector<float>> edge_records(int n, uint32_t seed) {
  std::vector<std::vector<float>> out;
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (float spread : {0.0f, 1e-6f, 1e-3f, 1.0f, 300.0f, 1e6f}) {
    std::vector<float> x(static_cast<size_t>(n), 0.0f);
    for (int i = 0; i < n; ++i) x[size_t(i)] = normal(rng) * spread;
    out.push_back(x);
  }
  for (float amax : {448.0f, 57344.0f, 127.0f, std::nextafter(448.0f, 1e9f), 1.0f / 64}) {
    std::vector<float> x(static_cast<size_t>(n), 0.0f);
    for (int i = 0; i < n; ++i) x[size_t(i)] = amax * float((i * 37) % 101 - 50) / 50.0f;
    out.push_back(x);
  }
  return out;
}

// The lane form on `Lanes` emulated lanes of a CUDA item gives the one-lane form's bytes (lo, hi, tail).
template <class Codec, int Lanes>
void check_lane_form(const float* k, const float* v, const std::vector<uint8_t>& lo, const std::vector<uint8_t>& hi,
                     const std::vector<uint8_t>& tail) {
  std::vector<uint8_t> lanes_lo(lo.size(), 0xee), lanes_hi(hi.size(), 0xee), lanes_tail(tail.size(), 0xee);
  ASSERT_TRUE(EmulatedLanes::run(Lanes, [&](int lane) {
    Codec::template encode<EmulatedCudaExec, Lanes>(k, v, lanes_lo.data(), lanes_hi.data(), lanes_tail.data(), lane);
  })) << Lanes << " lanes diverged";
  EXPECT_EQ(lanes_lo, lo) << Lanes << " lanes";
  EXPECT_EQ(lanes_hi, hi) << Lanes << " lanes";
  EXPECT_EQ(lanes_tail, tail) << Lanes << " lanes";
}

template <class T> void check_format() {
  using Codec = PartRecord<T>;
  const RecordFormat f = format_of<T>();
  const RefPlace place = ref_place(f);
  ASSERT_EQ(place.record_bytes, Codec::kBytes);  // the traits' bytes are the reference's own sums
  ASSERT_EQ(place.tail_bytes, Codec::kTail);
  for (int i = 0; i < f.num_parts; ++i) {
    ASSERT_EQ(place.bytes_at[size_t(i)], f.parts[i].bytes_at) << f.parts[i].name;
    if (f.parts[i].group) {
      ASSERT_EQ(place.scales_at[size_t(i)], f.parts[i].scales_at) << f.parts[i].name;
    }
  }
  for (const std::vector<float>& x : edge_records(Codec::kValues, 7)) {
    const RefRecord want = ref_part_record(f, x, DType::f32);
    const std::vector<uint8_t> want_record(want.bytes.begin(), want.bytes.begin() + Codec::kBytes);
    const std::vector<uint8_t> want_tail(want.bytes.begin() + Codec::kBytes, want.bytes.end());
    const float *k = x.data(), *v = x.data() + Codec::D;
    // The halves apart, as a layout that keeps K's and V's rows in two places holds them.
    std::vector<uint8_t> lo(size_t(Codec::kSplit), 0xee), hi(size_t(Codec::kBytes - Codec::kSplit), 0xee);
    std::vector<uint8_t> tail(size_t(Codec::kTail > 0 ? Codec::kTail : 1), 0xee);
    Codec::encode_whole(k, v, lo.data(), hi.data(), tail.data());
    std::vector<uint8_t> got(lo);
    got.insert(got.end(), hi.begin(), hi.end());
    ASSERT_EQ(got, want_record) << "one lane, spread " << x[1];
    if (Codec::kTail > 0) {
      ASSERT_EQ(std::vector<uint8_t>(tail.begin(), tail.begin() + Codec::kTail), want_tail);
    }
    check_lane_form<Codec, 32>(k, v, lo, hi, tail);  // a CUDA item's warp
    check_lane_form<Codec, 4>(k, v, lo, hi, tail);
    check_lane_form<Codec, 1>(k, v, lo, hi, tail);
    if (::testing::Test::HasFailure()) return;
    std::vector<float> whole(x.size(), -1.0f), split(x.size(), -1.0f);
    Codec::decode_whole(lo.data(), hi.data(), tail.data(), whole.data(), whole.data() + Codec::D);
    for (int lane = 0; lane < 32; ++lane)
      Codec::decode(lo.data(), hi.data(), tail.data(), split.data(), split.data() + Codec::D, lane, 32);
    for (size_t i = 0; i < x.size(); ++i) {
      ASSERT_TRUE(same_float(whole[i], want.gathered[i])) << i << ": " << whole[i] << " want " << want.gathered[i];
      ASSERT_TRUE(same_float(split[i], want.gathered[i])) << i;
    }
    std::vector<bf16> narrow(x.size());
    Codec::decode_whole(lo.data(), hi.data(), tail.data(), narrow.data(), narrow.data() + Codec::D);
    const RefRecord want_bf16 = ref_part_record(f, x, DType::bf16);
    for (size_t i = 0; i < x.size(); ++i) ASSERT_TRUE(same_float(to_float(narrow[i]), want_bf16.gathered[i])) << i;
  }
  // A NaN and infinities inside groups, off the first lane of any run: the lane form's reductions carry
  // them to the whole run and give the one-lane form's bytes (the reference takes finite values only;
  // ANanTakesItsGroupOrOnlyItselfAsThePartSays holds the one-lane form to the NaN rules).
  for (int at : {3, Codec::kValues / 2 + 5, Codec::kValues - 2}) {
    std::vector<float> x(size_t(Codec::kValues));
    for (int i = 0; i < Codec::kValues; ++i) x[size_t(i)] = float((i * 29) % 23 - 11) / 4.0f;
    x[size_t(at)] = NAN;
    x[size_t((at + 7) % Codec::kValues)] = INFINITY;
    x[size_t((at + 13) % Codec::kValues)] = -INFINITY;
    std::vector<uint8_t> lo(size_t(Codec::kSplit), 0xee), hi(size_t(Codec::kBytes - Codec::kSplit), 0xee);
    std::vector<uint8_t> tail(size_t(Codec::kTail > 0 ? Codec::kTail : 1), 0xee);
    Codec::encode_whole(x.data(), x.data() + Codec::D, lo.data(), hi.data(), tail.data());
    SCOPED_TRACE("a NaN at value " + std::to_string(at));
    check_lane_form<Codec, 32>(x.data(), x.data() + Codec::D, lo, hi, tail);
    check_lane_form<Codec, 4>(x.data(), x.data() + Codec::D, lo, hi, tail);
  }
}

TEST(PartRecord, IntegerAndE5m2CodesUnderFp32AndUe8m0ScalesGiveTheReferencesBytes) { check_format<CodesTraits>(); }
TEST(PartRecord, E4m3UnderBf16ScalesWithAFloorBesideFp16GivesTheReferencesBytes) { check_format<LatentTraits>(); }
TEST(PartRecord, ScalesAfterThePagesRecordsGiveTheReferencesBytes) { check_format<PageEndTraits>(); }
TEST(PartRecord, FourBitCodesTwoAByteGiveTheReferencesBytes) { check_format<NibbleTraits>(); }
TEST(PartRecord, TheDefaultFormatsGiveTheirOwnReferencesBytes) {
  // FlashMLA's and the index key's formats, whose references are written from their engines' sources:
  // the generic reference agrees with them, so either holds the codec.
  std::mt19937 rng(11);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> latent(576), key(128);
  for (float& x : latent) x = normal(rng) * 3.0f;
  for (float& x : key) x = normal(rng) * 1e-5f;  // under the floor
  EXPECT_EQ(ref_part_record(format_of<FlashMlaTraits<512, 64>>(), latent, DType::f32).bytes,
            ref_flashmla_record(latent, 512, 64, DType::f32).bytes);
  EXPECT_EQ(ref_part_record(format_of<IndexKeyTraits<128>>(), key, DType::f32).bytes, ref_index_key(key, DType::f32).bytes);
}

// A NaN: MX's rule makes its group's scale NaN and every code of the group NaN; by value, only its own
// code is (e4m3's NaN), and int8 codes it 0.
TEST(PartRecord, ANanTakesItsGroupOrOnlyItselfAsThePartSays) {
  using Codec = PartRecord<CodesTraits>;
  std::vector<float> x(64, 1.0f);
  x[19] = NAN;  // int8, nan: value
  x[45] = NAN;  // e5m2, nan: group (values 40..47)
  std::vector<uint8_t> record(size_t(Codec::kBytes));
  Codec::encode_whole(x.data(), x.data() + Codec::D, record.data(), record.data() + Codec::kSplit, nullptr);
  std::vector<float> back(64);
  Codec::decode_whole(record.data(), record.data() + Codec::kSplit, nullptr, back.data(), back.data() + Codec::D);
  EXPECT_EQ(record[32 + 3], 0);
  for (int i = 0; i < 64; ++i) {
    if (i == 19) EXPECT_EQ(back[size_t(i)], 0.0f);
    else if (i >= 40 && i < 48) EXPECT_TRUE(std::isnan(back[size_t(i)])) << i;
    else EXPECT_FLOAT_EQ(back[size_t(i)], 1.0f) << i;
  }
}

}  // namespace
}  // namespace kvtest
