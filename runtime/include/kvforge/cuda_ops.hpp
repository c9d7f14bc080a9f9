// Host-visible entry points of the CUDA instantiation of ops.hpp. The generated <variant>.cu defines
// them; host code calls them only when the build has CUDA (KVFORGE_WITH_CUDA).
#pragma once

#include "kvforge/op_args.hpp"

namespace kvforge::detail {

template <class Traits> struct CudaOps {
  using Store = typename Traits::storage_t;
  using In = typename Traits::input_t;
  static void write(void* stream, int block_threads, const WriteArgs<Store, In>& a);
  static void stage(void* stream, int block_threads, const StageArgs<In>& a);
  static void gather(void* stream, int block_threads, const GatherArgs<Store, In>& a);
  static void zero_row(void* stream, int block_threads, const ZeroRowArgs<Store>& a);
  static void reorder_layer(void* stream, int block_threads, const ReorderArgs<Store>& a);
  static void reorder_lengths(void* stream, int block_threads, const ReorderArgs<Store>& a);
  static void copy_pages(void* stream, int block_threads, const CopyPagesArgs<Store>& a);
  static void move_pages(void* stream, int block_threads, const MovePagesArgs<Store>& a);
};

// Device-side index validation (no host read, so graph capture stays legal).
void check_indices_on_device(void* stream, const IndexCheckArgs& a);

}  // namespace kvforge::detail
