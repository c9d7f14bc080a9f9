// The CUDA instantiation of step_build.hpp (step_cuda.cu), which the CUDA backend's build_step runs.
#pragma once

#include <cstdint>

#include "kvforge/detail/step_build.hpp"

namespace kvforge::detail {

// Scratch bytes CUB's exclusive scan needs for `items` int32 values.
int64_t step_scan_temp_bytes_cuda(int64_t items);
// Queues the step's build on `stream`; `temp` holds step_scan_temp_bytes_cuda(n + 1) bytes.
void build_step_cuda(const StepBuildArgs& args, void* stream, void* temp, int64_t temp_bytes);

}  // namespace kvforge::detail
