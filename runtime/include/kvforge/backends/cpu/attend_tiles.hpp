// The work of an attend block (attend/attend_ops.hpp) in a CPU level's vectors: the scores of a tile of
// query rows against a block of decoded keys, their exponentials, and the weighted sum of the block's
// values into the rows' outputs. The two products hold a small tile of partial sums in registers over
// the whole reduction:
//   - scores: 4 query rows x 2 keys (or 1 x 4 where an item holds one row, MHA's decode), eight sums of
//     eight lanes each over the key's width, so that eight independent FMA chains hide the FMA's
//     latency; each key vector loaded once for 4 rows;
//   - values: 4 rows x 16 outputs (or 1 x 32) held over every position of the block, so that an output
//     is loaded and stored once a block, not once a position.
// The portable loops (one dot product at a time, an output row re-read for each position) ran the bf16
// decode at 2.0-2.6x a copy of its bytes; GCC did not keep the same tiling in registers when it was
// written as portable loops (bench/RESULTS.md, section 22), and left attend_exp's loop scalar (a third
// of a prefill's time).
//
// Level 3 (AVX2 and FMA) and up take these; widths that are not a whole number of 8-lane vectors take
// the portable loops (each returns false). Sums are fp32 in a different order from the portable loop's,
// which the reference tests' fp32 tolerance covers.
//
// Every function is a template on the level, so that files compiled for different levels never share
// a symbol (exec_cpu.hpp says why).
#pragma once

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

#include "kvforge/detail/qualifiers.hpp"

namespace kvforge::detail::attend_tiles {

#if defined(__AVX2__) && defined(__FMA__)
// The sum of a vector's lanes.
template <int Level> KVF_INLINE float sum8(__m256 v) {
  const __m128 h = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 q = _mm_add_ps(h, _mm_movehl_ps(h, h));
  return _mm_cvtss_f32(_mm_add_ss(q, _mm_shuffle_ps(q, q, 1)));
}

// The sums of four vectors' lanes, in order.
template <int Level> KVF_INLINE __m128 sum4(__m256 a, __m256 b, __m256 c, __m256 d) {
  const __m256 ab = _mm256_hadd_ps(a, b), cd = _mm256_hadd_ps(c, d);
  const __m256 abcd = _mm256_hadd_ps(ab, cd);  // [a b c d] of each 128-bit half
  return _mm_add_ps(_mm256_castps256_ps128(abcd), _mm256_extractf128_ps(abcd, 1));
}

// scores[r * ss + j] = q[r * qs, +kw) . keys[j * ks, +kw) for R rows and J keys, J * R a multiple of 4.
template <int Level, int R, int J>
KVF_INLINE void score_tile(float* scores, int ss, const float* q, int qs, const float* keys, int ks, int kw) {
  __m256 sum[R][J];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < J; ++j) sum[r][j] = _mm256_setzero_ps();
  for (int e = 0; e < kw; e += 8) {
    __m256 key[J];
    for (int j = 0; j < J; ++j) key[j] = _mm256_loadu_ps(keys + j * ks + e);
    for (int r = 0; r < R; ++r) {
      const __m256 query = _mm256_loadu_ps(q + r * qs + e);
      for (int j = 0; j < J; ++j) sum[r][j] = _mm256_fmadd_ps(query, key[j], sum[r][j]);
    }
  }
  const __m256* flat = &sum[0][0];
  for (int i = 0; i < R * J; i += 4) {
    alignas(16) float dots[4];
    _mm_store_ps(dots, sum4<Level>(flat[i], flat[i + 1], flat[i + 2], flat[i + 3]));
    for (int k = 0; k < 4; ++k) scores[((i + k) / J) * ss + (i + k) % J] = dots[k];
  }
}

// One row's dot product with one key.
template <int Level> KVF_INLINE float score_one(const float* q, const float* key, int kw) {
  __m256 a = _mm256_setzero_ps(), b = _mm256_setzero_ps();
  int e = 0;
  for (; e + 16 <= kw; e += 16) {
    a = _mm256_fmadd_ps(_mm256_loadu_ps(q + e), _mm256_loadu_ps(key + e), a);
    b = _mm256_fmadd_ps(_mm256_loadu_ps(q + e + 8), _mm256_loadu_ps(key + e + 8), b);
  }
  if (e < kw) a = _mm256_fmadd_ps(_mm256_loadu_ps(q + e), _mm256_loadu_ps(key + e), a);
  return sum8<Level>(_mm256_add_ps(a, b));
}

