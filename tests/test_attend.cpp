// Cache::attend of every registered variant against attend_reference.hpp: softmax attention in double over
// the K and V that the variant's own dequantizing gather returns. Histories of lengths that are no multiple
// of a page, rings that have wrapped, ragged batches of decodes and causal chunks, GQA, MQA and MLA's
// absorbed form, windows, soft-caps, sinks, the log-sum-exp and an exact merge of two halves; and every
// refused argument leaves the output as it was.
//
// The tolerance, from the input dtype's unit roundoff u (fp32 2^-24, fp16 2^-11, bf16 2^-8) and the largest
// value |V| of the history: kvforge rounds its output to the input dtype (u |V|); the gather rounds
// dequantized values to it where storage is coded (u |V| on V, and on each score at most
// delta = scale * sum_e |q_e| |k_e| * u, which moves the softmax weights by 2 delta relatively: 2 delta |V|);
// fp32 accumulation over a few thousand positions and attend_exp's 2 ulp stay below 1e-5 |V|.
//   |out - reference| <= |V| (2u + 2 delta + 1e-5);  |lse - reference| <= 2 delta + 1e-5.
#include <functional>
#include <map>
#include <set>

#include "attend_reference.hpp"
#include "support.hpp"

namespace kvtest {
namespace {

double unit_roundoff(DType t) { return t == DType::f32 ? std::ldexp(1.0, -24) : t == DType::f16 ? std::ldexp(1.0, -11) : std::ldexp(1.0, -8); }

struct Scenario {
  std::string what;
  std::vector<int64_t> lengths;  // per sequence, after the writes
  std::vector<int64_t> queries;  // per sequence: 1 a decode, more a causal chunk
  int group = 1;                 // query heads a KV head serves
  bool causal = true;
  int window = 0;                // ring layouts: at most their window, which is taken where this is 0
  float softcap = 0;
  bool sinks = false;
  bool explicit_positions = false;
  std::vector<int32_t> begins;   // per sequence or empty: left padding, the first position a query sees
};

// A variant's cache with a random history per sequence, written through append (or append_record), and
// what its gather returns of it.
class History {
 public:
  History(const VariantEntry& e, const std::vector<int64_t>& lengths, uint32_t seed)
      : d_(*e.descriptor), arena_(Device::cpu), rng_(seed), lengths_(lengths) {
    row_ = 2 * d_.head_dim;
    kw_ = d_.mla() ? d_.mla_kv_lora_rank + d_.mla_rope_dim : d_.split_widths() ? d_.k_head_dim : d_.head_dim;
    vo_ = d_.mla() ? 0 : d_.split_widths() ? d_.k_head_dim : d_.head_dim;
    vw_ = d_.mla() ? d_.mla_kv_lora_rank : d_.split_widths() ? d_.v_head_dim : d_.head_dim;
    const int64_t sequences = int64_t(lengths.size());
    const int64_t longest = *std::max_element(lengths.begin(), lengths.end());
    int64_t tokens = 0;
    for (int64_t l : lengths) tokens += l;
    CacheConfig cfg;
    cfg.max_staged_tokens = tokens;
    if (d_.paged()) {
      pages_per_seq_ = (longest + d_.page_size - 1) / d_.page_size;
      cfg.pages = sequences * pages_per_seq_ + 2;
      std::vector<int32_t> order(size_t(cfg.pages));
      std::iota(order.begin(), order.end(), 0);
      std::shuffle(order.begin(), order.end(), rng_);
      table_.assign(order.begin(), order.begin() + sequences * pages_per_seq_);
    } else {
      cfg.rows = sequences + 1;
      cfg.max_seq_len = d_.addressing == Addressing::contiguous ? longest : 0;
    }
    cache_ = e.create(cfg);
    if (d_.takes_tensor_scale())
      for (int l = 0; l < d_.layers; ++l) cache_->set_tensor_scale(l, 0.5f + 0.25f * float(l % 3), 0.75f);
    layers_ = {0};
    if (d_.layers > 1) layers_.push_back(d_.layers - 1);
    for (int layer : layers_) write(layer);
    if (d_.lazy()) cache_->commit();
    for (int layer : layers_) read(layer);
  }

