#include "kvforge/block_allocator.hpp"

#include <string>

namespace kvforge {

BlockAllocator::BlockAllocator(int32_t blocks) {
  if (blocks < 0) throw OutOfRangeError("blocks", blocks, 0, INT32_MAX);
  refs_.assign(size_t(blocks), 0);
  generations_.assign(size_t(blocks), 0);
  free_.reserve(size_t(blocks));
  for (int32_t b = blocks - 1; b >= 0; --b) free_.push_back(b);  // block 0 is handed out first
}

void BlockAllocator::check_block(const char* argument, int32_t block) const {
  if (block < 0 || block >= total()) throw OutOfRangeError(argument, block, 0, total());
}

void BlockAllocator::allocate(int32_t n, std::vector<int32_t>& out) {
  if (n < 0) throw OutOfRangeError("n", n, 0, INT32_MAX);
  if (n > free_count()) throw CapacityError("blocks", n, free_count());
  for (int32_t i = 0; i < n; ++i) {
    const int32_t b = free_.back();
    free_.pop_back();
    refs_[size_t(b)] = 1;
    ++generations_[size_t(b)];
    out.push_back(b);
  }
}

std::vector<int32_t> BlockAllocator::allocate(int32_t n) {
  std::vector<int32_t> out;
  allocate(n, out);
  return out;
}

void BlockAllocator::retain(int32_t block) {
  check_block("block", block);
  if (refs_[size_t(block)] == 0) throw StateError("block", std::to_string(block) + " is free; only a block in use can be shared");
  ++refs_[size_t(block)];
}

void BlockAllocator::release(const std::vector<int32_t>& blocks) {
  for (int32_t b : blocks) check_block("blocks", b);
  // Drop the counts, undoing them all if a block turns out to be released more often than owned, so
  // an error changes nothing; blocks reach the free list only once the whole list is accepted.
  for (size_t i = 0; i < blocks.size(); ++i) {
    const int32_t b = blocks[i];
    if (refs_[size_t(b)] == 0) {
      for (size_t j = 0; j < i; ++j) ++refs_[size_t(blocks[j])];
      bool repeated = false;
      for (size_t j = 0; j < i; ++j) repeated = repeated || blocks[j] == b;
      throw StateError("blocks", repeated ? "block " + std::to_string(b) + " is released more often than it is owned"
                                          : "block " + std::to_string(b) + " is already free (double free)");
    }
    --refs_[size_t(b)];
  }
  for (int32_t b : blocks)
    if (refs_[size_t(b)] == 0) {
      refs_[size_t(b)] = -1;  // mark while pushing, so a repeated block is pushed once
      ++generations_[size_t(b)];
      free_.push_back(b);
    }
  for (int32_t b : blocks)
    if (refs_[size_t(b)] == -1) refs_[size_t(b)] = 0;
}

int32_t BlockAllocator::ref_count(int32_t block) const {
  check_block("block", block);
  return refs_[size_t(block)];
}

}  // namespace kvforge
