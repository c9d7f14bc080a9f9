// Definitions of CudaOps<Traits>: each forwards to the one source in ops.hpp with the CUDA executor.
// A generated <variant>.cu includes this and instantiates `template struct CudaOps<traits>;`.
#pragma once

#include "kvforge/cuda_ops.hpp"
#include "kvforge/exec_cuda.cuh"
#include "kvforge/ops.hpp"

namespace kvforge::detail {

template <class T> using CudaOpsFor = Ops<T, CudaExec>;
inline CudaExec cuda_exec(void* stream, int block_threads) {
  return CudaExec{static_cast<cudaStream_t>(stream), block_threads};
}

template <class T> void CudaOps<T>::write(void* s, int b, const WriteArgs<Store, In>& a) { CudaOpsFor<T>::write(cuda_exec(s, b), a); }
template <class T> void CudaOps<T>::stage(void* s, int b, const StageArgs<In>& a) { CudaOpsFor<T>::stage(cuda_exec(s, b), a); }
template <class T> void CudaOps<T>::gather(void* s, int b, const GatherArgs<Store, In>& a) { CudaOpsFor<T>::gather(cuda_exec(s, b), a); }
template <class T> void CudaOps<T>::zero_row(void* s, int b, const ZeroRowArgs<Store>& a) { CudaOpsFor<T>::zero_row(cuda_exec(s, b), a); }
template <class T> void CudaOps<T>::reorder_layer(void* s, int b, const ReorderArgs<Store>& a) {
  CudaOpsFor<T>::reorder_layer(cuda_exec(s, b), a);
}
template <class T> void CudaOps<T>::reorder_lengths(void* s, int b, const ReorderArgs<Store>& a) {
  CudaOpsFor<T>::reorder_lengths(cuda_exec(s, b), a);
}
template <class T> void CudaOps<T>::copy_pages(void* s, int b, const CopyPagesArgs<Store>& a) {
  CudaOpsFor<T>::copy_pages(cuda_exec(s, b), a);
}
template <class T> void CudaOps<T>::move_pages(void* s, int b, const MovePagesArgs<Store>& a) {
  CudaOpsFor<T>::move_pages(cuda_exec(s, b), a);
}

}  // namespace kvforge::detail
