#include "kvforge/state_slots.hpp"

#include <algorithm>
#include <string>

#include "kvforge/errors.hpp"

namespace kvforge {

StateSlots::StateSlots(SequenceManager& manager, StatePool& pool, int32_t every)
    : manager_(manager), pool_(pool), every_(every), page_size_(manager.block_size()) {
  if (every < 1) throw OutOfRangeError("every", every, 1, INT32_MAX);
  if (pool.in_pages()) {
    if (pool.cache() != &manager.cache())
      throw ArgumentError("pool", "lies in the pages of another cache than the manager's; a state's page comes from the manager");
    if (manager.reclaimer())
      throw ArgumentError("manager", "keeps another StateSlots' states in its pages already; one StateSlots a manager");
    manager.set_reclaimer(this);
    return;
  }
  for (int64_t s = pool.config().slots; s-- > 0;) free_slots_.push_back(s);
  for (int64_t c = pool.config().checkpoints; c-- > 0;) free_checkpoints_.push_back(c);
}

StateSlots::~StateSlots() {
  if (!pool_.in_pages()) return;
  if (manager_.reclaimer() == this) manager_.set_reclaimer(nullptr);
  std::vector<int32_t> pages;
  for (const auto& [seq, h] : held_)
    if (h.slot >= 0) pages.push_back(int32_t(h.slot));
  for (const auto& [hash, c] : by_hash_) pages.push_back(int32_t(c.index));
  try {
    manager_.give_pages(pages);
  } catch (...) {  // a destructor does not throw; the pages stay taken
  }
}

void StateSlots::reclaim(int32_t n) {
  std::vector<int32_t> pages;
  for (; n > 0 && !lru_.empty(); --n) {
    const uint64_t victim = lru_.front();
    pages.push_back(int32_t(by_hash_.at(victim).index));
    by_hash_.erase(victim);
    lru_.pop_front();
    ++stats_.reclaimed;
  }
  manager_.give_pages(pages);
}

int64_t StateSlots::free_slots() const {
  return pool_.in_pages() ? manager_.available_blocks() : int64_t(free_slots_.size());
}

std::vector<uint64_t> StateSlots::block_hashes(const std::vector<int32_t>& tokens, int64_t blocks, uint64_t salt) const {
  std::vector<uint64_t> out;
  BlockChain chain;
  for (int64_t b = 0; b < blocks; ++b) {
    chain = manager_.hasher().next(chain, salt, tokens.data() + b * page_size_, int32_t(page_size_));
    out.push_back(chain.key);
  }
  return out;
}

int64_t StateSlots::take_slot(const char* argument) {
  if (free_slots() == 0) throw CapacityError(argument, 1, 0);  // every slot (or page) is held
  if (pool_.in_pages()) return manager_.take_pages(1)[0];
  const int64_t s = free_slots_.back();
  free_slots_.pop_back();
  return s;
}

void StateSlots::give_slot(int64_t slot) {
  if (pool_.in_pages()) manager_.give_pages({int32_t(slot)});
  else free_slots_.push_back(slot);
}

const StateSlots::Held& StateSlots::held(int64_t seq, const char* argument) const {
  const auto it = held_.find(seq);
  if (it == held_.end()) throw StateError(argument, "sequence " + std::to_string(seq) + " holds no state slot here");
  return it->second;
}

int64_t StateSlots::longest_kept(const std::vector<int32_t>& prompt, const std::vector<uint64_t>& hashes,
                                 int64_t limit) const {
  // Below the prompt's end: its last token is always computed.
  const int64_t boundary = int64_t(every_) * page_size_;
  int64_t at = std::min<int64_t>(limit, int64_t(prompt.size()) - 1) / boundary * boundary;
  while (at > 0 && !by_hash_.count(hashes[size_t(at / page_size_ - 1)])) at -= boundary;
  return std::max<int64_t>(at, 0);
}

int64_t StateSlots::reusable_prefix(const std::vector<int32_t>& prompt, std::optional<uint64_t> salt) const {
  const uint64_t s = salt.value_or(manager_.default_salt());
  const int64_t cached = manager_.cached_prefix(prompt, s);
  return longest_kept(prompt, block_hashes(prompt, cached / page_size_, s), cached);
}

int64_t StateSlots::add(int64_t seq, const std::vector<int32_t>& prompt, std::optional<uint64_t> salt) {
  if (held_.count(seq)) throw StateError("seq", "sequence " + std::to_string(seq) + " already exists");
  const uint64_t s = salt.value_or(manager_.default_salt());
  const int64_t cached = manager_.cached_prefix(prompt, s);
  const std::vector<uint64_t> hashes = block_hashes(prompt, cached / page_size_, s);
  const auto longest = [&](int64_t limit) { return longest_kept(prompt, hashes, limit); };
  int64_t reuse = longest(cached);
  const int64_t slot = take_slot("states");
  int64_t covered = 0;
  try {
    // A lower tier can give back fewer blocks than it listed (a record that fails its checksum): the
    // sequence then starts again from the longest kept boundary within what it got.
    while ((covered = manager_.add(seq, prompt, s, reuse)) != reuse) {
      manager_.free(seq);
      reuse = longest(covered);
    }
  } catch (...) {
    give_slot(slot);
    throw;
  }
  held_[seq] = Held{slot, s, {}};
  // What the prefix cache alone would have shared (SequenceManager::add leaves the last token).
  stats_.capped_tokens += std::max<int64_t>(std::min(cached, (int64_t(prompt.size()) - 1) / page_size_ * page_size_), 0) - covered;
  if (covered > 0) {
    Checkpoint& c = by_hash_.at(hashes[size_t(covered / page_size_ - 1)]);
    lru_.splice(lru_.end(), lru_, c.lru);
    pool_.restore(c.index, slot);
    ++stats_.restores;
  } else {
    pool_.zero_slot(slot);
  }
  return covered;
}

int64_t StateSlots::attach(int64_t seq) {
  if (held_.count(seq)) throw StateError("seq", "sequence " + std::to_string(seq) + " holds a state slot already");
  if (!manager_.contains(seq)) throw StateError("seq", "sequence " + std::to_string(seq) + " is not in the manager");
  const int64_t slot = take_slot("states");
  held_[seq] = Held{slot, manager_.default_salt(), {}};
  pool_.zero_slot(slot);
  return slot;
}

void StateSlots::fork(int64_t parent, int64_t child) {
  const int64_t from = held(parent, "parent").slot;
  if (from < 0) throw StateError("parent", "sequence " + std::to_string(parent) + " is offloaded; restore() it first");
  if (held_.count(child)) throw StateError("child", "sequence " + std::to_string(child) + " already exists");
  const int64_t slot = take_slot("states");
  try {
    manager_.fork(parent, child);
  } catch (...) {
    give_slot(slot);
    throw;
  }
  held_[child] = Held{slot, held_.at(parent).salt, {}};
  pool_.copy_slot(from, slot);
}

void StateSlots::free(int64_t seq) {
  const int64_t slot = held(seq, "seq").slot;
  manager_.free(seq);
  held_.erase(seq);
  if (slot >= 0) give_slot(slot);  // an offloaded sequence holds none
}

void StateSlots::offload(int64_t seq) {
  held(seq, "seq");
  Held& h = held_.at(seq);
  if (h.slot < 0) throw StateError("seq", "sequence " + std::to_string(seq) + " is offloaded already");
  manager_.offload(seq);
  h.offloaded.resize(size_t(pool_.slot_bytes()));
  pool_.read_slot(h.slot, h.offloaded.data());
  pool_.synchronize();
  give_slot(h.slot);
  h.slot = -1;
}

void StateSlots::restore(int64_t seq) {
  held(seq, "seq");
  Held& h = held_.at(seq);
  if (h.slot >= 0) throw StateError("seq", "sequence " + std::to_string(seq) + " is not offloaded");
  const int64_t slot = take_slot("states");
  try {
    manager_.restore(seq);
  } catch (...) {
    give_slot(slot);
    throw;
  }
  pool_.write_slot(slot, h.offloaded.data());
  pool_.synchronize();  // the host copy goes now
  h.slot = slot;
  h.offloaded = {};
}

int64_t StateSlots::next_boundary(int64_t seq) const {
  held(seq, "seq");
  const int64_t boundary = int64_t(every_) * page_size_;
  return (manager_.length(seq) / boundary + 1) * boundary;
}

int64_t StateSlots::slot(int64_t seq) const {
  const int64_t slot = held(seq, "seq").slot;
  if (slot < 0) throw StateError("seq", "sequence " + std::to_string(seq) + " is offloaded; restore() it first");
  return slot;
}

bool StateSlots::checkpoint(int64_t seq) {
  const Held& h = held(seq, "seq");
  const int64_t length = manager_.length(seq), boundary = int64_t(every_) * page_size_;
  if (h.slot < 0 || length == 0 || length % boundary != 0 || pool_.config().checkpoints == 0) return false;
  const uint64_t hash = block_hashes(manager_.tokens(seq), length / page_size_, h.salt).back();
  if (const auto it = by_hash_.find(hash); it != by_hash_.end()) {  // kept already: a shared prefix
    lru_.splice(lru_.end(), lru_, it->second.lru);
    return false;
  }
  int64_t index;
  // A new page only from free or cached ones: where only checkpoints could give one, the oldest makes room.
  if (pool_.in_pages() && int64_t(by_hash_.size()) < pool_.config().checkpoints &&
      manager_.available_blocks() > reclaimable()) {
    index = manager_.take_pages(1)[0];
  } else if (!free_checkpoints_.empty()) {
    index = free_checkpoints_.back();
    free_checkpoints_.pop_back();
  } else if (lru_.empty()) {
    return false;  // in the cache's pages, none is free and none is kept to replace
  } else {
    const uint64_t victim = lru_.front();
    index = by_hash_.at(victim).index;
    by_hash_.erase(victim);
    lru_.pop_front();
    ++stats_.replaced;
  }
  pool_.checkpoint(h.slot, index);
  lru_.push_back(hash);
  by_hash_[hash] = Checkpoint{index, std::prev(lru_.end())};
  ++stats_.checkpoints;
  return true;
}

}  // namespace kvforge
