// Sequences over the pages of one paged or blocked cache: page tables, prefix reuse, copy-on-write
// forks, host offload and restore, and the batch arrays kernels take. All of it is host-side
// bookkeeping; data moves only through the cache's own operations (copy_blocks, pack_pages,
// unpack_pages), so it serves every paged variant on either backend. See docs/memory.md.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "kvforge/backend.hpp"
#include "kvforge/block_allocator.hpp"
#include "kvforge/block_hash.hpp"
#include "kvforge/block_store.hpp"
#include "kvforge/cache.hpp"
#include "kvforge/kv_events.hpp"
#include "kvforge/prefix_cache.hpp"
#include "kvforge/step_state.hpp"

namespace kvforge {

class DiskReadAhead;
class PromotionAhead;

// What a step hands to the kernels, as host arrays; `DeviceBatch` puts them on the cache's device.
// Building costs O(new tokens) for the slots plus O(pages) for the page tables, which are that big.
struct BatchMetadata {
  std::vector<int64_t> slots;        // per new token, sequences in the order given: the append targets
  std::vector<int32_t> query_start;  // [sequences + 1]: where each sequence's new tokens start in `slots`
  std::vector<int32_t> lengths;      // per sequence: tokens held after this step
  std::vector<int32_t> page_table;   // [sequences][max_pages], padded with -1 (vLLM's block_tables)
  int32_t max_pages = 0;
  std::vector<int32_t> indptr;         // FlashInfer paged_kv: [sequences + 1] into `indices`
  std::vector<int32_t> indices;        // every sequence's pages, concatenated
  std::vector<int32_t> last_page_len;  // per sequence: tokens in its last page
};

// BatchMetadata copied to a device, with views the cache operations take.
class DeviceBatch {
 public:
  DeviceBatch(const BatchMetadata& m, Device device, void* stream = nullptr);
  TokenTargets targets() const { return TokenTargets::paged(slots); }
  IndexView slots, query_start, lengths, page_table, indptr, indices, last_page_len;

