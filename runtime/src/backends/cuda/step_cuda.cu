// step_build.hpp's kernels on CUDA, with CUB's DeviceScan for the two scans (on the caller's stream,
// in the caller's scratch, so nothing here allocates).
#include "kvforge/backends/cuda/exec_cuda.cuh"  // first: it names the target

#include <cub/device/device_scan.cuh>

#include "kvforge/detail/step_build.hpp"
#include "step_cuda.hpp"

namespace kvforge::detail {

void exclusive_scan(const CudaExec& ex, const int32_t* in, int32_t* out, int64_t items, void* temp, int64_t temp_bytes) {
  size_t bytes = size_t(temp_bytes);
  const cudaError_t err = cub::DeviceScan::ExclusiveSum(temp, bytes, in, out, int(items), ex.stream);
  if (err != cudaSuccess) throw_cuda_error(err, "exclusive scan");
}

int64_t step_scan_temp_bytes_cuda(int64_t items) {
  size_t bytes = 0;
  cub::DeviceScan::ExclusiveSum(nullptr, bytes, static_cast<const int32_t*>(nullptr), static_cast<int32_t*>(nullptr),
                                int(items));
  return int64_t(bytes);
}

void build_step_cuda(const StepBuildArgs& args, void* stream, void* temp, int64_t temp_bytes) {
  build_step(CudaExec{static_cast<cudaStream_t>(stream), 256}, args, temp, temp_bytes);
}

}  // namespace kvforge::detail
