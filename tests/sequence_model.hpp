// A model-based harness for the sequence manager, shared by the randomized test and the libFuzzer
// target. Random operations (add with shared system prompts, decode and prefill appends, fork, free,
// offload, restore, and the evictions that allocation pressure causes) run against a plain model of
// which sequence holds which tokens. The K/V written for position p of a sequence is a pure function
// of its tokens [0, p], as a model's would be, so shared prefixes must read back identically. After
// every operation the manager's invariants are checked, and its KV events, replayed into a router's
// view of the cache written here (the block hashes computed from docs/memory.md's definition), give
// exactly the blocks it caches; every verify() gathers each live sequence and compares it with the
// model. Retention priorities change at random, and the prefix cache is reset now and then.
#pragma once

#include <unistd.h>

#include <cstdio>
#include <functional>
#include <map>
#include <random>
#include <set>
#include <string>

#include "part_record_reference.hpp"
#include "quant_reference.hpp"

namespace kvtest {

// Where the operations' choices come from: a seeded generator, or the fuzzer's bytes.
struct Choices {
  virtual ~Choices() = default;
  virtual uint32_t below(uint32_t n) = 0;  // in [0, n)
  virtual bool exhausted() const { return false; }
};

struct RandomChoices : Choices {
  explicit RandomChoices(uint64_t seed) : rng(seed) {}
  uint32_t below(uint32_t n) override { return n ? uint32_t(rng() % n) : 0; }
  std::mt19937_64 rng;
};

struct ByteChoices : Choices {
  ByteChoices(const uint8_t* d, size_t n) : data(d), size(n) {}
  uint32_t below(uint32_t n) override {
    if (!n) return 0;
    uint32_t v = 0;
    for (int i = 0; i < 2; ++i) v = v << 8 | (at < size ? data[at++] : 0u);
    return v % n;
  }
  bool exhausted() const override { return at >= size; }
  const uint8_t* data;
  size_t size, at = 0;
};

// Raised by the harness on any disagreement, so that the fuzzer and the test can both report it.
struct ModelMismatch : std::runtime_error {
  using std::runtime_error::runtime_error;
};

class SequenceModel {
 public:
  SequenceModel(const VariantEntry& e, int64_t pages, int32_t host_pages, bool prefix_caching, int32_t window = 0,
                bool promote_ahead = false)
      : d_(*e.descriptor), arena_(Device::cpu), window_(window) {
    CacheConfig cfg;
    cfg.pages = pages;
    cfg.max_staged_tokens = pages * e.descriptor->page_size;  // lazy: one step may fill every slot
    cache_ = e.create(cfg);
    SequenceManagerOptions o;
    o.prefix_caching = prefix_caching;
    o.host_blocks = host_pages;
    o.window = window;
    o.kv_events = true;
    o.promote_ahead = promote_ahead;
    if (host_pages > 0) {  // a disk tier below the host tier, in a file of this model's own
      static int models = 0;
      disk_path_ = "/tmp/kvforge_model_" + std::to_string(getpid()) + "_" + std::to_string(models++);
      std::remove(disk_path_.c_str());
      o.disk_path = disk_path_;
      o.disk_blocks = 24;
    }
    manager_ = std::make_unique<SequenceManager>(*cache_, o);
    // System prompts that many requests start with: 0 to 3 pages and a bit.
    const int P = d_.page_size;
    for (int s = 0; s < 3; ++s) {
      std::vector<int32_t> t;
      for (int i = 0; i < s * P + P / 2 + 1; ++i) t.push_back(int32_t(1000 * (s + 1) + i));
      system_prompts_.push_back(t);
    }
  }

  ~SequenceModel() {
    if (!disk_path_.empty()) std::remove(disk_path_.c_str());
  }