 private:
  std::vector<Buffer> buffers_;  // a Buffer keeps its allocation when the vector moves it
};

struct SequenceManagerOptions {
  bool prefix_caching = true;
  uint64_t salt = 0;        // mixed into every block hash (an adapter or model id); add() may override
  // How a full block's key is built (block_hash.hpp); hash_seed starts vllm_sha256_cbor's chain, as
  // vLLM's PYTHONHASHSEED does (default: vLLM's own default).
  BlockHashScheme block_hash = BlockHashScheme::kvforge;
  std::string hash_seed = "vllm-none-hash";
  // Capacity of the host tier, in pages: offloaded sequences, and the cached blocks that eviction
  // demotes there. 0: no host tier (no offload, and eviction frees).
  int32_t host_blocks = 0;
  // Sliding-window attention: only the last `window` positions are ever read, so pages wholly before
  // them are freed (their page-table entries become -1). 0: keep everything.
  int32_t window = 0;
  // Keep KV events (kv_events.hpp) for take_kv_events(); off, none are kept.
  bool kv_events = false;
  // The retention priority of a cached block that no retention range covers, 0..100.
  int default_priority = kDefaultPriority;
  // Seconds on a monotonic clock, which retention durations count on; null: std::chrono::steady_clock.
  double (*clock)() = nullptr;
  // With a host tier and prefix caching: an evicted cached block moves to the host tier (its own
  // LRU, by the same priorities) rather than vanishing, and a prefix hit there comes back into
  // device pages. Offload takes host pages from demoted blocks when it must.
  bool demote_to_host = true;
  // The disk tier below the host tier: blocks the host tier evicts are written there, one record
  // each (block_store.hpp), and come back on a prefix hit. `disk_path`'s file is created or reused:
  // a restart serves every record that checks out. 0 blocks: no disk tier. The file names what it
  // holds (the variant, its dimensions and dtypes, block_hash and hash_seed, weights_tag): a file of
  // another is refused at construction, naming both. One manager owns a file at a time (a lock); a
  // failed write (a full disk, EIO) drops that block, as a miss (stats().disk_write_failures).
  std::string disk_path;
  int64_t disk_blocks = 0;
  // What the model's weights are (a checkpoint's name or hash): disk records written under another tag
  // are never served. Change it with new weights; reset_prefix_cache() clears the disk tier too.
  std::string weights_tag;
  // A store of the caller's in place of the file at disk_path (an object store; tests inject faults):
  // disk_blocks must not exceed its capacity().
  std::shared_ptr<BlockStore> disk_store;
  // Disk-tier blocks that prefetch() may hold at once, queued or read and not yet promoted (each one
  // packed page of host memory); 0: prefetch() reads nothing ahead.
  int32_t read_ahead_blocks = 64;
  // Host-tier blocks that add() promotes are copied into their device pages ahead, so that add()
  // returns at once and the copy overlaps the caller's work: on a thread of this manager's (CPU), or
  // on a CUDA stream of its own, which the cache's stream waits for by an event (without it, a CUDA
  // promotion's host-to-device copies are waited for inside add()). step(), step_on_device() and
  // range() of a sequence wait for its own pages only; free(), offload(), eviction and
  // reset_prefix_cache() for the pages they touch. On CUDA "wait" is the cache's stream's: the host
  // goes on. Read a promoted prefix only through those (a gather straight after add() may see the
  // copy unfinished).
  bool promote_ahead = false;
};

// How long a token range of a sequence's prefix stays cached once nobody holds it, as TensorRT-LLM's
// KvCacheRetentionConfig: eviction takes the lowest priority first, then the least recently used. A
// full block takes the highest priority of the ranges it overlaps; after `seconds` (0: for good) it
// drops to the default priority.
struct RetentionRange {
  int64_t begin = 0;  // token positions [begin, end) of the sequence, 0 <= begin <= end
  int64_t end = 0;
  int priority = kDefaultPriority;  // 0..100
  double seconds = 0;               // >= 0; 0: the priority holds for good
};

struct SequenceStats {
  int64_t prefix_hits = 0;    // full prompt blocks shared from the prefix cache
  int64_t prefix_misses = 0;  // full prompt blocks looked up and not found
  int64_t evictions = 0;      // cached blocks freed to make room
  int64_t copies_on_write = 0;
  int64_t offloaded_pages = 0;
  int64_t restored_pages = 0;
  int64_t demoted_blocks = 0;   // cached blocks moved to the host tier on eviction
  int64_t promoted_blocks = 0;  // prefix hits served from a lower tier, copied back into device pages
  int64_t disk_writes = 0;      // blocks the host tier evicted into the disk tier
  int64_t disk_reads = 0;       // of promoted_blocks, those read from the disk tier
  int64_t disk_misses = 0;      // disk records that did not check out when read (torn, cut short, changed)
  int64_t disk_write_failures = 0;  // blocks the disk tier could not take (a full disk, EIO): dropped, as misses
  int64_t read_ahead_hits = 0;  // of disk_reads, those prefetch() had read ahead
  int64_t promoted_ahead = 0;   // of promoted_blocks, host-tier ones copied ahead (promote_ahead)
};

// An owner of pages taken from a SequenceManager (take_pages) that can give some back when an allocation
// runs short: StateSlots' checkpoints kept in the cache's pages. The manager asks it only after
// evicting every cached block it could.
class PageReclaimer {
 public:
  virtual ~PageReclaimer() = default;
  virtual int32_t reclaimable() const = 0;  // pages reclaim() would give back
  virtual void reclaim(int32_t n) = 0;      // gives back min(n, reclaimable()) pages through give_pages()
};

// Maps sequence ids to page tables over one paged cache, and moves the data that sharing, forking and
// offload need through that cache. Sequence ids are any int64 the caller chooses; token ids are any
// int32 (they are hashed and compared, never interpreted). A refused call raises a typed error naming
// the argument (StateError for an unknown, existing or offloaded sequence; CapacityError when pages run
// short) and changes nothing: allocation is all or nothing.
class SequenceManager {
 public:
  // cache: a paged, non-hybrid cache (else UnsupportedError), which must outlive the manager.
  explicit SequenceManager(Cache& cache, SequenceManagerOptions options = {});
  ~SequenceManager();

