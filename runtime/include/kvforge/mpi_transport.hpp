// kvforge's Transport over MPI (Open MPI here): nonblocking point-to-point for transfers, an
// all-reduce for capacity. In the kvforge_mpi library, built where CMake finds MPI.
#pragma once

#include <mpi.h>

#include <unordered_map>

#include "kvforge/transport.hpp"

namespace kvforge {

class MpiTransport final : public Transport {
 public:
  // Collective over `comm` (it duplicates it). MPI must be initialized, and this object destroyed
  // before MPI_Finalize.
  explicit MpiTransport(MPI_Comm comm = MPI_COMM_WORLD);
  ~MpiTransport() override;
  int rank() const override { return rank_; }
  int size() const override { return size_; }
  void register_memory(void*, int64_t) override {}
  Handle post_send(const void* data, int64_t bytes, int peer, int tag) override;
  Handle post_recv(void* data, int64_t bytes, int peer, int tag) override;
  bool poll(Handle h) override;
  void cancel(Handle h) override;
  int max_tag() const override { return max_tag_; }
  bool arrived(int peer, int tag) override;
  // Host memory always; CUDA memory where this MPI says it is CUDA-aware (asked at run time).
  bool takes_memory_of(Device device) const override;
  int64_t all_min(int64_t value) override;

 private:
  Handle post(MPI_Request r);
  MPI_Comm comm_;
  int rank_ = 0, size_ = 1, max_tag_ = 32767;
  Handle next_ = 0;
  std::unordered_map<Handle, MPI_Request> requests_;
};

}  // namespace kvforge
