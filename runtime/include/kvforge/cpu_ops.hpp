// The CPU backend's operations: the one source in ops.hpp run on the CPU executor. A generated
// <variant>.cpp instantiates cpu_op_table<its traits>().
#pragma once

#include "kvforge/checks.hpp"
#include "kvforge/exec_cpu.hpp"
#include "kvforge/ops.hpp"

namespace kvforge::detail {

template <class Traits> const OpTable<Traits>& cpu_op_table() {
  static const OpTable<Traits> table =
      make_op_table<Traits, CpuExec>([](const Launch&, const IndexCheckArgs& a) { check_indices_on_host(a); });
  return table;
}

}  // namespace kvforge::detail
