// The tiers' tests' fixture (test_tiers.cpp, test_disk_faults.cpp): a tiny variant's cache whose
// prefix cache has a host and a disk tier, prompts served through it with values tier_values.hpp
// derives from each token's coordinates, and read back against that rule.
#pragma once

#include <unistd.h>

#include <cstdio>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "support.hpp"
#include "tier_values.hpp"

namespace kvtest {

constexpr const char* kVariant = "vllm_paged_nhd.tiny.fp32";

// A tiny variant's cache with a host and a disk tier, and its values written and read back by
// tier_values.hpp's rule. `adjust` changes the manager's options before it is made (a weights tag, a
// store of the test's own, sized by the cache); `variant` another variant.
struct Tiers {
  std::unique_ptr<Cache> cache;
  std::unique_ptr<SequenceManager> manager;
  const VariantDescriptor& d;
  Tiers(const std::string& disk, int64_t pages = 6, int32_t host = 4, int64_t disk_blocks = 32, int32_t read_ahead = 64,
        bool promote_ahead = false,
        const std::function<void(SequenceManagerOptions&, const Cache&)>& adjust = {},
        const char* variant = kVariant)
      : d(*registry().at(variant).descriptor) {
    CacheConfig cfg;
    cfg.pages = pages;
    cache = registry().at(variant).create(cfg);
    SequenceManagerOptions o;
    o.host_blocks = host;
    o.disk_path = disk;
    o.disk_blocks = disk_blocks;
    o.kv_events = true;
    o.read_ahead_blocks = read_ahead;
    o.promote_ahead = promote_ahead;
    if (adjust) adjust(o, *cache);
    manager = std::make_unique<SequenceManager>(*cache, o);
  }
  // Adds `prompt` as `id`, writes what it did not find cached, and returns the tokens it found.
  int64_t serve(int64_t id, const std::vector<int32_t>& prompt) {
    const int64_t cached = manager->add(id, prompt);
    write(id, prompt, cached);
    return cached;
  }
  // Steps sequence `id` alone and writes its new tokens, those after the `cached` ones.
  void write(int64_t id, const std::vector<int32_t>& prompt, int64_t cached) {
    const BatchMetadata b = manager->step({id});
    const int64_t T = int64_t(b.slots.size());
    std::vector<float> k, v;
    for (int layer = 0; layer < d.layers; ++layer) {
      tier_inputs(d, prompt, cached, T, layer, k, v);
      cache->append(layer, TensorView::contiguous(k.data(), d.input, Device::cpu, T, d.heads, d.head_dim),
                    TensorView::contiguous(v.data(), d.input, Device::cpu, T, d.heads, d.head_dim),
                    TokenTargets::paged(IndexView::of(b.slots.data(), T)));
    }
  }
  // Serves every prompt again, each read back against the values written, and frees it.
  void serve_and_check_all(const std::vector<std::vector<int32_t>>& prompts) {
    for (const auto& p : prompts) {
      const int64_t id = int64_t(p[0]);
      serve(id, p);
      expect_contents(id, p);
      manager->free(id);
    }
  }
  // Every layer of sequence `id` read back equals the values written for its tokens.
  void expect_contents(int64_t id, const std::vector<int32_t>& prompt) {
    const int64_t n = int64_t(prompt.size());
    std::vector<float> k(size_t(d.heads * n * d.head_dim)), v(k.size());
    for (int layer = 0; layer < d.layers; ++layer) {
      cache->gather(layer, manager->range(id, 0, n), TensorView::contiguous(k.data(), d.input, Device::cpu, d.heads, n, d.head_dim),
                    TensorView::contiguous(v.data(), d.input, Device::cpu, d.heads, n, d.head_dim));
      expect_tier_layer(d, prompt, layer, k, v);
    }
  }
  int P() const { return d.page_size; }
};


inline std::string temp_file(const std::string& name) {
  const std::string path = testing::TempDir() + "/kvforge_" + name + "_" + std::to_string(getpid());
  std::remove(path.c_str());
  return path;
}

// Serves prompts 0..9 (two blocks each) through a 6-page device pool and a 4-page host tier, so that
// most of their blocks end on disk; returns them.
inline std::vector<std::vector<int32_t>> fill(Tiers& t) {
  std::vector<std::vector<int32_t>> prompts;
  for (int i = 0; i < 10; ++i) {
    prompts.push_back(tier_prompt(i + 1, 2, t.P()));
    t.serve(i, prompts.back());
    t.manager->free(i);
  }
  return prompts;
}

}  // namespace kvtest