  // Starts sequence `seq` with `prompt` (token ids). With prefix caching, the full blocks at the head
  // of the prompt that are cached are shared, at most up to the prompt's last token, which is always
  // left to compute. Returns how many prompt tokens are covered; the rest are new tokens of the
  // next step. seq: a new id; prompt: token ids, any length; salt: mixed into every block key (default
  // options.salt); max_cached: share at most this many tokens (a hybrid cache's groups agree on it).
  int64_t add(int64_t seq, const std::vector<int32_t>& prompt, std::optional<uint64_t> salt = {},
              int64_t max_cached = INT64_MAX);
  // Starts reading the disk-tier blocks that add(prompt) would promote, on a thread of this manager's,
  // so that their reads overlap the caller's work until then (the engine's current step): the add()
  // that promotes them waits only for those reads. Changes nothing the manager holds; at most
  // options.read_ahead_blocks blocks are held ahead. Returns how many reads it queued (0 without a disk
  // tier). Bytes read ahead stand for their block's key, as every tier's do; reset_prefix_cache()
  // drops them.
  int64_t prefetch(const std::vector<int32_t>& prompt, std::optional<uint64_t> salt = {});
  // What add() would cover from the prefix cache, without taking anything.
  int64_t cached_prefix(const std::vector<int32_t>& prompt, std::optional<uint64_t> salt = {}) const;
  // Pages add() (sharing `cached` tokens) or append() would allocate now: all-or-nothing across the
  // managers of a hybrid cache's groups.
  int32_t pages_to_add(const std::vector<int32_t>& prompt, int64_t cached) const;
  int32_t pages_to_append(int64_t seq, int64_t tokens) const;
  // Grows a live sequence by tokens (a decode token, or a prefill chunk), allocating pages as it goes,
  // all or nothing. Writing into a page that a fork shares first copies it (copy-on-write).
  void append(int64_t seq, const std::vector<int32_t>& tokens);
  // `child` (a new id) starts as a copy of live `parent`, sharing every page (beam search, parallel
  // sampling).
  void fork(int64_t parent, int64_t child);
  void free(int64_t seq);
  // Moves a sequence's pages to the host tier and frees its device pages; restore() brings them back,
  // into whatever pages are free then. Both are one pack or unpack launch plus one copy per page.
  void offload(int64_t seq);
  void restore(int64_t seq);

  // The kernels' view of one step: every new token (added or appended since the last step) of the
  // given live sequences, in the order given, and their page tables (see BatchMetadata for shapes).
  BatchMetadata step(const std::vector<int64_t>& seqs);
  // The same step, built on the cache's device from a persistent block table (step_state.hpp): the
  // host uploads only what changed, O(sequences + changes). `indices`: also build FlashInfer's
  // `indices` (O(held pages) on the device). `host`: also fill the host-built arrays of this same
  // step, for tests and the bench. The views stay valid until the next call. A sequence listed twice
  // is refused (ArgumentError), before anything changes.
  const DeviceStep& step_on_device(const std::vector<int64_t>& seqs, bool indices = false, BatchMetadata* host = nullptr);
  // Sizes the device block table for `sequences` live sequences of up to `tokens` tokens each, as an
  // engine knows its max batch and model length, so that no step_on_device() reallocates it (a
  // larger step still grows it, and re-uploads every row once).
  void reserve_device_steps(int32_t sequences, int64_t tokens);
  // A gather over positions [begin, end) of a live sequence, 0 <= begin <= end <= length(seq): its
  // page list as int32 on the cache's device (valid until the next call of range()).
  GatherRange range(int64_t seq, int64_t begin, int64_t end);

  // Pages that no sequence holds, from the same free list (evicting cached blocks when it must), all
  // or nothing (CapacityError("pages") when fewer are available): a hybrid model's state slots and
  // checkpoints, kept in the cache's own pages (StatePool over a cache). give_pages() hands them back;
  // a page it was not given raises StateError, before anything changes.
  std::vector<int32_t> take_pages(int32_t n);
  void give_pages(const std::vector<int32_t>& pages);
  int32_t taken_pages() const { return int32_t(taken_.size()); }
  // The owner of taken pages that gives some back when pages run short (one at a time; null: none).
  // available_blocks() counts what it would give.
  void set_reclaimer(PageReclaimer* reclaimer) { reclaimer_ = reclaimer; }
  PageReclaimer* reclaimer() const { return reclaimer_; }
  const Cache& cache() const { return cache_; }