  // One random operation. Capacity errors are part of the game: the manager must refuse them whole.
  void random_op(Choices& c) {
    const uint32_t op = c.below(100);
    const std::vector<int64_t> ids = live_ids();
    const int64_t any = ids.empty() ? -1 : ids[c.below(uint32_t(ids.size()))];
    try {
      if (op < 22 || ids.empty()) {
        add(c);
      } else if (op < 55) {
        append(any, c.below(4) == 0 ? 1 + c.below(uint32_t(2 * d_.page_size)) : 1, c);
      } else if (op < 63) {
        fork(any);
      } else if (op < 75) {
        free(any);
      } else if (op < 83) {
        offload(any);
      } else if (op < 91) {
        restore(c);
      } else if (op < 94 && any >= 0 && !model_.at(any).offloaded) {
        retain(any, c);
      } else if (op == 94) {
        try {
          manager_->reset_prefix_cache();
        } catch (const StateError&) {  // a live sequence holds a cached block: refused whole
        }
      } else {
        step_all();
      }
    } catch (const CapacityError&) {
      ++capacity_refusals;
    }
    check();
  }

  // Random retention ranges over the sequence's tokens.
  void retain(int64_t id, Choices& c) {
    std::vector<RetentionRange> ranges;
    const int64_t n = int64_t(model_.at(id).tokens.size());
    for (uint32_t i = c.below(3); i > 0; --i) {
      RetentionRange r;
      r.begin = int64_t(c.below(uint32_t(n + 1)));
      r.end = r.begin + int64_t(c.below(uint32_t(n - r.begin + 1)));
      r.priority = int(c.below(101));
      ranges.push_back(r);
    }
    manager_->set_retention(id, ranges);
  }

  // A block's hash as docs/memory.md defines it, written from that page.
  static uint64_t documented_mix(uint64_t h, uint64_t v) {
    h ^= v + 0x9e3779b97f4a7c15ULL + (h << 6) + (h >> 2);
    h = (h ^ (h >> 30)) * 0xbf58476d1ce4e5b9ULL;
    h = (h ^ (h >> 27)) * 0x94d049bb133111ebULL;
    return h ^ (h >> 31);
  }

  // The manager's events since the last check, replayed into the set of blocks a router believes the
  // cache holds; every stored hash is recomputed from its parent, salt and tokens.
  void replay_events() {
    for (const KvEvent& e : manager_->take_kv_events()) {
      switch (e.kind) {
        case KvEvent::Kind::block_stored: {
          if (e.block_size != d_.page_size || e.token_ids.size() != e.block_hashes.size() * size_t(e.block_size))
            throw ModelMismatch("BlockStored: sizes disagree");
          uint64_t parent = e.parent_block_hash.value_or(0);
          for (size_t b = 0; b < e.block_hashes.size(); ++b) {
            uint64_t h = documented_mix(parent, e.salt);
            for (int i = 0; i < e.block_size; ++i)
              h = documented_mix(h, uint64_t(uint32_t(e.token_ids[b * size_t(e.block_size) + size_t(i)])));
            if (h != e.block_hashes[b]) throw ModelMismatch("BlockStored: a hash is not the documented one");
            if (!router_[e.medium].insert(h).second) throw ModelMismatch("BlockStored: a block stored twice in " + e.medium);
            parent = h;
          }
          break;
        }
        case KvEvent::Kind::block_removed:
          for (uint64_t h : e.block_hashes)
            if (!router_[e.medium].erase(h)) throw ModelMismatch("BlockRemoved: a block never stored in " + e.medium);
          break;
        case KvEvent::Kind::all_blocks_cleared:
          router_.clear();
          break;
      }
    }
    // A CPU cache's blocks are "CPU", its host tier's "HOST", its disk tier's "DISK".
    for (const auto& [medium, held] : {std::pair{std::string("CPU"), manager_->cached_block_hashes()},
                                       std::pair{std::string("HOST"), manager_->host_cached_block_hashes()},
                                       std::pair{std::string("DISK"), manager_->disk_cached_block_hashes()}}) {
      const std::set<uint64_t>& replayed = router_[medium];
      if (std::vector<uint64_t>(replayed.begin(), replayed.end()) != held)
        throw ModelMismatch("the router's replay holds " + std::to_string(replayed.size()) + " blocks in " + medium +
                            ", the cache " + std::to_string(held.size()));
    }
  }

  void add(Choices& c) {
    std::vector<int32_t> prompt;
    if (c.below(3)) prompt = system_prompts_[c.below(uint32_t(system_prompts_.size()))];
    const uint32_t extra = c.below(uint32_t(2 * d_.page_size));
    for (uint32_t i = 0; i < extra + (prompt.empty() ? 1 : 0); ++i) prompt.push_back(int32_t(c.below(50)));
    const int64_t id = next_id_++;
    const int64_t cached = manager_->add(id, prompt);
    if (cached < 0 || cached >= int64_t(prompt.size()) || cached % d_.page_size)
      throw ModelMismatch("add: covered " + std::to_string(cached) + " of " + std::to_string(prompt.size()) + " tokens");
    model_[id] = {prompt, int64_t(prompt.size()) - cached, false};
  }

