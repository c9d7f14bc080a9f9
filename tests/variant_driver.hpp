// The randomized driver of the registry tests: ragged batches of prefill and decode with padding,
// written to a cache and to the reference of reference.hpp, then read back and compared; and the
// raw storage read through strides the test derives itself.
#pragma once

#include <algorithm>
#include <functional>
#include <numeric>
#include <random>
#include <map>
#include <set>

#include "part_record_reference.hpp"
#include "quant_reference.hpp"
#include "reference.hpp"

namespace kvtest {
namespace {

class Driver {
 public:
  using Factory = std::function<std::unique_ptr<Cache>(const CacheConfig&)>;
  Driver(const VariantEntry& e, Device device, uint32_t seed) : Driver(*e.descriptor, e.create, device, seed) {}
  // Any implementation of a descriptor: a generated variant, or the generic path.
  Driver(const VariantDescriptor& d, const Factory& create, Device device, uint32_t seed)
      : d_(d), arena_(device), rng_(seed), heads_(d_.heads), dim_(d_.head_dim) {
    esize_ = dtype_size(d_.input);
    ref_.window = d_.addressing == Addressing::ring ? d_.window : 0;
    const bool big_ring = d_.addressing == Addressing::ring && int64_t(d_.window) * d_.bytes_per_token > (64 << 20);
    sequences_ = big_ring ? 2 : 3;
    capacity_ = d_.addressing == Addressing::ring ? INT32_MAX : std::min<int64_t>(d_.max_seq_len, 40);
    CacheConfig cfg;
    cfg.device = device;
    cfg.max_staged_tokens = 96;
    if (d_.paged()) {
      pages_per_seq_ = (capacity_ + d_.page_size - 1) / d_.page_size;
      // One sequence's worth of spare pages for forks, and one page no sequence uses.
      cfg.pages = (sequences_ + 1) * pages_per_seq_ + 1;
      std::vector<int32_t> order(size_t(cfg.pages));
      std::iota(order.begin(), order.end(), 0);
      std::shuffle(order.begin(), order.end(), rng_);
      page_table_.resize(size_t(sequences_ + 1));
      for (int s = 0; s <= sequences_; ++s)
        page_table_[s].assign(order.begin() + s * pages_per_seq_, order.begin() + (s + 1) * pages_per_seq_);
    } else {
      cfg.rows = sequences_;
      cfg.max_seq_len = d_.addressing == Addressing::contiguous ? capacity_ : 0;
    }
    cache_ = create(cfg);
    if (d_.takes_tensor_scale()) {
      // Scales that differ by layer and by K/V, so that mixing them up shows; with values up to 32
      // some fp8_e4m3 codes saturate, which the reference must predict too.
      for (int l = 0; l < d_.layers; ++l) cache_->set_tensor_scale(l, tensor_scale(l, 0), tensor_scale(l, 1));
    }
    for (int l = 0; l < d_.layers; ++l)
      if (d_.layers <= 4 || l == 0 || l == d_.layers / 2 || l == d_.layers - 1) layers_.push_back(l);
    next_.assign(size_t(sequences_), 0);
    if (ref_.window) {
      // Rings start each sequence somewhere in its first three windows, so slots wrap.
      for (auto& n : next_) n = std::uniform_int_distribution<int64_t>(0, 3 * int64_t(d_.window))(rng_);
    }
    visible_ = next_;
  }

