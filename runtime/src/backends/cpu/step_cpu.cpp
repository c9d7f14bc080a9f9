// The CPU's instantiation of step_build.hpp: a step's batch arrays built by the CPU executor, for
// every backend whose memory is host memory (host_backend.hpp).
#include "kvforge/backends/cpu/exec_cpu.hpp"
#include "kvforge/detail/step_build.hpp"
#include "kvforge/vocab.hpp"
#include "base/host_backend.hpp"

namespace kvforge::detail {

// The CPU's scan: a loop, as the batch is at most thousands of sequences.
template <int Level>
void exclusive_scan(const CpuExec<Level>&, const int32_t* in, int32_t* out, int64_t items, void*, int64_t) {
  int32_t sum = 0;
  for (int64_t i = 0; i < items; ++i) {
    const int32_t v = in[i];
    out[i] = sum;
    sum += v;
  }
}

void build_step_on_host(const StepBuildArgs& args) {
  CpuExec<kCpuBaseLevel> ex{tunables::cpu_parallel_bytes.default_value, 0, false};
  build_step(ex, args, nullptr, 0);
}

}  // namespace kvforge::detail