  bool ring() const { return d_.addressing == Addressing::ring; }
  // The oldest position the cache still holds of a sequence.
  int64_t oldest(int64_t b) const { return ring() ? std::max<int64_t>(0, lengths_[size_t(b)] - d_.window) : 0; }

  const VariantDescriptor& d_;
  Arena arena_;
  std::mt19937 rng_;
  std::vector<int64_t> lengths_;
  int row_, kw_, vo_, vw_;
  int64_t pages_per_seq_ = 0;
  std::vector<int32_t> table_;  // paged: [sequences, pages_per_seq_]
  std::unique_ptr<Cache> cache_;
  std::vector<int> layers_;
  // gathered_[layer][b]: [heads][positions from oldest(b)][row_] floats, K then V (or the record)
  std::map<int, std::vector<std::vector<float>>> gathered_;
  float largest_value_ = 0;

  const float* at(int layer, int64_t b, int h, int64_t pos) const {
    const int64_t n = lengths_[size_t(b)] - oldest(b);
    return gathered_.at(layer)[size_t(b)].data() + (int64_t(h) * n + (pos - oldest(b))) * row_;
  }

 private:
  std::vector<unsigned char> values(int64_t count, uint64_t key) {
    const int64_t es = dtype_size(d_.input);
    std::vector<unsigned char> out(size_t(count * es));
    for (int64_t i = 0; i < count; ++i) store_as(d_.input, exact_value(key * 1000003 + uint64_t(i)) / 16.0f, out.data() + i * es);
    return out;
  }
  void write(int layer) {
    const int H = d_.heads;
    const int64_t es = dtype_size(d_.input);
    // Rings take each sequence's positions in order, no more than a window a call, so that no call
    // writes one cell twice.
    const int64_t step = ring() ? std::min<int64_t>(d_.window, 16) : INT32_MAX;
    const int64_t longest = *std::max_element(lengths_.begin(), lengths_.end());
    for (int64_t first = 0; first < longest; first += step) {
      std::vector<int32_t> rows, positions;
      std::vector<int64_t> slots;
      for (int64_t b = 0; b < int64_t(lengths_.size()); ++b)
        for (int64_t p = first; p < std::min(lengths_[size_t(b)], first + step); ++p) {
          if (d_.paged()) {
            slots.push_back(int64_t(table_[size_t(b * pages_per_seq_ + p / d_.page_size)]) * d_.page_size + p % d_.page_size);
          } else {
            rows.push_back(int32_t(b));
            positions.push_back(int32_t(p));
          }
        }
      const int64_t tokens = d_.paged() ? int64_t(slots.size()) : int64_t(rows.size());
      const TokenTargets targets = d_.paged() ? TokenTargets::paged(arena_.index(slots))
                                              : TokenTargets::row_positions(arena_.index(rows), arena_.index(positions));
      auto data = values(tokens * H * row_, uint64_t(layer) * 7919 + uint64_t(first) + 1);
      if (d_.records()) {
        const int width = d_.record_width();
        if (width < row_)  // an odd record's pad is zero
          for (int64_t r = 0; r < tokens * H; ++r) store_as(d_.input, 0.0f, data.data() + ((r + 1) * row_ - 1) * es);
        cache_->append_record(layer, TensorView::contiguous(arena_.put(data), d_.input, Device::cpu, tokens, H, row_), targets);
      } else {
        std::vector<unsigned char> k(size_t(tokens * H * d_.head_dim * es)), v(k.size());
        for (int64_t r = 0; r < tokens * H; ++r) {
          std::memcpy(k.data() + r * d_.head_dim * es, data.data() + r * row_ * es, size_t(d_.head_dim * es));
          std::memcpy(v.data() + r * d_.head_dim * es, data.data() + (r * row_ + d_.head_dim) * es, size_t(d_.head_dim * es));
        }
        cache_->append(layer, TensorView::contiguous(arena_.put(k), d_.input, Device::cpu, tokens, H, d_.head_dim),
                       TensorView::contiguous(arena_.put(v), d_.input, Device::cpu, tokens, H, d_.head_dim), targets);
      }
    }
  }
  void read(int layer) {
    const int H = d_.heads;
    const int64_t es = dtype_size(d_.input);
    auto& per_seq = gathered_[layer];
    for (int64_t b = 0; b < int64_t(lengths_.size()); ++b) {
      const int64_t lo = oldest(b), n = lengths_[size_t(b)] - lo;
      GatherRange range;
      range.row = b;
      range.begin = lo;
      range.end = lengths_[size_t(b)];
      if (d_.paged())
        range.pages = IndexView::of(table_.data() + b * pages_per_seq_, pages_per_seq_);
      std::vector<float> rows(size_t(H * n * row_));
      if (d_.records()) {
        std::vector<unsigned char> out(size_t(H * n * row_ * es));
        cache_->gather_record(layer, range, TensorView::contiguous(out.data(), d_.input, Device::cpu, H, n, row_));
        for (size_t i = 0; i < rows.size(); ++i) rows[i] = load_as(d_.input, out.data() + i * es);
      } else {
        std::vector<unsigned char> k(size_t(H * n * d_.head_dim * es)), v(k.size());
        cache_->gather(layer, range, TensorView::contiguous(k.data(), d_.input, Device::cpu, H, n, d_.head_dim),
                       TensorView::contiguous(v.data(), d_.input, Device::cpu, H, n, d_.head_dim));
        for (int64_t r = 0; r < H * n; ++r)
          for (int e = 0; e < d_.head_dim; ++e) {
            rows[size_t(r * row_ + e)] = load_as(d_.input, k.data() + (r * d_.head_dim + e) * es);
            rows[size_t(r * row_ + d_.head_dim + e)] = load_as(d_.input, v.data() + (r * d_.head_dim + e) * es);
          }
      }
      for (int64_t r = 0; r < H * n; ++r)
        for (int e = 0; e < vw_; ++e) largest_value_ = std::max(largest_value_, std::fabs(rows[size_t(r * row_ + vo_ + e)]));
      per_seq.push_back(std::move(rows));
    }
  }
};

// A batch of queries over a History, and attend's results for it.
struct Queries {
  int64_t tokens = 0;
  int q_heads = 0;
  std::vector<int32_t> query_start, lengths, positions, rows, table;
  std::vector<float> q;  // [tokens, q_heads, kw]
  std::vector<unsigned char> q_bytes, out_bytes;
  std::vector<float> lse, sinks;
  AttendBatch batch;
  AttendOptions options;
  TensorView q_view, out_view, lse_view;

