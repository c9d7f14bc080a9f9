// What a transfer needs from a transport, and no more: register memory, post sends and receives,
// poll them, and agree on a minimum across ranks. Open MPI implements it (mpi_transport.hpp); UCX,
// NIXL or NCCL would implement the same five calls.
#pragma once

#include <cstdint>

#include "kvforge/vocab.hpp"  // Device

namespace kvforge {

class Transport {
 public:
  using Handle = int64_t;  // one posted operation
  virtual ~Transport() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  // Memory that posted operations will read or write. An RDMA transport pins and registers it; MPI
  // needs nothing.
  virtual void register_memory(void* data, int64_t bytes) = 0;
  // Post a send or a receive of `bytes` bytes to or from rank `peer`, matched by `tag` (0..max_tag()).
  // Messages between two ranks with the same tag arrive in the order they were posted.
  virtual Handle post_send(const void* data, int64_t bytes, int peer, int tag) = 0;
  virtual Handle post_recv(void* data, int64_t bytes, int peer, int tag) = 0;
  // True once the operation has completed; the handle is then spent.
  virtual bool poll(Handle h) = 0;
  // Withdraws a posted receive that has not completed; the handle is then spent.
  virtual void cancel(Handle h) = 0;
  virtual int max_tag() const = 0;
  // Whether a message from `peer` with `tag` has arrived and waits for a receive. A transport that
  // cannot tell says false; transfers then only lose the ability to drop a stale header at once
  // (transfer.hpp).
  virtual bool arrived(int peer, int tag) { (void)peer, (void)tag; return false; }
  // Whether posted memory may live on `device`; where not, transfers stage through host memory.
  virtual bool takes_memory_of(Device device) const = 0;
  // Collective over every rank: the smallest `value` (DeepSpeed's MIN all-reduce of its block count).
  virtual int64_t all_min(int64_t value) = 0;
};

}  // namespace kvforge
