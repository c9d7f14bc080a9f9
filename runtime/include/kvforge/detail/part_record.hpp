// The one codec of records of named parts (record_format.hpp), one source for both backends: a token's
// record, K then V of a head (values first [D] then second [D]), goes to its bytes part by part as the
// traits' record_parts place them, and back. The placement is codegen's (records.py); docs/specs.md
// ("Records of named parts") states the rules in words, and the tests hold the bytes to references
// written from each format's definition (FlashMLA's, vLLM's index keys, any spec's parts).
//
// A coded part, group by group: amax over the group's finite values, at least the part's amax_floor. A
// NaN in the group makes its scale NaN where the part says nan: group (MX's rule; every code of the
// group is then NaN), else only the NaN's own code is. The scale is amax / the code's largest value,
// kept exact or rounded up to a power of two (pow2_up), an all-zero group's 1; it is stored in the
// scale's dtype (rounded up where that dtype cannot hold it: bf16's next value, ue8m0's power of two),
// and a code is the value / the stored scale, rounded to nearest (ties to even), saturating. fp8 codes
// are the software encoders' (NaN stays NaN); int8's round and saturate, a NaN coded 0. A float part is
// each value in its dtype, rounded to nearest even. Decoding: code * scale in fp32, rounded once to the
// output's dtype.
//
// Where the bytes go: a record's first kSplit bytes to `lo` and the rest to `hi` (a head's K row and V
// row; the same run where they are adjacent), and the scales placed at the page's end to `tail`.
#pragma once

#include <cstdint>
#include <cstring>
#include <iterator>
#include <utility>

#include "kvforge/detail/block_quant.hpp"
#include "kvforge/record_format.hpp"

