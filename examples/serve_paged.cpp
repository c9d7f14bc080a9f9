// Driving a paged cache the way an engine does, only through the sequence manager: no hand-made page
// tables. Two requests share a system prompt (the second reuses its pages), both prefill and decode,
// one forks for parallel sampling, one is offloaded to host memory while the others keep decoding and
// is restored into different pages; then everything is read back and checked.
//
//   usage: kvforge_example_serve [variant]      (default: vllm_paged_nhd.tiny.bf16)
#include <cmath>
#include <cstdio>
#include <cstring>
#include <map>
#include <string>
#include <vector>

#include "kvforge/kvforge.hpp"

using namespace kvforge;

namespace {

// Stands in for a model: K/V of a position depend on the tokens up to it (so a shared prefix has
// shared K/V), as small integers that every float dtype holds exactly. prefix_hashes()[p] sums up
// tokens [0, p]; kv_value() gives value `i` of K or V from it.
std::vector<uint32_t> prefix_hashes(const std::vector<int32_t>& tokens) {
  std::vector<uint32_t> out;
  uint32_t h = 2166136261u;
  for (int32_t t : tokens) out.push_back(h = (h ^ uint32_t(t)) * 16777619u);
  return out;
}

float kv_value(uint32_t prefix_hash, int kv, int i) {
  return float(int((prefix_hash >> (i % 13)) % 17) - 8) + (kv ? 0.5f : 0.0f);
}

class Engine {
 public:
  explicit Engine(const VariantEntry& e) : d_(*e.descriptor) {
    MemoryRequest r;
    r.mode = PlanMode::reserve;
    r.budget_bytes = 64 * d_.bytes_per_token * d_.page_size;  // room for 64 pages
    const MemoryPlan plan = plan_memory(d_, r);
    std::printf("plan: %lld pages of %lld B, %lld tokens; 4 sequences can reach %lld tokens each\n",
                (long long)plan.pages, (long long)plan.page_bytes, (long long)plan.tokens,
                (long long)plan.max_len_for_batch(4));
    cache_ = e.create(plan.config());
    if (d_.quant == Quant::per_tensor) {
      // A static scale is calibrated offline; this model's values lie in [-8, 8.5], so the largest
      // maps to the code type's largest value (int4's and fp4's too: random specs, seed unknown, found
      // fp4 per-tensor at fp8 e5m2's largest value, every value saturating near 0).
      const float scale = 8.5f / quant_max(d_.storage);
      for (int layer = 0; layer < d_.layers; ++layer) cache_->set_tensor_scale(layer, scale, scale);
    }
    SequenceManagerOptions o;
    o.host_blocks = 32;
    manager_ = std::make_unique<SequenceManager>(*cache_, o);
  }

  void add(int64_t id, const std::vector<int32_t>& prompt) {
    const int64_t cached = manager_->add(id, prompt);
    std::printf("request %lld: %zu prompt tokens, %lld reused from the prefix cache\n", (long long)id, prompt.size(),
                (long long)cached);
  }
  void decode(int64_t id, int32_t token) { manager_->append(id, {token}); }

  // One forward step: K/V for every new token of `ids`, written into the slots the manager gives.
  void step(const std::vector<int64_t>& ids) {
    const BatchMetadata b = manager_->step(ids);
    const int64_t T = int64_t(b.slots.size()), row = int64_t(d_.heads) * d_.head_dim, es = dtype_size(d_.input);
    std::vector<unsigned char> k(size_t(T * row * es)), v(k.size());
    for (size_t s = 0; s < ids.size(); ++s) {
      const std::vector<uint32_t> hashes = prefix_hashes(manager_->tokens(ids[s]));
      for (int32_t t = b.query_start[s]; t < b.query_start[s + 1]; ++t) {
        const uint32_t h = hashes[size_t(b.lengths[s] - (b.query_start[s + 1] - t))];
        for (int64_t i = 0; i < row; ++i) {
          store_float(d_.input, kv_value(h, 0, int(i)), k.data() + (t * row + i) * es);
          store_float(d_.input, kv_value(h, 1, int(i)), v.data() + (t * row + i) * es);
        }
      }
    }
    const DeviceBatch on_device(b, cache_->config().device);
    for (int layer = 0; layer < d_.layers; ++layer)
      cache_->append(layer, TensorView::contiguous(k.data(), d_.input, Device::cpu, T, d_.heads, d_.head_dim),
                     TensorView::contiguous(v.data(), d_.input, Device::cpu, T, d_.heads, d_.head_dim),
                     on_device.targets());
    cache_->commit();
  }