  Queries(History& h, const Scenario& sc, uint32_t seed) {
    const VariantDescriptor& d = h.d_;
    q_heads = d.heads * sc.group;
    query_start.push_back(0);
    for (size_t b = 0; b < sc.lengths.size(); ++b) {
      query_start.push_back(query_start.back() + int32_t(sc.queries[b]));
      lengths.push_back(int32_t(sc.lengths[b]));
      rows.push_back(int32_t(b));
      for (int64_t i = 0; i < sc.queries[b]; ++i) positions.push_back(int32_t(sc.lengths[b] - sc.queries[b] + i));
    }
    tokens = query_start.back();
    const int64_t es = dtype_size(d.input);
    q_bytes.resize(size_t(tokens * q_heads * h.kw_ * es));
    for (int64_t i = 0; i < tokens * q_heads * h.kw_; ++i) {
      const float x = exact_value(uint64_t(seed) * 104729 + uint64_t(i)) / 32.0f;
      store_as(d.input, x, q_bytes.data() + i * es);
      q.push_back(load_as(d.input, q_bytes.data() + i * es));
    }
    out_bytes.assign(size_t(tokens * q_heads * h.vw_ * es), 0x5a);  // a sentinel a refused call must leave
    lse.assign(size_t(tokens * q_heads), -1234.5f);
    for (int i = 0; i < q_heads; ++i) sinks.push_back(0.5f * float(i % 5) - 1.0f);
    batch.query_start = IndexView::of(query_start.data(), int64_t(query_start.size()));
    batch.lengths = IndexView::of(lengths.data(), int64_t(lengths.size()));
    if (sc.explicit_positions) batch.positions = IndexView::of(positions.data(), int64_t(positions.size()));
    if (!sc.begins.empty()) batch.begins = IndexView::of(sc.begins.data(), int64_t(sc.begins.size()));
    if (d.paged()) {
      batch.page_table = IndexView::of(h.table_.data(), int64_t(h.table_.size()));
      batch.max_pages = h.pages_per_seq_;
    } else {
      batch.rows = IndexView::of(rows.data(), int64_t(rows.size()));
    }
    options.causal = sc.causal;
    options.window = sc.window;
    // A ring holds its last `window` positions, so a chunk of n queries sees at most window - n + 1 of them.
    if (h.ring()) {
      const int widest = d.window - int(*std::max_element(sc.queries.begin(), sc.queries.end())) + 1;
      if (options.window == 0 || options.window > widest) options.window = widest;
    }
    options.softcap = sc.softcap;
    if (sc.sinks) options.sinks = TensorView{sinks.data(), DType::f32, Device::cpu, {1, 1, q_heads}, {q_heads, q_heads, 1}};
    q_view = TensorView::contiguous(q_bytes.data(), d.input, Device::cpu, tokens, q_heads, h.kw_);
    out_view = TensorView::contiguous(out_bytes.data(), d.input, Device::cpu, tokens, q_heads, h.vw_);
    lse_view = TensorView::contiguous(lse.data(), DType::f32, Device::cpu, tokens, q_heads, 1);
  }

