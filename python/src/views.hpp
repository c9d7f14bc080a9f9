// The cache's memory as Python sees it (bindings.cpp's Cache.view, raw_buffers and a descriptor's
// layer groups): DLPack arrays over the pool, in the shapes engines hand their kernels. Internal
// linkage, as translate.hpp's.
#pragma once

#include "translate.hpp"

namespace kvforge {
namespace {

// FlashMLA's fp8 record by its parts, each [.., n] over the record's bytes (FlashMLA's
// kv_cache_format: the latent's R e4m3 codes, then an fp32 scale per 128 of them, then the RoPE part's P
// bf16 values): "latent" (e4m3 codes as bytes), "latent_scales" and "rope". A part is a tensor of its own
// type where the record's stride is a whole number of its elements (R a multiple of 128, P even: every
// FlashMLA record), and absent otherwise.
void flashmla_part_views(const VariantDescriptor& d, const RecordView& r, nb::handle owner, nb::dict& out) {
  const size_t rows = size_t(r.rows_or_pages), slots = size_t(r.seq_or_slots);
  const int64_t R = d.mla_kv_lora_rank, tiles = R / kFlashMlaTile;
  const char* record = static_cast<const char*>(r.record);
  auto part = [&](const char* name, int64_t offset, DType dtype, int64_t values) {
    const int64_t size = dtype_size(dtype);
    if (offset % size || r.strides.row_or_page % size || r.strides.seq_or_slot % size) return;
    out[name] = export_array(record + offset, dtype, r.device, {rows, slots, size_t(values)},
                             {r.strides.row_or_page / size, r.strides.seq_or_slot / size, 1}, owner);
  };
  part("latent", 0, DType::f8e4m3, R);
  part("latent_scales", flashmla_scales_at(int(R)), DType::f32, tiles);
  part("rope", flashmla_rope_at(int(R)), DType::bf16, d.mla_rope_dim);
}

// The record views of a float layout that keeps each head's record whole (kvforge::record_view): "record"
// [.., heads, first + second]; an MLA model's "latent" [.., R] and "rope" [.., P] without the heads axis,
// also named "ckv" and "kpe" (FlashInfer's ckv_cache and kpe_cache; SGLang slices its one buffer so), K
// and V of other widths' "k_part" [.., heads, K] and "v_part" [.., heads, V]. FlashMLA's fp8 records:
// "record", its bytes, and its parts by name (flashmla_part_views).
void record_views(const Cache& cache, int layer, nb::handle owner, nb::dict& out) {
  const std::optional<RecordView> r = record_view(cache, layer);
  if (!r) return;
  const size_t rows = size_t(r->rows_or_pages), slots = size_t(r->seq_or_slots), heads = size_t(r->heads);
  const std::vector<int64_t> strides{r->strides.row_or_page, r->strides.seq_or_slot, r->strides.head, 1};
  const size_t first = size_t(r->first_width), second = size_t(r->second_width);
  out["record"] = export_array(r->record, r->dtype, r->device, {rows, slots, heads, first + second}, strides, owner);
  if (cache.descriptor().flashmla_records()) return flashmla_part_views(cache.descriptor(), *r, owner, out);
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

// A layer of fp8 index keys (indexer_record.hpp), whose K and V rows are no token's bytes: "pages"
// [pages, P * (W + W / 32)] uint8 as SGLang's index buffer (and vLLM's [blocks, P, W + W / 32] tensor,
// flattened), and in it "key" [pages, P, W] uint8 (e4m3 bits) and "key_scales" [pages, P, W / 128] fp32.
void index_key_views(const LayerView& v, nb::handle owner, nb::dict& out) {
  const size_t pages = size_t(v.rows_or_pages), P = size_t(v.seq_or_slots), width = 2 * size_t(v.head_dim);
  const size_t tiles = width / size_t(kIndexerTile), page_bytes = size_t(v.strides.row_or_page);
  out["pages"] = export_array(v.k, DType::indexer_f8, v.device, {pages, page_bytes}, {int64_t(page_bytes), 1}, owner);
  // The key part and its scales, also by their part names ("key", "key_scales").
  for (const char* name : {"key", "codes"})  // an array a name: a DLPack capsule is consumed once
    out[name] = export_array(v.k, DType::indexer_f8, v.device, {pages, P, width}, {int64_t(page_bytes), int64_t(width), 1},
                             owner);
  for (const char* name : {"key_scales", "scales"})
    out[name] = export_array(static_cast<const char*>(v.k) + P * width, DType::f32, v.device, {pages, P, tiles},
                             {int64_t(page_bytes / 4), int64_t(tiles), 1}, owner);
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
  if (cache.descriptor().indexer_records()) {
    index_key_views(v, owner, out);
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
