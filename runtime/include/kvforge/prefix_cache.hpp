// Prefix reuse, as its own unit: full blocks found by content, and the cached blocks nobody holds kept
// in least-recently-released order so that they are evicted only when pages run short. A block's key
// chains its parent's key, a salt and its tokens, so equal keys mean equal prefixes; a hit is still
// confirmed against the stored tokens, never trusted. Host-side; O(1) per block.
#pragma once

#include <cstddef>
#include <cstdint>
#include <unordered_map>
#include <vector>

namespace kvforge {

class PrefixCache {
 public:
  explicit PrefixCache(int32_t blocks);

  // The key of a full block of `n` tokens whose parent block has key `parent` (0 for the first).
  static uint64_t key(uint64_t parent, uint64_t salt, const int32_t* tokens, int32_t n);

  // The cached block holding exactly `tokens` under `key`, or -1.
  int32_t find(uint64_t key, const int32_t* tokens, int32_t n) const;
  bool has_key(uint64_t key) const { return by_key_.count(key) != 0; }
  bool cached(int32_t block) const { return cached_[size_t(block)] != 0; }
  int32_t size() const { return int32_t(by_key_.size()); }
  // Records that `block` holds `tokens` under `key`; the caller keeps a reference for the cache.
  void insert(uint64_t key, int32_t block, const int32_t* tokens, int32_t n);

  // Evictable blocks: cached, and held by nobody but the cache.
  bool evictable(int32_t block) const { return prev_[size_t(block)] >= 0 || head_ == block; }
  int32_t evictable_count() const { return evictable_; }
  void make_evictable(int32_t block);  // the newest; nothing when it already is
  void keep(int32_t block);            // someone holds it again; nothing when it was not evictable
  // Forgets the least recently released evictable block and returns it, for the caller to free.
  int32_t evict_oldest();
  template <class F> void for_each_evictable(F f) const {
    for (int32_t b = head_; b >= 0; b = next_[size_t(b)]) f(b);
  }
  // Whether the key map and the block agree (for invariant checks).
  bool consistent(int32_t block) const;

 private:
  std::unordered_map<uint64_t, int32_t> by_key_;
  std::vector<uint64_t> key_of_;
  std::vector<uint8_t> cached_;
  std::vector<std::vector<int32_t>> tokens_;
  // The evictable blocks as an intrusive list, oldest first.
  std::vector<int32_t> prev_, next_;
  int32_t head_ = -1, tail_ = -1, evictable_ = 0;
};

}  // namespace kvforge
