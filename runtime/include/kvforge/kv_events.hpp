// What a prefix cache tells a KV-aware router (Dynamo, llm-d): which blocks it holds now and which it
// dropped, as vLLM publishes them (vllm/distributed/kv_events.py): BlockStored, BlockRemoved and
// AllBlocksCleared, with vLLM's field names and meaning. kvforge.kv_events (Python) serializes a batch
// as vLLM does, in msgpack. A block's hash is its key (block_hash.hpp: kvforge's construction, or
// vLLM's own), documented in docs/memory.md, so a router can compute the hash of a prompt's blocks.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace kvforge {

struct KvEvent {
  enum class Kind : uint8_t { block_stored, block_removed, all_blocks_cleared };
  Kind kind = Kind::block_stored;
  // block_stored: consecutive blocks of one prefix, in order; block_removed: the blocks dropped.
  std::vector<uint64_t> block_hashes;
  // block_stored: the hash of the block before the first one; none for a prefix's first block.
  std::optional<uint64_t> parent_block_hash;
  std::vector<int32_t> token_ids;  // block_stored: every block's tokens, block after block
  int32_t block_size = 0;          // block_stored: tokens per block (the cache's page size)
  uint64_t salt = 0;               // block_stored: the salt every hash of the prefix chains
  std::string medium;              // where the blocks are: "GPU" (a CUDA cache), "CPU" (a CPU cache)
  int group = -1;                  // a hybrid cache's layer group; -1 for a cache of one group
};

// Events in the order they happened, kept until taken. Off by default: a manager that nobody reads
// events from keeps none.
class KvEventLog {
 public:
  bool enabled = false;
  void push(KvEvent e) {
    if (enabled) events_.push_back(std::move(e));
  }
  std::vector<KvEvent> take() { return std::exchange(events_, {}); }
  size_t pending() const { return events_.size(); }

 private:
  std::vector<KvEvent> events_;
};

}  // namespace kvforge
