// How a CUDA item quantizes one token's K or V in 16-byte chunks of input, and dequantizes it back: the
// lanes' share of the chunks, and the per-chunk steps (load, amax, encode and a packed store; a packed
// load and decode into a 16-byte store). The rules themselves are
// quant_codec.hpp's; this is only the access pattern, which the CUDA executor's write runs
// (ops.hpp, quantize_token_chunked) and tests/test_quant.cpp checks lane by lane on the host.
//
// A head's row of D inputs is C chunks of V elements. Lanes come in groups of Lh, one group per head
// of a pass; a pass covers P heads, so an item has L = P * Lh lanes (at most MaxLanes) and takes Q
// passes. Where C is a power of two up to a warp, Lh = C and each lane holds one chunk of each head it
// meets; otherwise Lh is the largest power of two below C (at most a warp), and each lane takes every
// Lh-th chunk of its head (K of them). Either way P is as many heads as MaxLanes holds groups for (a
// power of two, at most H's), so a head_dim of 96 spreads 32 heads over 256 lanes, not 8. A head's amax
// is then a reduction over its group of Lh lanes, inside one warp, and a token's over all L, across
// warps where L is wider (the executor's item_max).
#pragma once

#include <cstdint>
#include <cstring>

#include "kvforge/detail/config.hpp"
#include "kvforge/dtype.hpp"
#include "kvforge/detail/quant_codec.hpp"
#include "kvforge/detail/token_vectors.hpp"

