// The CPU executor: items run on OpenMP threads; each body moves whole rows with memcpy, which the
// compiler turns into vector loads and stores for the compile-time row length.
//
// `Level` is the x86-64 level the enclosing file is compiled for (cpu_ops.hpp). It is part of every
// kernel's type, so the kernels built for different levels never share a symbol: the linker cannot
// swap an AVX-512 body in where the SSE4.2 one was meant.
#pragma once

#include <immintrin.h>
#include <omp.h>

#include <cstdint>
#include <cstring>
#include <type_traits>

#include "kvforge/detail/host_checks.hpp"
#include "kvforge/cpu_level.hpp"
#include "kvforge/backends/cpu/attend_tiles.hpp"
#include "kvforge/backends/cpu/code_rows.hpp"
#include "kvforge/detail/op_args.hpp"
#include "kvforge/detail/op_table.hpp"

namespace kvforge::detail {

template <int Level> struct CpuExec {
  int64_t parallel_bytes;  // Tuning::cpu_parallel_bytes: below this much data an operation runs on one thread
  int chunk_items;         // Tuning::cpu_chunk_items; 0: one even chunk per thread
  bool stream_stores;      // Launch::stream_stores: rows go to memory past the caches (copy_row)

  // Whether this thread's row copies use non-temporal stores: set for one parallel region of an
  // operation whose Launch asks for it, and fenced at its end, before the threads join.
  static bool& streaming() {
    static thread_local bool on = false;
    return on;
  }
  struct StreamingScope {
    explicit StreamingScope(bool on) { streaming() = on; }
    ~StreamingScope() {
      if (streaming()) _mm_sfence();
      streaming() = false;
    }
  };

  // Tokens a thread takes at once when an operation walks a tile head by head (ops.hpp,
  // walk_heads_outside): up to 256, 64 KiB runs of one head at head_dim 128 in bf16. A 1k-token
  // gather from a 1 GiB [row, head, seq, dim] pool took 0.8x the time with 256 as with 64.
  static constexpr int kTileItems = 256;

  // Tokens per tile for `items` tokens: at most `longest` (a layout's bound), and fewer so that every
  // thread gets a tile (a 64-token decode step must not run on one core).
  static int tile_for(int64_t items, int longest) {
    const int64_t threads = cpu_threads();
    const int64_t even = (items + threads - 1) / threads;
    return int(even < 1 ? 1 : even < longest ? even : longest);
  }

  static CpuExec from(const Launch& l) {
    return CpuExec{l.tuning.cpu_parallel_bytes, int(l.tuning.cpu_chunk_items), l.stream_stores};
  }

  // Runs body(item, 0, 1) for every item, after `checks` (which throw on the first bad entry). An item
  // is one thread here, whatever lanes CUDA would give it.
  template <int Lanes, class Body>
  void for_each_item(int64_t items, Fixed<Lanes>, int64_t item_bytes, Body body,
                     const IndexChecks& checks = IndexChecks{}) const {
    check_indices_on_host(checks);
    if (items <= 0) return;
    const int threads = cpu_threads();
    if (items * item_bytes < parallel_bytes || threads == 1) {
      // Below the threshold the loop runs right here: even `omp parallel if (false)` enters the
      // OpenMP runtime, which costs about half a microsecond, as much as a small decode step's work.
      const StreamingScope scope(stream_stores);
      for (int64_t i = 0; i < items; ++i) body(i, 0, 1);
      return;
    }
#pragma omp parallel num_threads(threads)
    {
      const StreamingScope scope(stream_stores);
      if (chunk_items > 0) {
#pragma omp for schedule(dynamic, chunk_items) nowait
        for (int64_t i = 0; i < items; ++i) body(i, 0, 1);
      } else {
#pragma omp for schedule(static) nowait
        for (int64_t i = 0; i < items; ++i) body(i, 0, 1);
      }
    }
  }

  // An item is one thread here, so its lanes' maximum is its own value.
  template <int Lanes, int Group = Lanes> static uint32_t lane_max(uint32_t value) { return value; }
  template <int Lanes> static uint32_t item_max(uint32_t value) { return value; }
  // Rows are quantized whole (quant_ops.hpp), not in CUDA's 16-byte chunks, and an item copies its token once
  // it knows where it goes: a core's out-of-order window already overlaps the loads that CUDA's lanes
  // must issue up front.
  static constexpr bool kChunkedQuant = false;
  static constexpr bool kHoldsTokens = false;
  // Ring appends of at most this many tokens take row lengths from a scan of their targets in each item
  // (ops.hpp, write): quadratic in tokens, so only where that costs less than a pass of its own.
  static constexpr int64_t kScannedRingTokens = 16;
  // Attention (attend/attend_ops.hpp): the query rows one item holds (a tile of queries times the query
  // heads of a KV head: 16 prefill queries of llama3-8b's four, a decode's 4), and the positions decoded
  // into fp32 at once: 32 rows of 128 K and V values are 32 KiB, an L1 cache.
  static constexpr int kAttendRows = kAttendRowsCpu;
  static constexpr int kAttendBlock = 32;

  // Row primitives. An item is one thread, which takes each row whole: the loop bounds are constants,
  // so the compiler vectorizes them.
  static constexpr int row_begin(int /*lane*/) { return 0; }
  static constexpr int row_step(int /*lanes*/) { return 1; }

  // Sizes come as Fixed<N> (generated variants: constant loop bounds and memcpy sizes) or as int
  // (runtime-sized traits): one body serves both.
  template <class DExt, class Dst, class Src> static KVF_INLINE void copy_row(Dst* dst, const Src* src, DExt d) {
    if constexpr (std::is_same_v<Dst, Src>) {
      const size_t bytes = size_t(int(d)) * sizeof(Dst);
      if (streaming() && stream_row(dst, src, bytes)) return;
      // Rows move in 16-byte pieces at every level. GCC moves a row of up to 256 bytes so for v2 and v3,
      // but a longer one (an MLA record's 576 bytes, fp32 rows of 128) with `rep movsq`, whose start-up
      // cost made 80% of a DeepSeek-V3 decode append's time on this EPYC. With AVX-512 on it moves
      // rows in 64- and 32-byte pieces, which ran a decode append into [row, head, seq, dim] (rows
      // 4 KiB apart) at half the speed (bench/RESULTS.md, section 8).
      if (bytes % 16 == 0) {
#pragma GCC unroll 16
        for (size_t i = 0; i < bytes; i += 16)
          std::memcpy(reinterpret_cast<char*>(dst) + i, reinterpret_cast<const char*>(src) + i, 16);
        return;
      }
      std::memcpy(dst, src, bytes);
    } else {
      for (int i = 0; i < int(d); ++i) dst[i] = convert<Dst>(src[i]);
    }
  }

  // A row written with non-temporal stores of the level's widest vector, where it is aligned to one
  // and a whole number of them; false (nothing written) otherwise.
  static KVF_INLINE bool stream_row(void* dst, const void* src, size_t bytes) {
    constexpr size_t kVector = Level >= 4 ? 64 : Level >= 3 ? 32 : 16;
    if (reinterpret_cast<uintptr_t>(dst) % kVector != 0 || bytes % kVector != 0) return false;
    char* out = static_cast<char*>(dst);
    const char* in = static_cast<const char*>(src);
    for (size_t i = 0; i < bytes; i += kVector) {
      if constexpr (Level >= 4) {
        _mm512_stream_si512(reinterpret_cast<__m512i*>(out + i), _mm512_loadu_si512(in + i));
      } else if constexpr (Level >= 3) {
        _mm256_stream_si256(reinterpret_cast<__m256i*>(out + i), _mm256_loadu_si256(reinterpret_cast<const __m256i*>(in + i)));
      } else {
        _mm_stream_si128(reinterpret_cast<__m128i*>(out + i), _mm_loadu_si128(reinterpret_cast<const __m128i*>(in + i)));
      }
    }
    return true;
  }

  // All heads of one item, each a row of head_dim elements, converting types where they differ.
  template <class HExt, class DExt, class Dst, class Src>
  static KVF_INLINE void copy_heads(Dst* dst, int64_t dst_head_stride, const Src* src, int64_t src_head_stride, HExt heads,
                                    DExt head_dim, int /*lane*/, int /*lanes*/) {
    for (int h = 0; h < int(heads); ++h) copy_row(dst + h * dst_head_stride, src + h * src_head_stride, head_dim);
  }

  // K's and V's heads of one token (the CUDA executor interleaves their loads; here, K then V).
  template <class HExt, class DExt, class Dst, class Src>
  static KVF_INLINE void copy_heads_kv(TokenHeads<Dst> k_dst, TokenHeads<Dst> v_dst, TokenHeads<const Src> k_src,
                                       TokenHeads<const Src> v_src, HExt heads, DExt head_dim, int lane, int lanes) {
    copy_heads(k_dst.data, k_dst.head_stride, k_src.data, k_src.head_stride, heads, head_dim, lane, lanes);
    copy_heads(v_dst.data, v_dst.head_stride, v_src.data, v_src.head_stride, heads, head_dim, lane, lanes);
  }

  template <class HExt, class DExt, class Dst>
  static KVF_INLINE void zero_heads(Dst* dst, int64_t dst_head_stride, HExt heads, DExt head_dim, int /*lane*/,
                                    int /*lanes*/) {
    for (int h = 0; h < int(heads); ++h)
      std::memset(static_cast<void*>(dst + h * dst_head_stride), 0, size_t(int(head_dim)) * sizeof(Dst));
  }

  // A row of n values into 8-bit codes of value / scale, in this level's vectors (code_rows.hpp). Only
  // where the level has a vector loop for Code and In: row_codecs.hpp takes its portable one otherwise.
  template <class Code, class In,
            class = std::enable_if_t<code_rows::kVectorCode<Code> && code_rows::kVectorInput<In> &&
                                     (code_rows::width<Level, Code>() > 1)>>
  static KVF_INLINE void encode_code_row(Code* dst, const In* src, float scale, int n) {
    code_rows::encode<Level>(dst, src, scale, n);
  }

  // And back: n codes into their values times scale, in fp32 (the attend job's tiles, gathers into fp32).
  template <class Code, class = std::enable_if_t<(code_rows::decode_width<Level, Code>() > 1)>>
  static KVF_INLINE void decode_code_row(float* dst, const Code* src, float scale, int n) {
    code_rows::decode<Level>(dst, src, scale, n);
  }

  // An attend block's products and exponentials in this level's vectors (attend_tiles.hpp); false where
  // the level or the width has none, and attend_ops.hpp takes its portable loops.
  //   scores[r * ss + j] = q[r * qs, +kw) . keys[j * ks, +kw)            r < rows, j < nb
  //   acc[r * as + e] += sum over j of w[r * ws + j] * values[j * vs + e]  r < rows, e < vw
  static KVF_INLINE bool attend_scores(float* scores, int ss, const float* q, int qs, const float* keys, int ks, int rows,
                                       int nb, int kw) {
    return attend_tiles::scores<Level>(scores, ss, q, qs, keys, ks, rows, nb, kw);
  }
  //   s[j] = e^(s[j] - m), j < n, and `sum` their sum
  static KVF_INLINE bool attend_exp_sum(float* s, int n, float m, float& sum) {
    return attend_tiles::exp_sum<Level>(s, n, m, sum);
  }
  static KVF_INLINE bool attend_accumulate(float* acc, int as, const float* w, int ws, const float* values, int vs,
                                           int rows, int nb, int vw) {
    return attend_tiles::accumulate<Level>(acc, as, w, ws, values, vs, rows, nb, vw);
  }

  // Asks for [at, at + bytes) into the caches ahead of a read (attend_ops.hpp says where).
  static KVF_INLINE void prefetch(const void* at, int bytes) {
    const char* p = static_cast<const char*>(at);
    for (int i = 0; i < bytes; i += 64) _mm_prefetch(p + i, _MM_HINT_T0);
  }

  static void atomic_max(int32_t* target, int32_t value) {
    int32_t seen = __atomic_load_n(target, __ATOMIC_RELAXED);
    while (seen < value &&
           !__atomic_compare_exchange_n(target, &seen, value, true, __ATOMIC_RELAXED, __ATOMIC_RELAXED)) {
    }
  }
};


}  // namespace kvforge::detail
