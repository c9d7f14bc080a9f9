// SequenceManager's prefix-cache policy: which cached block goes first when pages run short
// (retention priorities), and the KV events that tell a router what the cache holds.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <string>

#include "tiers/disk_read_ahead.hpp"
#include "kvforge/errors.hpp"
#include "kvforge/sequence_manager.hpp"

namespace kvforge {

// vLLM's names for where a block is: "GPU" for a CUDA cache, "CPU" for its host tier. A CPU cache is
// "CPU" itself, and its host tier "HOST".
const char* SequenceManager::device_medium() const { return cache_.config().device == Device::cpu ? "CPU" : "GPU"; }
const char* SequenceManager::host_medium() const { return cache_.config().device == Device::cpu ? "HOST" : "CPU"; }

double SequenceManager::now() const {
  if (options_.clock) return options_.clock();
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

void SequenceManager::record_removed(std::vector<uint64_t> hashes, const char* medium) {
  if (hashes.empty()) return;
  KvEvent removed;
  removed.kind = KvEvent::Kind::block_removed;
  removed.block_hashes = std::move(hashes);
  removed.medium = medium;
  events_.push(std::move(removed));
}

std::pair<int, double> SequenceManager::retention_of(const Sequence& s, int64_t index) const {
  const int64_t P = page_size(), begin = index * P, end = begin + P;
  int priority = -1;
  double until = 0;
  for (const RetentionRange& r : s.retention) {
    if (r.end <= begin || r.begin >= end || r.priority < priority) continue;
    const double range_until = r.seconds > 0 ? now() + r.seconds : 0.0;
    if (r.priority > priority || range_until == 0.0 || (until != 0.0 && range_until > until)) until = range_until;
    priority = r.priority;
  }
  return priority < 0 ? std::pair<int, double>{options_.default_priority, 0.0} : std::pair<int, double>{priority, until};
}

void SequenceManager::record_stored(const PrefixCache& cache, const std::vector<int32_t>& blocks, const char* medium) {
  if (!events_.enabled) return;
  KvEvent e;
  for (size_t i = 0; i <= blocks.size(); ++i) {
    // A block that does not continue the chain of the one before starts an event of its own.
    const bool continues = i < blocks.size() && !e.block_hashes.empty() && cache.parent_of(blocks[i]) == e.block_hashes.back() &&
                           cache.salt_of(blocks[i]) == e.salt;
    if (!e.block_hashes.empty() && !continues) events_.push(std::exchange(e, KvEvent{}));
    if (i == blocks.size()) break;
    const int32_t b = blocks[i];
    if (e.block_hashes.empty()) {
      e.kind = KvEvent::Kind::block_stored;
      e.block_size = page_size();
      e.salt = cache.salt_of(b);
      e.medium = medium;
      if (cache.parent_of(b) != 0) e.parent_block_hash = cache.parent_of(b);
    }
    e.block_hashes.push_back(cache.key_of(b));
    e.token_ids.insert(e.token_ids.end(), cache.tokens_of(b).begin(), cache.tokens_of(b).end());
  }
}

void SequenceManager::set_retention(int64_t seq, const std::vector<RetentionRange>& ranges) {
  Sequence& s = live(seq, "seq");
  for (size_t i = 0; i < ranges.size(); ++i) {
    const RetentionRange& r = ranges[i];
    const std::string name = "ranges[" + std::to_string(i) + "]";
    if (r.begin < 0 || r.end < r.begin)
      throw ArgumentError(name, "begin " + std::to_string(r.begin) + ", end " + std::to_string(r.end) +
                                    ": needs 0 <= begin <= end");
    if (r.priority < kMinPriority || r.priority > kMaxPriority)
      throw OutOfRangeError(name + ".priority", r.priority, kMinPriority, kMaxPriority + 1);
    if (!(r.seconds >= 0) || !std::isfinite(r.seconds))
      throw ArgumentError(name + ".seconds", "must be finite and >= 0 (0: for good), got " + std::to_string(r.seconds));
  }
  s.retention = ranges;
  for (int32_t i = s.dropped; i < s.hashed_blocks; ++i) {
    const int32_t b = s.pages[size_t(i)];
    if (b >= 0 && prefix_.cached(b)) {
      const auto [priority, until] = retention_of(s, i);
      prefix_.retain(b, priority, until);
    }
  }
}

void SequenceManager::reset_prefix_cache() {
  if (prefix_.evictable_count() != prefix_.size())
    throw StateError("prefix_cache", std::to_string(prefix_.size() - prefix_.evictable_count()) +
                                         " cached blocks are held by live sequences; free them first");
  settle_all();
  device_.release(prefix_.evict_all());
  host_.release(host_prefix_.evict_all());
  for (int32_t slot : disk_prefix_.evict_all()) disk_free_.push_back(slot);
  if (read_ahead_) read_ahead_->clear();
  KvEvent cleared;
  cleared.kind = KvEvent::Kind::all_blocks_cleared;
  cleared.medium = device_medium();
  events_.push(std::move(cleared));
  // The disk tier's records go too, for any later process on the file (a reset for new weights): the
  // store's generation moves on. Everything above is done first; a store that cannot says so.
  if (disk_) disk_->invalidate_all();
}

namespace {
std::vector<uint64_t> sorted_keys(const PrefixCache& cache) {
  std::vector<uint64_t> out;
  cache.for_each_cached([&](uint64_t key, int32_t) { out.push_back(key); });
  std::sort(out.begin(), out.end());
  return out;
}
}  // namespace

std::vector<uint64_t> SequenceManager::cached_block_hashes() const { return sorted_keys(prefix_); }
std::vector<uint64_t> SequenceManager::host_cached_block_hashes() const { return sorted_keys(host_prefix_); }
std::vector<uint64_t> SequenceManager::disk_cached_block_hashes() const { return sorted_keys(disk_prefix_); }

}  // namespace kvforge