  // One step: every sequence gets a prefill chunk or one decode token; padding is mixed in; the token
  // order is shuffled; on some steps the input's heads lie further apart than a row: by whole 16-byte
  // vectors, or by one element, which leaves rows off 16 bytes (an executor's element path).
  void step(int index) {
    struct Token {
      int64_t seq, pos;
    };
    std::vector<Token> tokens;
    for (int64_t s = 0; s < sequences_; ++s) {
      const bool prefill = index == 0 || std::uniform_int_distribution<int>(0, 9)(rng_) < 3;
      int64_t n = prefill ? std::uniform_int_distribution<int64_t>(2, ref_.window ? 24 : 12)(rng_) : 1;
      n = std::min(n, capacity_ - next_[s]);
      for (int64_t i = 0; i < n; ++i) tokens.push_back({s, next_[s] + i});
      next_[s] += n;
    }
    const int padding = std::uniform_int_distribution<int>(0, 3)(rng_);
    for (int i = 0; i < padding; ++i) tokens.push_back({-1, -1});
    std::shuffle(tokens.begin(), tokens.end(), rng_);
    const int64_t T = int64_t(tokens.size());

    std::vector<int32_t> rows, positions;
    std::vector<int64_t> slots;
    for (const Token& t : tokens) {
      rows.push_back(int32_t(t.seq));
      positions.push_back(int32_t(t.pos));
      slots.push_back(t.seq < 0 ? -1 : int64_t(page_table_.empty() ? 0 : page_table_[t.seq][t.pos / std::max(1, d_.page_size)]) * d_.page_size + t.pos % std::max(1, d_.page_size));
    }
    const TokenTargets targets = d_.paged() ? TokenTargets::paged(arena_.index(slots))
                                            : TokenTargets::row_positions(arena_.index(rows), arena_.index(positions));
    const int64_t head_stride = dim_ + (index % 3 == 1 ? 8 : index % 3 == 2 ? 1 : 0);
    for (int layer : layers_) {
      std::vector<unsigned char> k(size_t(T * heads_ * head_stride * esize_)), v(k.size());
      for (int64_t t = 0; t < T; ++t) {
        const uint64_t id = ++last_id_;
        if (tokens[t].seq >= 0) pending_.push_back({layer, tokens[t].seq, tokens[t].pos, id});
        for (int h = 0; h < heads_; ++h)
          for (int x = 0; x < dim_; ++x) {
            const size_t at = size_t(((t * heads_ + h) * head_stride + x) * esize_);
            store_as(d_.input, Reference::value(id, 0, h, x, heads_, dim_), k.data() + at);
            store_as(d_.input, Reference::value(id, 1, h, x, heads_, dim_), v.data() + at);
          }
      }
      const TensorView kv[2] = {
          {arena_.put(k), d_.input, arena_.device(), {T, heads_, dim_}, {heads_ * head_stride, head_stride, 1}},
          {arena_.put(v), d_.input, arena_.device(), {T, heads_, dim_}, {heads_ * head_stride, head_stride, 1}}};
      cache_->append(layer, kv[0], kv[1], targets);
    }
    if (d_.update == UpdateMode::lazy && index == 1) {
      // Before commit, staged tokens are invisible: the cache still reads as the reference does.
      verify("before commit");
    }
    cache_->commit();
    // Within one append, a ring cell shared by several positions of a row holds the highest one
    // (the contract): apply the batch to the reference in position order, not in token order.
    std::stable_sort(pending_.begin(), pending_.end(), [](const Pending& a, const Pending& b) { return a.pos < b.pos; });
    for (const auto& p : pending_) ref_.write(p.layer, p.seq, p.pos, p.id);
    pending_.clear();
    cache_->synchronize();
    visible_ = next_;
  }

  static float tensor_scale(int layer, int kv) { return kv == 0 ? 0.0625f * float(1 + layer % 3) : 0.046875f * float(1 + layer % 2); }

