// The CUDA backend's operations: the one source in ops.hpp run on the CUDA executor. A generated
// <variant>.cu fills its op_table<traits, Device::cuda>() from cuda_ops<traits>().
#pragma once

#include "kvforge/backends/cuda/exec_cuda.cuh"
#include "kvforge/detail/upkeep_ops.hpp"

namespace kvforge::detail {

template <class Traits> OpTable<Traits> cuda_ops() {
  return make_op_table<Traits, CudaExec>(
      [](const Launch& l, const IndexChecks& c) { check_indices_on_device(l.stream, c); });
}

}  // namespace kvforge::detail
