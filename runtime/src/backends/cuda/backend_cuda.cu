// The CUDA backend: memory, copies, device-side index checks. Built only with KVFORGE_CUDA=ON.
#include "kvforge/backends/cuda/exec_cuda.cuh"  // first: it names the target

#include <cuda_runtime.h>

#include <cstring>

#include <string>

#include "base/host_backend.hpp"
#include "step_cuda.hpp"
#include "kvforge/errors.hpp"

namespace kvforge {

namespace detail {
void throw_cuda_error(cudaError_t err, const char* what) {
  throw BackendError(std::string("cuda: ") + what + ": " + cudaGetErrorString(err));
}

namespace {
void check(cudaError_t err, const char* what) {
  if (err != cudaSuccess) throw_cuda_error(err, what);
}

// The checks of calls too long to check inside their own launch (CudaExec::for_each_item): all of
// an operation's checks (a row layout's rows and positions) in one launch.
// The operation's launch, queued right behind, starts at once and issues its loads meanwhile
// (CudaExec::launch); it waits for this grid before it reads the status word.
__global__ void check_indices_kernel(IndexChecks checks) {
  let_next_grid_start();
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  for (int c = 0; c < checks.count; ++c) {
    const IndexCheckArgs& a = checks.check[c];
    for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < a.count; i += stride) {
      int64_t value;
      if (!index_passes(a, i, value)) record_index_failure(a, i, value);
    }
  }
}
}  // namespace

void check_indices_on_device(void* stream, const IndexChecks& checks) {
  const int64_t longest = checks.longest();
  if (longest <= 0) return;
  const int threads = 256;
  const int64_t blocks = (longest + threads - 1) / threads;
  check_indices_kernel<<<unsigned(blocks < 1024 ? blocks : 1024), threads, 0, static_cast<cudaStream_t>(stream)>>>(checks);
  check(cudaGetLastError(), "index check launch");
}
}  // namespace detail

namespace {
using detail::check;

// Page-locked host memory: the host tier of offload, so that transfers run at full PCIe speed.
class PinnedHostBackend final : public HostMemoryBackend {
 public:
  void* allocate(int64_t bytes) override {
    void* p = nullptr;
    check(cudaMallocHost(&p, size_t(bytes)), "cudaMallocHost");
    std::memset(p, 0, size_t(bytes));
    return p;
  }
  void release(void* p) noexcept override { cudaFreeHost(p); }
};

class CudaBackend final : public Backend {
 public:
  Device device() const override { return Device::cuda; }
  void* allocate(int64_t bytes) override {
    void* p = nullptr;
    check(cudaMalloc(&p, size_t(bytes)), "cudaMalloc");
    check(cudaMemset(p, 0, size_t(bytes)), "cudaMemset");
    return p;
  }
  void release(void* p) noexcept override { cudaFree(p); }
  void fill(void* dst, int byte, int64_t bytes, void* s) override {
    check(cudaMemsetAsync(dst, byte, size_t(bytes), static_cast<cudaStream_t>(s)), "cudaMemsetAsync");
  }
  void copy(void* dst, const void* src, int64_t bytes, void* s) override {
    check(cudaMemcpyAsync(dst, src, size_t(bytes), cudaMemcpyDeviceToDevice, static_cast<cudaStream_t>(s)),
          "cudaMemcpyAsync d2d");
  }
  void to_host(void* host, const void* src, int64_t bytes, void* s) override {
    check(cudaMemcpyAsync(host, src, size_t(bytes), cudaMemcpyDeviceToHost, static_cast<cudaStream_t>(s)),
          "cudaMemcpyAsync d2h");
    check(cudaStreamSynchronize(static_cast<cudaStream_t>(s)), "cudaStreamSynchronize");
  }
  void from_host(void* dst, const void* host, int64_t bytes, void* s) override {
    check(cudaMemcpyAsync(dst, host, size_t(bytes), cudaMemcpyHostToDevice, static_cast<cudaStream_t>(s)),
          "cudaMemcpyAsync h2d");
    check(cudaStreamSynchronize(static_cast<cudaStream_t>(s)), "cudaStreamSynchronize");
  }
  void synchronize(void* s) override { check(cudaStreamSynchronize(static_cast<cudaStream_t>(s)), "cudaStreamSynchronize"); }
  int64_t free_memory() override {
    size_t free = 0, total = 0;
    check(cudaMemGetInfo(&free, &total), "cudaMemGetInfo");
    return int64_t(free);
  }
  Backend& host() override {
    static PinnedHostBackend pinned;
    return pinned;
  }
  int64_t step_scratch_bytes(int64_t items) override { return detail::step_scan_temp_bytes_cuda(items); }
  void build_step(const detail::StepBuildArgs& args, void* stream, void* scratch, int64_t scratch_bytes) override {
    detail::build_step_cuda(args, stream, scratch, scratch_bytes);
  }
  // Non-blocking: the legacy default stream, which a cache may be on, would otherwise serialize with it.
  void* create_stream() override {
    cudaStream_t s = nullptr;
    check(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "cudaStreamCreateWithFlags");
    return s;
  }
  void destroy_stream(void* s) noexcept override { cudaStreamDestroy(static_cast<cudaStream_t>(s)); }
  void* record_event(void* s) override {
    cudaEvent_t e = nullptr;
    check(cudaEventCreateWithFlags(&e, cudaEventDisableTiming), "cudaEventCreateWithFlags");
    const cudaError_t err = cudaEventRecord(e, static_cast<cudaStream_t>(s));
    if (err != cudaSuccess) {
      cudaEventDestroy(e);
      check(err, "cudaEventRecord");
    }
    return e;
  }
  void wait_event(void* s, void* e) override {
    cudaStreamCaptureStatus capturing = cudaStreamCaptureStatusNone;
    check(cudaStreamIsCapturing(static_cast<cudaStream_t>(s), &capturing), "cudaStreamIsCapturing");
    if (capturing != cudaStreamCaptureStatusNone)
      check(cudaEventSynchronize(static_cast<cudaEvent_t>(e)), "cudaEventSynchronize");
    else
      check(cudaStreamWaitEvent(static_cast<cudaStream_t>(s), static_cast<cudaEvent_t>(e), 0), "cudaStreamWaitEvent");
  }
  bool event_done(void* e) override {
    const cudaError_t err = cudaEventQuery(static_cast<cudaEvent_t>(e));
    if (err == cudaErrorNotReady) return false;
    check(err, "cudaEventQuery");
    return true;
  }
  void destroy_event(void* e) noexcept override { cudaEventDestroy(static_cast<cudaEvent_t>(e)); }
  void from_host_queued(void* dst, const void* host, int64_t bytes, void* s) override {
    check(cudaMemcpyAsync(dst, host, size_t(bytes), cudaMemcpyHostToDevice, static_cast<cudaStream_t>(s)),
          "cudaMemcpyAsync h2d");
  }
};
}  // namespace

bool cuda_available(std::string* why) {
  int count = 0;
  const cudaError_t err = cudaGetDeviceCount(&count);
  if (err != cudaSuccess || count == 0) {
    if (why) *why = err != cudaSuccess ? std::string("no usable CUDA driver or device: ") + cudaGetErrorString(err)
                                       : std::string("no CUDA device is present");
    return false;
  }
  return true;
}

Backend& cuda_backend() {
  std::string why;
  if (!cuda_available(&why)) throw BackendError(why);
  static CudaBackend b;
  return b;
}

}  // namespace kvforge
