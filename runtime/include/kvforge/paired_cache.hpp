// A cache and a companion over the same pages: DeepSeek-V3.2's sparse-attention indexer keeps a second
// per-token record (its index keys) beside the MLA latent, in pages the main cache's page table also
// names. Page p of the pair is page p of both, so one SequenceManager over the pair allocates, shares,
// copies on fork, offloads, tiers and frees the two together.
#pragma once

#include <memory>

#include "kvforge/cache.hpp"

namespace kvforge {

// Every op goes where its row of cache_ops.hpp routes it: to the main cache, except those that act on
// pages or on the whole cache, which go to both: reset, copy_blocks, commit, synchronize, set_stream and
// set_tuning; pack_pages and unpack_pages move page i as the main cache's packed page, then the
// companion's (packed_page_bytes() is their sum); memory() is the sum. The companion's own records are written and
// read through companion().
class PairedCache final : public Cache {
 public:
  // Both caches paged, of one page_size, one page count and one device; else ArgumentError naming
  // `companion`.
  PairedCache(std::unique_ptr<Cache> main, std::unique_ptr<Cache> companion);

  Cache& main() { return *main_; }
  Cache& companion() { return *companion_; }
  const Cache& companion() const { return *companion_; }

  KVFORGE_CACHE_OPS(KVFORGE_CACHE_OP_OVERRIDE)

 private:
  std::unique_ptr<Cache> main_, companion_;
};

}  // namespace kvforge
