// Prefix reuse, as its own unit: full blocks found by content, and the cached blocks nobody holds kept
// for eviction, which takes the lowest retention priority first and, within a priority, the least
// recently released. A block's key (block_hash.hpp) chains its parent's key, a salt and its tokens, so
// equal keys mean equal prefixes; a hit is still confirmed against the stored tokens, never trusted. Host-side; O(1)
// per block, plus O(log n) per block whose priority expires.
#pragma once

#include <cstddef>
#include <cstdint>
#include <queue>
#include <unordered_map>
#include <utility>
#include <vector>

namespace kvforge {

// Retention priorities, as TensorRT-LLM's KvCacheRetentionConfig has them: 0 (evicted first) to 100.
inline constexpr int kMinPriority = 0;
inline constexpr int kMaxPriority = 100;
inline constexpr int kDefaultPriority = 35;  // TensorRT-LLM's default

class PrefixCache {
 public:
  explicit PrefixCache(int32_t blocks, int default_priority = kDefaultPriority);

  // The cached block holding exactly `tokens` under `key`, or -1.
  int32_t find(uint64_t key, const int32_t* tokens, int32_t n) const;
  bool has_key(uint64_t key) const { return by_key_.count(key) != 0; }
  bool cached(int32_t block) const { return cached_[size_t(block)] != 0; }
  uint64_t key_of(int32_t block) const { return key_of_[size_t(block)]; }
  uint64_t parent_of(int32_t block) const { return parent_of_[size_t(block)]; }  // 0 for a first block
  uint64_t salt_of(int32_t block) const { return salt_of_[size_t(block)]; }
  const std::vector<int32_t>& tokens_of(int32_t block) const { return tokens_[size_t(block)]; }
  int32_t size() const { return int32_t(by_key_.size()); }
  // Records that `block` holds `tokens` under `key`, after the block keyed `parent` (0: none) and
  // hashed with `salt`; the caller keeps a reference for the cache.
  void insert(uint64_t key, int32_t block, const int32_t* tokens, int32_t n, uint64_t parent, uint64_t salt);

  // Caches `block` as a copy of `other`'s `other_block` (another tier's): its key, tokens, parent,
  // salt and priority, evictable at once. The caller copied the data and holds the cache's reference.
  void adopt(const PrefixCache& other, int32_t other_block, int32_t block);

  // Retention: a block's priority, and until when (seconds on the caller's clock; 0: for good) it
  // holds before it drops to the default. retain() keeps the higher of the block's priority and
  // `priority`, and the later end of the two.
  void retain(int32_t block, int priority, double until);
  int priority(int32_t block) const { return priority_[size_t(block)]; }
  // Priorities whose time ran out by `now` drop to the default.
  void expire(double now);

  // Evictable blocks: cached, and held by nobody but the cache.
  bool evictable(int32_t block) const { return prev_[size_t(block)] >= 0 || head_[priority_[size_t(block)]] == block; }
  int32_t evictable_count() const { return evictable_; }
  void make_evictable(int32_t block);  // the newest of its priority; nothing when it already is
  void keep(int32_t block);            // someone holds it again; nothing when it was not evictable
  // The evictable block of lowest priority released longest ago, no longer evictable but still
  // cached: the caller reads what it needs (a demotion copies it), then forget()s it and frees it.
  int32_t take_victim();
  void forget(int32_t block);
  // Forgets every cached block (all must be evictable); returns them, for the caller to free.
  std::vector<int32_t> evict_all();
  template <class F> void for_each_evictable(F f) const {
    for (int p = kMinPriority; p <= kMaxPriority; ++p)
      for (int32_t b = head_[p]; b >= 0; b = next_[size_t(b)]) f(b);
  }
  template <class F> void for_each_cached(F f) const {
    for (const auto& [key, block] : by_key_) f(key, block);
  }
  // Whether the key map and the block agree (for invariant checks).
  bool consistent(int32_t block) const;

 private:
  std::unordered_map<uint64_t, int32_t> by_key_;
  std::vector<uint64_t> key_of_, parent_of_, salt_of_;
  std::vector<uint8_t> cached_;
  std::vector<std::vector<int32_t>> tokens_;
  // Evictable blocks as one intrusive list per priority, oldest first.
  std::vector<int32_t> prev_, next_;
  int32_t head_[kMaxPriority + 1], tail_[kMaxPriority + 1];
  int32_t evictable_ = 0;
  int default_priority_;
  std::vector<uint8_t> priority_;
  std::vector<double> until_;  // 0: the priority holds for good
  // (until, block) of every priority with an end, soonest first; stale entries are skipped.
  std::priority_queue<std::pair<double, int32_t>, std::vector<std::pair<double, int32_t>>, std::greater<>> ends_;
};

}  // namespace kvforge
