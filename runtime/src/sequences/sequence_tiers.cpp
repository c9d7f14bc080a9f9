// SequenceManager's tiers below the device: an evicted cached block moves down (device, host, disk)
// rather than vanishing, each tier with its own LRU by the same priorities, and a prefix hit on a
// lower tier comes back into device pages (docs/memory.md, "Tiers").
#include <algorithm>
#include <string>

#include "tiers/disk_read_ahead.hpp"
#include "tiers/promotion_ahead.hpp"
#include "kvforge/errors.hpp"
#include "kvforge/sequence_manager.hpp"

namespace kvforge {

std::string SequenceManager::disk_identity() const {
  const VariantDescriptor& d = cache_.descriptor();
  std::string text = std::string("variant ") + d.name + "; layers " + std::to_string(d.layers) + "; heads " +
                     std::to_string(d.heads) + "; head_dim " + std::to_string(d.head_dim) + "; page_size " +
                     std::to_string(d.page_size) + "; storage " + std::string(d.storage_name()) + "; input " +
                     std::string(dtype_name(d.input)) + "; quant " + name_of(d.quant) + "; scale " +
                     std::string(dtype_name(d.scale)) + "; group " + std::to_string(d.quant_group) +
                     "; packed_page_bytes " + std::to_string(cache_.packed_page_bytes()) + "; block_hash " +
                     (options_.block_hash == BlockHashScheme::vllm_sha256_cbor ? "vllm_sha256_cbor" : "kvforge");
  if (options_.block_hash == BlockHashScheme::vllm_sha256_cbor) text += "; hash_seed " + options_.hash_seed;
  return text + "; weights " + options_.weights_tag;
}

void SequenceManager::open_disk_tier() {
  if (options_.disk_blocks <= 0) return;
  const int32_t P = page_size();
  disk_ = options_.disk_store ? options_.disk_store
                              : std::shared_ptr<BlockStore>(open_file_store(options_.disk_path, options_.disk_blocks,
                                                                            cache_.packed_page_bytes(), P, disk_identity()));
  // A restart keeps every record that checks out (one per key), in slot order; the rest are free.
  std::vector<uint8_t> used(size_t(options_.disk_blocks), 0);
  std::vector<int32_t> found;
  disk_->scan([&](int64_t slot, const StoredBlock& b) {
    if (disk_prefix_.has_key(b.key)) return;
    disk_prefix_.insert(b.key, int32_t(slot), b.tokens.data(), int32_t(b.tokens.size()), b.parent, b.salt);
    disk_prefix_.retain(int32_t(slot), std::clamp(b.priority, kMinPriority, kMaxPriority), 0.0);
    disk_prefix_.make_evictable(int32_t(slot));
    used[size_t(slot)] = 1;
    found.push_back(int32_t(slot));
  });
  for (int64_t slot = options_.disk_blocks - 1; slot >= 0; --slot)
    if (!used[size_t(slot)]) disk_free_.push_back(int32_t(slot));
  record_stored(disk_prefix_, found, "DISK");
}

SequenceManager::~SequenceManager() {
  promotion_.reset();  // its copies finish while the host pool they read is alive
}

void SequenceManager::settle(uint64_t ticket, bool host_waits) {
  if (ticket) host_waits ? promotion_->wait(ticket) : promotion_->order(ticket);
  const uint64_t done = promotion_->finished();
  for (auto it = promoting_.begin(); it != promoting_.end();) it = it->second <= done ? promoting_.erase(it) : std::next(it);
  auto copied = promoting_host_.begin();
  for (; copied != promoting_host_.end() && copied->first <= done; ++copied)
    for (int32_t h : copied->second)
      if (host_prefix_.cached(h)) host_prefix_.make_evictable(h);
  promoting_host_.erase(promoting_host_.begin(), copied);
}

// A sequence's page list as it is: its -1 entries (pages that left the window) match no copy, and while
// no copy is pending this costs one test, on step()'s path too.
void SequenceManager::settle_pages(const std::vector<int32_t>& pages) {
  if (promoting_.empty()) return;
  uint64_t last = 0;
  for (int32_t p : pages)
    if (const auto it = promoting_.find(p); it != promoting_.end()) last = std::max(last, it->second);
  if (last) settle(last, false);
}

void SequenceManager::settle_all() {
  if (!promoting_host_.empty()) settle(promoting_host_.back().first, true);
}

int64_t SequenceManager::prefetch(const std::vector<int32_t>& prompt, std::optional<uint64_t> salt) {
  if (!disk_ || options_.read_ahead_blocks == 0) return 0;
  if (!read_ahead_)  // its thread starts with the first read ahead
    read_ahead_ = std::make_unique<DiskReadAhead>(*disk_, cache_.packed_page_bytes(), options_.read_ahead_blocks);
  const uint64_t s = salt.value_or(options_.salt);
  BlockChain chain;
  const std::vector<int32_t> shared = shared_prefix(prompt, s, chain);
  int64_t queued = 0;
  for (const LowerBlock& b : lower_prefix(prompt, s, int64_t(shared.size()), chain))
    if (b.on_disk && read_ahead_->request(b.index, disk_prefix_.key_of(b.index))) ++queued;
  return queued;
}

int32_t SequenceManager::take_disk_slot() {
  if (disk_free_.empty()) {
    disk_prefix_.expire(now());
    const int32_t victim = disk_prefix_.take_victim();
    record_removed({disk_prefix_.key_of(victim)}, "DISK");
    disk_prefix_.forget(victim);
    return victim;
  }
  const int32_t slot = disk_free_.back();
  disk_free_.pop_back();
  return slot;
}

int32_t SequenceManager::host_room(int32_t n) {
  std::vector<uint64_t> dropped;
  if (host_.free_count() < n) host_prefix_.expire(now());
  bool synced = false;
  while (host_.free_count() < n && host_prefix_.evictable_count() > 0) {
    const int32_t h = host_prefix_.take_victim();
    if (disk_ && !disk_prefix_.has_key(host_prefix_.key_of(h))) {
      // Down to the disk tier: the host page's bytes once the stream has put them there.
      if (!synced && &backend_.host() != &backend_) backend_.synchronize(cache_.config().stream), synced = true;
      const int32_t slot = take_disk_slot();
      StoredBlock b{host_prefix_.key_of(h), host_prefix_.parent_of(h), host_prefix_.salt_of(h), host_prefix_.priority(h),
                    host_prefix_.tokens_of(h)};
      try {
        disk_->write(slot, b, static_cast<const unsigned char*>(host_pool_.data()) + h * cache_.packed_page_bytes());
        disk_prefix_.adopt(host_prefix_, h, slot);
        record_stored(disk_prefix_, {slot}, "DISK");  // at once: a later write of this loop may evict it
        ++stats_.disk_writes;
      } catch (const BackendError& e) {
        // A full disk, a file size limit, EIO: the block leaves the host tier as a miss (recomputed when
        // asked for again), and the slot is free; whatever the failed write left there never checks out
        // as another block (its checksum and key). Every page stays accounted for.
        disk_free_.push_back(slot);
        ++stats_.disk_write_failures;
        last_disk_error_ = e.what();
      }
    }
    dropped.push_back(host_prefix_.key_of(h));
    host_prefix_.forget(h);
    host_.release({h});
  }
  record_removed(std::move(dropped), host_medium());
  return std::min(n, host_.free_count());
}

void SequenceManager::evict(int32_t n) {
  if (device_.free_count() >= n) return;
  prefix_.expire(now());
  std::vector<int32_t> victims;
  while (device_.free_count() + int32_t(victims.size()) < n && prefix_.evictable_count() > 0) {  // then the reclaimer's
    victims.push_back(prefix_.take_victim());
  }
  settle_pages(victims);  // a promoted block whose sequence went before its step: its copy ends first
  // Demoted to the host tier, as many as it has room for: packed there before the pages are reused.
  const bool demote = options_.demote_to_host && host_.total() > 0;
  std::vector<int32_t> moved, host_pages;
  if (demote) {
    for (int32_t b : victims)
      if (!host_prefix_.has_key(prefix_.key_of(b))) moved.push_back(b);
    moved.resize(size_t(host_room(int32_t(moved.size()))));
    host_.allocate(int32_t(moved.size()), host_pages);
    pages_to_host(moved, host_pages);
    for (size_t i = 0; i < moved.size(); ++i) host_prefix_.adopt(prefix_, moved[i], host_pages[i]);
    stats_.demoted_blocks += int64_t(moved.size());
    record_stored(host_prefix_, host_pages, host_medium());
  }
  std::vector<uint64_t> removed;
  for (int32_t b : victims) {
    if (options_.kv_events) removed.push_back(prefix_.key_of(b));  // an event only where events are kept
    prefix_.forget(b);
    device_.release({b});
    ++stats_.evictions;
  }
  record_removed(std::move(removed), device_medium());
}

std::vector<SequenceManager::LowerBlock> SequenceManager::lower_prefix(const std::vector<int32_t>& prompt, uint64_t salt,
                                                                        int64_t from, BlockChain chain,
                                                                        int64_t* covered, std::vector<int32_t>* between) const {
  std::vector<LowerBlock> out;
  int64_t blocks = 0;
  if ((host_prefix_.size() > 0 || disk_prefix_.size() > 0) && !prompt.empty()) {
    const int32_t P = page_size();
    const int64_t lookups = int64_t(prompt.size() - 1) / P;  // the prompt's last token is always computed
    for (int64_t i = from; i < lookups; ++i, ++blocks) {
      const int32_t* t = prompt.data() + i * P;
      chain = hasher_.next(chain, salt, t, P);
      if (const int32_t on_device = prefix_.find(chain.key, t, P); on_device >= 0) {
        if (between) between->push_back(on_device);
        continue;  // past a block a lower tier brings back, the device has more
      }
      const int32_t h = host_prefix_.find(chain.key, t, P);
      const int32_t d = h < 0 ? disk_prefix_.find(chain.key, t, P) : -1;
      if (h < 0 && d < 0) break;
      out.push_back(h >= 0 ? LowerBlock{false, h} : LowerBlock{true, d});
    }
  }
  if (covered) *covered = blocks;
  return out;
}

void SequenceManager::promote(std::vector<LowerBlock> blocks) {
  // Disk records are read and checked before anything changes: the prefix ends at the first one that
  // does not check out, which is forgotten (a miss, never wrong data).
  const int64_t ppb = cache_.packed_page_bytes();
  const int64_t on_disk = std::count_if(blocks.begin(), blocks.end(), [](const LowerBlock& b) { return b.on_disk; });
  disk_io_.resize(size_t(on_disk * ppb));
  int64_t read = 0;
  for (size_t i = 0; i < blocks.size(); ++i) {
    if (!blocks[i].on_disk) continue;
    const int32_t slot = blocks[i].index;
    const uint64_t key = disk_prefix_.key_of(slot);
    unsigned char* into = disk_io_.data() + read * ppb;
    if (read_ahead_ && read_ahead_->take(key, into)) {
      ++stats_.read_ahead_hits;
    } else if (!disk_->read(slot, key, into)) {
      record_removed({key}, "DISK");
      disk_prefix_.keep(slot);
      disk_prefix_.forget(slot);
      disk_free_.push_back(slot);
      ++stats_.disk_misses;
      blocks.resize(i);
      break;
    }
    ++read;
  }
  if (blocks.empty()) return;
  // Demotions while allocating must not drop them.
  for (const LowerBlock& b : blocks) (b.on_disk ? disk_prefix_ : host_prefix_).keep(b.index);
  std::vector<int32_t> pages;
  allocate(int32_t(blocks.size()), pages);
  std::vector<int32_t> host_blocks, host_pages, disk_pages;
  for (size_t i = 0; i < blocks.size(); ++i) {
    if (blocks[i].on_disk) disk_pages.push_back(pages[i]);
    else host_blocks.push_back(blocks[i].index), host_pages.push_back(pages[i]);
  }
  const bool ahead = options_.promote_ahead && !host_blocks.empty();
  if (ahead) {
    if (!promotion_) promotion_ = PromotionAhead::start(cache_, backend_);
    settle(0, false);  // copies done since the last settle give their host blocks back, whoever steps next
    std::vector<const unsigned char*> from;
    for (int32_t h : host_blocks) from.push_back(static_cast<const unsigned char*>(host_pool_.data()) + h * ppb);
    const uint64_t ticket = promotion_->queue(std::move(from), host_pages);
    for (int32_t p : host_pages) promoting_[p] = ticket;
    promoting_host_.emplace_back(ticket, host_blocks);
    stats_.promoted_ahead += int64_t(host_blocks.size());
  } else {
    pages_from_host(host_blocks, host_pages);
  }
  if (!disk_pages.empty()) {
    const int64_t bytes = int64_t(disk_pages.size()) * ppb;
    if (&backend_.host() == &backend_) {
      cache_.unpack_pages(disk_io_.data(), device_index(disk_pages, 1));
    } else {
      if (staging_.bytes() < bytes) staging_ = Buffer(backend_, bytes);
      backend_.from_host(staging_.data(), disk_io_.data(), bytes, cache_.config().stream);
      cache_.unpack_pages(staging_.data(), device_index(disk_pages, 1));
    }
  }
  // The allocation's reference becomes the cache's own; the lower copy stays, the newest there.
  for (size_t i = 0; i < pages.size(); ++i) {
    PrefixCache& tier = blocks[i].on_disk ? disk_prefix_ : host_prefix_;
    prefix_.adopt(tier, blocks[i].index, pages[i]);
    if (blocks[i].on_disk || !ahead) tier.make_evictable(blocks[i].index);  // else once its copy is settled
  }
  stats_.promoted_blocks += int64_t(pages.size());
  stats_.disk_reads += int64_t(disk_pages.size());
  record_stored(prefix_, pages, device_medium());
}

}  // namespace kvforge