  float out(const History& h, int64_t t, int qh, int e) const {
    return load_as(h.d_.input, out_bytes.data() + ((t * q_heads + qh) * h.vw_ + e) * dtype_size(h.d_.input));
  }
};

// Attend over a History, every output and LSE against the reference.
void check_scenario(const VariantEntry& e, const Scenario& sc, uint32_t seed) {
  SCOPED_TRACE(sc.what);
  History h(e, sc.lengths, seed);
  const VariantDescriptor& d = h.d_;
  const double u = unit_roundoff(d.input);
  for (int layer : h.layers_) {
    SCOPED_TRACE("layer " + std::to_string(layer));
    Queries qs(h, sc, seed + uint32_t(layer));
    h.cache_->attend(layer, qs.q_view, qs.batch, qs.options, qs.out_view, qs.lse_view);
    const double scale = 1.0 / std::sqrt(double(h.kw_));
    for (int64_t b = 0; b < int64_t(sc.lengths.size()); ++b) {
      const int64_t n = sc.queries[size_t(b)], len = sc.lengths[size_t(b)];
      for (int64_t i = 0; i < n; ++i) {
        const int64_t t = qs.query_start[size_t(b)] + i;
        const int64_t p = sc.causal ? len - n + i : len - 1;
        int64_t lo = qs.options.window > 0 ? std::max<int64_t>(0, p - qs.options.window + 1) : 0;
        if (!sc.begins.empty()) lo = std::max<int64_t>(lo, sc.begins[size_t(b)]);
        if (lo > p) {  // a pad's own query sees nothing: zeros, and an lse of -inf
          for (int qh = 0; qh < qs.q_heads; ++qh) {
            for (int x = 0; x < h.vw_; ++x) ASSERT_EQ(qs.out(h, t, qh, x), 0.0f) << "sequence " << b << " query " << i;
            ASSERT_EQ(qs.lse[size_t(t * qs.q_heads + qh)], -std::numeric_limits<float>::infinity());
          }
          continue;
        }
        ASSERT_GE(lo, h.oldest(b)) << "the scenario reads positions the ring no longer holds";
        for (int qh = 0; qh < qs.q_heads; ++qh) {
          const int kvh = qh / sc.group;
          std::vector<float> q(qs.q.begin() + (t * qs.q_heads + qh) * h.kw_, qs.q.begin() + (t * qs.q_heads + qh + 1) * h.kw_);
          double delta = 0;
          for (int64_t j = lo; j <= p; ++j) {
            double s = 0;
            for (int x = 0; x < h.kw_; ++x) s += std::fabs(double(q[size_t(x)]) * h.at(layer, b, kvh, j)[x]);
            delta = std::max(delta, scale * s * u);
          }
          const AttendRow ref = attend_reference(
              q, lo, p + 1, [&](int64_t j) { return h.at(layer, b, kvh, j); },
              [&](int64_t j) { return h.at(layer, b, kvh, j) + h.vo_; }, h.vw_, scale, sc.softcap, sc.sinks,
              sc.sinks ? qs.sinks[size_t(qh)] : 0.0);
          const double tol = double(h.largest_value_) * (2 * u + 2 * delta + 1e-5) + 1e-6;
          for (int x = 0; x < h.vw_; ++x)
            ASSERT_NEAR(qs.out(h, t, qh, x), ref.out[size_t(x)], tol)
                << "sequence " << b << " query " << i << " head " << qh << " value " << x;
          ASSERT_NEAR(qs.lse[size_t(t * qs.q_heads + qh)], ref.lse, 2 * delta + 1e-5)
              << "sequence " << b << " query " << i << " head " << qh;
        }
      }
    }
  }
}

// Every variant with storage of its own, on the CPU (test_attend_cuda would be this on a GPU).
std::vector<Case> cpu_cases() {
  std::vector<Case> out;
  for (const Case& c : all_cases())
    if (c.device == Device::cpu) out.push_back(c);
  return out;
}

class Attend : public testing::TestWithParam<Case> {
 protected:
  const VariantEntry& entry() const { return *GetParam().entry; }
  const VariantDescriptor& d() const { return *entry().descriptor; }
  // Lengths that fit the variant's capacity: contiguous rows hold max_seq_len.
  int64_t fit(int64_t n) const { return d().addressing == Addressing::contiguous ? std::min<int64_t>(n, d().max_seq_len) : n; }
  // GQA ratios the variant's shape allows at a cost a test can pay: MLA serves many heads from one.
  std::vector<int> groups() const { return d().mla() ? std::vector<int>{1, 16} : std::vector<int>{1, 4}; }
};

TEST_P(Attend, DecodesAndCausalChunksMatchTheReference) {
  const int64_t P = d().paged() ? d().page_size : 16;
  for (int g : groups()) {
    Scenario sc;
    sc.what = "decodes and a chunk of 7, group " + std::to_string(g);
    // No multiple of a page; a ring's longest sequence wraps its window.
    const int64_t longest = d().addressing == Addressing::ring ? d().window + 9 : fit(2 * P + 5);
    sc.lengths = {longest, fit(P + 1), 1, fit(std::max<int64_t>(9, P - 3))};
    sc.queries = {1, std::min<int64_t>(7, sc.lengths[1]), 1, 1};
    sc.group = g;
    sc.explicit_positions = g > 1;
    check_scenario(entry(), sc, 11u + uint32_t(g));
    if (testing::Test::HasFailure()) return;
  }
}

TEST_P(Attend, WindowSoftcapAndSinksMatchTheReference) {
  Scenario sc;
  sc.what = "a window of 5, soft-cap 3, sinks, group 2";
  sc.lengths = {fit(23), fit(12)};
  sc.queries = {3, 1};
  sc.group = d().mla() ? 8 : 2;
  sc.window = 5;
  sc.softcap = 3.0f;
  sc.sinks = true;
  check_scenario(entry(), sc, 5u);
}

// HF's left-padded batches: each sequence begins past its pads, and the pads' own queries see nothing.
TEST_P(Attend, LeftPaddingBeginsEachSequence) {
  Scenario sc;
  sc.what = "a chunk of 6 over left pads of 3 and 0, and a decode past pads of 2";
  sc.lengths = {fit(6), fit(6), fit(9)};
  sc.queries = {6, 6, 1};
  sc.begins = {3, 0, 2};
  sc.group = 2;
  if (d().addressing == Addressing::ring) sc.lengths[2] = std::min<int64_t>(sc.lengths[2], d().window);
  check_scenario(entry(), sc, 7u);
}

INSTANTIATE_TEST_SUITE_P(Registry, Attend, testing::ValuesIn(cpu_cases()), case_name);

// The variants one per addressing and storage family that the longer cases run on.
std::vector<Case> family_cases() {
  std::vector<Case> out;
  std::set<std::string> seen;
  for (const Case& c : cpu_cases()) {
    const VariantDescriptor& d = *c.entry->descriptor;
    const std::string family = std::string(name_of(d.addressing)) + std::string(dtype_name(d.storage)) + name_of(d.quant) +
                               (d.records() ? "r" : "") + (d.has_axis(Axis::layer) ? "s" : "") + (d.lazy() ? "l" : "");
    if (seen.insert(family).second) out.push_back(c);
  }
  return out;
}

class AttendFamily : public testing::TestWithParam<Case> {};

// Long histories where too few items would leave cores idle: the positions split, and the parts merge.
TEST_P(AttendFamily, LongSequencesSplitAndMerge) {
  const VariantDescriptor& d = *GetParam().entry->descriptor;
  if (d.addressing == Addressing::contiguous && d.max_seq_len < 600) GTEST_SKIP() << "rows of " << d.max_seq_len << " positions: no long history";
  Scenario sc;
  sc.what = "one sequence of 700, decode, group 8";
  sc.lengths = {d.addressing == Addressing::ring ? d.window + 3 : 700};
  sc.queries = {1};
  sc.group = d.mla() ? 16 : 8;
  check_scenario(*GetParam().entry, sc, 3u);
  sc.what = "a causal chunk of 64 over 700";
  sc.queries = {std::min<int64_t>(64, d.addressing == Addressing::ring ? d.window / 2 : 64)};
  sc.group = d.mla() ? 4 : 1;
  check_scenario(*GetParam().entry, sc, 4u);
}

// Non-causal attention over [0, n) is the exact merge of [0, n/2) and [n/2, n) by their LSEs.
TEST_P(AttendFamily, TwoHalvesMergeToTheWhole) {
  const VariantDescriptor& d = *GetParam().entry->descriptor;
  const int64_t n = d.addressing == Addressing::ring ? d.window : std::min<int64_t>(d.max_seq_len, 50);
  History h(*GetParam().entry, {n}, 9u);
  const int layer = h.layers_[0];
  Scenario sc;
  sc.lengths = {n};
  sc.queries = {2};
  sc.group = 2;
  sc.causal = false;
  Queries whole(h, sc, 1u), first(h, sc, 1u), second(h, sc, 1u);
  whole.options.window = 0, first.options.window = 0, second.options.window = int(n - n / 2);
  if (h.ring()) whole.options.window = first.options.window = d.window;
  first.lengths[0] = int32_t(n / 2);
  h.cache_->attend(layer, whole.q_view, whole.batch, whole.options, whole.out_view, whole.lse_view);
  h.cache_->attend(layer, first.q_view, first.batch, first.options, first.out_view, first.lse_view);
  h.cache_->attend(layer, second.q_view, second.batch, second.options, second.out_view, second.lse_view);
  const double u = unit_roundoff(d.input);
  for (int64_t t = 0; t < whole.tokens; ++t)
    for (int qh = 0; qh < whole.q_heads; ++qh) {
      const size_t r = size_t(t * whole.q_heads + qh);
      const double l1 = first.lse[r], l2 = second.lse[r], top = std::max(l1, l2);
      const double w1 = std::exp(l1 - top), w2 = std::exp(l2 - top);
      ASSERT_NEAR(whole.lse[r], top + std::log(w1 + w2), 1e-4);
      for (int x = 0; x < h.vw_; ++x) {
        const double merged = (w1 * first.out(h, t, qh, x) + w2 * second.out(h, t, qh, x)) / (w1 + w2);
        // Each half and the whole are rounded to the input dtype once.
        ASSERT_NEAR(whole.out(h, t, qh, x), merged, double(h.largest_value_) * (3 * u + 1e-5) + 1e-6);
      }
    }
}

// Each refused argument: a typed error naming it, and the output as it was.
TEST_P(AttendFamily, RefusedArgumentsWriteNothing) {
  const VariantDescriptor& d = *GetParam().entry->descriptor;
  const int64_t n = d.addressing == Addressing::ring ? d.window + 4 : std::min<int64_t>(d.max_seq_len, 20);
  History h(*GetParam().entry, {n, 3}, 2u);
  Scenario sc;
  sc.lengths = {n, 3};
  sc.queries = {1, 2};
  sc.group = 2;
  const auto refused = [&](const std::string& argument, const std::function<void(Queries&)>& spoil) {
    SCOPED_TRACE(argument);
    Queries qs(h, sc, 1u);
    spoil(qs);
    const std::vector<unsigned char> before = qs.out_bytes;
    try {
      h.cache_->attend(0, qs.q_view, qs.batch, qs.options, qs.out_view, qs.lse_view);
      ADD_FAILURE() << "not refused";
    } catch (const ArgumentError& err) {
      EXPECT_EQ(err.argument(), argument) << err.what();
    }
    EXPECT_EQ(qs.out_bytes, before) << "a refused call wrote its output";
    EXPECT_EQ(qs.lse[0], -1234.5f);
  };
  refused("batch.lengths", [&](Queries& qs) { qs.lengths[1] = 0; });  // an empty sequence
  if (d.paged()) {
    refused("batch.lengths", [&](Queries& qs) { qs.lengths[0] = int32_t(h.pages_per_seq_ * d.page_size + 1); });
    refused("batch.page_table", [&](Queries& qs) { qs.batch.page_table = IndexView::of(qs.table.data(), 0); });
    std::vector<int32_t> table = h.table_;
    refused("batch.page_table", [&](Queries& qs) {
      table[0] = int32_t(h.cache_->config().pages);
      qs.batch.page_table = IndexView::of(table.data(), int64_t(table.size()));
    });
  } else if (d.addressing == Addressing::ring) {
    refused("batch.lengths", [&](Queries& qs) { qs.lengths[1] = 4; });  // past the row's length
    refused("batch.lengths", [&](Queries& qs) { qs.options.window = 0; });  // a position that left the window
    refused("options.window", [&](Queries& qs) { qs.options.window = d.window + 1; });
  } else {
    refused("batch.lengths", [&](Queries& qs) { qs.lengths[0] = int32_t(d.max_seq_len + 1); });
    refused("batch.rows", [&](Queries& qs) { qs.rows[0] = 99; });
  }
  refused("q", [&](Queries& qs) { qs.q_view.shape[2] += 1; });
  refused("q", [&](Queries& qs) { qs.q_view.dtype = d.input == DType::f32 ? DType::bf16 : DType::f32; });
  if (d.heads > 1)
    refused("q", [&](Queries& qs) { qs.q_view.shape[1] = d.heads * 2 + 1; qs.out_view.shape[1] = qs.q_view.shape[1]; });
  refused("out", [&](Queries& qs) { qs.out_view.shape[2] -= 1; });
  refused("batch.query_start", [&](Queries& qs) { qs.query_start[2] = 5; });
  refused("batch.query_start", [&](Queries& qs) { qs.query_start[1] = 0; qs.lengths[1] = 2; });  // 3 queries, 2 positions
  refused("options.scale", [&](Queries& qs) { qs.options.scale = -1.0f; });
  refused("options.softcap", [&](Queries& qs) { qs.options.softcap = NAN; });
}

INSTANTIATE_TEST_SUITE_P(Families, AttendFamily, testing::ValuesIn(family_cases()), case_name);

}  // namespace
}  // namespace kvtest
