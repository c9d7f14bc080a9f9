// The backend seam. Every operation of a variant on one kind of device is an entry of an OpTable, which
// that backend's instantiation file fills from the one source in ops.hpp run on its executor:
//   cpu:  cpu_ops.hpp  (CpuExec),  instantiated by the generated <variant>.cpp;
//   cuda: cuda_ops.cuh (CudaExec), instantiated by the generated <variant>.cu.
// TypedCache runs whichever table its device has, so it holds no code of any backend.
#pragma once

#include <array>

#include "kvforge/geometry.hpp"
#include "kvforge/op_args.hpp"
#include "kvforge/tensor.hpp"

namespace kvforge::detail {

// What a launch needs besides its arguments: the queue to run on and how to split the work.
struct Launch {
  void* stream;   // cudaStream_t on CUDA; unused on the CPU
  Tuning tuning;  // the cache's launch parameters now in force
};

template <class Traits> struct OpTable {
  using Store = typename Traits::storage_t;
  using In = typename Traits::input_t;
  void (*write)(const Launch&, const WriteArgs<Store, In>&);
  void (*stage)(const Launch&, const StageArgs<In>&);
  void (*gather)(const Launch&, const GatherArgs<Store, In>&);
  void (*zero_row)(const Launch&, const ZeroRowArgs<Store>&);
  void (*reorder_layer)(const Launch&, const ReorderArgs<Store>&);
  void (*reorder_lengths)(const Launch&, const ReorderArgs<Store>&);
  void (*copy_pages)(const Launch&, const CopyPagesArgs<Store>&);
  void (*move_pages)(const Launch&, const MovePagesArgs<Store>&);
  // Bounds of an index array: the CPU throws at once; CUDA records a failure in the device status word
  // for synchronize() to raise, so that nothing is read back on the host (graph capture stays legal).
  void (*check_indices)(const Launch&, const IndexCheckArgs&);
};

// One slot per Device; null where this build has no backend of that kind.
inline constexpr int kDeviceKinds = 2;
template <class Traits> using OpTables = std::array<const OpTable<Traits>*, kDeviceKinds>;

// Defined by each backend's header (cpu_ops.hpp, cuda_ops.cuh) and instantiated per variant by the
// generated file of that backend; a variant's traits name the ones its build has (Traits::op_tables).
template <class Traits> const OpTable<Traits>& cpu_op_table();
template <class Traits> const OpTable<Traits>& cuda_op_table();

}  // namespace kvforge::detail
