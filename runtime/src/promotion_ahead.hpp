// Host-tier promotions copied on a thread of their own (SequenceManagerOptions::promote_ahead): add()
// queues a prefix's copy back into device pages and returns, so that the copy overlaps the caller's
// work until the step that needs those pages, which waits for them alone. Internal to the sequence
// manager, for a cache whose device memory is host memory (the CPU backend): a GPU's copies are
// already asynchronous on the cache's stream.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <exception>
#include <mutex>
#include <thread>
#include <vector>

#include "kvforge/cache.hpp"

namespace kvforge {

class PromotionAhead {
 public:
  explicit PromotionAhead(Cache& cache);
  ~PromotionAhead();  // finishes every queued copy

  // Queues unpacking packed page from[i] (packed_page_bytes() each, left untouched until the copy is
  // done) into device page pages[i]. Returns the copy's ticket: 1 for the first, one more each call.
  uint64_t queue(std::vector<const unsigned char*> from, std::vector<int32_t> pages);
  // Waits until copy `ticket` and every copy queued before it are done; rethrows a copy's failure.
  void wait(uint64_t ticket);
  // The ticket of the last copy done: every copy up to it is done (0: none yet).
  uint64_t finished();

 private:
  struct Copy {
    std::vector<const unsigned char*> from;
    std::vector<int32_t> pages;
  };
  void run();

  Cache& cache_;
  std::mutex mutex_;
  std::condition_variable changed_;
  std::deque<Copy> queue_;
  uint64_t queued_ = 0, finished_ = 0;
  std::exception_ptr failure_;
  bool stop_ = false;
  std::thread worker_;
};

}  // namespace kvforge