  void append(int64_t id, uint32_t n, Choices& c) {
    if (model_.at(id).offloaded) return;
    std::vector<int32_t> t;
    for (uint32_t i = 0; i < n; ++i) t.push_back(int32_t(c.below(50)));
    manager_->append(id, t);
    auto& m = model_.at(id);
    m.tokens.insert(m.tokens.end(), t.begin(), t.end());
    m.pending += n;
  }

  void fork(int64_t parent) {
    if (model_.at(parent).offloaded) return;
    step_all();  // a fork needs the parent's tokens written
    const int64_t child = next_id_++;
    manager_->fork(parent, child);
    model_[child] = model_.at(parent);
  }

  void free(int64_t id) {
    manager_->free(id);
    model_.erase(id);
  }

  void offload(int64_t id) {
    if (model_.at(id).offloaded) return;
    step_all();
    manager_->offload(id);
    model_.at(id).offloaded = true;
  }

  void restore(Choices& c) {
    std::vector<int64_t> out;
    for (const auto& [id, m] : model_)
      if (m.offloaded) out.push_back(id);
    if (out.empty()) return;
    const int64_t id = out[c.below(uint32_t(out.size()))];
    manager_->restore(id);
    model_.at(id).offloaded = false;
  }

  // Writes every pending token of every live sequence, through the manager's slots, in every layer.
  void step_all() {
    std::vector<int64_t> ids;
    for (const auto& [id, m] : model_)
      if (!m.offloaded && m.pending) ids.push_back(id);
    if (ids.empty()) return;
    // Steps are built on the device from the persistent block table and held equal to the host-built
    // arrays of the same step; every fifth goes the host way only, so that the two paths also mix.
    BatchMetadata b;
    if (++steps_ % 5 == 0) {
      b = manager_->step(ids);
    } else {
      const DeviceStep& device = manager_->step_on_device(ids, true, &b);
      check_device_step(device, b, ids);
    }
    const int64_t T = int64_t(b.slots.size());
    std::vector<std::vector<float>> k(static_cast<size_t>(T)), v(static_cast<size_t>(T));
    for (size_t i = 0; i < ids.size(); ++i) {
      auto& m = model_.at(ids[i]);
      const int64_t count = b.query_start[i + 1] - b.query_start[i];
      if (count != m.pending || b.lengths[i] != int64_t(m.tokens.size()))
        throw ModelMismatch("step: sequence " + std::to_string(ids[i]) + " has " + std::to_string(count) +
                            " new tokens and length " + std::to_string(b.lengths[i]) + ", the model " +
                            std::to_string(m.pending) + " and " + std::to_string(m.tokens.size()));
      for (int64_t j = 0; j < count; ++j) {
        const int64_t pos = int64_t(m.tokens.size()) - count + j;
        k[size_t(b.query_start[i] + j)] = token_values(m.tokens, pos, 0);
        v[size_t(b.query_start[i] + j)] = token_values(m.tokens, pos, 1);
      }
      m.pending = 0;
    }
    const int es = dtype_size(d_.input);
    const int64_t hd = int64_t(d_.heads) * d_.head_dim;
    std::vector<unsigned char> kb(size_t(T * hd * es)), vb(kb.size());
    for (int64_t t = 0; t < T; ++t)
      for (int64_t i = 0; i < hd; ++i) {
        store_as(d_.input, k[size_t(t)][size_t(i)], kb.data() + (t * hd + i) * es);
        store_as(d_.input, v[size_t(t)][size_t(i)], vb.data() + (t * hd + i) * es);
      }
    for (int layer = 0; layer < d_.layers; ++layer)
      cache_->append(layer, TensorView::contiguous(kb.data(), d_.input, Device::cpu, T, d_.heads, d_.head_dim),
                     TensorView::contiguous(vb.data(), d_.input, Device::cpu, T, d_.heads, d_.head_dim),
                     TokenTargets::paged(IndexView::of(b.slots.data(), T)));
    cache_->commit();
  }

