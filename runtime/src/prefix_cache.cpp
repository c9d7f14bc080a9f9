#include "kvforge/prefix_cache.hpp"

#include <algorithm>

namespace kvforge {

namespace {
uint64_t mix(uint64_t h, uint64_t v) {
  // splitmix64's finalizer over a running combination: cheap and well spread.
  h ^= v + 0x9e3779b97f4a7c15ULL + (h << 6) + (h >> 2);
  h ^= h >> 30;
  h *= 0xbf58476d1ce4e5b9ULL;
  h ^= h >> 27;
  h *= 0x94d049bb133111ebULL;
  h ^= h >> 31;
  return h;
}
}  // namespace

PrefixCache::PrefixCache(int32_t blocks)
    : key_of_(size_t(blocks), 0),
      cached_(size_t(blocks), 0),
      tokens_(size_t(blocks)),
      prev_(size_t(blocks), -1),
      next_(size_t(blocks), -1) {}

uint64_t PrefixCache::key(uint64_t parent, uint64_t salt, const int32_t* tokens, int32_t n) {
  uint64_t h = mix(parent, salt);
  for (int32_t i = 0; i < n; ++i) h = mix(h, uint64_t(uint32_t(tokens[i])));
  return h;
}

int32_t PrefixCache::find(uint64_t key, const int32_t* tokens, int32_t n) const {
  auto it = by_key_.find(key);
  if (it == by_key_.end()) return -1;
  const std::vector<int32_t>& stored = tokens_[size_t(it->second)];
  return int32_t(stored.size()) == n && std::equal(tokens, tokens + n, stored.begin()) ? it->second : -1;
}

void PrefixCache::insert(uint64_t key, int32_t block, const int32_t* tokens, int32_t n) {
  by_key_[key] = block;
  key_of_[size_t(block)] = key;
  cached_[size_t(block)] = 1;
  tokens_[size_t(block)].assign(tokens, tokens + n);
}

void PrefixCache::make_evictable(int32_t b) {
  if (evictable(b)) return;
  prev_[size_t(b)] = tail_;
  next_[size_t(b)] = -1;
  if (tail_ >= 0) next_[size_t(tail_)] = b; else head_ = b;
  tail_ = b;
  ++evictable_;
}

void PrefixCache::keep(int32_t b) {
  if (!evictable(b)) return;
  const int32_t p = prev_[size_t(b)], n = next_[size_t(b)];
  if (p >= 0) next_[size_t(p)] = n; else head_ = n;
  if (n >= 0) prev_[size_t(n)] = p; else tail_ = p;
  prev_[size_t(b)] = next_[size_t(b)] = -1;
  --evictable_;
}

int32_t PrefixCache::evict_oldest() {
  const int32_t b = head_;
  keep(b);
  by_key_.erase(key_of_[size_t(b)]);
  cached_[size_t(b)] = 0;
  tokens_[size_t(b)].clear();
  return b;
}

bool PrefixCache::consistent(int32_t b) const {
  if (!cached(b)) return true;
  auto it = by_key_.find(key_of_[size_t(b)]);
  return it != by_key_.end() && it->second == b;
}

}  // namespace kvforge
