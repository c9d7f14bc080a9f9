// The host-tier promotion benchmarks' one setup (promote_ahead_bench.cpp on the CPU, cuda_promote_bench.cu
// on CUDA): a pool of one prompt's pages and one more, a host tier of two prompts, and two prompts of
// kPages blocks of kMemoryVariant, which push each other down: serving one promotes it from the host
// tier and demotes the other.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "kvforge/kvforge.hpp"
#include "memory_bench.hpp"

namespace kvforge_bench {

struct PromotionSetup {
  static constexpr int64_t kPages = 64;  // 128 MiB of llama3-8b bf16 pages
  std::unique_ptr<kvforge::Cache> cache;
  std::unique_ptr<kvforge::SequenceManager> manager;
  std::vector<int32_t> a, b;

  // `config` gives the device and stream; its page count is set here.
  PromotionSetup(kvforge::CacheConfig config, bool ahead) {
    config.pages = kPages + 1;
    cache = kvforge::registry().at(kMemoryVariant).create(config);
    const int P = cache->descriptor().page_size;
    kvforge::SequenceManagerOptions o;
    o.host_blocks = int32_t(2 * kPages);
    o.promote_ahead = ahead;
    manager = std::make_unique<kvforge::SequenceManager>(*cache, o);
    a.assign(size_t(kPages * P + 1), 1);
    b.assign(size_t(kPages * P + 1), 2);
  }
};

}  // namespace kvforge_bench
