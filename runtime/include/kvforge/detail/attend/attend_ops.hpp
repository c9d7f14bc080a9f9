// Attention over one layer's history where it lies: the one source of the attend job, run by each
// backend's executor (the CPU's threads; CUDA's threads, an item each). One template serves decode (one
// query a sequence) and prefill (a chunk of them), every addressing, axis order and storage: a position's
// K and V are found by the layout's own address formula (locate_position, element_offset) and decoded by
// the codecs the writes and gathers use (decode_head, PartRecord::decode_whole), a block of positions at
// a time into a tile of fp32 values that never outgrows the block.
//
// An item is (sequence, tile of its queries, KV head, chunk of that head's query heads, split of the
// positions): a KV head's rows are read once for all the query heads it serves (GQA, MQA, MLA's one
// latent head). Its rows of queries run one online softmax each (a running maximum m, sum l and output
// acc, rescaled as m grows: FlashAttention's recurrence). Split positions (flash-decoding) leave their
// partial (acc, m, l) for a second pass that merges them exactly by their log-sum-exp.
//
// A token's decoded row, both halves of the head (K then V, 2 * head_dim values), holds the key and the
// value as two spans: K and V for a plain layout; for an MLA record [latent | rope] the key is all of it
// and the value the latent (the absorbed form: queries and outputs in the latent space); for K and V of
// other widths the record's two parts.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "kvforge/detail/attend/attend_args.hpp"
#include "kvforge/detail/quant_ops.hpp"
#include "kvforge/errors.hpp"

