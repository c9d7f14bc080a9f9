// Reference-counted blocks: DeepSpeed's BlockedAllocator semantics (allocate n all or nothing, free,
// count what is free) plus reference counts, so that one block can belong to several sequences.
#pragma once

#include <cstdint>
#include <vector>

#include "kvforge/errors.hpp"

namespace kvforge {

// O(1) per block.
class BlockAllocator {
 public:
  explicit BlockAllocator(int32_t blocks);
  int32_t total() const { return int32_t(refs_.size()); }
  int32_t free_count() const { return int32_t(free_.size()); }
  // Appends n fresh blocks (reference count 1) to `out`; CapacityError when fewer than n are free.
  void allocate(int32_t n, std::vector<int32_t>& out);
  std::vector<int32_t> allocate(int32_t n);
  // One more owner of a block in use.
  void retain(int32_t block);
  // One owner fewer for each block; a block whose last owner leaves is free again. The whole list is
  // checked first (unknown, free, or released more often than owned), so an error changes nothing.
  void release(const std::vector<int32_t>& blocks);
  int32_t ref_count(int32_t block) const;
  // Each block's generation: one more whenever its bytes may come to hold another owner's tokens, at its
  // last release (freed) and at its allocation (reused). A block shared by one more owner (retain: a
  // fork, a prefix hit) keeps its generation: its bytes do not change, and a write to a shared block goes
  // to a copy. Whoever published a block's generation can tell, reading it again, that the block was
  // freed or reused since (kvforge.nixl checks a pull's pages so). int64 [total()], at a fixed address.
  const int64_t* generations() const { return generations_.data(); }

 private:
  void check_block(const char* argument, int32_t block) const;
  std::vector<int32_t> free_;  // a stack: the most recently freed block is reused first
  std::vector<int32_t> refs_;
  std::vector<int64_t> generations_;
};

}  // namespace kvforge
