// The physical geometry of a cache: a layout is a shape and a stride, as in CuTe. make_geometry is the
// one place that turns a variant's axes and capacity into element strides.
#pragma once

#include <cstdint>

#include "kvforge/detail/qualifiers.hpp"
#include "kvforge/descriptor.hpp"

namespace kvforge {

// Capacity chosen at construction: how many rows and positions, or how many pages.
struct Capacity {
  int64_t rows = 0;       // contiguous and ring
  int64_t positions = 0;  // contiguous: per row; ring: the window
  int64_t pages = 0;      // paged
};

// Strides in elements of the storage pool for the five coordinates a token row needs. For a layout
// without a `layer` or `kv` axis, the pool holds one tensor per layer (and per K/V) back to back, and
// the stride steps from one tensor to the next, so addressing is uniform.
struct Strides {
  int64_t layer = 0;
  int64_t kv = 0;
  int64_t row_or_page = 0;
  int64_t seq_or_slot = 0;
  int64_t head = 0;
};

// The one address formula: where (layer, K or V, row or page, position or slot) starts, in elements of
// the pool (or, with scale strides, of the scales). Every operation addresses through it.
KVF_HD KVF_INLINE int64_t element_offset(const Strides& s, int64_t layer, int64_t kv, int64_t row_or_page,
                                         int64_t seq_or_slot) {
  return layer * s.layer + kv * s.kv + row_or_page * s.row_or_page + seq_or_slot * s.seq_or_slot;
}

// Scales of a quantized layout use the same five coordinates; the strides of coordinates a scale does
// not vary over are 0 (head for per_token; all but layer and kv for per_tensor).
struct Geometry {
  int64_t axis_stride[kNumAxes] = {};
  Strides strides;
  int64_t tensor_elems = 0;  // elements of one physical tensor (with its in-page scales)
  int tensors = 0;           // physical tensors in the pool: (stacked ? 1 : layers) * (kv_fused ? 1 : 2)
  int64_t total_elems = 0;   // elements of the storage pool
  // Quantized layouts only. Scale strides are in scale elements from the scale base, which is the
  // separate scale buffer, or the pool plus `scale_offset_bytes` when scales live in each page.
  Strides scale_strides;
  int64_t scale_elems = 0;         // size of the separate scale buffer (0 for in-page scales)
  int64_t scale_offset_bytes = 0;  // in-page: where page 0's scales start in the pool
  int64_t page_block_bytes = 0;    // in-page: one page's codes and scales, the page stride in bytes

  KVF_HD int64_t offset(int layer, int kv, int64_t row_or_page, int64_t seq_or_slot, int head) const {
    return element_offset(strides, layer, kv, row_or_page, seq_or_slot) + head * strides.head;
  }
};

Geometry make_geometry(const VariantDescriptor& d, const Capacity& c);

}  // namespace kvforge