  bool contains(int64_t seq) const { return sequences_.count(seq) != 0; }
  int64_t length(int64_t seq) const;
  bool offloaded(int64_t seq) const;
  const std::vector<int32_t>& pages(int64_t seq) const;
  const std::vector<int32_t>& tokens(int64_t seq) const;
  const SequenceStats& stats() const { return stats_; }
  // The message of the last disk write that failed (stats().disk_write_failures), or "".
  const std::string& last_disk_error() const { return last_disk_error_; }
  uint64_t default_salt() const { return options_.salt; }
  const BlockHasher& hasher() const { return hasher_; }
  int32_t block_size() const { return cache_.descriptor().page_size; }  // tokens a page holds
  const BlockAllocator& allocator() const { return device_; }
  const PrefixCache& prefix_cache() const { return prefix_; }
  int32_t cached_blocks() const { return prefix_.size(); }
  int32_t evictable_blocks() const { return prefix_.evictable_count(); }
  // Pages a new allocation can take: free ones, cached ones nobody uses, and those the reclaimer gives.
  int32_t available_blocks() const {
    return device_.free_count() + prefix_.evictable_count() + (reclaimer_ ? reclaimer_->reclaimable() : 0);
  }
  // Host pages offload can take: free ones plus demoted blocks, which it evicts.
  int32_t host_free() const { return host_.free_count() + host_prefix_.evictable_count(); }
  // Token slots holding live or cached tokens over the slots of the pages held (a shared page counts
  // once): 1 means no waste. O(pages).
  double utilization() const;
  // Retention of the sequence's blocks (RetentionRange): applies at once to the full blocks it holds
  // now, and to every block it fills later. Replaces what an earlier call set. All ranges are checked
  // (ArgumentError or OutOfRangeError naming the range) before anything changes.
  void set_retention(int64_t seq, const std::vector<RetentionRange>& ranges);
  // The KV events since the last call, oldest first (options.kv_events; else none).
  std::vector<KvEvent> take_kv_events() { return events_.take(); }
  // Forgets every cached block and records AllBlocksCleared, as vLLM's reset_prefix_cache. Refused
  // (StateError) while any live sequence holds a cached block, before anything changes.
  void reset_prefix_cache();
  // The hash of every cached block on the device, and in the host tier (the sets a router that
  // replays this manager's events holds, per medium).
  std::vector<uint64_t> cached_block_hashes() const;
  std::vector<uint64_t> host_cached_block_hashes() const;
  std::vector<uint64_t> disk_cached_block_hashes() const;
  // What this manager's disk records hold, as the file names it: the variant, its dimensions and
  // dtypes, the block hash and its seed, the weights tag. A file of another identity is refused.
  std::string disk_identity() const;

  // Verifies every internal invariant (reference counts against owners, LRU membership, page counts);
  // throws StateError naming the first broken one. For tests; O(blocks + tokens).
  void check_invariants() const;

