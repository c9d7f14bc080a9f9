// Memory, synchronization and step building for one device kind: a row of the backend table
// (vocab.hpp), implemented in the backend's folder (runtime/src/backends/<name>/). Kernels are not
// here: they are launched through the executors in kvforge/backends/<name>/, from the one source in
// ops.hpp.
#pragma once

#include <cstdint>
#include <string>

#include "kvforge/tensor.hpp"

namespace kvforge {

namespace detail {
struct StepBuildArgs;  // step_build.hpp
}

class Backend {
 public:
  virtual ~Backend() = default;
  virtual Device device() const = 0;
  virtual void* allocate(int64_t bytes) = 0;  // zero-filled, 256-byte aligned
  virtual void release(void* p) noexcept = 0;
  virtual void fill(void* dst, int byte, int64_t bytes, void* stream) = 0;
  virtual void copy(void* dst, const void* src, int64_t bytes, void* stream) = 0;  // within the device
  virtual void to_host(void* host, const void* src, int64_t bytes, void* stream) = 0;
  virtual void from_host(void* dst, const void* host, int64_t bytes, void* stream) = 0;
  virtual void synchronize(void* stream) = 0;
  // Bytes the device has free now, or -1 where that is not a meaningful number (the CPU).
  virtual int64_t free_memory() = 0;
  // The host memory that pairs with this device for offload: pinned memory for CUDA, so transfers
  // run at full speed; plain memory for the CPU (this same backend).
  virtual Backend& host() = 0;
  // A step's batch arrays (step_build.hpp), built where this backend's memory is: the scratch bytes
  // the build needs for `items` scanned entries, and the build, queued on `stream`, with `scratch`
  // of at least that many bytes.
  virtual int64_t step_scratch_bytes(int64_t items) = 0;
  virtual void build_step(const detail::StepBuildArgs& args, void* stream, void* scratch, int64_t scratch_bytes) = 0;

  // Work queued beside a stream's and ordered against it by events: the sequence manager's promotions
  // ahead of a step (SequenceManagerOptions::promote_ahead). Host memory queues nothing (an operation
  // is done when it returns), so it has no streams and its events are done at once.
  virtual void* create_stream() { return nullptr; }
  virtual void destroy_stream(void*) noexcept {}
  // A new event, done once the work queued on `stream` so far is.
  virtual void* record_event(void* /*stream*/) { return nullptr; }
  // Work queued on `stream` from now on waits for `event`; the host does not (except where `stream` is
  // being captured into a graph, which cannot wait for an event recorded outside it: the host waits).
  virtual void wait_event(void* /*stream*/, void* /*event*/) {}
  virtual bool event_done(void* /*event*/) { return true; }
  virtual void destroy_event(void*) noexcept {}
  // from_host without waiting for the copy: `host` (of host().allocate, or the copy is not truly
  // queued) must stay as it is until the stream has copied it.
  virtual void from_host_queued(void* dst, const void* host, int64_t bytes, void* stream) { from_host(dst, host, bytes, stream); }
};

// The backend for a device; throws BackendError when it is not built in or no device is present.
Backend& backend(Device d);

// Whether a device's kernels can run here; when not, `why` says why (not built, no driver, no device).
bool backend_available(Device d, std::string* why = nullptr);
// The same for CUDA, by name (the cuda row of the table).
bool cuda_available(std::string* why = nullptr);

// Owns one allocation from a backend.
class Buffer {
 public:
  Buffer() = default;
  Buffer(Backend& b, int64_t bytes) : backend_(&b), bytes_(bytes), data_(bytes ? b.allocate(bytes) : nullptr) {}
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;
  Buffer(Buffer&& o) noexcept { swap(o); }
  Buffer& operator=(Buffer&& o) noexcept {
    Buffer tmp(std::move(o));
    swap(tmp);
    return *this;
  }
  ~Buffer() {
    if (data_) backend_->release(data_);
  }
  void* data() const { return data_; }
  template <class T> T* as() const { return static_cast<T*>(data_); }
  int64_t bytes() const { return bytes_; }

 private:
  void swap(Buffer& o) noexcept {
    std::swap(backend_, o.backend_);
    std::swap(bytes_, o.bytes_);
    std::swap(data_, o.data_);
  }
  Backend* backend_ = nullptr;
  int64_t bytes_ = 0;
  void* data_ = nullptr;
};

}  // namespace kvforge