  // What (layer, write id, kv, head, dim) reads back as: the written value, or for quantized storage
  // what the reference quantizer makes of the token it belongs to.
  const RefToken& quantized_token(int layer, uint64_t id, int kv) {
    auto it = quantized_.find({id, kv});
    if (it != quantized_.end()) return it->second;
    std::vector<float> x(size_t(heads_) * dim_);
    for (int h = 0; h < heads_; ++h)
      for (int i = 0; i < dim_; ++i) x[size_t(h) * dim_ + i] = Reference::value(id, kv, h, i, heads_, dim_);
    return quantized_[{id, kv}] = ref_quantize(d_, x, tensor_scale(layer, kv));
  }
  // A record format's reference (part_record_reference.hpp): head h's whole record of the token (its K
  // values, then its V values) encoded at once.
  const RefRecord& record_token(uint64_t id, int h) {
    auto it = records_.find({id, h});
    if (it != records_.end()) return it->second;
    std::vector<float> latent(size_t(2) * dim_);
    for (int i = 0; i < 2 * dim_; ++i) latent[size_t(i)] = Reference::value(id, i / dim_, h, i % dim_, heads_, dim_);
    return records_[{id, h}] = ref_record(d_, latent);
  }
  float expected(int layer, uint64_t id, int kv, int h, int x) {
    if (d_.coded_records() && id != 0) return record_token(id, h).gathered[size_t(kv) * dim_ + x];
    if (!d_.quantized() || id == 0) return Reference::value(id, kv, h, x, heads_, dim_);
    return quantized_token(layer, id, kv).gathered[size_t(h) * dim_ + x];
  }

  std::pair<int64_t, int64_t> readable(int64_t seq) const {
    const int64_t end = visible_[seq];
    return {ref_.window ? std::max<int64_t>(0, end - ref_.window) : 0, end};
  }

  GatherRange range_of(int64_t seq, int64_t begin, int64_t end, std::vector<int32_t>& pages_host) {
    GatherRange g;
    g.row = seq;
    g.begin = begin;
    g.end = end;
    if (d_.paged()) {
      pages_host = page_table_[seq];
      g.pages = arena_.index(pages_host);
    }
    return g;
  }

  void verify(const std::string& when) {
    for (int layer : layers_)
      for (int64_t s = 0; s < sequences_; ++s) {
        auto [begin, end] = readable(s);
        if (!ref_.window) end = capacity_;  // also check that unwritten positions read as zero
        if (end == begin) continue;
        const int64_t n = end - begin;
        // [H, n, D], every other gather with one element between heads (rows then off 16 bytes).
        const int64_t head_stride = n * dim_ + (verify_calls_++ % 2);
        const int64_t bytes = heads_ * head_stride * esize_;
        void* ko = arena_.scratch_zeros(0, bytes);
        void* vo = arena_.scratch_zeros(1, bytes);
        std::vector<int32_t> pages;
        cache_->gather(layer, range_of(s, begin, end, pages),
                       TensorView{ko, d_.input, arena_.device(), {heads_, n, dim_}, {head_stride, dim_, 1}},
                       TensorView{vo, d_.input, arena_.device(), {heads_, n, dim_}, {head_stride, dim_, 1}});
        cache_->synchronize();
        const auto kh = arena_.fetch(ko, bytes), vh = arena_.fetch(vo, bytes);
        for (int h = 0; h < heads_; ++h)
          for (int64_t j = 0; j < n; ++j) {
            const uint64_t id = ref_.at(layer, s, begin + j);
            for (int x = 0; x < dim_; ++x) {
              const size_t at = size_t((h * head_stride + j * dim_ + x) * esize_);
              const float want_k = expected(layer, id, 0, h, x);
              const float want_v = expected(layer, id, 1, h, x);
              if (load_as(d_.input, kh.data() + at) != want_k || load_as(d_.input, vh.data() + at) != want_v) {
                ADD_FAILURE() << d_.name << " " << when << ": layer " << layer << " seq " << s << " pos "
                              << begin + j << " head " << h << " dim " << x << ": got K "
                              << load_as(d_.input, kh.data() + at) << " V " << load_as(d_.input, vh.data() + at)
                              << ", want K " << want_k << " V " << want_v;
                return;
              }
            }
          }
      }
  }