namespace kvforge::detail {

// e^x for x <= 0 (every exponent the recurrence takes), within |x| 2^-24 plus about 2 ulp, relative (the
// first from the rounding of x log2 e: 5e-6 at x = -87, where a weight is 1e-38 of the block's largest
// and adds nothing to a sum), in operations a loop vectorizes (a libm call does not): e^x = 2^n * 2^f,
// n = round(x log2 e), 2^f by a degree-6 polynomial on [-1/2, 1/2]. Below -87 it is 0, as e^x is in fp32 to within its smallest normal.
KVF_HD KVF_INLINE float attend_exp(float x) {
  x = x < -87.0f ? -87.0f : x;
  const float t = x * 1.44269504088896341f;
  const float n = t >= 0.0f ? float(int(t + 0.5f)) : -float(int(0.5f - t));
  const float f = t - n;
  float p = 1.5353362e-4f;
  p = p * f + 1.3398874e-3f;
  p = p * f + 9.6180800e-3f;
  p = p * f + 5.5503339e-2f;
  p = p * f + 2.4022652e-1f;
  p = p * f + 6.9314718e-1f;
  p = p * f + 1.0f;
  const uint32_t bits = uint32_t(int(n) + 127) << 23;
  float scale;
  memcpy(&scale, &bits, sizeof scale);
  return x <= -87.0f ? 0.0f : p * scale;
}

// The widths of a token's key and value in its decoded row, from the model's record (descriptor.hpp),
// and the tiles they size. Runtime-sized traits (the generic path) size them by the widest head they take.
template <class Traits> struct AttendShape {
  static constexpr bool kRuntime = has_runtime_extents<Traits>::value;
  static constexpr int kMla = mla_traits<Traits>::kv_lora_rank;
  static constexpr int kMlaRope = mla_traits<Traits>::rope_dim;
  static constexpr int kKWidth = kv_width_traits<Traits>::k_head_dim;
  static constexpr int kVWidth = kv_width_traits<Traits>::v_head_dim;
  static constexpr int key_width(int head_dim) { return kMla ? kMla + kMlaRope : kKWidth ? kKWidth : head_dim; }
  static constexpr int value_offset(int head_dim) { return kMla ? 0 : kKWidth ? kKWidth : head_dim; }
  static constexpr int value_width(int head_dim) { return kMla ? kMla : kKWidth ? kVWidth : head_dim; }
  static constexpr int kMaxRuntimeDim = 512;
  static constexpr int kRowDim = kRuntime ? kMaxRuntimeDim : fixed_extents<Traits>().head_dim;  // half a row
  static constexpr int kKeyMax = kRuntime ? kMaxRuntimeDim : key_width(kRowDim);
  static constexpr int kValueMax = kRuntime ? kMaxRuntimeDim : value_width(kRowDim);
  // Query rows an item holds on an executor that asks for `exec_rows`: fewer where wide rows would
  // pass 64 KiB of queries (an MLA query is 576 values). The host plans by the same number.
  static constexpr int max_rows(int exec_rows) {
    const int cap = 16384 / kKeyMax < 1 ? 1 : 16384 / kKeyMax;
    return exec_rows < cap ? exec_rows : cap;
  }
};

// Whether an executor computes an attend block's products and exponentials in vectors of its own (the
// CPU's attend_scores, attend_exp_sum and attend_accumulate).
template <class Exec, class = void> struct HasAttendTiles : std::false_type {};
template <class Exec>
struct HasAttendTiles<Exec, std::void_t<decltype(Exec::attend_scores(nullptr, 0, nullptr, 0, nullptr, 0, 0, 0, 0)),
                                        decltype(Exec::attend_accumulate(nullptr, 0, nullptr, 0, nullptr, 0, 0, 0, 0)),
                                        decltype(Exec::attend_exp_sum(nullptr, 0, 0.0f, std::declval<float&>()))>>
    : std::true_type {};

// Whether an executor can ask for memory ahead of its reads (the CPU's prefetch).
template <class Exec, class = void> struct HasPrefetch : std::false_type {};
template <class Exec>
struct HasPrefetch<Exec, std::void_t<decltype(Exec::prefetch(static_cast<const void*>(nullptr), 0))>> : std::true_type {};

template <class Traits, class Exec> struct AttendOps : QuantOps<Traits, Exec> {
  using O = QuantOps<Traits, Exec>;
  using Store = typename O::Store;
  using In = typename O::In;
  using Spans = AttendShape<Traits>;
  static constexpr bool kRuntime = O::kRuntime;
  static constexpr int kRowDim = Spans::kRowDim;
  static constexpr int kKeyMax = Spans::kKeyMax;
  static constexpr int kValueMax = Spans::kValueMax;
  static constexpr int kMaxRows = Spans::max_rows(Exec::kAttendRows);
  static constexpr int kBlock = Exec::kAttendBlock;  // positions decoded at once

  KVF_HD static KVF_INLINE int key_width(const Extents& e) {
    if constexpr (kRuntime) return e.head_dim; else return Spans::key_width(O::D);
  }
  KVF_HD static KVF_INLINE int value_width(const Extents& e) {
    if constexpr (kRuntime) return e.head_dim; else return Spans::value_width(O::D);
  }
  KVF_HD static KVF_INLINE int value_offset(const Extents& e) {
    if constexpr (kRuntime) return e.head_dim; else return Spans::value_offset(O::D);
  }

  // Quantized heads of one scale each (per tensor, token or token-head; a group the whole head), where
  // the key is the K row and the value the V row: the block's tile holds their codes' values unscaled,
  // and the loop takes each position's two scales once (the key's on its dot products, the value's on
  // its weights), not a multiply a value. Not MLA's, whose key spans both rows and whose value is K's.
  static constexpr bool kScalesOutside = O::kQuantized && !O::kRecord && !O::kZeroPoint && O::kGroups == 1 &&
                                         Spans::kMla == 0 && Spans::kKWidth == 0;

  // Both halves of head h of the token at (unit, slot), as fp32: row[0, D) its K row, row[D, 2D) its V.
  // Where kScalesOutside, the values unscaled and kv_scale[0, 2) K's and V's scales.
  KVF_HD static KVF_INLINE void decode_token_head(const AttendArgs<Store, In>& a, int64_t unit, int64_t slot, int h,
                                                  float* row, float* kv_scale) {
    const int d = int(O::head_dim(a.ext));
    if constexpr (O::kRecord) {
      using R = typename O::Record;
      if constexpr (R::kTail > 0) {  // one head: the page's records, then their scales
        const auto* page = reinterpret_cast<const uint8_t*>(a.pool + element_offset(a.s, a.layer, 0, unit, 0));
        const uint8_t *record = page + slot * R::kBytes, *tail = page + O::P * R::kBytes + slot * R::kTail;
        R::decode_whole(record, record + R::kSplit, tail, row, row + d);
      } else {
        const auto* record = reinterpret_cast<const uint8_t*>(a.pool + element_offset(a.s, a.layer, 0, unit, slot));
        R::decode_whole(record + h * a.s.head, record + a.s.kv + h * a.s.head, nullptr, row, row + d);
      }
    } else {
      const Store* src = a.pool + element_offset(a.s, a.layer, 0, unit, slot) + h * a.s.head;
      if constexpr (kScalesOutside) {
        const float unscaled = 1.0f;
        for (int kv = 0; kv < 2; ++kv) {
          const auto* stored = O::scale_at(a.scales, a.layer, kv, unit, slot) + h * a.scales.s.head;
          kv_scale[kv] = O::scale_value(stored[0], O::tensor_scale(a.scales, a.layer, kv));
          decode_groups<O::D, O::kGroup, Exec>(row + kv * d, src + kv * a.s.kv, &unscaled, 0, 1);
        }
      } else if constexpr (O::kQuantized) {
        for (int kv = 0; kv < 2; ++kv)
          O::decode_head(row + kv * d, src + kv * a.s.kv, O::scale_at(a.scales, a.layer, kv, unit, slot) + h * a.scales.s.head,
                         O::tensor_scale(a.scales, a.layer, kv), 0, 1);
      } else {
        for (int i = 0; i < d; ++i) row[i] = to_float(src[i]);
        const Store* v = src + a.s.kv;
        for (int i = 0; i < d; ++i) row[d + i] = to_float(v[i]);
      }
    }
  }

  // A block's scores, scores[r * ss + j] = q[r * qs, +kw) . keys[j * ks, +kw), their exponentials, and
  // its values' weighted sum, acc[r * as + e] += sum over j of w[r * ws + j] * values[j * vs + e]: the
  // executor's vector tiles where it has them (the CPU's, attend_tiles.hpp), these loops otherwise.
  KVF_HD static KVF_INLINE void block_scores(float* scores, int ss, const float* q, int qs, const float* keys, int ks,
                                             int rows, int nb, int kw) {
    if constexpr (HasAttendTiles<Exec>::value)
      if (Exec::attend_scores(scores, ss, q, qs, keys, ks, rows, nb, kw)) return;
    for (int r = 0; r < rows; ++r)
      for (int j = 0; j < nb; ++j) {
        const float *qr = q + r * qs, *key = keys + j * ks;
        float dot = 0.0f;
KVF_SIMD_SUM(dot)
        for (int e = 0; e < kw; ++e) dot += qr[e] * key[e];
        scores[r * ss + j] = dot;
      }
  }
  // s[j] = e^(s[j] - m) for j < n (every s[j] <= m), and their sum.
  KVF_HD static KVF_INLINE float block_exp_sum(float* s, int n, float m) {
    float sum = 0.0f;
    if constexpr (HasAttendTiles<Exec>::value)
      if (Exec::attend_exp_sum(s, n, m, sum)) return sum;
KVF_SIMD_SUM(sum)
    for (int j = 0; j < n; ++j) {
      const float e = attend_exp(s[j] - m);
      s[j] = e;
      sum += e;
    }
    return sum;
  }
  KVF_HD static KVF_INLINE void block_accumulate(float* acc, int as, const float* w, int ws, const float* values, int vs,
                                                 int rows, int nb, int vw) {
    if constexpr (HasAttendTiles<Exec>::value)
      if (Exec::attend_accumulate(acc, as, w, ws, values, vs, rows, nb, vw)) return;
    for (int r = 0; r < rows; ++r) {
      float* out = acc + r * as;
      for (int j = 0; j < nb; ++j) {
        const float weight = w[r * ws + j];
        const float* value = values + j * vs;
KVF_SIMD
        for (int e = 0; e < vw; ++e) out[e] += weight * value[e];
      }
    }
  }

  // Asks for the rows of head h of the token at (unit, slot) ahead of decode_token_head: a block of
  // positions is decoded while the one before it computes, so that its rows need not wait on memory.
  // A row of [position, head, dim] is one head's share of a token (2 KiB apart in llama3-8b's NHD
  // pages), a stride the hardware's prefetchers do not follow. Only where the executor can (not CUDA's,
  // whose lanes read a row together) and the rows are plain (a record's codes are decoded whole).
  static constexpr bool kPrefetches = HasPrefetch<Exec>::value && !O::kRecord;
  KVF_HD static KVF_INLINE void prefetch_token_head(const AttendArgs<Store, In>& a, int64_t unit, int64_t slot, int h) {
    const Store* src = a.pool + element_offset(a.s, a.layer, 0, unit, slot) + h * a.s.head;
    const int bytes = int(O::head_dim(a.ext) * int64_t(sizeof(Store)) / kValuesPerElement<Store>);
    Exec::prefetch(src, bytes);
    Exec::prefetch(src + a.s.kv, bytes);
  }

  // Query i of sequence b (of n) sees positions [lo, hi).
  KVF_HD static KVF_INLINE void visible(const AttendArgs<Store, In>& a, int b, int64_t t, int64_t i, int64_t n,
                                        int64_t& lo, int64_t& hi) {
    const int64_t len = a.lengths[b];
    const int64_t p = !a.causal ? len - 1 : a.positions ? int64_t(a.positions[t]) : len - n + i;
    hi = p + 1;
    lo = a.window > 0 && p - a.window + 1 > 0 ? p - a.window + 1 : 0;
    if (a.begins && a.begins[b] > lo) lo = a.begins[b];
  }

  static void attend(const Exec& ex, const AttendArgs<Store, In>& a) {
    const AttendPlan plan = a.plan;
    // The host plans by AttendShape::max_rows of the backend's kAttendRows*: a tile past this item's
    // arrays would be a planning bug, never a user's.
    if (plan.query_tile * plan.head_chunk > kMaxRows) throw BackendError("attend: a tile of more query rows than an item holds");
    const int64_t items = plan.items() * int64_t(O::heads(a.ext));
    // An item reads a share of a sequence's history: worth a thread of its own at any size, so the
    // bytes given to the executor's threshold are the most it could read.
    const int64_t item_bytes = int64_t(1) << 30;
    ex.for_each_item(items, Fixed<1>{}, item_bytes, [a] KVF_HD(int64_t item, int, int) { attend_item(a, item); }, a.checks);
    if (plan.splits > 1)
      ex.for_each_item(int64_t(plan.batch) * plan.query_tiles * plan.query_tile * a.q_heads, Fixed<1>{},
                       int64_t(plan.splits) * (kValueMax + 2) * int64_t(sizeof(float)),
                       [a] KVF_HD(int64_t row, int, int) { merge_row(a, row); }, IndexChecks{});
  }

  // One item's queries over one split of their positions.
  KVF_HD static void attend_item(const AttendArgs<Store, In>& a, int64_t item) {
    if (a.status->code) return;
    const AttendPlan& p = a.plan;
    const int H = int(O::heads(a.ext));
    const int split = int(item % p.splits);
    int64_t rest = item / p.splits;
    const int chunk = int(rest % p.head_chunks);
    rest /= p.head_chunks;
    const int h = int(rest % H);
    rest /= H;
    const int tile = int(rest % p.query_tiles);
    const int b = int(rest / p.query_tiles);
    const int64_t first_query = a.query_start[b], n = a.query_start[b + 1] - first_query;
    const int64_t tile_first = int64_t(tile) * p.query_tile;
    if (tile_first >= n) return;
    const int nq = int(n - tile_first < p.query_tile ? n - tile_first : p.query_tile);
    const int heads_here = p.head_chunk;
    const int rows = nq * heads_here;
    const int kw = key_width(a.ext), vw = value_width(a.ext), vo = value_offset(a.ext);
    const int first_head = h * a.group + chunk * p.head_chunk;  // query head of row 0

    // The rows' queries, scaled; each row's visible positions.
    float q[kMaxRows][kKeyMax];
    int64_t lo[kMaxRows], hi[kMaxRows];
    int64_t span_lo = INT64_MAX, span_hi = 0;
    for (int i = 0; i < nq; ++i) {
      const int64_t t = first_query + tile_first + i;
      int64_t l, u;
      visible(a, b, t, tile_first + i, n, l, u);
      span_lo = l < span_lo ? l : span_lo;
      span_hi = u > span_hi ? u : span_hi;
      for (int g = 0; g < heads_here; ++g) {
        const int r = i * heads_here + g;
        lo[r] = l, hi[r] = u;
        const In* src = a.q.data + t * a.q.token_stride + int64_t(first_head + g) * a.q.head_stride;
        for (int e = 0; e < kw; ++e) q[r][e] = to_float(src[e]) * a.scale;
      }
    }
    // This split's positions: an even share, whole blocks.
    const int64_t span = span_hi - span_lo;
    int64_t share = (span + p.splits - 1) / p.splits;
    share = (share + kBlock - 1) / kBlock * kBlock;
    const int64_t begin = span_lo + int64_t(split) * share;
    const int64_t end = begin + share < span_hi ? begin + share : span_hi;

    float m[kMaxRows], l[kMaxRows], acc[kMaxRows][kValueMax];
    for (int r = 0; r < rows; ++r) {
      m[r] = -INFINITY, l[r] = 0.0f;
      for (int e = 0; e < vw; ++e) acc[r][e] = 0.0f;
    }
    const int32_t* pages = a.page_table ? a.page_table + int64_t(b) * a.max_pages : nullptr;
    const int64_t row = a.rows ? int64_t(a.rows[b]) : 0;
    float kv[kBlock][2 * kRowDim];
    float kv_scale[kBlock][2];  // kScalesOutside: each position's K and V scale
    float s[kMaxRows][kBlock];
    for (int64_t j0 = begin; j0 < end; j0 += kBlock) {
      const int nb = int(end - j0 < kBlock ? end - j0 : kBlock);
      for (int j = 0; j < nb; ++j) {
        int64_t unit, slot;
        O::locate_position(a.ext, row, pages, j0 + j, unit, slot);
        decode_token_head(a, unit, slot, h, kv[j], kv_scale[j]);
        if constexpr (kPrefetches)
          if (j0 + kBlock + j < end) {
            O::locate_position(a.ext, row, pages, j0 + kBlock + j, unit, slot);
            prefetch_token_head(a, unit, slot, h);
          }
      }
      block_scores(s[0], kBlock, q[0], kKeyMax, kv[0], 2 * kRowDim, rows, nb, kw);
      for (int r = 0; r < rows; ++r) {
        // The row sees the block's positions [first, last): the rest weigh 0.
        const int64_t first_seen = lo[r] - j0, last_seen = hi[r] - j0;
        const int first = first_seen > 0 ? int(first_seen < nb ? first_seen : nb) : 0;
        const int last = last_seen > first ? int(last_seen < nb ? last_seen : nb) : first;
        float* sr = s[r];
        for (int j = 0; j < first; ++j) sr[j] = 0.0f;
        for (int j = last; j < nb; ++j) sr[j] = 0.0f;
        if (first == last) continue;  // nothing of this block is visible to the row
        float block_max = -INFINITY;
        for (int j = first; j < last; ++j) {
          float dot = sr[j];
          if constexpr (kScalesOutside) dot *= kv_scale[j][0];
          if (a.softcap > 0.0f) dot = a.softcap * tanhf(dot / a.softcap);
          sr[j] = dot;
          block_max = dot > block_max ? dot : block_max;
        }
        if (block_max == -INFINITY) {  // every visible score -inf (keys of inf): weights of 0, as e^-inf
          for (int j = first; j < last; ++j) sr[j] = 0.0f;
          continue;
        }
        const float m_new = block_max > m[r] ? block_max : m[r];
        if (m_new > m[r]) {
          const float correction = attend_exp(m[r] - m_new);  // 0 where m was -inf
          l[r] *= correction;
KVF_SIMD
          for (int e = 0; e < vw; ++e) acc[r][e] *= correction;
          m[r] = m_new;
        }
        l[r] += block_exp_sum(sr + first, last - first, m_new);
        if constexpr (kScalesOutside)
          for (int j = first; j < last; ++j) sr[j] *= kv_scale[j][1];
      }
      block_accumulate(acc[0], kValueMax, s[0], kBlock, kv[0] + vo, 2 * kRowDim, rows, nb, vw);
    }
    if (p.splits > 1) {
      float* part = a.partial + (item * kMaxRows) * int64_t(vw + 2);
      for (int r = 0; r < rows; ++r) {
        float* dst = part + int64_t(r) * (vw + 2);
        for (int e = 0; e < vw; ++e) dst[e] = acc[r][e];
        dst[vw] = m[r], dst[vw + 1] = l[r];
      }
      return;
    }
    for (int r = 0; r < rows; ++r) {
      const int64_t t = first_query + tile_first + r / heads_here;
      finish_row(a, t, first_head + r % heads_here, acc[r], m[r], l[r], vw);
    }
  }

  // A row's output from its merged (acc, m, l), with its head's sink in the denominator.
  KVF_HD static KVF_INLINE void finish_row(const AttendArgs<Store, In>& a, int64_t t, int qh, const float* acc, float m,
                                           float l, int vw) {
    if (a.sinks) {
      const float sink = a.sinks[qh];
      const float m_new = sink > m ? sink : m;
      l = l * attend_exp(m - m_new) + attend_exp(sink - m_new);
      const float correction = attend_exp(m - m_new);
      In* out = a.out.data + t * a.out.token_stride + int64_t(qh) * a.out.head_stride;
      const float inv = 1.0f / l;
      for (int e = 0; e < vw; ++e) out[e] = from_float<In>(acc[e] * correction * inv);
      if (a.lse) a.lse[t * a.lse_token_stride + qh] = m_new + logf(l);
      return;
    }
    In* out = a.out.data + t * a.out.token_stride + int64_t(qh) * a.out.head_stride;
    const float inv = l > 0.0f ? 1.0f / l : 0.0f;
    for (int e = 0; e < vw; ++e) out[e] = from_float<In>(acc[e] * inv);
    if (a.lse) a.lse[t * a.lse_token_stride + qh] = l > 0.0f ? m + logf(l) : -INFINITY;
  }

  // The second pass: one query row's splits merged by their maxima and sums. `index` walks every row
  // slot of every (sequence, tile); those past a sequence's queries return.
  KVF_HD static void merge_row(const AttendArgs<Store, In>& a, int64_t index) {
    if (a.status->code) return;
    const AttendPlan& p = a.plan;
    const int qh = int(index % a.q_heads);
    int64_t rest = index / a.q_heads;
    const int i = int(rest % p.query_tile);
    rest /= p.query_tile;
    const int tile = int(rest % p.query_tiles);
    const int b = int(rest / p.query_tiles);
    const int64_t first_query = a.query_start[b], n = a.query_start[b + 1] - first_query;
    const int64_t query = int64_t(tile) * p.query_tile + i;
    if (query >= n) return;
    const int h = qh / a.group, chunk = (qh % a.group) / p.head_chunk, g = (qh % a.group) % p.head_chunk;
    const int vw = value_width(a.ext);
    const int r = i * p.head_chunk + g;
    const int64_t first_item = ((((int64_t(b) * p.query_tiles + tile) * int(O::heads(a.ext)) + h) * p.head_chunks + chunk) *
                                p.splits);
    float m = -INFINITY;
    for (int sp = 0; sp < p.splits; ++sp) {
      const float ms = a.partial[((first_item + sp) * kMaxRows + r) * int64_t(vw + 2) + vw];
      m = ms > m ? ms : m;
    }
    float acc[kValueMax];
    for (int e = 0; e < vw; ++e) acc[e] = 0.0f;
    float l = 0.0f;
    if (m != -INFINITY) {
      for (int sp = 0; sp < p.splits; ++sp) {
        const float* part = a.partial + ((first_item + sp) * kMaxRows + r) * int64_t(vw + 2);
        if (part[vw] == -INFINITY) continue;
        const float w = attend_exp(part[vw] - m);
        l += part[vw + 1] * w;
        for (int e = 0; e < vw; ++e) acc[e] += part[e] * w;
      }
    }
    finish_row(a, first_query + query, qh, acc, m, l, vw);
  }
};

}  // namespace kvforge::detail
