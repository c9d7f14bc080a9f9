// Cache.gather_batch: one layer's positions [begin, end) of a batch of sequences in one call, as a
// transformers Cache reads them each forward (every sequence of a batch holds the same length). One
// gather a sequence, looped here with the GIL released, not in Python; the kernels read the page table
// where the cache is.
#pragma once

#include <string>
#include <vector>

#include "translate.hpp"

namespace kvforge {
namespace {

// Sequence b's [H, n, D] of a [B, H, n, D] output: the same memory, strided as given.
TensorView batch_member(const ArrayArg& a, DType dtype, Device device, int64_t b) {
  TensorView t;
  t.data = static_cast<char*>(a.data()) + b * a.stride(0) * dtype_size(dtype);
  t.dtype = dtype;
  t.device = device;
  for (int i = 0; i < 3; ++i) {
    t.shape[i] = a.shape(i + 1);
    t.stride[i] = a.stride(i + 1);
  }
  return t;
}

// k_out, v_out: [B, H, end - begin, D] in the cache's input dtype, on its device; rows: B rows of a
// contiguous or ring cache (host integers); page_table: [B, >= ceil(end / P)] int32 on the cache's
// device, row b sequence b's page list (a paged cache's; vLLM's block table, a SequenceManager step's
// "page_table").
void gather_batch(Cache& c, int layer, nb::handle k_out, nb::handle v_out, const std::vector<int64_t>& rows,
                  nb::handle page_table, int64_t begin, int64_t end) {
  const ArrayArg k = array_arg(k_out, "k_out", Access::written), v = array_arg(v_out, "v_out", Access::written);
  for (const auto& [a, name] : {std::pair<const ArrayArg&, const char*>{k, "k_out"}, {v, "v_out"}})
    if (a.t.ndim != 4)
      throw ShapeError(name, "expected [batch, heads, positions, head_dim], got " + std::to_string(a.t.ndim) + " dimensions");
  const int64_t batch = k.shape(0);
  if (v.shape(0) != batch)
    throw ShapeError("v_out", "a batch of " + std::to_string(v.shape(0)) + ", k_out's is " + std::to_string(batch));
  const DType kt = dtype_of_array(k, "k_out"), vt = dtype_of_array(v, "v_out");
  const Device kd = device_of_array(k, "k_out"), vd = device_of_array(v, "v_out");
  std::vector<GatherRange> ranges(static_cast<size_t>(batch));
  if (c.descriptor().paged()) {
    if (page_table.is_none()) throw ArgumentError("page_table", "a paged cache reads each sequence's page list from it");
    const ArrayArg t = array_arg(page_table, "page_table", Access::read);
    if (t.t.ndim != 2 || t.shape(0) != batch)
      throw ShapeError("page_table", "expected [" + std::to_string(batch) + ", pages] (a row a sequence), got " +
                                         std::to_string(t.t.ndim) + " dimensions");
    if (dtype_of_array(t, "page_table") != DType::i32) throw DtypeError("page_table", "must be int32 (allowed: int32)");
    if (t.shape(1) > 1 && t.stride(1) != 1)
      throw ShapeError("page_table", "its rows must be contiguous (stride 1 along pages), got stride " +
                                         std::to_string(t.stride(1)));
    const Device td = device_of_array(t, "page_table");
    for (int64_t b = 0; b < batch; ++b)
      ranges[size_t(b)].pages = IndexView{static_cast<int32_t*>(t.data()) + b * t.stride(0), DType::i32, td, t.shape(1)};
  } else {
    if (int64_t(rows.size()) != batch)
      throw ShapeError("rows", std::to_string(rows.size()) + " rows for a batch of " + std::to_string(batch));
    for (int64_t b = 0; b < batch; ++b) ranges[size_t(b)].row = rows[size_t(b)];
  }
  nb::gil_scoped_release unlocked;
  for (int64_t b = 0; b < batch; ++b) {
    ranges[size_t(b)].begin = begin, ranges[size_t(b)].end = end;
    c.gather(layer, ranges[size_t(b)], batch_member(k, kt, kd, b), batch_member(v, vt, vd, b));
  }
}

}  // namespace
}  // namespace kvforge
