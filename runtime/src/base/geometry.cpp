#include "kvforge/geometry.hpp"

namespace kvforge {
namespace {

// Row-major strides over axes [begin, end) of the declared order, the last moving fastest, starting
// from `unit`. Axes `skip` names get stride 0 (a scale does not vary over them). Returns the extent
// in elements of the packed range.
int64_t pack(const VariantDescriptor& d, const int64_t* extents, int begin, int end, bool skip_head, bool skip_dim,
             int64_t unit, int64_t* axis_stride) {
  for (int i = end - 1; i >= begin; --i) {
    const Axis a = d.axes[i];
    if ((a == Axis::head && skip_head) || (a == Axis::dim && skip_dim)) {
      axis_stride[int(a)] = 0;
      continue;
    }
    axis_stride[int(a)] = unit;
    unit *= extents[int(a)];
  }
  return unit;
}

// The five coordinate strides of a pool of `tensor` elements per physical tensor. A layout without a
// `layer` or `kv` axis keeps one tensor per layer (and per K/V) back to back, so the stride steps from
// one tensor to the next and addressing stays uniform.
Strides coordinate_strides(const VariantDescriptor& d, const int64_t* axis_stride, int64_t tensor) {
  Strides s;
  const bool fused = d.kv_fused();
  s.kv = fused ? axis_stride[int(Axis::kv)] : tensor;
  s.layer = d.stacked() ? axis_stride[int(Axis::layer)] : tensor * (fused ? 1 : 2);
  s.row_or_page = axis_stride[int(d.paged() ? Axis::page : Axis::row)];
  s.seq_or_slot = axis_stride[int(d.paged() ? Axis::slot : Axis::seq)];
  s.head = axis_stride[int(Axis::head)];
  return s;
}

}  // namespace

Geometry make_geometry(const VariantDescriptor& d, const Capacity& c) {
  Geometry g;
  // `dim` counts stored elements (stored_row): two values each for packed 4-bit codes, half a record's
  // bytes for FlashMLA's.
  const int64_t extents[kNumAxes] = {d.layers,  c.rows, c.positions, c.pages, d.page_size, 2,
                                     d.heads, d.stored_dim()};
  g.tensors = (d.stacked() ? 1 : d.layers) * (d.kv_fused() ? 1 : 2);
  const bool scale_skips_head = d.quant == Quant::per_token;
  // A per_group head's scales run along `dim`, one per group; the other granularities' do not vary
  // over it. `dim` is last, so a head's groups are adjacent (stride 1).
  const bool scale_skips_dim = d.quant != Quant::per_group;
  int64_t scale_extents[kNumAxes];
  for (int a = 0; a < kNumAxes; ++a) scale_extents[a] = extents[a];
  scale_extents[int(Axis::dim)] = d.scale_groups();
  int64_t scale_axis_stride[kNumAxes] = {};

  if (d.scales_in_page()) {
    // Each page is one block: its codes (the axes after `page`), then their scales in the same order.
    int page_at = 0;
    while (d.axes[page_at] != Axis::page) ++page_at;
    const int64_t ss = dtype_size(d.scale);
    const int64_t codes = pack(d, extents, page_at + 1, d.num_axes, false, false, 1, g.axis_stride);
    const int64_t scales =
        pack(d, scale_extents, page_at + 1, d.num_axes, scale_skips_head, scale_skips_dim, 1, scale_axis_stride);
    g.page_block_bytes = codes + scales * ss;
    g.scale_offset_bytes = codes;
    g.tensor_elems = pack(d, extents, 0, page_at + 1, false, false, g.page_block_bytes, g.axis_stride);
    pack(d, extents, 0, page_at + 1, false, false, g.page_block_bytes / ss, scale_axis_stride);
    g.strides = coordinate_strides(d, g.axis_stride, g.tensor_elems);
    g.scale_strides = coordinate_strides(d, scale_axis_stride, g.tensor_elems / ss);
  } else {
    g.tensor_elems = pack(d, extents, 0, d.num_axes, false, false, 1, g.axis_stride);
    g.strides = coordinate_strides(d, g.axis_stride, g.tensor_elems);
    if (d.quant == Quant::per_tensor) {
      g.scale_strides.layer = 2;
      g.scale_strides.kv = 1;
      g.scale_elems = int64_t(d.layers) * 2;
    } else if (d.quantized()) {
      const int64_t scales = pack(d, scale_extents, 0, d.num_axes, scale_skips_head, scale_skips_dim, 1, scale_axis_stride);
      g.scale_strides = coordinate_strides(d, scale_axis_stride, scales);
      g.scale_elems = scales * g.tensors;
    }
  }
  g.total_elems = g.tensor_elems * g.tensors;
  return g;
}

}  // namespace kvforge
