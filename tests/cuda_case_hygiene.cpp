// Every CUDA case leaves the device as it found it. After each case that tools/gpu-check's filter names
// a CUDA case (its suite or name holds "Cuda" or "cuda_"), in a process with a GPU, the whole device is
// synchronized and its state read before the case reports: a case that leaves a kernel running hangs
// inside its own report, so that tools/gtest_watch.py names it rather than the case after it; a case
// that leaves an error behind (a failed launch nobody read, an illegal address, a capture still open
// on the legacy stream) ends the process with its own name and the error, and the cases after it run
// in a fresh one. The last GPU run (f1d6b61) saw every case after DeviceChecks hang: this says which
// case left what. Built with KVFORGE_CUDA only; where no GPU is present it does nothing.
#include <cuda_runtime.h>

#include <gtest/gtest.h>

#include <cstdio>
#include <cstdlib>
#include <string>

#include "kvforge/backend.hpp"

namespace {

bool is_cuda_case(const testing::TestInfo& info) {
  const std::string name = std::string(info.test_suite_name()) + "." + info.name();
  return name.find("Cuda") != std::string::npos || name.find("cuda_") != std::string::npos;
}

class DeviceLeftAsFound : public testing::EmptyTestEventListener {
 public:
  // Listeners hear a case's end in reverse order of joining: this one, appended after GoogleTest's
  // printer, runs before the case's "[ OK ]" line is printed.
  void OnTestEnd(const testing::TestInfo& info) override {
    if (!is_cuda_case(info) || info.result()->Skipped() || !kvforge::cuda_available(nullptr)) return;
    const cudaError_t synced = cudaDeviceSynchronize();  // a kernel left running hangs here
    const cudaError_t pending = cudaGetLastError();
    cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
    const cudaError_t queried = cudaStreamIsCapturing(nullptr, &capture);
    std::string left;
    if (synced != cudaSuccess) left += std::string(" synchronize: ") + cudaGetErrorString(synced) + ";";
    if (pending != cudaSuccess) left += std::string(" an unread error: ") + cudaGetErrorString(pending) + ";";
    if (queried != cudaSuccess) left += std::string(" the legacy stream's capture state: ") + cudaGetErrorString(queried) + ";";
    if (capture != cudaStreamCaptureStatusNone) left += " a capture still open on the legacy stream;";
    if (left.empty()) return;
    std::fprintf(stderr, "kvtest: %s.%s left the device as it should not:%s the process ends here, so that no later case "
                 "takes the blame\n", info.test_suite_name(), info.name(), left.c_str());
    std::fflush(stderr);
    std::fflush(stdout);
    std::_Exit(3);
  }
};

[[maybe_unused]] const bool kListening = [] {
  testing::UnitTest::GetInstance()->listeners().Append(new DeviceLeftAsFound);
  return true;
}();

}  // namespace
