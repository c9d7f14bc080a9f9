#include "tiers/disk_read_ahead.hpp"

namespace kvforge {

DiskReadAhead::DiskReadAhead(BlockStore& store, int64_t packed_bytes, int64_t keep)
    : store_(store), packed_(packed_bytes), keep_(size_t(keep)), worker_([this] { run(); }) {}

DiskReadAhead::~DiskReadAhead() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stop_ = true;
  }
  changed_.notify_all();
  worker_.join();
}

bool DiskReadAhead::request(int64_t slot, uint64_t key) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (reads_.count(key)) return false;
    // Full: the oldest reads that are done and were never taken (their request went elsewhere or was
    // dropped) make room, so that such leftovers cannot stop reading ahead for good.
    while (reads_.size() >= keep_ && !order_.empty()) {
      const auto [oldest, ticket] = order_.front();
      const auto it = reads_.find(oldest);
      if (it != reads_.end() && it->second.ticket == ticket) {
        if (!it->second.done) break;  // still to be read: nothing older is left to drop
        if (!it->second.bytes.empty()) spare_.push_back(std::move(it->second.bytes));
        reads_.erase(it);
      }
      order_.pop_front();
    }
    if (reads_.size() >= keep_) return false;
    Read r;
    r.slot = slot, r.ticket = next_ticket_++;
    order_.emplace_back(key, r.ticket);
    reads_.emplace(key, std::move(r));
    queue_.push_back(key);
    if (order_.size() > 4 * keep_) {  // taken reads leave their entries behind: keep the live ones only
      std::deque<std::pair<uint64_t, uint64_t>> live;
      for (const auto& [k, t] : order_)
        if (const auto it = reads_.find(k); it != reads_.end() && it->second.ticket == t) live.emplace_back(k, t);
      order_.swap(live);
    }
  }
  changed_.notify_all();
  return true;
}

bool DiskReadAhead::take(uint64_t key, void* packed) {
  std::unique_lock<std::mutex> lock(mutex_);
  auto it = reads_.find(key);
  if (it == reads_.end()) return false;
  const uint64_t ticket = it->second.ticket;
  changed_.wait(lock, [&] {
    it = reads_.find(key);
    return it == reads_.end() || it->second.ticket != ticket || it->second.done;
  });
  if (it == reads_.end() || it->second.ticket != ticket) return false;  // cleared meanwhile
  const bool intact = it->second.intact;
  if (intact) std::copy(it->second.bytes.begin(), it->second.bytes.end(), static_cast<unsigned char*>(packed));
  if (!it->second.bytes.empty()) spare_.push_back(std::move(it->second.bytes));  // the next read's buffer
  reads_.erase(it);
  return intact;
}

void DiskReadAhead::clear() {
  std::lock_guard<std::mutex> lock(mutex_);
  queue_.clear();
  order_.clear();
  reads_.clear();
  changed_.notify_all();
}

void DiskReadAhead::run() {
  std::unique_lock<std::mutex> lock(mutex_);
  for (;;) {
    changed_.wait(lock, [&] { return stop_ || !queue_.empty(); });
    if (stop_) return;
    const uint64_t key = queue_.front();
    queue_.pop_front();
    const Read& queued = reads_.at(key);
    const int64_t slot = queued.slot;
    const uint64_t ticket = queued.ticket;
    std::vector<unsigned char> bytes;
    if (!spare_.empty()) bytes = std::move(spare_.back()), spare_.pop_back();
    lock.unlock();
    bytes.resize(static_cast<size_t>(packed_));
    const bool intact = store_.read(slot, key, bytes.data());
    lock.lock();
    const auto it = reads_.find(key);
    if (it == reads_.end() || it->second.ticket != ticket) continue;  // cleared while it was read
    it->second.done = true;
    it->second.intact = intact;
    if (intact) it->second.bytes = std::move(bytes);
    changed_.notify_all();
  }
}

}  // namespace kvforge
