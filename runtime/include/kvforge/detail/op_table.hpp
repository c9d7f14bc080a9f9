// The backend seam. Every operation of a variant on one kind of device is an entry of an OpTable, which
// that backend's generated file fills from the one source in ops.hpp run on the backend's executor:
//   cpu:  backends/cpu/cpu_ops.hpp   (CpuExec),  in the generated <variant>.cpp;
//   cuda: backends/cuda/cuda_ops.cuh (CudaExec), in the generated <variant>.cu.
// TypedCache runs whichever table its device has, so it holds no code of any backend.
#pragma once

#include <array>
#include <iterator>

#include "kvforge/geometry.hpp"
#include "kvforge/detail/attend/attend_args.hpp"
#include "kvforge/detail/op_args.hpp"
#include "kvforge/tensor.hpp"
#include "kvforge/vocab.hpp"

namespace kvforge::detail {

// What a launch needs besides its arguments: the queue to run on and how to split the work.
struct Launch {
  void* stream;   // cudaStream_t on CUDA; unused on the CPU
  Tuning tuning;  // the cache's launch parameters now in force
  // The CPU writes pool rows with non-temporal stores: set for the operations that write the pool
  // when the pool is far larger than the last-level cache, where keeping its rows cached would only
  // evict what is used next (a write then also skips reading the line it replaces).
  bool stream_stores = false;
};

// The kernels every backend's table holds, one row each: X(name, job, argument block). `job` names the
// struct of the one source whose static `name` is the body (WriteOps in write_ops.hpp, GatherOps in
// gather_ops.hpp, AttendOps in attend/attend_ops.hpp, UpkeepOps in upkeep_ops.hpp); Store and In are the traits' storage and input types.
// OpTable's members and make_op_table's entries (upkeep_ops.hpp) both expand it.
#define KVFORGE_KERNELS(X)                    \
  X(write, WriteOps, WriteArgs<Store, In>)    \
  X(stage, WriteOps, StageArgs<In>)           \
  X(gather, GatherOps, GatherArgs<Store, In>) \
  X(attend, AttendOps, AttendArgs<Store, In>) \
  X(zero_row, UpkeepOps, ZeroRowArgs<Store>)  \
  X(reorder_layer, UpkeepOps, ReorderArgs<Store>)   \
  X(reorder_lengths, UpkeepOps, ReorderArgs<Store>) \
  X(copy_pages, UpkeepOps, CopyPagesArgs<Store>)    \
  X(move_pages, UpkeepOps, MovePagesArgs<Store>)

template <class Traits> struct OpTable {
  using Store = typename Traits::storage_t;
  using In = typename Traits::input_t;
#define KVFORGE_KERNEL_ENTRY(name, job, ...) void (*name)(const Launch&, const __VA_ARGS__&);
  KVFORGE_KERNELS(KVFORGE_KERNEL_ENTRY)
#undef KVFORGE_KERNEL_ENTRY
  // Bounds of an index array: the CPU throws at once; CUDA records a failure in the device status word
  // for synchronize() to raise, so that nothing is read back on the host (graph capture stays legal).
  // The backend's own, not the one source's.
  void (*check_indices)(const Launch&, const IndexChecks&);  // all of them in one pass (CUDA: one launch)
};

// One slot per Device; null where this build has no backend of that kind.
inline constexpr int kDeviceKinds = int(std::size(kDeviceNames));
template <class Traits> using OpTables = std::array<const OpTable<Traits>*, kDeviceKinds>;

// A variant's table for one device. Declared here only: the generated header declares, and that
// backend's generated file defines, one explicit specialization per variant (codegen/templates/
// _kernels.j2), from the backend's <backend>_ops<Traits>() (cpu_ops.hpp, cuda_ops.cuh).
template <class Traits, Device D> const OpTable<Traits>& op_table();

}  // namespace kvforge::detail
