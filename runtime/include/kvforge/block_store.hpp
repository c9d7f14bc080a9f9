// The lowest tier of the prefix cache: blocks kept outside memory, in fixed-size records. A small
// interface, so that an object store could stand in for the file; FileBlockStore keeps one file,
// written and read with direct I/O where the file system allows it (docs/memory.md, "Disk tier").
// Each record carries the block's identity and a checksum over all of it: a record torn by a crash,
// cut short or changed on disk reads as a miss, never as wrong data, and a restart reuses every
// record that checks out.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

namespace kvforge {

// What a stored block is, besides its bytes: enough to find it again and to announce it.
struct StoredBlock {
  uint64_t key = 0;     // the block's key (block_hash.hpp)
  uint64_t parent = 0;  // the previous block's key; 0 for a prefix's first
  uint64_t salt = 0;
  int32_t priority = 0;
  std::vector<int32_t> tokens;
};

// Reads may run on another thread than writes, at the same time (a manager's read-ahead): a record
// being replaced then reads as a miss.
class BlockStore {
 public:
  virtual ~BlockStore() = default;
  virtual int64_t capacity() const = 0;  // records
  // Writes `block` and its packed bytes into record `slot`, replacing what was there.
  virtual void write(int64_t slot, const StoredBlock& block, const void* packed) = 0;
  // Reads record `slot` into `packed` if it holds block `key` intact; false otherwise (a miss).
  virtual bool read(int64_t slot, uint64_t key, void* packed) = 0;
  // Every record that checks out, as a restart finds them: f(slot, block).
  virtual void scan(const std::function<void(int64_t, const StoredBlock&)>& f) = 0;
};

// A store of `records` records in the file at `path` (created if absent, grown to size; an
// existing file's intact records survive). Each record holds a block of `block_tokens` tokens and
// `packed_bytes` packed bytes. Throws BackendError when the file cannot be opened or sized.
std::unique_ptr<BlockStore> open_file_store(const std::string& path, int64_t records, int64_t packed_bytes,
                                            int32_t block_tokens);

// Bytes one record of such a store takes on disk: header, tokens and packed bytes, rounded up to
// 4096 so that direct I/O can move it whole.
int64_t file_store_record_bytes(int64_t packed_bytes, int32_t block_tokens);

}  // namespace kvforge
