// Host-tier promotions copied ahead of the step that needs them (SequenceManagerOptions::promote_ahead):
// add() queues a prefix's copy back into device pages and returns, so that the copy overlaps the
// caller's work until the step that needs those pages, which waits for them alone. Where the cache's
// device memory is host memory (the CPU backend) the copies run on a thread of their own; on a GPU, on
// a stream of their own, which the cache's stream waits for by an event while the host goes on.
// Internal to the sequence manager.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "kvforge/backend.hpp"
#include "kvforge/cache.hpp"

namespace kvforge {

class PromotionAhead {
 public:
  // The copier for `cache` on `backend` (its device's): a thread for host memory, else a stream.
  static std::unique_ptr<PromotionAhead> start(Cache& cache, Backend& backend);
  virtual ~PromotionAhead() = default;  // each copier finishes every queued copy first

  // Queues unpacking packed page from[i] (packed_page_bytes() each, in memory of backend.host(), left
  // untouched until the copy is done) into device page pages[i]. Returns the copy's ticket: 1 for the
  // first, one more each call.
  virtual uint64_t queue(std::vector<const unsigned char*> from, std::vector<int32_t> pages) = 0;
  // Work on the cache's stream from now on finds copy `ticket` and every copy before it done. A
  // stream's copier makes the stream wait; the thread's makes the host wait, its work being the host's.
  virtual void order(uint64_t ticket) = 0;
  // The host waits until copy `ticket` and every copy queued before it are done; rethrows a copy's
  // failure.
  virtual void wait(uint64_t ticket) = 0;
  // The ticket of the last copy done: every copy up to it is done (0: none yet).
  virtual uint64_t finished() = 0;
};

}  // namespace kvforge