  // The device-built arrays (CPU memory here) against the host-built ones, entry by entry.
  void check_device_step(const DeviceStep& d, const BatchMetadata& h, const std::vector<int64_t>& ids) const {
    auto same = [&](const char* what, const IndexView& got, const auto& want) {
      using T = typename std::decay_t<decltype(want)>::value_type;
      if (got.size != int64_t(want.size()))
        throw ModelMismatch(std::string("device step: ") + what + " has " + std::to_string(got.size) +
                            " entries, the host's " + std::to_string(want.size()));
      for (size_t i = 0; i < want.size(); ++i)
        if (static_cast<const T*>(got.data)[i] != want[i])
          throw ModelMismatch(std::string("device step: ") + what + "[" + std::to_string(i) + "] = " +
                              std::to_string(static_cast<const T*>(got.data)[i]) + ", the host's " + std::to_string(want[i]));
    };
    same("slots", d.slots, h.slots);
    same("query_start", d.query_start, h.query_start);
    same("seq_lens", d.seq_lens, h.lengths);
    same("indptr", d.indptr, h.indptr);
    same("indices", d.indices, h.indices);
    same("last_page_len", d.last_page_len, h.last_page_len);
    const auto* table = static_cast<const int32_t*>(d.block_table.data);
    const auto* rows = static_cast<const int32_t*>(d.rows.data);
    for (size_t i = 0; i < ids.size(); ++i)
      for (size_t j = 0; j < manager_->pages(ids[i]).size(); ++j) {
        const int32_t got = table[int64_t(rows[i]) * d.block_table_stride + int64_t(j)];
        const int32_t want = h.page_table[i * size_t(h.max_pages) + j];
        if (got != want)
          throw ModelMismatch("device step: sequence " + std::to_string(ids[i]) + " page " + std::to_string(j) + " is " +
                              std::to_string(got) + " in the device table, " + std::to_string(want) + " on the host");
      }
  }

  // Gathers every live sequence (after writing what is pending) and compares with the model.
  void verify() {
    step_all();
    for (const auto& [id, m] : model_) {
      if (m.offloaded) continue;
      // With a sliding window only the last `window` positions are readable.
      const int64_t end = int64_t(m.tokens.size());
      const int64_t begin = window_ ? std::max<int64_t>(0, end - window_) : 0;
      const int64_t n = end - begin;
      if (n == 0) continue;
      const int es = dtype_size(d_.input);
      for (int layer = 0; layer < d_.layers; ++layer) {
        std::vector<unsigned char> ko(size_t(d_.heads * n * d_.head_dim * es)), vo(ko.size());
        cache_->gather(layer, manager_->range(id, begin, end),
                       TensorView::contiguous(ko.data(), d_.input, Device::cpu, d_.heads, n, d_.head_dim),
                       TensorView::contiguous(vo.data(), d_.input, Device::cpu, d_.heads, n, d_.head_dim));
        for (int64_t pos = begin; pos < end; ++pos)
          for (int kv = 0; kv < 2; ++kv) {
            const std::vector<float> want = expected(m.tokens, pos, kv);
            for (int h = 0; h < d_.heads; ++h)
              for (int x = 0; x < d_.head_dim; ++x) {
                const float got = load_as(d_.input, (kv ? vo : ko).data() + ((h * n + pos - begin) * d_.head_dim + x) * es);
                if (got != want[size_t(h * d_.head_dim + x)])
                  throw ModelMismatch(std::string(d_.name) + ": sequence " + std::to_string(id) + " layer " +
                                      std::to_string(layer) + " position " + std::to_string(pos) + " kv " +
                                      std::to_string(kv) + " head " + std::to_string(h) + " dim " +
                                      std::to_string(x) + ": got " + std::to_string(got) + ", want " +
                                      std::to_string(want[size_t(h * d_.head_dim + x)]));
              }
          }
      }
      ++verified_sequences;
    }
  }

