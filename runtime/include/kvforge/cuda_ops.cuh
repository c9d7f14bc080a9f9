// The CUDA backend's operations: the one source in ops.hpp run on the CUDA executor. A generated
// <variant>.cu includes this and instantiates cuda_op_table<its traits>().
#pragma once

#include "kvforge/exec_cuda.cuh"
#include "kvforge/ops.hpp"

namespace kvforge::detail {

template <class Traits> const OpTable<Traits>& cuda_op_table() {
  static const OpTable<Traits> table = make_op_table<Traits, CudaExec>(
      [](const Launch& l, const IndexCheckArgs& a) { check_indices_on_device(l.stream, a); });
  return table;
}

}  // namespace kvforge::detail
