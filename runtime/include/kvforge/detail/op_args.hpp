// Plain argument blocks shared by the host-side cache class and the kernels of both backends.
#pragma once

#include <cstdint>

#include "kvforge/detail/config.hpp"
#include "kvforge/detail/device_status.hpp"
#include "kvforge/geometry.hpp"

namespace kvforge::detail {

// A size fixed at compile time, usable wherever a run-time int is: loops over it have constant bounds.
// Ops pass an item's lanes to the executors this way, and generated extents (ops.hpp) too.
template <int N> struct Fixed {
  static constexpr int value = N;
  KVF_HD constexpr operator int() const { return N; }
};

// An item's lanes, as a block of their own: for a body whose lanes meet at the block's barrier (a
// per-token scale reduced across warps, CudaExec::item_max). An executor that runs an item on one
// thread, or on lanes it steps through in turn, takes it as the Fixed it is.
template <int N> struct BlockItem : Fixed<N> {};

// Bounds check of an index array: every value in [lo, hi), or -1 where padding is allowed.
struct IndexCheckArgs {
  const void* data;
  bool is64;
  int64_t count;
  int64_t lo;
  int64_t hi;
  bool allow_padding;
  int32_t code;
  DeviceStatus* status;
};

// Whether element i passes its check; `value` is what it holds. The one rule of both backends' checks.
KVF_HD KVF_INLINE bool index_passes(const IndexCheckArgs& a, int64_t i, int64_t& value) {
  value = a.is64 ? static_cast<const int64_t*>(a.data)[i] : static_cast<const int32_t*>(a.data)[i];
  return (a.allow_padding && value == -1) || (value >= a.lo && value < a.hi);
}

// The index checks of one append or gather, given to the operation itself so that an executor can run
// them inside the operation's own launch (CUDA, for decode-sized calls: one launch, not four). Either
// way they finish before anything is written, and a failure writes nothing anywhere.
inline constexpr int kMaxIndexChecks = 3;  // an append's slots, or rows and positions; a gather's range
struct IndexChecks {
  IndexCheckArgs check[kMaxIndexChecks];
  int count = 0;
  void add(const IndexCheckArgs& a) { check[count++] = a; }
  // The most entries any one of them checks.
  int64_t longest() const {
    int64_t n = 0;
    for (int c = 0; c < count; ++c) n = check[c].count > n ? check[c].count : n;
    return n;
  }
};

// The sizes a kernel loops over. Generated variants fix them at compile time, and their ops never read
// this; runtime-sized traits (the generic path) pass them here.
struct Extents {
  int heads = 0;
  int head_dim = 0;
  int page_size = 0;  // paged only
  int window = 0;     // ring only
};

// One rank-3 input or output as the kernels address it: element strides for token and head.
template <class T> struct Rows3 {
  T* data;
  int64_t token_stride;
  int64_t head_stride;
};

// One token's K or V, all heads: where head 0 starts and the elements between heads. Both executors'
// copy_heads_kv take a token's K and V as four of these.
template <class T> struct TokenHeads {
  T* data;
  int64_t head_stride;
};

// Scales of a quantized layout: the base of layer 0, K, unit 0, slot 0, head 0, and the coordinate
// strides in scale elements (see Geometry). Null for float layouts.
struct ScaleRef {
  void* base;
  Strides s;
  const float* tensor = nullptr;  // [layers, 2]: a tensor-scaled layout's second-level scales, else null
};

// append (one layer) and commit (every layer's staged tokens) are one operation.
template <class Store, class In> struct WriteArgs {
  Store* pool;
  Strides s;
  ScaleRef scales;
  Rows3<const In> k, v;
  int64_t input_layer_stride;   // elements between successive layers' staged tokens
  const int32_t* rows;          // contiguous and ring
  const int32_t* positions;
  const int64_t* slots;         // paged
  int64_t target_layer_stride;  // entries between successive layers' targets
  int64_t tokens;               // per layer
  int first_layer;
  int num_layers;
  int32_t* row_length;
  const DeviceStatus* status;
  Extents ext = {};  // read by runtime-sized traits only
  IndexChecks checks = {};  // the targets' bounds, run by the operation before it writes
};

// A token's targets, copied beside it into staging: slots (paged), or rows and positions.
struct StagedTargets {
  const int64_t* slots = nullptr;  // [tokens]
  int64_t* slots_stage = nullptr;
  const int32_t* rows = nullptr;  // [tokens]
  int32_t* rows_stage = nullptr;
  const int32_t* positions = nullptr;  // [tokens]
  int32_t* positions_stage = nullptr;
};

template <class In> struct StageArgs {
  Rows3<const In> k_in, v_in;
  In* k_stage;  // [tokens, heads, head_dim], contiguous
  In* v_stage;
  int64_t tokens;
  const DeviceStatus* status;
  Extents ext = {};  // read by runtime-sized traits only
  StagedTargets targets = {};
  IndexChecks checks = {};  // the targets' bounds, run by the operation before it stages anything
};

template <class Store, class In> struct GatherArgs {
  const Store* pool;
  Strides s;
  ScaleRef scales;
  Rows3<In> k, v;  // token_stride: within a head; head_stride: between heads
  int layer;
  int64_t row;
  const int32_t* pages;
  int64_t begin;
  int64_t count;
  const DeviceStatus* status;
  Extents ext = {};  // read by runtime-sized traits only
  IndexChecks checks = {};  // the range's bounds, run by the operation before it reads
};

// Zero positions [0, extent) of one row in every layer: reset_row.
template <class Store> struct ZeroRowArgs {
  Store* pool;
  Strides s;
  ScaleRef scales;
  int64_t row;
  int64_t positions;
  int layers;
  Extents ext = {};  // read by runtime-sized traits only
};

// Reorder, per layer: pack selected rows to scratch [rows, 2, positions, heads, dim], then unpack.
// Quantized layouts carry their scales along through scale_scratch [rows, 2, positions, heads].
template <class Store> struct ReorderArgs {
  Store* pool;
  Strides s;
  ScaleRef scales;
  Store* scratch;
  void* scale_scratch;
  const int32_t* beam;
  int64_t rows;
  int64_t positions;
  int layer;
  int32_t* row_length;
  int32_t* length_scratch;
  const DeviceStatus* status;
  Extents ext = {};  // read by runtime-sized traits only
};

template <class Store> struct CopyPagesArgs {
  Store* pool;
  Strides s;
  ScaleRef scales;
  const int32_t* pairs;  // [n, 2] as (src, dst)
  int64_t count;
  int layers;
  const DeviceStatus* status;
  Extents ext = {};  // read by runtime-sized traits only
};

// Pages of every layer to or from a packed buffer (offload and restore). Packed page i holds codes
// [layers][2][page_size][heads * head_dim], then scales [layers][2][page_size][scales per token].
template <class Store> struct MovePagesArgs {
  Store* pool;
  Strides s;
  ScaleRef scales;
  const int32_t* pages;
  int64_t count;
  int layers;
  unsigned char* packed;
  int64_t packed_page_bytes;
  bool to_packed;
  const DeviceStatus* status;
  Extents ext = {};  // read by runtime-sized traits only
};

}  // namespace kvforge::detail