namespace kvforge::detail {

// A part's codes: the stored code of a value already divided by its scale, and back. 4-bit codes
// (kPacked) go two to a byte, value 2i in the low nibble of byte i.
template <DType T> struct PartCodes;
template <> struct PartCodes<DType::f8e4m3> {
  static constexpr float qmax = 448.0f;
  KVF_HD static KVF_INLINE uint8_t encode(float x) { return E4M3::encode(x); }
  KVF_HD static KVF_INLINE float decode(uint8_t c) { return E4M3::decode(c); }
};
template <> struct PartCodes<DType::f8e5m2> {
  static constexpr float qmax = 57344.0f;
  KVF_HD static KVF_INLINE uint8_t encode(float x) { return E5M2::encode(x); }
  KVF_HD static KVF_INLINE float decode(uint8_t c) { return E5M2::decode(c); }
};
template <> struct PartCodes<DType::i8> {
  static constexpr float qmax = 127.0f;
  KVF_HD static KVF_INLINE uint8_t encode(float x) { return uint8_t(Codec<int8_t>::encode(x)); }
  KVF_HD static KVF_INLINE float decode(uint8_t c) { return float(int8_t(c)); }
};
template <> struct PartCodes<DType::f4e2m1> {  // e2m1 (MXFP4's codes); NaN is stored as 0, as the cache stores it
  static constexpr float qmax = 6.0f;
  KVF_HD static KVF_INLINE uint8_t encode(float x) { return Codec<fp4_e2m1x2>::code(x); }
  KVF_HD static KVF_INLINE float decode(uint8_t c) { return E2M1::decode(c); }
};
template <> struct PartCodes<DType::i4> {  // -7..7 in two's complement nibbles; NaN is stored as 0
  static constexpr float qmax = 7.0f;
  KVF_HD static KVF_INLINE uint8_t encode(float x) { return Codec<int4x2>::code(x); }
  KVF_HD static KVF_INLINE float decode(uint8_t c) { return Codec<int4x2>::decode_nibble(c); }
};
template <DType T> inline constexpr bool kPacked = T == DType::f4e2m1 || T == DType::i4;

// A float part's values as stored.
template <DType T> struct PartFloat;
template <> struct PartFloat<DType::f32> { using type = float; };
template <> struct PartFloat<DType::f16> { using type = fp16; };
template <> struct PartFloat<DType::bf16> { using type = bf16; };

template <class Traits> struct PartRecord {
  static constexpr int kParts = int(std::size(Traits::record_parts));
  static constexpr int kValues = Traits::record_values;
  static constexpr int kBytes = Traits::record_bytes;
  static constexpr int kTail = Traits::record_tail_bytes;
  static constexpr int kRow = (kBytes + kTail) / 2;          // a head's K (or V) row in the pool
  static constexpr int kSplit = kRow < kBytes ? kRow : kBytes;  // the record's bytes in the first row
  static constexpr int D = kValues / 2;                      // values of each half of a record
  template <int I> static constexpr RecordPart kPart = Traits::record_parts[I];

  // The scale of a group of a coded part: amax its largest finite magnitude, nan whether it holds a NaN.
  // Writes the stored scale's bytes to `at` and returns the scale its codes divide by.
  template <int I> KVF_HD static KVF_INLINE float scale_of(float amax, bool nan, uint8_t* at) {
    constexpr RecordPart p = kPart<I>;
    constexpr float qmax = PartCodes<p.dtype>::qmax;
    const float a = amax > p.amax_floor ? amax : p.amax_floor;
    float s = a > 0.0f ? a / qmax : 1.0f;
    if constexpr (p.rounding == ScaleRounding::pow2_up) s = a > 0.0f ? UE8M0::decode(UE8M0::encode_up(s)) : 1.0f;
    if (p.nan_group && nan) s = UE8M0::decode(255);  // NaN
    if constexpr (p.scale_dtype == DType::ue8m0) {
      const uint8_t e = nan && p.nan_group ? uint8_t(255) : UE8M0::encode_up(s);
      *at = e;
      return UE8M0::decode(e);
    } else if constexpr (p.scale_dtype == DType::bf16) {
      const bf16 b = s == s ? store_scale<bf16>(s) : from_float<bf16>(s);
      std::memcpy(at, &b, 2);
      return to_float(b);
    } else {
      std::memcpy(at, &s, 4);
      return s;
    }
  }
  template <int I> KVF_HD static KVF_INLINE float stored_scale(const uint8_t* at) {
    constexpr RecordPart p = kPart<I>;
    if constexpr (p.scale_dtype == DType::ue8m0) {
      return UE8M0::decode(*at);
    } else if constexpr (p.scale_dtype == DType::bf16) {
      bf16 b;
      std::memcpy(&b, at, 2);
      return to_float(b);
    } else {
      float s;
      std::memcpy(&s, at, 4);
      return s;
    }
  }

  // Part I of the record whose values are x [kValues] into `record` [kBytes] and `tail` [kTail].
  template <int I> KVF_HD static KVF_INLINE void encode_part(const float* x, uint8_t* record, uint8_t* tail) {
    constexpr RecordPart p = kPart<I>;
    const float* v = x + p.values_at;
    if constexpr (!p.scaled()) {
      using F = typename PartFloat<p.dtype>::type;
      F out[p.width];
      for (int i = 0; i < p.width; ++i) out[i] = from_float<F>(v[i]);
      std::memcpy(record + p.bytes_at, out, sizeof out);
    } else {
      uint8_t* codes = record + p.bytes_at;
      uint8_t* scales = (p.at_page_end ? tail : record) + p.scales_at;
      constexpr int scale_size = dtype_size(p.scale_dtype);
      for (int g = 0; g < p.width / p.group; ++g) {
        bool nan;
        const float amax = bits_float(group_amax<p.group>(v + g * p.group, nan));
        const float s = scale_of<I>(amax, nan, scales + g * scale_size);
        if constexpr (kPacked<p.dtype>) {  // a group is even: its values fill whole bytes
          for (int i = 0; i < p.group; i += 2)
            codes[(g * p.group + i) / 2] = uint8_t(PartCodes<p.dtype>::encode(v[g * p.group + i] / s) |
                                                   (PartCodes<p.dtype>::encode(v[g * p.group + i + 1] / s) << 4));
        } else {
          for (int i = 0; i < p.group; ++i) codes[g * p.group + i] = PartCodes<p.dtype>::encode(v[g * p.group + i] / s);
        }
      }
    }
  }
  template <int I, class Out> KVF_HD static KVF_INLINE void decode_part(const uint8_t* record, const uint8_t* tail, Out* x) {
    constexpr RecordPart p = kPart<I>;
    Out* v = x + p.values_at;
    if constexpr (!p.scaled()) {
      using F = typename PartFloat<p.dtype>::type;
      F in[p.width];
      std::memcpy(in, record + p.bytes_at, sizeof in);
      for (int i = 0; i < p.width; ++i) v[i] = from_float<Out>(to_float(in[i]));
    } else {
      const uint8_t* codes = record + p.bytes_at;
      const uint8_t* scales = (p.at_page_end ? tail : record) + p.scales_at;
      for (int g = 0; g < p.width / p.group; ++g) {
        const float s = stored_scale<I>(scales + g * dtype_size(p.scale_dtype));
        for (int i = 0; i < p.group; ++i)
          v[g * p.group + i] = from_float<Out>(PartCodes<p.dtype>::decode(code_at<p.dtype>(codes, g * p.group + i)) * s);
      }
    }
  }

  // Code i of a part whose codes start at `codes`.
  template <DType T> KVF_HD static KVF_INLINE uint8_t code_at(const uint8_t* codes, int i) {
    if constexpr (kPacked<T>) return nibble(codes, i);
    else return codes[i];
  }

  template <int... I, class F> KVF_HD static KVF_INLINE void each_part(std::integer_sequence<int, I...>, F&& f) {
    (f(std::integral_constant<int, I>{}), ...);
  }

  // record halves `first` [D] + `second` [D] -> lo [kSplit], hi [kBytes - kSplit], tail [kTail]: on one
  // lane, through a copy of the values on the stack, whose loops run over contiguous values and vectorize.
  template <class In>
  KVF_HD static KVF_INLINE void encode_whole(const In* first, const In* second, uint8_t* lo, uint8_t* hi, uint8_t* tail) {
    float x[kValues];
    for (int i = 0; i < D; ++i) x[i] = to_float(first[i]);
    for (int i = 0; i < D; ++i) x[D + i] = to_float(second[i]);
    // The record in place where its halves are one run (a layout that keeps a head's V row after its K
    // row, and every page-end format), else through a copy on the stack.
    uint8_t copy[kBytes];
    uint8_t* record = hi == lo + kSplit ? lo : copy;
    each_part(std::make_integer_sequence<int, kParts>{}, [&](auto i) { encode_part<decltype(i)::value>(x, record, tail); });
    if (record == copy) {
      std::memcpy(lo, copy, kSplit);
      std::memcpy(hi, copy + kSplit, kBytes - kSplit);
    }
  }

  template <class Out>
  KVF_HD static KVF_INLINE void decode_whole(const uint8_t* lo, const uint8_t* hi, const uint8_t* tail, Out* first, Out* second) {
    uint8_t copy[kBytes];
    const uint8_t* record = lo;
    if (hi != lo + kSplit) {  // the halves apart: one run on the stack
      std::memcpy(copy, lo, kSplit);
      std::memcpy(copy + kSplit, hi, kBytes - kSplit);
      record = copy;
    }
    Out x[kValues];
    each_part(std::make_integer_sequence<int, kParts>{}, [&](auto i) { decode_part<decltype(i)::value>(record, tail, x); });
    std::memcpy(first, x, sizeof(Out) * D);
    std::memcpy(second, x + D, sizeof(Out) * D);
  }

  // Value i of the record whose halves are `first` [D] and `second` [D].
  template <class In> KVF_HD static KVF_INLINE float value(const In* first, const In* second, int i) {
    return to_float(i < D ? first[i] : second[i - D]);
  }
  KVF_HD static KVF_INLINE uint8_t* byte(uint8_t* lo, uint8_t* hi, int j) { return j < kSplit ? lo + j : hi + (j - kSplit); }
  KVF_HD static KVF_INLINE const uint8_t* byte(const uint8_t* lo, const uint8_t* hi, int j) {
    return j < kSplit ? lo + j : hi + (j - kSplit);
  }

  // Lanes that share one group of part I in the lane form, of an item's Lanes: one where the part has
  // a group for every lane, else as many as spread its groups over the item (a power of two, each lane
  // with a value, or a pair of 4-bit codes, at least): the index key's one group of 128 takes a warp's
  // 32 lanes, 4 values each, where one lane coded it whole while 31 waited; FlashMLA's 4 groups of its
  // latent 8 lanes each.
  template <int I, int Lanes> static constexpr int group_lanes() {
    constexpr RecordPart p = kPart<I>;
    constexpr int groups = p.width / p.group, units = kPacked<p.dtype> ? p.group / 2 : p.group;
    int s = 1;
    while (s * 2 * groups <= Lanes && s * 2 <= units && s * 2 <= 32) s *= 2;
    return s;
  }

  // The same bytes on lane `lane` of an item's Lanes lanes (CUDA's; Exec::lane_max reduces across them,
  // so every lane must call this). A float part's values lane, lane + Lanes, ... are the lane's; a coded
  // part's groups go to runs of group_lanes() lanes, whose amax (and NaN) is one reduction over the run,
  // each lane then coding its share of the group's values and the run's first lane storing its scale.
  // Each byte is one lane's.
  template <class Exec, int Lanes, class In>
  KVF_HD static KVF_INLINE void encode(const In* first, const In* second, uint8_t* lo, uint8_t* hi, uint8_t* tail, int lane) {
    each_part(std::make_integer_sequence<int, kParts>{}, [&](auto index) {
      constexpr int I = decltype(index)::value;
      constexpr RecordPart p = kPart<I>;
      if constexpr (!p.scaled()) {
        using F = typename PartFloat<p.dtype>::type;
        for (int i = lane; i < p.width; i += Lanes) {
          const F f = from_float<F>(value(first, second, p.values_at + i));
          uint8_t b[sizeof(F)];
          std::memcpy(b, &f, sizeof(F));
          for (int j = 0; j < int(sizeof(F)); ++j) *byte(lo, hi, p.bytes_at + i * int(sizeof(F)) + j) = b[j];
        }
      } else {
        constexpr int S = group_lanes<I, Lanes>(), groups = p.width / p.group, scale_size = dtype_size(p.scale_dtype);
        // A lane's values of its group: value sub + S j (a 4-bit part: the pair 2 (sub + S j), + 1).
        constexpr int kStep = kPacked<p.dtype> ? 2 : 1, kMine = (p.group / kStep + S - 1) / S;
        // Every lane takes the same turns, so that each reduction is the whole item's.
        for (int base = 0; base < groups * S; base += Lanes) {
          const int g = (base + lane) / S, sub = (base + lane) % S;
          const bool mine = g < groups;
          // The lane's values are read twice, for the amax and for the codes, rather than held: held, 16 a
          // lane of FlashMLA's latent took 64 registers (ptxas), half the threads an SM holds at 32.
          auto mine_at = [&](int j, int e) {
            const int i = (sub + S * j) * kStep + e;
            return mine && i < p.group ? value(first, second, p.values_at + g * p.group + i) : 0.0f;
          };
          AmaxBits m;
          for (int j = 0; j < kMine; ++j)
            for (int e = 0; e < kStep; ++e) m.fold(mine_at(j, e));
          if constexpr (S > 1) {
            m.amax = Exec::template lane_max<Lanes, S>(m.amax);
            m.raw = Exec::template lane_max<Lanes, S>(m.raw);
          }
          if (!mine) continue;
          uint8_t stored[scale_size];
          const float s = scale_of<I>(bits_float(m.amax), m.nan(), stored);
          if (sub == 0)
            for (int j = 0; j < scale_size; ++j) {
              if constexpr (p.at_page_end) tail[p.scales_at + g * scale_size + j] = stored[j];
              else *byte(lo, hi, p.scales_at + g * scale_size + j) = stored[j];
            }
          for (int j = 0; j < kMine; ++j) {
            const int unit = sub + S * j;
            if (unit * kStep >= p.group) break;
            if constexpr (kPacked<p.dtype>) {
              *byte(lo, hi, p.bytes_at + (g * p.group) / 2 + unit) =
                  uint8_t(PartCodes<p.dtype>::encode(mine_at(j, 0) / s) | (PartCodes<p.dtype>::encode(mine_at(j, 1) / s) << 4));
            } else {
              *byte(lo, hi, p.bytes_at + g * p.group + unit) = PartCodes<p.dtype>::encode(mine_at(j, 0) / s);
            }
          }
        }
      }
    });
  }

  template <class Out>
  KVF_HD static KVF_INLINE void decode(const uint8_t* lo, const uint8_t* hi, const uint8_t* tail, Out* first, Out* second,
                                       int lane, int lanes) {
    each_part(std::make_integer_sequence<int, kParts>{}, [&](auto index) {
      constexpr int I = decltype(index)::value;
      constexpr RecordPart p = kPart<I>;
      for (int i = lane; i < p.width; i += lanes) {
        float v;
        if constexpr (!p.scaled()) {
          using F = typename PartFloat<p.dtype>::type;
          uint8_t b[sizeof(F)];
          for (int j = 0; j < int(sizeof(F)); ++j) b[j] = *byte(lo, hi, p.bytes_at + i * int(sizeof(F)) + j);
          F f;
          std::memcpy(&f, b, sizeof(F));
          v = to_float(f);
        } else {
          constexpr int scale_size = dtype_size(p.scale_dtype);
          uint8_t stored[scale_size];
          for (int j = 0; j < scale_size; ++j)
            stored[j] = p.at_page_end ? tail[p.scales_at + (i / p.group) * scale_size + j]
                                      : *byte(lo, hi, p.scales_at + (i / p.group) * scale_size + j);
          const uint8_t code = kPacked<p.dtype> ? uint8_t((*byte(lo, hi, p.bytes_at + i / 2) >> (4 * (i % 2))) & 0xfu)
                                                : *byte(lo, hi, p.bytes_at + i);
          v = PartCodes<p.dtype>::decode(code) * stored_scale<I>(stored);
        }
        const int at = p.values_at + i;
        (at < D ? first[at] : second[at - D]) = from_float<Out>(v);
      }
    });
  }
};

// What ops.hpp instantiates for a variant that keeps no record format: one float part, never called.
struct NoRecordTraits {
  static constexpr int record_values = 2, record_bytes = 4, record_tail_bytes = 0;
  static constexpr RecordPart record_parts[] = {{"none", 0, 2, DType::bf16, 0}};
};

}  // namespace kvforge::detail
