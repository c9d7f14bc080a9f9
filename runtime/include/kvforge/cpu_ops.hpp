// The CPU backend's operations: the one source in ops.hpp run on the CPU executor. A generated
// <variant>.cpp fills its op_table<traits, Device::cpu>() from cpu_ops<traits>().
#pragma once

#include "kvforge/checks.hpp"
#include "kvforge/exec_cpu.hpp"
#include "kvforge/ops.hpp"

namespace kvforge::detail {

template <class Traits> OpTable<Traits> cpu_ops() {
  return make_op_table<Traits, CpuExec>([](const Launch&, const IndexCheckArgs& a) { check_indices_on_host(a); });
}

}  // namespace kvforge::detail
