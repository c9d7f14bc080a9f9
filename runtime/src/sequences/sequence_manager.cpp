#include "kvforge/sequence_manager.hpp"

#include "tiers/disk_read_ahead.hpp"
#include "tiers/promotion_ahead.hpp"

#include <algorithm>
#include <climits>
#include <cstring>
#include <string>

namespace kvforge {

namespace {
// A step's batch names each sequence once; throws for the first listed twice.
void check_listed_once(const std::vector<int64_t>& seqs) {
  std::vector<int64_t> sorted = seqs;
  std::sort(sorted.begin(), sorted.end());
  const auto twice = std::adjacent_find(sorted.begin(), sorted.end());
  if (twice != sorted.end()) throw ArgumentError("seqs", "sequence " + std::to_string(*twice) + " is listed twice");
}

const SequenceManagerOptions& checked(const SequenceManagerOptions& o) {
  if (o.host_blocks < 0) throw OutOfRangeError("options.host_blocks", o.host_blocks, 0, LLONG_MAX, -1, "0: no offload");
  if (o.window < 0) throw OutOfRangeError("options.window", o.window, 0, LLONG_MAX, -1, "0: no window");
  if (o.disk_blocks < 0 || o.disk_blocks > INT32_MAX)
    throw OutOfRangeError("options.disk_blocks", o.disk_blocks, 0, int64_t(INT32_MAX) + 1, -1, "0: no disk tier");
  if (o.disk_blocks > 0 && o.disk_path.empty() && !o.disk_store)
    throw ArgumentError("options.disk_path", "a disk tier of " + std::to_string(o.disk_blocks) + " blocks needs a file path");
  if (o.disk_store && o.disk_blocks > o.disk_store->capacity())
    throw OutOfRangeError("options.disk_blocks", o.disk_blocks, 0, o.disk_store->capacity() + 1, -1,
                          "options.disk_store holds that many records");
  if (o.disk_blocks > 0 && o.host_blocks == 0)
    throw ArgumentError("options.disk_blocks", "blocks reach the disk tier from the host tier: give options.host_blocks too");
  if (o.read_ahead_blocks < 0) throw OutOfRangeError("options.read_ahead_blocks", o.read_ahead_blocks, 0, INT32_MAX, -1, "0: none");
  if (o.block_hash != BlockHashScheme::kvforge && o.block_hash != BlockHashScheme::vllm_sha256_cbor)
    throw OutOfRangeError("options.block_hash", int(o.block_hash), 0, 2, -1, "0: kvforge, 1: vllm_sha256_cbor");
  if (o.default_priority < kMinPriority || o.default_priority > kMaxPriority)
    throw OutOfRangeError("options.default_priority", o.default_priority, kMinPriority, kMaxPriority + 1);
  return o;
}
}  // namespace

SequenceManager::SequenceManager(Cache& cache, SequenceManagerOptions options)
    : cache_(cache),
      options_(checked(options)),
      hasher_(options.block_hash, options.hash_seed),
      backend_(backend(cache.config().device)),
      device_(int32_t(cache.config().pages)),
      prefix_(int32_t(cache.config().pages), options.default_priority),
      host_(options.host_blocks),
      host_prefix_(options.host_blocks, options.default_priority),
      disk_prefix_(int32_t(options.disk_blocks), options.default_priority) {
  if (!cache.descriptor().paged())
    throw UnsupportedError(std::string(cache.descriptor().name) + ": a sequence manager owns pages; this layout has none");
  events_.enabled = options.kv_events;
  if (options.host_blocks > 0) host_pool_ = Buffer(backend_.host(), int64_t(options.host_blocks) * cache.packed_page_bytes());
  open_disk_tier();
}

SequenceManager::Sequence& SequenceManager::live(int64_t seq, const char* argument) {
  auto it = sequences_.find(seq);
  if (it == sequences_.end()) throw StateError(argument, "sequence " + std::to_string(seq) + " does not exist");
  if (it->second.offloaded)
    throw StateError(argument, "sequence " + std::to_string(seq) + " is offloaded; restore() it first");
  return it->second;
}

const SequenceManager::Sequence& SequenceManager::find(int64_t seq, const char* argument) const {
  auto it = sequences_.find(seq);
  if (it == sequences_.end()) throw StateError(argument, "sequence " + std::to_string(seq) + " does not exist");
  return it->second;
}

int64_t SequenceManager::length(int64_t seq) const { return int64_t(find(seq, "seq").tokens.size()); }
bool SequenceManager::offloaded(int64_t seq) const { return find(seq, "seq").offloaded; }
const std::vector<int32_t>& SequenceManager::pages(int64_t seq) const { return find(seq, "seq").pages; }
const std::vector<int32_t>& SequenceManager::tokens(int64_t seq) const { return find(seq, "seq").tokens; }

void SequenceManager::allocate(int32_t n, std::vector<int32_t>& out) {
  if (n > available_blocks()) throw CapacityError("pages", n, available_blocks());
  evict(n);
  if (device_.free_count() < n && reclaimer_) reclaimer_->reclaim(n - device_.free_count());
  device_.allocate(n, out);
}

void SequenceManager::release(const std::vector<int32_t>& pages) {
  device_.release(pages);
  // A cached page that only the prefix cache still holds becomes evictable.
  for (int32_t b : pages)
    if (prefix_.cached(b) && device_.ref_count(b) == 1) prefix_.make_evictable(b);
}

std::vector<int32_t> SequenceManager::take_pages(int32_t n) {
  if (n < 0) throw OutOfRangeError("n", n, 0, INT32_MAX);
  std::vector<int32_t> out;
  allocate(n, out);
  taken_.insert(out.begin(), out.end());
  return out;
}

void SequenceManager::give_pages(const std::vector<int32_t>& pages) {
  std::unordered_set<int32_t> seen;
  for (int32_t b : pages)
    if (!taken_.count(b) || !seen.insert(b).second)
      throw StateError("pages", "page " + std::to_string(b) + " was not taken by take_pages(), or is listed twice");
  for (int32_t b : pages) taken_.erase(b);
  release(pages);
}

void SequenceManager::register_full_blocks(Sequence& s) {
  if (!options_.prefix_caching) return;
  const int32_t P = page_size();
  const int32_t full = int32_t(s.tokens.size() / size_t(P));
  std::vector<int32_t> joined;  // blocks joining the cache, for their BlockStored events
  for (; s.hashed_blocks < full; ++s.hashed_blocks) {
    const int32_t* t = s.tokens.data() + size_t(s.hashed_blocks) * P;
    const uint64_t parent = s.chain.key;
    s.chain = hasher_.next(s.chain, s.salt, t, P);
    const int32_t b = s.pages[size_t(s.hashed_blocks)];
    const auto [priority, until] = retention_of(s, s.hashed_blocks);
    // A page that left the window before its step was never written; one already cached is shared.
    const bool joins = b >= 0 && !prefix_.cached(b) && !prefix_.has_key(s.chain.key);
    if (joins) {
      prefix_.insert(s.chain.key, b, t, P, parent, s.salt);
      device_.retain(b);  // the cache's own reference
      joined.push_back(b);
    }
    if (b >= 0 && prefix_.cached(b)) prefix_.retain(b, priority, until);
  }
  record_stored(prefix_, joined, device_medium());
}

// The cached full blocks at the head of `prompt`, leaving its last token to compute. With a sliding
// window, blocks wholly before the prompt's window are never read, so they count as covered without a
// page (entry -1); only blocks that overlap the window must come from the cache.
std::vector<int32_t> SequenceManager::shared_prefix(const std::vector<int32_t>& prompt, uint64_t salt,
                                                    BlockChain& chain) const {
  std::vector<int32_t> shared;
  chain = BlockChain{};
  if (!options_.prefix_caching || prompt.empty()) return shared;
  const int32_t P = page_size();
  const int64_t lookups = int64_t(prompt.size() - 1) / P;
  const int64_t oldest = options_.window > 0 ? int64_t(prompt.size()) - options_.window : 0;
  for (int64_t i = 0; i < lookups; ++i) {
    const int32_t* t = prompt.data() + i * P;
    const BlockChain key = hasher_.next(chain, salt, t, P);
    if ((i + 1) * P <= oldest) {
      shared.push_back(-1);
      chain = key;
      continue;
    }
    const int32_t b = prefix_.find(key.key, t, P);
    if (b < 0) break;
    shared.push_back(b);
    chain = key;
  }
  return shared;
}

int64_t SequenceManager::cached_prefix(const std::vector<int32_t>& prompt, std::optional<uint64_t> salt) const {
  BlockChain chain;
  const uint64_t s = salt.value_or(options_.salt);
  const int64_t on_device = int64_t(shared_prefix(prompt, s, chain).size());
  int64_t further = 0;
  lower_prefix(prompt, s, on_device, chain, &further);
  return (on_device + further) * page_size();
}

int32_t SequenceManager::pages_to_add(const std::vector<int32_t>& prompt, int64_t cached) const {
  const int32_t P = page_size();
  return int32_t((int64_t(prompt.size()) + P - 1) / P - cached / P);
}

int32_t SequenceManager::pages_to_append(int64_t seq, int64_t tokens) const {
  const Sequence& s = find(seq, "seq");
  if (s.offloaded) throw StateError("seq", "sequence " + std::to_string(seq) + " is offloaded; restore() it first");
  const int32_t P = page_size();
  const int64_t length = int64_t(s.tokens.size());
  const bool copy_last = length % P != 0 && device_.ref_count(s.pages.back()) > 1;
  return int32_t((length + tokens + P - 1) / P) - int32_t(s.pages.size()) + (copy_last ? 1 : 0);
}

int64_t SequenceManager::add(int64_t seq, const std::vector<int32_t>& prompt, std::optional<uint64_t> salt,
                             int64_t max_cached) {
  if (sequences_.count(seq)) throw StateError("seq", "sequence " + std::to_string(seq) + " already exists");
  Sequence s;
  s.salt = salt.value_or(options_.salt);
  const int32_t P = page_size();
  BlockChain chain;
  std::vector<int32_t> shared = shared_prefix(prompt, s.salt, chain);
  const int64_t lookups = prompt.empty() ? 0 : int64_t(prompt.size() - 1) / P;
  // Blocks the host tier holds past the device's prefix come back first (not for a hybrid cache's
  // groups, which agree on max_cached and keep no host tier). They take pages that the prompt would
  // take anyway, so the capacity the rest of add() checks is the same, and it is checked first.
  if (max_cached == INT64_MAX) {
    // The prompt's device blocks, those of the device-held prefix and those past the lower blocks,
    // stay for the whole of add(): promotion's allocation must not evict them, so that add() covers
    // what cached_prefix() said.
    std::vector<int32_t> on_device;
    std::vector<LowerBlock> lower = lower_prefix(prompt, s.salt, int64_t(shared.size()), chain, nullptr, &on_device);
    if (!lower.empty()) {
      const int32_t reused = int32_t(shared.size() + on_device.size());  // blocks that take no new page
      int32_t pinned = 0;
      for (int32_t b : shared)
        if (b >= 0) on_device.push_back(b);
      for (int32_t b : on_device) pinned += prefix_.evictable(b) ? 1 : 0;
      const int32_t need = int32_t((int64_t(prompt.size()) + P - 1) / P) - reused;
      if (need > available_blocks() - pinned) throw CapacityError("pages", need, available_blocks() - pinned);
      for (int32_t b : on_device) prefix_.keep(b);  // the eviction that promotion may cause must not take them
      promote(std::move(lower));
      for (int32_t b : on_device)
        if (device_.ref_count(b) == 1) prefix_.make_evictable(b);
      shared = shared_prefix(prompt, s.salt, chain);
    }
  }
  if (int64_t(shared.size()) * P > max_cached) {
    // Another group holds less of this prefix: share only what every group can, and let the chain
    // restart from the last block kept.
    shared.resize(size_t(std::max<int64_t>(0, max_cached) / P));
    chain = BlockChain{};
    for (size_t i = 0; i < shared.size(); ++i) chain = hasher_.next(chain, s.salt, prompt.data() + i * P, P);
  }
  if (options_.prefix_caching) stats_.prefix_misses += lookups - int64_t(shared.size());
  const int64_t cached = int64_t(shared.size()) * P;
  const int32_t skipped = int32_t(std::count(shared.begin(), shared.end(), -1));  // outside the window
  shared.erase(shared.begin(), shared.begin() + skipped);
  const int64_t rest = int64_t(prompt.size()) - cached;
  const int32_t new_pages = int32_t((int64_t(prompt.size()) + P - 1) / P) - int32_t(shared.size()) - skipped;
  // Take the shared pages before allocating, so that eviction cannot pick them.
  for (int32_t b : shared) {
    prefix_.keep(b);
    device_.retain(b);
  }
  try {
    allocate(new_pages, s.pages);
  } catch (...) {
    release(shared);
    throw;
  }
  stats_.prefix_hits += int64_t(shared.size());
  s.pages.insert(s.pages.begin(), shared.begin(), shared.end());
  s.pages.insert(s.pages.begin(), size_t(skipped), -1);
  s.dropped = skipped;
  s.tokens = prompt;
  s.pending = rest;
  s.chain = chain;
  s.hashed_blocks = int32_t(shared.size()) + skipped;
  drop_out_of_window(s);
  s.row = take_row();
  sequences_.emplace(seq, std::move(s));
  return cached;
}

void SequenceManager::drop_out_of_window(Sequence& s) {
  if (options_.window <= 0) return;
  const int32_t P = page_size();
  const int64_t oldest = int64_t(s.tokens.size()) - options_.window;  // first position still readable
  std::vector<int32_t> gone;
  while (int64_t(s.dropped + 1) * P <= oldest) {
    gone.push_back(s.pages[size_t(s.dropped)]);
    set_page(s, size_t(s.dropped++), -1);
  }
  if (!gone.empty()) release(gone);
}

void SequenceManager::append(int64_t seq, const std::vector<int32_t>& tokens) {
  Sequence& s = live(seq, "seq");
  if (tokens.empty()) return;
  const int32_t P = page_size();
  const int64_t length = int64_t(s.tokens.size());
  const int32_t needed = int32_t((length + int64_t(tokens.size()) + P - 1) / P) - int32_t(s.pages.size());
  // A partial last page that others share is copied before it is written.
  const bool copy_last = length % P != 0 && device_.ref_count(s.pages.back()) > 1;
  if (needed + (copy_last ? 1 : 0) > available_blocks())
    throw CapacityError("pages", needed + (copy_last ? 1 : 0), available_blocks());
  if (copy_last) {
    settle_pages({s.pages.back()});
    std::vector<int32_t> fresh;
    allocate(1, fresh);
    const std::vector<int32_t> pair{s.pages.back(), fresh[0]};
    cache_.copy_blocks(device_index(pair, 0));
    release({s.pages.back()});
    set_page(s, s.pages.size() - 1, fresh[0]);
    ++stats_.copies_on_write;
  }
  allocate(needed, s.pages);
  s.tokens.insert(s.tokens.end(), tokens.begin(), tokens.end());
  s.pending += int64_t(tokens.size());
  drop_out_of_window(s);
}

void SequenceManager::fork(int64_t parent, int64_t child) {
  if (sequences_.count(child)) throw StateError("child", "sequence " + std::to_string(child) + " already exists");
  Sequence& p = live(parent, "parent");
  if (p.pending) throw StateError("parent", "sequence " + std::to_string(parent) + " has tokens no step() has written yet");
  Sequence c = p;
  for (int32_t b : held(c)) device_.retain(b);
  unsync(c);
  c.row = take_row();
  sequences_.emplace(child, std::move(c));
}

void SequenceManager::free(int64_t seq) {
  auto it = sequences_.find(seq);
  if (it == sequences_.end()) throw StateError("seq", "sequence " + std::to_string(seq) + " does not exist");
  if (it->second.offloaded) {
    host_.release(it->second.host_pages);
  } else {
    settle_pages(it->second.pages);  // its pages may go to another sequence next
    release(held(it->second));
  }
  free_rows_.push_back(it->second.row);
  last_batch_.clear();  // its Sequence* may be in the last batch
  sequences_.erase(it);
}

IndexView SequenceManager::device_index(const std::vector<int32_t>& host, int slot) {
  Buffer& b = index_scratch_[slot];
  const int64_t bytes = int64_t(host.size() * sizeof(int32_t));
  if (b.bytes() < bytes) b = Buffer(backend_, std::max<int64_t>(bytes, 256));
  backend_.from_host(b.data(), host.data(), bytes, cache_.config().stream);
  return IndexView{b.data(), DType::i32, cache_.config().device, int64_t(host.size())};
}

BatchMetadata SequenceManager::describe_step(const std::vector<int64_t>& seqs, bool consume) {
  BatchMetadata m;
  const int32_t P = page_size();
  for (int64_t id : seqs) {  // check everything before handing anything out
    const Sequence& s = live(id, "seqs");
    m.max_pages = std::max(m.max_pages, int32_t(s.pages.size()));
  }
  m.query_start.push_back(0);
  m.indptr.push_back(0);
  for (int64_t id : seqs) {
    Sequence& s = sequences_.at(id);
    const int64_t length = int64_t(s.tokens.size());
    for (int64_t pos = length - s.pending; pos < length; ++pos) {
      const int32_t page = s.pages[size_t(pos / P)];  // -1: the position already left the window
      m.slots.push_back(page < 0 ? -1 : int64_t(page) * P + pos % P);
    }
    if (consume) {
      s.pending = 0;
      // Its full pages are written by this step, so they can be shared from now on.
      register_full_blocks(s);
    }
    m.query_start.push_back(int32_t(m.slots.size()));
    m.lengths.push_back(int32_t(length));
    m.page_table.insert(m.page_table.end(), s.pages.begin(), s.pages.end());
    m.page_table.insert(m.page_table.end(), size_t(m.max_pages) - s.pages.size(), -1);
    m.indices.insert(m.indices.end(), s.pages.begin() + s.dropped, s.pages.end());
    m.indptr.push_back(int32_t(m.indices.size()));
    m.last_page_len.push_back(length == 0 ? 0 : int32_t((length - 1) % P + 1));
  }
  return m;
}

BatchMetadata SequenceManager::step(const std::vector<int64_t>& seqs) {
  check_listed_once(seqs);  // one listed twice would come out as two requests, the second with no tokens
  BatchMetadata m = describe_step(seqs, true);
  settle_pages(m.indices);  // the step's own promoted pages, and no others
  return m;
}

int32_t SequenceManager::take_row() {
  if (free_rows_.empty()) return next_row_++;
  const int32_t row = free_rows_.back();
  free_rows_.pop_back();
  return row;
}

const std::vector<SequenceManager::Sequence*>& SequenceManager::batch_sequences(const std::vector<int64_t>& seqs) {
  // A steady decode step serves the batch it served last: its sequences need no lookup. free() and
  // offload() forget the last batch, so no pointer here outlives its sequence's life.
  if (seqs != last_batch_) {
    std::vector<Sequence*> found(seqs.size());
    for (size_t i = 0; i < seqs.size(); ++i) found[i] = &live(seqs[i], "seqs");  // checks all before any change
    check_listed_once(seqs);  // one listed twice would have its row advanced twice on the device
    last_batch_ = seqs;
    last_batch_sequences_ = std::move(found);
  }
  return last_batch_sequences_;
}

void SequenceManager::record_changes(const std::vector<Sequence*>& batch, StepChanges& c) {
  const size_t n = batch.size();
  c.table.clear();
  c.rows_reset.clear();
  c.batch_changed = c.rows.size() != n;
  c.rows.resize(n);
  c.new_tokens.resize(n);
  c.total_new_tokens = c.total_held_pages = 0;
  c.max_pages = 0;
  c.table_rows = next_row_;
  for (size_t i = 0; i < n; ++i) {
    Sequence& s = *batch[i];
    const int32_t pending = int32_t(s.pending);
    const int64_t length = int64_t(s.tokens.size());
    if (s.synced_length != length - pending || s.synced_dropped != s.dropped)
      c.rows_reset.push_back({s.row, int32_t(length - pending), s.dropped});
    for (int32_t j : s.rewritten) c.table.push_back({s.row, j, s.pages[size_t(j)]});
    s.rewritten.clear();
    for (size_t j = size_t(s.synced_pages); j < s.pages.size(); ++j) c.table.push_back({s.row, int32_t(j), s.pages[j]});
    s.synced_pages = int32_t(s.pages.size());
    s.synced_length = length;
    s.synced_dropped = s.dropped;
    if (c.rows[i] != s.row || c.new_tokens[i] != pending) {
      c.batch_changed = true;
      c.rows[i] = s.row;
      c.new_tokens[i] = pending;
    }
    c.total_new_tokens += pending;
    c.total_held_pages += int64_t(s.pages.size()) - s.dropped;
    c.max_pages = std::max(c.max_pages, int32_t(s.pages.size()));
    s.pending = 0;
    register_full_blocks(s);
  }
}

void SequenceManager::ensure_device_table(int32_t rows, int32_t pages) {
  if (!device_state_)
    device_state_ = std::make_unique<DeviceStepState>(cache_.config().device, cache_.config().stream, page_size());
  if (!device_state_->fits(rows, pages)) {
    // A new table starts empty: every sequence's row goes up again with its next step.
    device_state_->grow(rows, pages);
    for (auto& [id, s] : sequences_) unsync(s);
  }
}

void SequenceManager::reserve_device_steps(int32_t sequences, int64_t tokens) {
  if (sequences < 0) throw OutOfRangeError("sequences", sequences, 0, INT32_MAX);
  if (tokens < 0 || tokens > INT32_MAX) throw OutOfRangeError("tokens", tokens, 0, INT32_MAX);
  ensure_device_table(std::max(sequences, next_row_), int32_t((tokens + page_size() - 1) / page_size()));
}

const DeviceStep& SequenceManager::step_on_device(const std::vector<int64_t>& seqs, bool indices, BatchMetadata* host) {
  const std::vector<Sequence*>& batch = batch_sequences(seqs);  // checks every sequence first
  if (host) *host = describe_step(seqs, false);
  int32_t longest = 0;
  for (const Sequence* s : batch) longest = std::max(longest, int32_t(s->pages.size()));
  ensure_device_table(next_row_, longest);
  for (const Sequence* s : batch) settle_pages(s->pages);
  record_changes(batch, changes_);
  return device_state_->build(changes_, indices);
}

GatherRange SequenceManager::range(int64_t seq, int64_t begin, int64_t end) {
  const Sequence& s = live(seq, "seq");
  const int64_t length = int64_t(s.tokens.size());
  if (begin < 0 || begin > length) throw OutOfRangeError("begin", begin, 0, length + 1);
  if (end < begin || end > length) throw OutOfRangeError("end", end, begin, length + 1);
  const int64_t first = int64_t(s.dropped) * page_size();
  if (begin < first && end > begin)
    throw OutOfRangeError("begin", begin, first, end + 1, -1,
                          "positions before " + std::to_string(first) + " have left the window of " +
                              std::to_string(options_.window) + " and their pages are freed");
  settle_pages(s.pages);
  GatherRange g;
  g.pages = device_index(s.pages, 1);
  g.begin = begin;
  g.end = end;
  return g;
}

double SequenceManager::utilization() const {
  // Each held page counts the tokens it really holds once, however many sequences share it; a cached
  // page nobody uses holds a full page of reusable tokens.
  const int32_t P = page_size();
  std::vector<int32_t> fill(size_t(device_.total()), 0);
  for (int32_t b = 0; b < device_.total(); ++b)
    if (prefix_.cached(b)) fill[size_t(b)] = P;
  for (const auto& [id, s] : sequences_) {
    const int64_t n = int64_t(s.tokens.size());
    for (size_t j = size_t(s.dropped); j < s.pages.size(); ++j)
      if (s.pages[j] >= 0)  // an offloaded sequence holds no device pages
        fill[size_t(s.pages[j])] = std::max<int32_t>(fill[size_t(s.pages[j])], int32_t(std::min<int64_t>(P, n - int64_t(j) * P)));
  }
  int64_t tokens = 0;
  for (int32_t f : fill) tokens += f;
  const int64_t held = device_.total() - device_.free_count();
  return held == 0 ? 1.0 : double(tokens) / double(held * int64_t(P));
}

}  // namespace kvforge