  // Reads the physical pool through offsets derived here from the spec's meaning, not through
  // kvforge's geometry, and compares with the reference:
  //   - axes in declared order, row-major; a layout without `layer` or `kv` axes keeps a tensor per
  //     layer (and per K/V) back to back;
  //   - separate scales: the same axes less dim (and less head for per_token), in a buffer beside the
  //     pool; per_tensor scales are [layer][kv];
  //   - in_page scales: each page is one block, the codes of the axes after `page`, then their scales.
  void verify_storage() {
    const Geometry& g = cache_->geometry();
    const auto pool = arena_.fetch(cache_->storage(), g.total_elems * dtype_size(d_.storage));
    const int64_t ss = dtype_size(d_.scale);
    const auto scale_buffer = d_.quantized() && !d_.scales_in_page()
                                  ? arena_.fetch(cache_->scale_storage(), g.scale_elems * ss)
                                  : std::vector<unsigned char>();
    const CacheConfig& cfg = cache_->config();
    const int64_t positions = ref_.window ? d_.window : cfg.max_seq_len;
    // Stored elements of a head's row: its values, two a byte for 4-bit codes; a record's half of bytes
    // (K's row the first half, V's the second; with page-end scales its page's size only, its bytes
    // lying where ref_page_byte says).
    const bool records = d_.coded_records();
    const int half = records ? (ref_place(*d_.record_format).record_bytes + ref_place(*d_.record_format).tail_bytes) / 2 : 0;
    const int row = records ? half : dim_ / dtype_values(d_.storage);
    std::vector<int64_t> extent;
    for (int i = 0; i < d_.num_axes; ++i) {
      switch (d_.axes[i]) {
        case Axis::layer: extent.push_back(d_.layers); break;
        case Axis::row: extent.push_back(cfg.rows); break;
        case Axis::seq: extent.push_back(positions); break;
        case Axis::page: extent.push_back(cfg.pages); break;
        case Axis::slot: extent.push_back(d_.page_size); break;
        case Axis::kv: extent.push_back(2); break;
        case Axis::head: extent.push_back(heads_); break;
        case Axis::dim: extent.push_back(row); break;
      }
    }
    int block_from = 0;  // axes [block_from, n) form one block: the whole tensor, or one page
    if (d_.scales_in_page())
      while (d_.axes[block_from++] != Axis::page) {
      }
    // A per_group scale varies along dim, one per group of the row (its coordinate x / width); the
    // others do not.
    const int groups = ref_groups(d_), width = dim_ / groups;
    auto scale_skips = [&](Axis a) {
      return (a == Axis::dim && d_.quant != Quant::per_group) || (a == Axis::head && d_.quant == Quant::per_token);
    };
    const bool stacked = d_.has_axis(Axis::layer), fused = d_.has_axis(Axis::kv);
    int checked = 0;
    for (const auto& [key, id] : ref_.cells) {
      const auto [layer, seq, cell] = key;
      // `cell` is a position (contiguous, paged) or position mod window (ring).
      for (int kv = 0; kv < 2; ++kv)
        for (int h = 0; h < heads_; ++h)
          for (int x = 0; x < (records ? row : dim_); ++x) {  // a record's bytes, else values
            int64_t coord[kNumAxes] = {};
            coord[int(Axis::layer)] = layer;
            coord[int(Axis::row)] = seq;
            coord[int(Axis::seq)] = cell;
            if (d_.paged()) {
              coord[int(Axis::page)] = page_table_[seq][cell / d_.page_size];
              coord[int(Axis::slot)] = cell % d_.page_size;
            }
            coord[int(Axis::kv)] = kv;
            coord[int(Axis::head)] = h;
            coord[int(Axis::dim)] = records ? x : x / dtype_values(d_.storage);  // 4-bit codes: value x in byte x / 2
            int64_t outer = 0, outer_count = 1, code_in = 0, codes = 1, scale_in = 0, scales = 1;
            for (int i = 0; i < d_.num_axes; ++i) {
              const Axis a = d_.axes[i];
              if (i < block_from) {
                outer = outer * extent[i] + coord[int(a)];
                outer_count *= extent[i];
                continue;
              }
              code_in = code_in * extent[i] + coord[int(a)];
              codes *= extent[i];
              if (!scale_skips(a)) {
                const bool grouped = a == Axis::dim;
                scale_in = scale_in * (grouped ? groups : extent[i]) + (grouped ? x / width : coord[int(a)]);
                scales *= grouped ? groups : extent[i];
              }
            }
            const int64_t tensor_index = (stacked ? 0 : layer) * (fused ? 1 : 2) + (fused ? 0 : kv);
            int64_t code_at, scale_at;
            if (d_.scales_in_page()) {
              const int64_t block = codes + scales * ss;
              const int64_t base = tensor_index * outer_count * block + outer * block;
              code_at = base + code_in;
              scale_at = base + codes + scale_in * ss;
            } else {
              code_at = (tensor_index * codes + code_in) * dtype_size(d_.storage);
              scale_at = d_.quant == Quant::per_tensor ? (layer * 2 + kv) * ss : (tensor_index * scales + scale_in) * ss;
            }
            std::string problem;
            if (d_.page_end_scales()) {  // the page starts where its slot 0's record would; the format's offsets in it
              const int64_t slot = cell % d_.page_size, j = kv * half + x;
              code_at = code_at - (slot * 2 * half + j) + ref_page_byte(*d_.record_format, d_.page_size, slot, j);
            }
            if (records) {
              const int got = pool[size_t(code_at)], want = record_token(id, h).bytes[size_t(kv * half + x)];
              if (got != want) problem = "record byte " + std::to_string(got) + ", want " + std::to_string(want);
            } else if (!d_.quantized()) {
              const float got = load_as(d_.storage, pool.data() + code_at);
              const float want = Reference::value(id, kv, h, x, heads_, dim_);
              if (got != want) problem = "got " + std::to_string(got) + ", want " + std::to_string(want);
            } else {
              const RefToken& want = quantized_token(layer, id, kv);
              const int got_code = dtype_values(d_.storage) == 1 ? pool[size_t(code_at)] : (pool[size_t(code_at)] >> (4 * (x % 2))) & 0xf;
              const int want_code = want.codes[size_t(h) * dim_ + x];
              const float got_scale = load_scale(d_.scale, (d_.scales_in_page() ? pool : scale_buffer).data() + scale_at);
              const size_t group = size_t(h * groups + x / width);
              if (got_code != want_code)
                problem = "code " + std::to_string(got_code) + ", want " + std::to_string(want_code);
              else if (got_scale != want.scales[group])
                problem = "scale " + std::to_string(got_scale) + ", want " + std::to_string(want.scales[group]);
              else if (is_zero_point_scale(d_.scale)) {
                const float got_zero = load_zero(d_.scale, (d_.scales_in_page() ? pool : scale_buffer).data() + scale_at);
                if (got_zero != want.zeros[group])
                  problem = "zero point " + std::to_string(got_zero) + ", want " + std::to_string(want.zeros[group]);
              }
            }
            if (!problem.empty()) {
              ADD_FAILURE() << d_.name << " storage: layer " << layer << " seq " << seq << " cell " << cell
                            << " kv " << kv << " head " << h << " dim " << x << ": " << problem;
              return;
            }
            ++checked;
          }
    }
    EXPECT_GT(checked, 0);
  }