namespace kvforge::detail {

constexpr int floor_pow2(int n) {
  int p = 1;
  while (p * 2 <= n) p *= 2;
  return p;
}

template <class Store, class In, int H, int D, int MaxLanes> struct QuantChunks {
  static_assert(MaxLanes >= 32 && (MaxLanes & (MaxLanes - 1)) == 0, "an item's lanes are whole warps past one");
  static constexpr int V = 16 / int(sizeof(In));  // inputs per chunk
  // Only rows of whole chunks take this path; the others quantize element by element.
  static constexpr bool kUsable = H > 0 && D > 0 && (D * int(sizeof(In))) % 16 == 0;
  static constexpr int C = kUsable ? D / V : 1;  // chunks per head
  static constexpr bool kWholeGroups = (C & (C - 1)) == 0 && C <= 32;
  static constexpr int Lh = kWholeGroups ? C : floor_pow2(C < 32 ? C : 32);
  static constexpr int P = MaxLanes / Lh < floor_pow2(H) ? MaxLanes / Lh : floor_pow2(H);
  static constexpr int L = P * Lh;
  static constexpr int K = (C + Lh - 1) / Lh;
  static constexpr int Q = (H + P - 1) / P;
  // Whether one lane holds all its chunks of a token's K and of its V at once (at most 8 vectors, 32
  // registers): every load is then issued before any store. Otherwise a pass at a time.
  static constexpr bool kPreload = Q * K <= 4;
  static constexpr int kCodeBytes = V * int(sizeof(Store));  // one chunk's codes, stored in one access

  // Head and chunk of a lane's k-th chunk in pass p; false where that lands past the row or the heads.
  KVF_HD static KVF_INLINE bool chunk_at(int lane, int p, int k, int& h, int& c) {
    static_assert((L & (L - 1)) == 0, "an item's lanes are a power of two");
    lane &= L - 1;  // a no-op (lane < L) that tells the compiler so: whole passes then test nothing
    h = p * P + lane / Lh;
    c = lane % Lh + k * Lh;
    return h < H && c < C;
  }

  // Whether a token's rows allow 16-byte loads and whole-chunk code stores: each side apart (a write
  // loads its inputs before it knows where their codes go), and both.
  KVF_HD static KVF_INLINE bool inputs_aligned(const In* src, int64_t src_head) {
    return reinterpret_cast<uintptr_t>(src) % 16 == 0 && (src_head * int64_t(sizeof(In))) % 16 == 0;
  }
  KVF_HD static KVF_INLINE bool codes_aligned(const Store* codes, int64_t codes_head) {
    return reinterpret_cast<uintptr_t>(codes) % kCodeBytes == 0 && (codes_head * int64_t(sizeof(Store))) % kCodeBytes == 0;
  }
  KVF_HD static KVF_INLINE bool aligned(const In* src, int64_t src_head, const Store* dst, int64_t dst_head) {
    return inputs_aligned(src, src_head) && codes_aligned(dst, dst_head);
  }

  // f(r, k, h, c) for every chunk `lane` holds in passes [first, first + Passes): its r-th pass there,
  // its k-th chunk of that pass's head h, chunk c of the head's row.
  template <int Passes, class F> KVF_HD static KVF_INLINE void for_each_chunk(int lane, int first, F f) {
    KVF_UNROLL
    for (int r = 0; r < Passes; ++r)
      KVF_UNROLL
      for (int k = 0; k < K; ++k) {
        int h, c;
        if (chunk_at(lane, first + r, k, h, c)) f(r, k, h, c);
      }
  }

  // One chunk's inputs, and its codes as stored (kCodeBytes, moved in one access).
  struct alignas(16) Inputs {
    In x[V];
  };
  struct alignas(kCodeBytes) Codes {
    Store code[V];
  };
  static_assert(sizeof(Inputs) == 16 && sizeof(Vec16) == 16);

  KVF_HD static KVF_INLINE Vec16 load(const In* src, int64_t src_head, int h, int c) {
    return load_vector<Vec16>(src + h * src_head + c * V);
  }

  // 16-bit inputs take their maximum in integers (Half16), converting only it: a chunk's values are
  // converted once, by encode, and the compiler holds the raw chunk, not 8 floats, until then.
  KVF_HD static KVF_INLINE uint32_t amax(const Vec16& chunk) {
    Inputs in;
    std::memcpy(&in, &chunk, sizeof in);
    if constexpr (Half16<In>::value) {
      uint16_t m = 0;
      KVF_UNROLL
      for (int i = 0; i < V; ++i) {
        const uint16_t finite = finite_magnitude16(in.x[i]);
        m = m > finite ? m : finite;
      }
      return magnitude_bits(to_float(In{m}));
    }
    uint32_t m = 0;
    KVF_UNROLL
    for (int i = 0; i < V; ++i) {
      const uint32_t b = magnitude_bits(to_float(in.x[i]));
      m = m > b ? m : b;
    }
    return m;
  }

  // One chunk's codes, stored in one access of kCodeBytes.
  KVF_HD static KVF_INLINE void encode(Store* dst, int64_t dst_head, int h, int c, const Vec16& chunk,
                                             const ScaleDivisor& divisor) {
    Inputs in;
    std::memcpy(&in, &chunk, sizeof in);
    float quotient[V];
    KVF_UNROLL
    for (int i = 0; i < V; ++i) quotient[i] = to_float(in.x[i]);
    divisor.divide_all(quotient);
    Codes out;
    KVF_UNROLL
    for (int i = 0; i < V; ++i) out.code[i] = Codec<Store>::encode(quotient[i]);
    store_vector(dst + h * dst_head + c * V, out);
  }

  // Whether a token's codes and its output rows allow whole-chunk loads and 16-byte stores (a gather).
  KVF_HD static KVF_INLINE bool aligned_codes(const Store* src, int64_t src_head, const In* dst, int64_t dst_head) {
    return aligned(dst, dst_head, src, src_head);
  }

  KVF_HD static KVF_INLINE Codes load_codes(const Store* src, int64_t src_head, int h, int c) {
    return load_vector<Codes>(src + h * src_head + c * V);
  }

  // One chunk's values, code * scale rounded to the input dtype, stored in one 16-byte access.
  KVF_HD static KVF_INLINE void decode(In* dst, int64_t dst_head, int h, int c, const Codes& codes, float scale) {
    Inputs out;
    KVF_UNROLL
    for (int i = 0; i < V; ++i) out.x[i] = from_float<In>(Codec<Store>::decode(codes.code[i]) * scale);
    store_vector(dst + h * dst_head + c * V, out);
  }
};

}  // namespace kvforge::detail
