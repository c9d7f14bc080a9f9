// The index checks an executor runs on the host before its loops (the CPU's, and the CUDA
// backend's where an index array lives in host memory): each throws OutOfRangeError naming the
// argument and its first bad element. Kernel level, so that executors need no cache
// (runtime/src/kernels/host_checks.cpp).
#pragma once

#include "kvforge/detail/op_args.hpp"

namespace kvforge::detail {

void check_indices_on_host(const IndexCheckArgs& a);
void check_indices_on_host(const IndexChecks& checks);  // each in turn

}  // namespace kvforge::detail