  void reorder() {
    std::vector<int32_t> beam(static_cast<size_t>(sequences_));
    for (auto& b : beam) b = std::uniform_int_distribution<int32_t>(0, int32_t(sequences_ - 1))(rng_);
    beam[0] = int32_t(sequences_ - 1);  // at least one row really moves
    cache_->reorder(arena_.index(beam));
    cache_->synchronize();
    Reference old = ref_;
    ref_.cells.clear();
    for (const auto& [key, id] : old.cells) {
      const auto [layer, seq, cell] = key;
      for (int64_t i = 0; i < sequences_; ++i)
        if (beam[i] == seq) ref_.cells[{layer, i, cell}] = id;
    }
    std::vector<int64_t> old_next = next_;
    for (int64_t i = 0; i < sequences_; ++i) next_[i] = old_next[beam[i]];
    for (int64_t i = 0; i < sequences_; ++i) EXPECT_EQ(cache_->row_length(i), next_[i]) << "row " << i;
    visible_ = next_;
  }

  // Fork sequence 0 into the spare pages, then check the fork reads as sequence 0 did.
  void copy_blocks() {
    const int64_t fork = sequences_;
    std::vector<int32_t> pairs;
    for (int64_t j = 0; j < pages_per_seq_; ++j) {
      pairs.push_back(page_table_[0][j]);
      pairs.push_back(page_table_[fork][j]);
    }
    cache_->copy_blocks(arena_.index(pairs));
    cache_->synchronize();
    for (const auto& [key, id] : Reference(ref_).cells)
      if (std::get<1>(key) == 0) ref_.cells[{std::get<0>(key), fork, std::get<2>(key)}] = id;
    next_.push_back(next_[0]);
    visible_ = next_;
    ++sequences_;
  }

