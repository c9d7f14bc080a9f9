// The lowest tier of the prefix cache: blocks kept outside memory, in fixed-size records. A small
// interface, so that an object store could stand in for the file; FileBlockStore keeps one file,
// written and read with direct I/O where the file system allows it (docs/memory.md, "Disk tier").
// Each record carries the block's key, the identity of what the store holds (variant, dimensions,
// dtypes, hash scheme and seed, the caller's weights tag), the store's generation and a checksum over
// all of it: a record torn by a crash, cut short, changed on disk, written for another model or
// weights, or cleared by reset_prefix_cache() reads as a miss, never as wrong data, and a restart
// reuses every record that checks out.
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
  // Makes every record written so far a miss, here and for any later process (reset_prefix_cache(),
  // for new weights): durable when it returns. Throws BackendError where the store cannot.
  virtual void invalidate_all() = 0;
};

// A store of `records` records in the file at `path`, holding blocks of `block_tokens` tokens and
// `packed_bytes` packed bytes of what `identity` describes (SequenceManager writes it: the variant,
// its dimensions and dtypes, the block hash and its seed, the caller's weights tag). A new file is
// created and sized; an existing one keeps every intact record, grown to size where it is smaller.
// One process at a time: the file is locked while the store is open (flock), and a second opener,
// in this process or another, gets StateError naming the path. Throws ArgumentError naming
// `options.disk_path` for a file of another identity or not of this format (nothing in it is
// changed), BackendError where the file cannot be opened, read or sized.
std::unique_ptr<BlockStore> open_file_store(const std::string& path, int64_t records, int64_t packed_bytes,
                                            int32_t block_tokens, const std::string& identity);

// Bytes one record of such a store takes on disk: header, tokens and packed bytes, rounded up to
// 4096 so that direct I/O can move it whole.
int64_t file_store_record_bytes(int64_t packed_bytes, int32_t block_tokens);
// Where record `slot` starts in the file: after the file's own header of 4096 bytes.
int64_t file_store_record_offset(int64_t slot, int64_t packed_bytes, int32_t block_tokens);

}  // namespace kvforge
