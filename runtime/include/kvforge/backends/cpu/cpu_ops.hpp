// The CPU backend's operations: the one source in ops.hpp run on the CPU executor. A generated
// <variant>.cpp fills its op_table<traits, Device::cpu>() from cpu_ops<traits>(), which picks the
// kernels built for the x86-64 level this CPU runs (cpu_level.hpp); each wider level's kernels are
// instantiated in <variant>.cpu_v<level>.cpp, compiled with that level's -march.
#pragma once

#include "kvforge/detail/host_checks.hpp"
#include "kvforge/cpu_level.hpp"
#include "kvforge/backends/cpu/exec_cpu.hpp"
#include "kvforge/detail/upkeep_ops.hpp"
#include "kvforge/vocab.hpp"

namespace kvforge::detail {

// The level the compiler targets in this file, read from the instruction sets it was told to use.
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
inline constexpr int kCompiledCpuLevel = 4;
#elif defined(__AVX2__) && defined(__FMA__)
inline constexpr int kCompiledCpuLevel = 3;
#else
inline constexpr int kCompiledCpuLevel = 2;
#endif

// A variant's CPU kernels for one level. Instantiated only in a file compiled for that level or wider;
// the variant's own file declares the wider ones `extern template`.
template <class Traits, int Level> OpTable<Traits> cpu_kernels() {
  static_assert(Level <= kCompiledCpuLevel, "a level's kernels must be compiled with that level's -march");
  return make_op_table<Traits, CpuExec<Level>>([](const Launch&, const IndexChecks& c) { check_indices_on_host(c); });
}

// The kernels for `level`, found by walking down from the widest level built.
template <class Traits, int Level = kCpuMaxLevel> OpTable<Traits> cpu_kernels_at(int level) {
  if constexpr (Level == kCpuBaseLevel) {
    return cpu_kernels<Traits, kCpuBaseLevel>();
  } else {
    return level >= Level ? cpu_kernels<Traits, Level>() : cpu_kernels_at<Traits, Level - 1>(level);
  }
}

// A generated variant's table: the kernels for the level this process runs at.
template <class Traits> OpTable<Traits> cpu_ops() { return cpu_kernels_at<Traits>(cpu_level()); }

// The table of a variant whose one file holds one level's kernels (codegen's --one-cpu-level): an
// on-demand library, compiled for the level the asking process runs at, and every variant of a build of
// one level (CMake's KVFORGE_CPU_LEVELS=<level> or native). One compile instead of one a level: on two
// cores, about half the wall time of a first use.
template <class Traits> OpTable<Traits> cpu_ops_compiled_level() {
  return cpu_kernels<Traits, kCompiledCpuLevel>();
}

}  // namespace kvforge::detail