  void reset_row(int64_t row) {
    cache_->reset_row(row);
    cache_->synchronize();
    for (auto it = ref_.cells.begin(); it != ref_.cells.end();)
      it = std::get<1>(it->first) == row ? ref_.cells.erase(it) : std::next(it);
    EXPECT_EQ(cache_->row_length(row), 0);
    next_[row] = 0;
    visible_ = next_;
  }

  void reset() {
    cache_->reset();
    cache_->synchronize();
    ref_.cells.clear();
    for (auto& n : next_) n = 0;
    visible_ = next_;
  }

  const VariantDescriptor& d_;
  Arena arena_;
  std::mt19937_64 rng_;
  int heads_, dim_, esize_ = 0;
  int64_t sequences_ = 0, capacity_ = 0, pages_per_seq_ = 0;
  std::unique_ptr<Cache> cache_;
  std::vector<int> layers_;
  std::vector<int64_t> next_;
  // What the cache shows now: next_ as of the last commit (a lazy step's staged tokens are not yet in).
  std::vector<int64_t> visible_;
  std::vector<std::vector<int32_t>> page_table_;
  Reference ref_;
  std::map<std::pair<uint64_t, int>, RefToken> quantized_;
  std::map<std::pair<uint64_t, int>, RefRecord> records_;  // (write id, head)
  uint64_t last_id_ = 0;
  int64_t verify_calls_ = 0;
  struct Pending {
    int layer;
    int64_t seq, pos;
    uint64_t id;
  };
  std::vector<Pending> pending_;
};

// Another implementation of a variant's descriptor (the generic path; the same on another executor)
// meets the reference: random traffic over `seeds`, its storage read through strides, then the upkeep
// its addressing has.
inline void twin_traffic_matches_reference(const VariantDescriptor& d, const Driver::Factory& create,
                                           std::initializer_list<uint32_t> seeds, const std::string& what) {
  for (uint32_t seed : seeds) {
    SCOPED_TRACE("seed " + std::to_string(seed));
    Driver drv(d, create, Device::cpu, seed);
    ASSERT_TRUE(drv.cache_->descriptor().generic);
    for (int i = 0; i < 6; ++i) {
      drv.step(i);
      drv.verify(what + ", after step " + std::to_string(i));
      if (testing::Test::HasFailure()) return;
    }
    drv.verify_storage();
    if (d.paged()) {
      drv.copy_blocks();
      drv.verify(what + ", after copy_blocks");
    } else {
      drv.reorder();
      drv.verify(what + ", after reorder");
      drv.reset_row(0);
      drv.verify(what + ", after reset_row");
    }
  }
}

// The registry's variants whose descriptor the generic path serves.
inline std::vector<Case> generic_cases() {
  std::vector<Case> out;
  for (const Case& c : all_cases())
    if (c.device == Device::cpu && generic_unsupported_reason(*c.entry->descriptor, CacheConfig{}).empty())
      out.push_back(c);
  return out;
}

}  // namespace
}  // namespace kvtest