 private:
  struct Sequence {
    std::vector<int32_t> pages;
    std::vector<int32_t> tokens;
    int64_t pending = 0;         // tokens not yet handed out by step()
    uint64_t salt = 0;
    BlockChain chain;            // the hash of the last registered full block
    std::vector<RetentionRange> retention;
    int32_t hashed_blocks = 0;   // full blocks registered in the prefix cache
    std::vector<int32_t> host_pages;
    bool offloaded = false;
    int32_t dropped = 0;  // leading pages freed because they left the window (entries are -1)
    // Its row of the device block table (step_on_device), and what that row holds: the first
    // `synced_pages` entries, except those in `rewritten`; the length and dropped count before the
    // last device step's tokens (-1: nothing yet).
    int32_t row = -1;
    int32_t synced_pages = 0;
    std::vector<int32_t> rewritten;
    int64_t synced_length = -1;
    int32_t synced_dropped = -1;
  };
  std::vector<int32_t> shared_prefix(const std::vector<int32_t>& prompt, uint64_t salt, BlockChain& chain) const;
  void drop_out_of_window(Sequence& s);
  // Every write to an existing page-table entry goes through here, so the device copy learns of it.
  static void set_page(Sequence& s, size_t index, int32_t page) {
    s.pages[index] = page;
    if (index < size_t(s.synced_pages)) s.rewritten.push_back(int32_t(index));
  }
  static void unsync(Sequence& s) {
    s.synced_pages = 0;
    s.rewritten.clear();
    s.synced_length = -1;
  }
  int32_t take_row();
  // The step's host-built arrays; `consume` marks its tokens handed out (step()), else it only looks.
  BatchMetadata describe_step(const std::vector<int64_t>& seqs, bool consume);
  void ensure_device_table(int32_t rows, int32_t pages);
  const std::vector<Sequence*>& batch_sequences(const std::vector<int64_t>& seqs);
  void record_changes(const std::vector<Sequence*>& batch, StepChanges& c);
  static std::vector<int32_t> held(const Sequence& s) {
    return std::vector<int32_t>(s.pages.begin() + s.dropped, s.pages.end());
  }
  Sequence& live(int64_t seq, const char* argument);
  const Sequence& find(int64_t seq, const char* argument) const;
  void allocate(int32_t n, std::vector<int32_t>& out);  // evicts cached pages when it must
  void release(const std::vector<int32_t>& pages);
  void register_full_blocks(Sequence& s);
  void evict(int32_t n);  // cached pages nobody holds, lowest priority first, until n are free
  int32_t host_room(int32_t n);  // frees up to n host pages from demoted blocks; returns how many are free
  // A block of a lower tier: a host page, or a disk record.
  struct LowerBlock {
    bool on_disk;
    int32_t index;
  };
  // The lower tiers' blocks that continue the prefix of `prompt` after its first `from` full blocks
  // (whose chain is `chain`), with the device's blocks between them; `covered`: how many blocks all
  // tiers give; `between`: the device's blocks among them, which promotion's allocation must not evict.
  std::vector<LowerBlock> lower_prefix(const std::vector<int32_t>& prompt, uint64_t salt, int64_t from, BlockChain chain,
                                       int64_t* covered = nullptr, std::vector<int32_t>* between = nullptr) const;
  // Copies lower-tier blocks back into fresh device pages and caches them there; a disk record that
  // does not check out ends them there.
  void promote(std::vector<LowerBlock> blocks);
  // Orders the cache's later work after the promote_ahead copies into `pages` (settle_pages; on a GPU
  // the stream waits, not the host), or makes the host wait for every one (settle_all), then makes the
  // host blocks that finished copies read evictable again.
  void settle_pages(const std::vector<int32_t>& pages);
  void settle_all();
  void settle(uint64_t ticket, bool host_waits);
  void open_disk_tier();
  int32_t take_disk_slot();  // a free record, or the disk tier's eviction victim's
  // Packed pages between device pages and host pages, one launch (and one copy per run) per call.
  void pages_to_host(const std::vector<int32_t>& pages, const std::vector<int32_t>& host_pages);
  void pages_from_host(const std::vector<int32_t>& host_pages, const std::vector<int32_t>& pages);
  void record_removed(std::vector<uint64_t> hashes, const char* medium);
  double now() const;
  // The retention of full block `index` of `s`: the highest priority of its ranges, and its end.
  std::pair<int, double> retention_of(const Sequence& s, int64_t index) const;
  // BlockStored for `blocks` of `cache` (one event per chain among them), in `medium`.
  void record_stored(const PrefixCache& cache, const std::vector<int32_t>& blocks, const char* medium);
  const char* device_medium() const;
  const char* host_medium() const;
  IndexView device_index(const std::vector<int32_t>& host, int slot);
  int32_t page_size() const { return cache_.descriptor().page_size; }

  Cache& cache_;
  SequenceManagerOptions options_;
  BlockHasher hasher_;
  Backend& backend_;
  BlockAllocator device_;
  std::unordered_map<int64_t, Sequence> sequences_;
  std::unordered_set<int32_t> taken_;  // take_pages(): held outside every sequence
  PageReclaimer* reclaimer_ = nullptr;
  // Holds one reference on each cached block. A full block joins at the step() that hands out its last
  // slots: from then on its K/V is written.
  PrefixCache prefix_;
  // Host tier: offloaded sequences' pages, and demoted cached blocks (one reference each).
  BlockAllocator host_;
  PrefixCache host_prefix_;
  // Disk tier: the store, its index (a record per slot, all evictable) and its free slots.
  std::shared_ptr<BlockStore> disk_;
  std::string last_disk_error_;  // the last failed disk write's message
  PrefixCache disk_prefix_;
  std::vector<int32_t> disk_free_;
  std::vector<unsigned char> disk_io_;
  std::unique_ptr<DiskReadAhead> read_ahead_;  // after disk_: its thread reads disk_ until it goes
  // promote_ahead: the copy of each device page not yet settled (its ticket), and the host blocks each
  // copy reads, held (not evictable) until it is settled.
  std::unique_ptr<PromotionAhead> promotion_;
  std::unordered_map<int32_t, uint64_t> promoting_;
  std::vector<std::pair<uint64_t, std::vector<int32_t>>> promoting_host_;
  Buffer host_pool_;
  Buffer staging_;
  Buffer index_scratch_[2];
  SequenceStats stats_;
  KvEventLog events_;
  // The device side of step_on_device: table rows free for new sequences, the last batch (whose
  // sequences a steady decode step finds again without a lookup), and the persistent state.
  std::vector<int32_t> free_rows_;
  int32_t next_row_ = 0;
  std::vector<int64_t> last_batch_;
  std::vector<Sequence*> last_batch_sequences_;
  StepChanges changes_;
  std::unique_ptr<DeviceStepState> device_state_;
};

}  // namespace kvforge