  // Reads a whole sequence back from every layer; returns the largest error against the model.
  double check(int64_t id) {
    const std::vector<uint32_t> hashes = prefix_hashes(manager_->tokens(id));
    const int64_t n = int64_t(hashes.size()), es = dtype_size(d_.input);
    double worst = 0;
    for (int layer = 0; layer < d_.layers; ++layer) {
      std::vector<unsigned char> k(size_t(d_.heads * n * d_.head_dim * es)), v(k.size());
      cache_->gather(layer, manager_->range(id, 0, n),
                     TensorView::contiguous(k.data(), d_.input, Device::cpu, d_.heads, n, d_.head_dim),
                     TensorView::contiguous(v.data(), d_.input, Device::cpu, d_.heads, n, d_.head_dim));
      for (int h = 0; h < d_.heads; ++h)
        for (int64_t p = 0; p < n; ++p)
          for (int x = 0; x < d_.head_dim; ++x) {
            const int64_t at = (h * n + p) * d_.head_dim + x;
            const int i = h * d_.head_dim + x;
            worst = std::max(worst, double(std::fabs(load_float(d_.input, k.data() + at * es) - kv_value(hashes[size_t(p)], 0, i))));
            worst = std::max(worst, double(std::fabs(load_float(d_.input, v.data() + at * es) - kv_value(hashes[size_t(p)], 1, i))));
          }
    }
    return worst;
  }

  SequenceManager& manager() { return *manager_; }
  const VariantDescriptor& d_;
  std::unique_ptr<Cache> cache_;
  std::unique_ptr<SequenceManager> manager_;
};

}  // namespace

int main(int argc, char** argv) {
  try {
    const std::string name = argc > 1 ? argv[1] : "vllm_paged_nhd.tiny.bf16";
    const VariantEntry& e = registry().at(name);
    Engine engine(e);
    const int P = e.descriptor->page_size;
    std::vector<int32_t> system(size_t(2 * P + 3));
    for (size_t i = 0; i < system.size(); ++i) system[i] = int32_t(100 + i);
    std::vector<int32_t> a = system, b = system;
    a.insert(a.end(), {7, 8, 9});
    b.insert(b.end(), {4, 5});
    engine.add(1, a);
    engine.step({1});
    engine.add(2, b);  // shares the system prompt's full pages with request 1
    engine.step({2});
    // Decode until request 2 ends inside a page (where pages hold more than one token), so that the fork
    // below shares a partial page and its first write copies it.
    for (int t = 0; t < P + 5 || (P > 1 && engine.manager().length(2) % P == 0); ++t) {
      engine.decode(1, 20 + t);
      engine.decode(2, 40 + t);
      engine.step({1, 2});
    }
    engine.manager().fork(2, 3);  // parallel sampling: 3 shares 2's pages until it writes
    engine.manager().offload(1);  // 1 waits on the host while 2 and 3 decode
    for (int t = 0; t < 2 * P; ++t) {
      engine.decode(2, 60 + t);
      engine.decode(3, 80 + t);
      engine.step({2, 3});
    }
    engine.manager().restore(1);  // back, into whatever pages are free now
    engine.decode(1, 99);
    engine.step({1});
    double worst = 0;
    for (int64_t id : {1, 2, 3}) worst = std::max(worst, engine.check(id));
    const SequenceStats& s = engine.manager().stats();
    std::printf("prefix hits %lld, misses %lld; copies on write %lld; offloaded %lld pages, restored %lld\n",
                (long long)s.prefix_hits, (long long)s.prefix_misses, (long long)s.copies_on_write,
                (long long)s.offloaded_pages, (long long)s.restored_pages);
    std::printf("memory utilization %.1f%% (live-token bytes / bytes of pages held)\n", 100 * engine.manager().utilization());
    engine.manager().check_invariants();
    // The documented bound (docs/quantization.md) at this model's largest |value|, 8.5: half a scale step
    // of int8, int4 and uint4 (whose step is a range of at most 17 over 15), or half the float grid's
    // spacing (relative 2^-4 for e4m3, 2^-3 for e5m2, 2^-2 for e2m1, whose subnormal step is half its
    // scale), plus the input dtype's rounding of the result.
    // A dynamic scale is amax / qmax rounded up, by scale_round_up (at a tensor scale of 1 this model's
    // group scales are normal e4m3 values).
    const DType storage = e.descriptor->storage;
    const double round_up = kvforge::scale_round_up(e.descriptor->scale);
    const double allowed = e.descriptor->coded_records()  // each part within its own bound
                               ? e.descriptor->record_format->error_bound(8.5f, 8.5f) + 0.07
                           : !e.descriptor->quantized()        ? 0.0
                           : storage == DType::i8     ? 8.5 / 127 * round_up + 0.07
                           : storage == DType::i4     ? 0.5 * 8.5 / 7 * round_up + 0.07
                           : storage == DType::u4     ? 0.5 * 17 / 15 + 0.07  // a head's range, at most 17
                           : storage == DType::f4e2m1 ? 8.5 / 4 + 0.25 * 8.5 / 6 * round_up + 0.07
                           : storage == DType::f8e4m3 ? 8.5 / 16 + 0.07
                                                      : 8.5 / 8 + 0.07;
    std::printf("%s: largest error %.4g (allowed %.4g): %s\n", name.c_str(), worst, allowed, worst <= allowed ? "ok" : "FAIL");
    // One-token pages are always full, so a fork shares only full pages and never copies one.
    const bool cow_expected = P > 1;
    return worst <= allowed && s.prefix_hits > 0 && (s.copies_on_write > 0 || !cow_expected) ? 0 : 1;
  } catch (const Error& err) {
    std::fprintf(stderr, "kvforge_example_serve: %s\n", err.what());
    return 1;
  }
}
