#include "kvforge/mpi_transport.hpp"

#include <climits>
#include <string>

#include "kvforge/errors.hpp"
#if __has_include(<mpi-ext.h>)
#include <mpi-ext.h>  // Open MPI's MPIX_Query_cuda_support
#endif

namespace kvforge {
namespace {

void check(int status, const char* what) {
  if (status != MPI_SUCCESS) {
    char text[MPI_MAX_ERROR_STRING];
    int length = 0;
    MPI_Error_string(status, text, &length);
    throw BackendError(std::string("MPI ") + what + ": " + std::string(text, size_t(length)));
  }
}

int count_of(int64_t bytes) {
  if (bytes < 0 || bytes > INT_MAX) throw OutOfRangeError("bytes", bytes, 0, int64_t(INT_MAX) + 1, -1, "one MPI message");
  return int(bytes);
}

}  // namespace

MpiTransport::MpiTransport(MPI_Comm comm) {
  // A communicator of its own: its tags never meet the application's messages, and its errors come
  // back as codes (BackendError) instead of aborting the job.
  check(MPI_Comm_dup(comm, &comm_), "Comm_dup");
  check(MPI_Comm_set_errhandler(comm_, MPI_ERRORS_RETURN), "Comm_set_errhandler");
  check(MPI_Comm_rank(comm_, &rank_), "Comm_rank");
  check(MPI_Comm_size(comm_, &size_), "Comm_size");
  int* upper = nullptr;
  int found = 0;
  check(MPI_Comm_get_attr(comm_, MPI_TAG_UB, &upper, &found), "Comm_get_attr(MPI_TAG_UB)");
  if (found && upper) max_tag_ = *upper;
}

MpiTransport::~MpiTransport() {
  for (auto& [h, r] : requests_) {  // what nobody waited for: withdraw receives, finish sends
    int done = 0;
    MPI_Test(&r, &done, MPI_STATUS_IGNORE);
    if (!done) MPI_Request_free(&r);
  }
  MPI_Comm_free(&comm_);
}

Transport::Handle MpiTransport::post(MPI_Request r) {
  requests_.emplace(next_, r);
  return next_++;
}

Transport::Handle MpiTransport::post_send(const void* data, int64_t bytes, int peer, int tag) {
  MPI_Request r;
  check(MPI_Isend(data, count_of(bytes), MPI_BYTE, peer, tag, comm_, &r), "Isend");
  return post(r);
}

Transport::Handle MpiTransport::post_recv(void* data, int64_t bytes, int peer, int tag) {
  MPI_Request r;
  check(MPI_Irecv(data, count_of(bytes), MPI_BYTE, peer, tag, comm_, &r), "Irecv");
  return post(r);
}

bool MpiTransport::poll(Handle h) {
  auto it = requests_.find(h);
  if (it == requests_.end()) throw StateError("handle", "no operation " + std::to_string(h) + " is posted");
  int done = 0;
  check(MPI_Test(&it->second, &done, MPI_STATUS_IGNORE), "Test");
  if (done) requests_.erase(it);
  return done != 0;
}

void MpiTransport::cancel(Handle h) {
  auto it = requests_.find(h);
  if (it == requests_.end()) return;
  MPI_Cancel(&it->second);
  MPI_Wait(&it->second, MPI_STATUS_IGNORE);
  requests_.erase(it);
}

bool MpiTransport::arrived(int peer, int tag) {
  int flag = 0;
  check(MPI_Iprobe(peer, tag, comm_, &flag, MPI_STATUS_IGNORE), "Iprobe");
  return flag != 0;
}

bool MpiTransport::takes_memory_of(Device device) const {
  if (device == Device::cpu) return true;
#if defined(MPIX_CUDA_AWARE_SUPPORT) && MPIX_CUDA_AWARE_SUPPORT
  return MPIX_Query_cuda_support() == 1;
#else
  return false;
#endif
}

int64_t MpiTransport::all_min(int64_t value) {
  int64_t out = value;
  check(MPI_Allreduce(&value, &out, 1, MPI_INT64_T, MPI_MIN, comm_), "Allreduce");
  return out;
}

}  // namespace kvforge
