// Disk-tier records read ahead of the add() that needs them, on a thread of their own
// (SequenceManager::prefetch): the read of a long prefix's records overlaps whatever the caller does
// meanwhile, and add() waits only for the blocks it promotes. Internal to the sequence manager.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <mutex>
#include <thread>
#include <unordered_map>
#include <utility>
#include <vector>

#include "kvforge/block_store.hpp"

namespace kvforge {

class DiskReadAhead {
 public:
  // store: read from this object's thread while its owner writes (BlockStore's contract allows it);
  // keep: blocks held at most, queued or read and not yet taken.
  DiskReadAhead(BlockStore& store, int64_t packed_bytes, int64_t keep);
  ~DiskReadAhead();  // finishes the read in progress, drops the rest

  // Queues record `slot`'s read as block `key`; false where that key is queued or held already, or
  // `keep` blocks are and none of them is a finished read to drop (the oldest go first).
  bool request(int64_t slot, uint64_t key);
  // Block `key`'s bytes, once its read is done (waiting for it, and so for those queued before it),
  // into `packed`, and forgets it. False where none was asked for, or its record did not check out
  // when read (it may have been rewritten since): the caller reads the record itself, which decides.
  // Blocks are content-addressed, so bytes read intact for a key stay right for that key.
  bool take(uint64_t key, void* packed);
  // Forgets everything queued or held (the prefix cache was reset: a key's content may change).
  void clear();

 private:
  struct Read {
    int64_t slot = 0;
    uint64_t ticket = 0;  // which request this is, so that a read finishing after clear() is dropped
    bool done = false, intact = false;
    std::vector<unsigned char> bytes;
  };
  void run();

  BlockStore& store_;
  int64_t packed_;
  size_t keep_;
  std::mutex mutex_;
  std::condition_variable changed_;
  std::deque<uint64_t> queue_;  // keys to read, oldest first
  std::deque<std::pair<uint64_t, uint64_t>> order_;  // (key, ticket) of every request, oldest first
  std::unordered_map<uint64_t, Read> reads_;
  std::vector<std::vector<unsigned char>> spare_;  // buffers of taken reads, reused: no allocation a read
  uint64_t next_ticket_ = 0;
  bool stop_ = false;
  std::thread worker_;
};

}  // namespace kvforge
