// The cache's memory as Python sees it (bindings.cpp's Cache.view, raw_buffers and a descriptor's
// layer groups): DLPack arrays over the pool, in the shapes engines hand their kernels. Internal
// linkage, as translate.hpp's.
#pragma once

#include "translate.hpp"

namespace kvforge {
namespace {

// One part of a record format and its scales as tensors of their own types over the record's bytes:
// "<part>" [pages or rows, slots or positions, (heads,) width] (fp8 codes as bytes, int8, 4-bit codes as
// bytes of two, [.., width / 2], or the float part's dtype) and "<part>_scales" [.., width / group] (fp32, bf16, or ue8m0 as bytes). `record` is
// the first token's record, `tail` its page-end scales; the strides are in bytes, each a whole number of
// the part's elements (records.py places every part so). The heads axis is left out of a record of one
// head, as FlashMLA's and vLLM's index key views have it.
void part_views(const RecordFormat& f, const char* record, const char* tail, Device device, size_t rows, size_t slots,
                size_t heads, const int64_t (&record_strides)[3], const int64_t (&tail_strides)[2], nb::handle owner,
                nb::dict& out) {
  auto view = [&](const std::string& name, const char* at, DType dtype, size_t width, const int64_t* strides) {
    const int64_t size = dtype_size(dtype);
    std::vector<size_t> shape{rows, slots};
    std::vector<int64_t> in_elements{strides[0] / size, strides[1] / size};
    if (heads > 1) shape.push_back(heads), in_elements.push_back(strides[2] / size);
    shape.push_back(width), in_elements.push_back(1);
    out[name.c_str()] = export_array(at, dtype, device, shape, in_elements, owner);
  };
  for (int i = 0; i < f.num_parts; ++i) {
    const RecordPart& p = f.parts[i];
    view(p.name, record + p.bytes_at, p.dtype, size_t(p.width / dtype_values(p.dtype)), record_strides);
    if (!p.scaled()) continue;
    const std::string scales = std::string(p.name) + "_scales";
    if (p.at_page_end)
      view(scales, tail + p.scales_at, p.scale_dtype, size_t(p.width / p.group), tail_strides);
    else
      view(scales, record + p.scales_at, p.scale_dtype, size_t(p.width / p.group), record_strides);
  }
}

// The record views of a float layout that keeps each head's record whole (kvforge::record_view): "record"
// [.., heads, first + second]; an MLA model's "latent" [.., R] and "rope" [.., P] without the heads axis,
// also named "ckv" and "kpe" (FlashInfer's ckv_cache and kpe_cache; SGLang slices its one buffer so), K
// and V of other widths' "k_part" [.., heads, K] and "v_part" [.., heads, V]. A record format's records
// (FlashMLA's fp8 record, a spec's own): "record", its bytes, and its parts by name (part_views).
void record_views(const Cache& cache, int layer, nb::handle owner, nb::dict& out) {
  const std::optional<RecordView> r = record_view(cache, layer);
  if (!r) return;
  const size_t rows = size_t(r->rows_or_pages), slots = size_t(r->seq_or_slots), heads = size_t(r->heads);
  const std::vector<int64_t> strides{r->strides.row_or_page, r->strides.seq_or_slot, r->strides.head, 1};
  const size_t first = size_t(r->first_width), second = size_t(r->second_width);
  out["record"] = export_array(r->record, r->dtype, r->device, {rows, slots, heads, first + second}, strides, owner);
  if (const RecordFormat* f = cache.descriptor().record_format) {
    const int64_t none[2] = {0, 0};
    return part_views(*f, static_cast<const char*>(r->record), nullptr, r->device, rows, slots, heads,
                      {strides[0], strides[1], strides[2]}, none, owner, out);
  }
  if (cache.descriptor().mla()) {
    const std::vector<int64_t> token{strides[0], strides[1], 1};
    for (const char* name : {"latent", "ckv"})  // an array a name: a DLPack capsule is consumed once
      out[name] = export_array(r->record, r->dtype, r->device, {rows, slots, first}, token, owner);
    for (const char* name : {"rope", "kpe"})
      out[name] = export_array(r->second, r->dtype, r->device, {rows, slots, second}, token, owner);
  } else {
    out["k_part"] = export_array(r->record, r->dtype, r->device, {rows, slots, heads, first}, strides, owner);
    out["v_part"] = export_array(r->second, r->dtype, r->device, {rows, slots, heads, second}, strides, owner);
  }
}

// A layer of a record format whose scales follow each page's records (DeepSeek-V3.2's fp8 index keys),
// so that its K and V rows are no token's bytes: "pages" [pages, page bytes] uint8, as SGLang's index
// buffer (and vLLM's [blocks, P, record + scales] tensor, flattened), and in it each part and its scales
// by name (part_views): an index key's "key" [pages, P, W] (e4m3 bits) and "key_scales" [pages, P,
// W / 128] fp32. A format of one coded part names them "codes" and "scales" too.
void page_end_views(const RecordFormat& f, const LayerView& v, nb::handle owner, nb::dict& out) {
  const size_t pages = size_t(v.rows_or_pages), P = size_t(v.seq_or_slots);
  const int64_t page_bytes = v.strides.row_or_page;
  const char* page = static_cast<const char*>(v.k);
  out["pages"] = export_array(page, DType::record, v.device, {pages, size_t(page_bytes)}, {page_bytes, 1}, owner);
  part_views(f, page, page + int64_t(P) * f.record_bytes, v.device, pages, P, 1, {page_bytes, f.record_bytes, 0},
             {page_bytes, f.tail_bytes}, owner, out);
  if (f.num_parts == 1) {  // an array a name: a DLPack capsule is consumed once, so these are views again
    nb::dict again;
    part_views(f, page, page + int64_t(P) * f.record_bytes, v.device, pages, P, 1, {page_bytes, f.record_bytes, 0},
               {page_bytes, f.tail_bytes}, owner, again);
    out["codes"] = again[f.parts[0].name];
    out["scales"] = again[(std::string(f.parts[0].name) + "_scales").c_str()];
  }
}

nb::dict layer_view(const Cache& cache, int layer, nb::handle owner) {
  const LayerView v = cache.view(layer);
  // The last axis counts stored elements: a byte of two values for packed 4-bit codes, half a record's
  // bytes for FlashMLA's.
  const std::vector<size_t> shape{size_t(v.rows_or_pages), size_t(v.seq_or_slots), size_t(v.heads),
                                  size_t(v.stored_dim)};
  const std::vector<int64_t> strides{v.strides.row_or_page, v.strides.seq_or_slot, v.strides.head, 1};
  nb::dict out;
  out["dtype"] = name(v.dtype);
  if (cache.descriptor().page_end_scales()) {
    page_end_views(*cache.descriptor().record_format, v, owner, out);
    return out;
  }
  out["k"] = export_array(v.k, v.dtype, v.device, shape, strides, owner);
  out["v"] = export_array(v.v, v.dtype, v.device, shape, strides, owner);
  out["quant"] = name_of(v.quant);
  if (v.quant != Quant::none) {
    // [rows or pages, positions or slots, heads], and per_group's [.., groups] (a head's groups adjacent).
    std::vector<size_t> scale_shape{shape[0], shape[1], shape[2]};
    std::vector<int64_t> scale_strides{v.scale_strides.row_or_page, v.scale_strides.seq_or_slot, v.scale_strides.head};
    if (v.quant == Quant::per_group) scale_shape.push_back(size_t(v.scale_groups)), scale_strides.push_back(1);
    const DType scale_dtype = scale_value_dtype(v.scale_dtype);
    if (is_zero_point_scale(v.scale_dtype)) {
      // [.., 2]: each entry's scale, then its zero point, in their dtype (lmdeploy's `k_scales_zeros`).
      for (int64_t& s : scale_strides) s *= 2;
      scale_shape.push_back(2), scale_strides.push_back(1);
    }
    out["k_scales"] = export_array(v.k_scales, scale_dtype, v.device, scale_shape, scale_strides, owner);
    out["v_scales"] = export_array(v.v_scales, scale_dtype, v.device, scale_shape, scale_strides, owner);
    if (v.tensor_scales)  // [2]: K's and V's second-level scale, which every group scale of the layer sits on
      out["tensor_scales"] = export_array(v.tensor_scales, DType::f32, v.device, {2}, {1}, owner);
  }
  record_views(cache, layer, owner, out);
  return out;
}

// The cache's own allocations as flat bytes: the pool, then the separate scale buffer if there is one
// (in-page scales are inside the pool). A hybrid cache lists each group's in turn.
void raw_buffers(const Cache& cache, nb::handle owner, nb::list& out) {
  if (cache.num_groups() > 1) {
    for (int g = 0; g < cache.num_groups(); ++g) raw_buffers(const_cast<Cache&>(cache).group(g), owner, out);
    return;
  }
  const MemoryReport m = cache.memory();
  const bool separate_scales = cache.scale_storage() != nullptr;
  const int64_t pool = m.storage_bytes - (separate_scales ? m.scale_bytes : 0);
  out.append(export_array(cache.storage(), DType::i8, cache.config().device, {size_t(pool)}, {1}, owner));
  if (separate_scales)
    out.append(export_array(cache.scale_storage(), DType::i8, cache.config().device, {size_t(m.scale_bytes)}, {1}, owner));
}

nb::list layer_groups(const VariantDescriptor& d) {
  nb::list groups;
  if (d.hybrid)
    for (int g = 0; g < d.hybrid->num_groups; ++g) {
      const LayerGroupInfo& info = d.hybrid->groups[g];
      nb::dict gi;
      gi["name"] = info.name;
      gi["layers"] = std::vector<int>(info.layers, info.layers + info.num_layers);
      gi["sliding_window"] = info.sliding_window;
      gi["member"] = info.member->name;
      gi["member_layout"] = info.member->layout;
      gi["page_size"] = info.member->page_size;
      gi["heads"] = info.member->heads;
      groups.append(gi);
    }
  return groups;
}

}  // namespace
}  // namespace kvforge