// acc[r * as, +8V) += sum over j < nb of w[r * ws + j] * values[j * vs, +8V), for R rows.
template <int Level, int R, int V>
KVF_INLINE void accumulate_tile(float* acc, int as, const float* w, int ws, const float* values, int vs, int nb) {
  __m256 out[R][V];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < V; ++v) out[r][v] = _mm256_loadu_ps(acc + r * as + 8 * v);
  for (int j = 0; j < nb; ++j) {
    __m256 value[V];
    for (int v = 0; v < V; ++v) value[v] = _mm256_loadu_ps(values + j * vs + 8 * v);
    for (int r = 0; r < R; ++r) {
      const __m256 weight = _mm256_broadcast_ss(w + r * ws + j);
      for (int v = 0; v < V; ++v) out[r][v] = _mm256_fmadd_ps(weight, value[v], out[r][v]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < V; ++v) _mm256_storeu_ps(acc + r * as + 8 * v, out[r][v]);
}

// e^x for 8 values x <= 0, NaN kept: attend_ops.hpp's attend_exp, the same polynomial and bounds (n rounds half to
// even here, half away from zero there: either way f lies in [-1/2, 1/2], where the polynomial holds).
template <int Level> KVF_INLINE __m256 exp8(__m256 x) {
  const __m256 floor = _mm256_set1_ps(-87.0f);
  const __m256 underflow = _mm256_cmp_ps(x, floor, _CMP_LE_OQ);  // e^x is 0 there (and for -inf)
  x = _mm256_max_ps(floor, x);  // a NaN x stays NaN (max takes its second operand where one is NaN)
  const __m256 t = _mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f));
  const __m256 n = _mm256_round_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m256 f = _mm256_sub_ps(t, n);
  __m256 p = _mm256_set1_ps(1.5353362e-4f);
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.3398874e-3f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(9.6180800e-3f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(5.5503339e-2f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(2.4022652e-1f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(6.9314718e-1f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f));
  const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_andnot_ps(underflow, _mm256_mul_ps(p, _mm256_castsi256_ps(bits)));
}
#endif

// s[j] = e^(s[j] - m) for j < n, every s[j] <= m; returns their sum. False (nothing written) where the
// level has no vector loop.
template <int Level> KVF_INLINE bool exp_sum(float* s, int n, float m, float& sum) {
#if defined(__AVX2__) && defined(__FMA__)
  if constexpr (Level >= 3) {
    const __m256 max = _mm256_set1_ps(m);
    __m256 total = _mm256_setzero_ps();
    int j = 0;
    for (; j + 8 <= n; j += 8) {
      const __m256 e = exp8<Level>(_mm256_sub_ps(_mm256_loadu_ps(s + j), max));
      _mm256_storeu_ps(s + j, e);
      total = _mm256_add_ps(total, e);
    }
    if (j < n) {  // the tail through a masked load and store
      alignas(32) int lanes[8];
      for (int i = 0; i < 8; ++i) lanes[i] = j + i < n ? -1 : 0;
      const __m256i mask = _mm256_load_si256(reinterpret_cast<const __m256i*>(lanes));
      const __m256 e = _mm256_and_ps(_mm256_castsi256_ps(mask), exp8<Level>(_mm256_sub_ps(_mm256_maskload_ps(s + j, mask), max)));
      _mm256_maskstore_ps(s + j, mask, e);
      total = _mm256_add_ps(total, e);
    }
    sum = sum8<Level>(total);
    return true;
  }
#endif
  (void)s, (void)n, (void)m, (void)sum;
  return false;
}

// scores[r * ss + j] = q[r * qs, +kw) . keys[j * ks, +kw), r < rows, j < nb. False (nothing written)
// where the level has no vector loop for it.
template <int Level>
KVF_INLINE bool scores(float* scores, int ss, const float* q, int qs, const float* keys, int ks, int rows, int nb, int kw) {
#if defined(__AVX2__) && defined(__FMA__)
  if constexpr (Level >= 3) {
    if (kw % 8 != 0) return false;
    int r = 0;
    for (; r + 4 <= rows; r += 4) {
      int j = 0;
      for (; j + 2 <= nb; j += 2) score_tile<Level, 4, 2>(scores + r * ss + j, ss, q + r * qs, qs, keys + j * ks, ks, kw);
      for (; j < nb; ++j)
        for (int i = 0; i < 4; ++i) scores[(r + i) * ss + j] = score_one<Level>(q + (r + i) * qs, keys + j * ks, kw);
    }
    for (; r < rows; ++r) {
      int j = 0;
      for (; j + 4 <= nb; j += 4) score_tile<Level, 1, 4>(scores + r * ss + j, ss, q + r * qs, qs, keys + j * ks, ks, kw);
      for (; j < nb; ++j) scores[r * ss + j] = score_one<Level>(q + r * qs, keys + j * ks, kw);
    }
    return true;
  }
#endif
  (void)scores, (void)ss, (void)q, (void)qs, (void)keys, (void)ks, (void)rows, (void)nb, (void)kw;
  return false;
}

// acc[r * as + e] += sum over j < nb of w[r * ws + j] * values[j * vs + e], r < rows, e < vw. False
// (nothing written) where the level has no vector loop for it.
template <int Level>
KVF_INLINE bool accumulate(float* acc, int as, const float* w, int ws, const float* values, int vs, int rows, int nb, int vw) {
#if defined(__AVX2__) && defined(__FMA__)
  if constexpr (Level >= 3) {
    if (vw % 8 != 0) return false;
    int r = 0;
    for (; r + 4 <= rows; r += 4) {
      int e = 0;
      for (; e + 16 <= vw; e += 16) accumulate_tile<Level, 4, 2>(acc + r * as + e, as, w + r * ws, ws, values + e, vs, nb);
      if (e < vw) accumulate_tile<Level, 4, 1>(acc + r * as + e, as, w + r * ws, ws, values + e, vs, nb);
    }
    for (; r < rows; ++r) {
      int e = 0;
      for (; e + 32 <= vw; e += 32) accumulate_tile<Level, 1, 4>(acc + r * as + e, as, w + r * ws, ws, values + e, vs, nb);
      for (; e < vw; e += 8) accumulate_tile<Level, 1, 1>(acc + r * as + e, as, w + r * ws, ws, values + e, vs, nb);
    }
    return true;
  }
#endif
  (void)acc, (void)as, (void)w, (void)ws, (void)values, (void)vs, (void)rows, (void)nb, (void)vw;
  return false;
}

}  // namespace kvforge::detail::attend_tiles
