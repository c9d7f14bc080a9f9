// Which sequence holds which StatePool slot, beside the SequenceManager that holds its pages, and
// prefix reuse for hybrid models: a linear layer's state cannot be rebuilt from cached K/V, so a prefix
// hit is usable only up to a position whose state was kept. At every `every`-th block boundary the
// state is checkpointed, keyed by that block's prefix hash; a new sequence whose cached prefix reaches
// such a boundary restores the longest one and computes from there (vLLM's mamba_cache_mode "align").
// See docs/memory.md, "State slots".
#pragma once

#include <cstdint>
#include <list>
#include <optional>
#include <unordered_map>
#include <vector>

#include "kvforge/sequence_manager.hpp"
#include "kvforge/state_pool.hpp"

namespace kvforge {

struct StateSlotsStats {
  int64_t checkpoints = 0;   // states checkpointed at a boundary
  int64_t restores = 0;      // sequences started from a checkpoint
  int64_t replaced = 0;      // checkpoints dropped, least recently used first, to make room
  int64_t capped_tokens = 0;  // cached prompt tokens not shared because no checkpoint reached them
  int64_t reclaimed = 0;      // checkpoints in the cache's pages given up to an allocation that ran short
};

class StateSlots : private PageReclaimer {
 public:
  // manager: the paged cache's sequences; pool: a slot per sequence alive at once, and
  // pool.config().checkpoints records for checkpoints (0: no prefix reuse, every prompt is computed
  // whole). every: checkpoint at every every-th block boundary, >= 1. Both must outlive this.
  // A pool in the manager's cache's pages (StatePool over a cache) takes each slot and checkpoint as a
  // page from the manager (take_pages), so states and K/V share one free list. It keeps at most
  // pool.config().checkpoints checkpoint pages, and gives them back, least recently used first, to an
  // allocation that finds no free or cached page (the manager's PageReclaimer; one StateSlots a
  // manager). A pool in another cache's pages: ArgumentError("pool").
  StateSlots(SequenceManager& manager, StatePool& pool, int32_t every);
  ~StateSlots();  // gives back the pages it took
  StateSlots(const StateSlots&) = delete;
  StateSlots& operator=(const StateSlots&) = delete;

  // How many of `prompt`'s tokens add() would share now: the longest checkpointed boundary within the
  // cached prefix, short of the prompt's last token. An engine that chunks prefill at boundaries adds
  // the prompt up to the next boundary after this, then appends the rest chunk by chunk.
  int64_t reusable_prefix(const std::vector<int32_t>& prompt, std::optional<uint64_t> salt = {}) const;
  // SequenceManager::add, sharing the cached prefix only up to its longest checkpointed boundary, whose
  // state is restored into the sequence's slot (else the slot is zeroed). Returns the covered tokens.
  // A slot short raises CapacityError("states") before anything changes.
  int64_t add(int64_t seq, const std::vector<int32_t>& prompt, std::optional<uint64_t> salt = {});
  // A sequence the manager holds but this does not (a KvReceiver added its pages) gets a zeroed slot.
  // StateError where it holds one already or the manager does not hold it; CapacityError("states")
  // where no slot is free; nothing changes then.
  int64_t attach(int64_t seq);
  void fork(int64_t parent, int64_t child);  // the child's slot gets a copy of the parent's state
  void free(int64_t seq);
  // Preemption: the sequence's pages go to the host tier (SequenceManager::offload) and its state to
  // host memory, and its slot is free for another sequence; restore() brings both back, into any free
  // slot. A slot short raises CapacityError("states") before anything changes.
  void offload(int64_t seq);
  void restore(int64_t seq);
  // Call after the forward that brought `seq` to its current length (before appending more): at a
  // checkpoint boundary, its state is kept. True when a checkpoint was taken.
  bool checkpoint(int64_t seq);
  // Where `seq`'s next checkpoint boundary lies: a prefill chunk that ends there gets checkpointed.
  int64_t next_boundary(int64_t seq) const;
  int64_t slot(int64_t seq) const;
  int32_t every() const { return every_; }
  // Slots a new sequence can take now (in the cache's pages: the manager's available pages).
  int64_t free_slots() const;
  SequenceManager& manager() const { return manager_; }
  StatePool& pool() const { return pool_; }
  int64_t checkpoints_held() const { return int64_t(by_hash_.size()); }
  const StateSlotsStats& stats() const { return stats_; }

 private:
  struct Held {
    int64_t slot;  // -1 while offloaded
    uint64_t salt;
    std::vector<unsigned char> offloaded;  // the state while offloaded
  };
  struct Checkpoint {
    int64_t index;
    std::list<uint64_t>::iterator lru;
  };
  // The prefix hash of each full block of tokens[0, blocks * page size).
  std::vector<uint64_t> block_hashes(const std::vector<int32_t>& tokens, int64_t blocks, uint64_t salt) const;
  // The longest checkpointed boundary of `prompt` (block hashes `hashes`) within `limit` tokens.
  int64_t longest_kept(const std::vector<int32_t>& prompt, const std::vector<uint64_t>& hashes, int64_t limit) const;
  int64_t take_slot(const char* argument);
  void give_slot(int64_t slot);
  int32_t reclaimable() const override { return int32_t(by_hash_.size()); }
  void reclaim(int32_t n) override;
  const Held& held(int64_t seq, const char* argument) const;

  SequenceManager& manager_;
  StatePool& pool_;
  int32_t every_;
  int64_t page_size_;
  std::unordered_map<int64_t, Held> held_;
  std::vector<int64_t> free_slots_;
  std::unordered_map<uint64_t, Checkpoint> by_hash_;
  std::list<uint64_t> lru_;  // least recently used first
  std::vector<int64_t> free_checkpoints_;
  StateSlotsStats stats_;
};

}  // namespace kvforge
