#include "kvforge/layout.hpp"

namespace kvforge {

Geometry make_geometry(const VariantDescriptor& d, const Capacity& c) {
  Geometry g;
  const int64_t extents[kNumAxes] = {d.layers, c.rows, c.positions, c.pages, d.page_size, 2, d.heads, d.head_dim};
  for (int i = 0; i < d.num_axes; ++i) g.extent[int(d.axes[i])] = extents[int(d.axes[i])];
  // Row-major over the declared order: the last axis moves fastest.
  int64_t stride = 1;
  for (int i = d.num_axes - 1; i >= 0; --i) {
    g.axis_stride[int(d.axes[i])] = stride;
    stride *= extents[int(d.axes[i])];
  }
  g.tensor_elems = stride;
  const bool stacked = d.has_axis(Axis::layer);
  const bool fused = d.has_axis(Axis::kv);
  g.tensors = (stacked ? 1 : d.layers) * (fused ? 1 : 2);
  g.total_elems = g.tensor_elems * g.tensors;
  // Separate tensors sit back to back in the pool: per layer, K then V.
  g.strides.kv = fused ? g.axis_stride[int(Axis::kv)] : g.tensor_elems;
  if (stacked) {
    g.strides.layer = g.axis_stride[int(Axis::layer)];
    if (!fused) g.strides.kv = g.tensor_elems;
  } else {
    g.strides.layer = g.tensor_elems * (fused ? 1 : 2);
  }
  const bool paged = d.addressing == Addressing::paged;
  g.strides.row_or_page = g.axis_stride[int(paged ? Axis::page : Axis::row)];
  g.strides.seq_or_slot = g.axis_stride[int(paged ? Axis::slot : Axis::seq)];
  g.strides.head = g.axis_stride[int(Axis::head)];
  return g;
}

}  // namespace kvforge