  // The manager agrees with the model, and its own invariants hold.
  void check() {
    manager_->check_invariants();
    replay_events();
    const double u = manager_->utilization();
    if (!(u >= 0.0 && u <= 1.0)) throw ModelMismatch("utilization " + std::to_string(u) + " is outside [0, 1]");
    for (const auto& [id, m] : model_) {
      if (!manager_->contains(id)) throw ModelMismatch("sequence " + std::to_string(id) + " vanished");
      if (manager_->tokens(id) != m.tokens) throw ModelMismatch("sequence " + std::to_string(id) + " tokens differ");
      if (manager_->offloaded(id) != m.offloaded) throw ModelMismatch("sequence " + std::to_string(id) + " offload state");
    }
    int64_t manager_count = 0;
    for (int64_t id = 0; id < next_id_; ++id) manager_count += manager_->contains(id);
    if (manager_count != int64_t(model_.size())) throw ModelMismatch("the manager holds sequences the model freed");
  }

  SequenceManager& manager() { return *manager_; }
  const std::map<int64_t, std::vector<int32_t>> live_tokens() const {
    std::map<int64_t, std::vector<int32_t>> out;
    for (const auto& [id, m] : model_) out[id] = m.tokens;
    return out;
  }
  std::unique_ptr<Cache> cache_;
  int64_t capacity_refusals = 0, verified_sequences = 0;

 private:
  std::string disk_path_;
  std::map<std::string, std::set<uint64_t>> router_;  // per medium, the blocks the events say it holds
  struct Model {
    std::vector<int32_t> tokens;
    int64_t pending = 0;
    bool offloaded = false;
  };

  std::vector<int64_t> live_ids() const {
    std::vector<int64_t> out;
    for (const auto& [id, m] : model_) out.push_back(id);
    return out;
  }

  // K or V of position `pos` as the model writes it: a function of tokens [0, pos] only.
  static uint64_t token_hash(const std::vector<int32_t>& tokens, int64_t pos) {
    uint64_t h = 0x12345;
    for (int64_t i = 0; i <= pos; ++i) h = (h ^ uint64_t(uint32_t(tokens[size_t(i)]))) * 0x100000001b3ULL + uint64_t(i);
    return h;
  }
  std::vector<float> token_values(const std::vector<int32_t>& tokens, int64_t pos, int kv) const {
    const uint64_t h = token_hash(tokens, pos);
    std::vector<float> out(size_t(d_.heads) * d_.head_dim);
    for (size_t i = 0; i < out.size(); ++i) out[i] = exact_value(h * 2654435761ULL + i * 2 + uint64_t(kv));
    return out;
  }
  // What a gather returns for it: the values, or the reference quantizer's reading of them. Every layer
  // and every check reads the same token: the reference's slow search runs once a token.
  const std::vector<float>& expected(const std::vector<int32_t>& tokens, int64_t pos, int kv) const {
    std::vector<float>& known = expected_[{token_hash(tokens, pos), kv}];
    if (known.empty()) {
      std::vector<float> x = token_values(tokens, pos, kv);
      if (d_.coded_records()) {  // a record codes a head's K and V values together
        const std::vector<float> k = token_values(tokens, pos, 0), v = token_values(tokens, pos, 1);
        const size_t D = size_t(d_.head_dim);
        for (int side = 0; side < 2; ++side) expected_[{token_hash(tokens, pos), side}].resize(k.size());
        for (size_t h = 0; h < size_t(d_.heads); ++h) {
          std::vector<float> record(k.begin() + h * D, k.begin() + (h + 1) * D);
          record.insert(record.end(), v.begin() + h * D, v.begin() + (h + 1) * D);
          const RefRecord r = ref_record(d_, record);
          for (int side = 0; side < 2; ++side)
            std::copy(r.gathered.begin() + side * D, r.gathered.begin() + (side + 1) * D,
                      expected_[{token_hash(tokens, pos), side}].begin() + h * D);
        }
      } else {
        known = d_.quantized() ? ref_quantize(d_, x, 1.0f).gathered : std::move(x);
      }
    }
    return known;
  }

  const VariantDescriptor& d_;
  Arena arena_;
  std::unique_ptr<SequenceManager> manager_;
  std::map<int64_t, Model> model_;
  std::vector<std::vector<int32_t>> system_prompts_;
  int32_t window_ = 0;
  mutable std::map<std::pair<uint64_t, int>, std::vector<float>> expected_;  // by (token_hash, kv)
  int64_t next_id_ = 0;
  int64_t steps_ = 0;  // step_all() calls: every fifth on the host only
};

}  // namespace kvtest
