#include "kvforge/prefix_cache.hpp"

#include <algorithm>
#include <functional>

namespace kvforge {

PrefixCache::PrefixCache(int32_t blocks, int default_priority)
    : key_of_(size_t(blocks), 0),
      parent_of_(size_t(blocks), 0),
      salt_of_(size_t(blocks), 0),
      cached_(size_t(blocks), 0),
      tokens_(size_t(blocks)),
      prev_(size_t(blocks), -1),
      next_(size_t(blocks), -1),
      default_priority_(default_priority),
      priority_(size_t(blocks), uint8_t(default_priority)),
      until_(size_t(blocks), 0.0) {
  std::fill(std::begin(head_), std::end(head_), -1);
  std::fill(std::begin(tail_), std::end(tail_), -1);
}

int32_t PrefixCache::find(uint64_t key, const int32_t* tokens, int32_t n) const {
  auto it = by_key_.find(key);
  if (it == by_key_.end()) return -1;
  const std::vector<int32_t>& stored = tokens_[size_t(it->second)];
  return int32_t(stored.size()) == n && std::equal(tokens, tokens + n, stored.begin()) ? it->second : -1;
}

void PrefixCache::insert(uint64_t key, int32_t block, const int32_t* tokens, int32_t n, uint64_t parent,
                         uint64_t salt) {
  by_key_[key] = block;
  key_of_[size_t(block)] = key;
  parent_of_[size_t(block)] = parent;
  salt_of_[size_t(block)] = salt;
  cached_[size_t(block)] = 1;
  tokens_[size_t(block)].assign(tokens, tokens + n);
  priority_[size_t(block)] = uint8_t(default_priority_);
  until_[size_t(block)] = 0.0;
}

void PrefixCache::adopt(const PrefixCache& other, int32_t other_block, int32_t block) {
  const std::vector<int32_t>& t = other.tokens_of(other_block);
  insert(other.key_of(other_block), block, t.data(), int32_t(t.size()), other.parent_of(other_block),
         other.salt_of(other_block));
  retain(block, other.priority(other_block), 0.0);
  make_evictable(block);
}

void PrefixCache::retain(int32_t b, int priority, double until) {
  const int old = priority_[size_t(b)];
  const double old_until = until_[size_t(b)];
  // A priority for good outlasts one with an end; of two ends, the later.
  const bool keeps_old = old > priority || (old == priority && (old_until == 0.0 || (until != 0.0 && old_until >= until)));
  if (keeps_old || (priority == default_priority_ && old == default_priority_)) return;
  const bool listed = evictable(b);
  if (listed) keep(b);
  priority_[size_t(b)] = uint8_t(priority);
  until_[size_t(b)] = until;
  if (until != 0.0) ends_.push({until, b});
  if (listed) make_evictable(b);
}

void PrefixCache::expire(double now) {
  while (!ends_.empty() && ends_.top().first <= now) {
    const auto [until, b] = ends_.top();
    ends_.pop();
    if (!cached(b) || until_[size_t(b)] != until) continue;  // forgotten, or given a new end since
    const bool listed = evictable(b);
    if (listed) keep(b);
    priority_[size_t(b)] = uint8_t(default_priority_);
    until_[size_t(b)] = 0.0;
    if (listed) make_evictable(b);
  }
}

void PrefixCache::make_evictable(int32_t b) {
  if (evictable(b)) return;
  const int p = priority_[size_t(b)];
  prev_[size_t(b)] = tail_[p];
  next_[size_t(b)] = -1;
  if (tail_[p] >= 0) next_[size_t(tail_[p])] = b; else head_[p] = b;
  tail_[p] = b;
  ++evictable_;
}

void PrefixCache::keep(int32_t b) {
  if (!evictable(b)) return;
  const int p = priority_[size_t(b)];
  const int32_t before = prev_[size_t(b)], after = next_[size_t(b)];
  if (before >= 0) next_[size_t(before)] = after; else head_[p] = after;
  if (after >= 0) prev_[size_t(after)] = before; else tail_[p] = before;
  prev_[size_t(b)] = next_[size_t(b)] = -1;
  --evictable_;
}

void PrefixCache::forget(int32_t b) {
  keep(b);
  by_key_.erase(key_of_[size_t(b)]);
  cached_[size_t(b)] = 0;
  tokens_[size_t(b)].clear();
  priority_[size_t(b)] = uint8_t(default_priority_);
  until_[size_t(b)] = 0.0;
}

int32_t PrefixCache::take_victim() {
  int p = kMinPriority;
  while (head_[p] < 0) ++p;  // the caller checked evictable_count() > 0
  const int32_t b = head_[p];
  keep(b);
  return b;
}

std::vector<int32_t> PrefixCache::evict_all() {
  std::vector<int32_t> out;
  for (const auto& entry : by_key_) out.push_back(entry.second);
  for (int32_t b : out) forget(b);
  ends_ = {};
  return out;
}

bool PrefixCache::consistent(int32_t b) const {
  if (!cached(b)) return priority_[size_t(b)] == default_priority_;
  auto it = by_key_.find(key_of_[size_t(b)]);
  return it != by_key_.end() && it->second == b;
}

}  // namespace kvforge
