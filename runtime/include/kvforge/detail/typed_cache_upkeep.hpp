// TypedCache's page and row upkeep (typed_cache.hpp declares the class): reset, reorder for beams,
// copy_blocks for copy-on-write, and the packed pages of offload.
#pragma once

#include "kvforge/detail/typed_cache.hpp"

namespace kvforge {

template <class Traits> void TypedCache<Traits>::reset() {
  backend_->fill(pool_.data(), 0, pool_.bytes(), config_.stream);
  // Dynamic scales only: per-tensor and second-level scales are the user's calibration, kept.
  if (quant != Quant::per_tensor && scales_.data())
    backend_->fill(scales_.data(), 0, geometry_.scale_elems * int64_t(sizeof(scale_t)), config_.stream);
  if (row_length_.data()) backend_->fill(row_length_.data(), 0, row_length_.bytes(), config_.stream);
}

template <class Traits> void TypedCache<Traits>::reset_row(int64_t row) {
  check_row(row);
  detail::ZeroRowArgs<storage_t> a{pool_.as<storage_t>(), geometry_.strides, scale_ref(), row, capacity_.positions,
                                  layers()};
  a.ext = extents();
  ops_->zero_row(launch(), a);
  backend_->fill(row_length_.as<int32_t>() + row, 0, sizeof(int32_t), config_.stream);
}

template <class Traits> void TypedCache<Traits>::make_reorder_scratch() {
  const int64_t layer_elems = capacity_.rows * 2 * capacity_.positions * heads() * desc().stored_dim();
  reorder_scratch_ = Buffer(*backend_, layer_elems * int64_t(sizeof(storage_t)));
  const int per_token = scales_per_token(quant, heads(), desc().scale_groups());
  if (per_token > 0)
    scale_scratch_ = Buffer(*backend_, capacity_.rows * 2 * capacity_.positions * per_token * int64_t(sizeof(scale_t)));
  length_scratch_ = Buffer(*backend_, capacity_.rows * int64_t(sizeof(int32_t)));
}

template <class Traits> void TypedCache<Traits>::reorder(const IndexView& beam) {
  if (desc().paged())
    throw UnsupportedError(std::string(desc().name) +
                           ": reorder is for contiguous and ring layouts; paged layouts fork by copy_blocks");
  detail::check_index_view("beam", beam, DType::i32, capacity_.rows, config_.device, capacity_.rows);
  check_indices(beam, capacity_.rows, 0, capacity_.rows, false, detail::kCheckBeam);
  if (!reorder_scratch_.data()) make_reorder_scratch();
  detail::ReorderArgs<storage_t> a{pool_.as<storage_t>(),
                                  geometry_.strides,
                                  scale_ref(),
                                  reorder_scratch_.as<storage_t>(),
                                  scale_scratch_.data(),
                                  static_cast<const int32_t*>(beam.data),
                                  capacity_.rows,
                                  capacity_.positions,
                                  0,
                                  row_length_.as<int32_t>(),
                                  length_scratch_.as<int32_t>(),
                                  status()};
  for (int layer = 0; layer < layers(); ++layer) {
    a.layer = layer;
    a.ext = extents();
    ops_->reorder_layer(launch(), a);
  }
  a.ext = extents();
  ops_->reorder_lengths(launch(), a);
}

template <class Traits> void TypedCache<Traits>::copy_blocks(const IndexView& pairs) {
  if (!desc().paged())
    throw UnsupportedError(std::string(desc().name) + ": copy_blocks is for paged layouts");
  if (pairs.size % 2 != 0)
    throw ShapeError("pairs", "holds (src, dst) pairs, so its size must be even, got " + std::to_string(pairs.size));
  detail::check_index_view("pairs", pairs, DType::i32, pairs.size, config_.device);
  if (pairs.size == 0) return;
  check_indices(pairs, pairs.size, 0, capacity_.pages, false, detail::kCheckBlockPairs);
  if (on_cpu()) detail::check_pairs_disjoint_on_host(static_cast<const int32_t*>(pairs.data), pairs.size / 2);
  detail::CopyPagesArgs<storage_t> a{pool_.as<storage_t>(), geometry_.strides, scale_ref(),
                                    static_cast<const int32_t*>(pairs.data), pairs.size / 2, layers(), status()};
  a.ext = extents();
  ops_->copy_pages(launch_pool_writes(), a);
}

template <class Traits> int64_t TypedCache<Traits>::packed_page_bytes() const {
  return desc().paged() ? detail::packed_page_bytes(desc()) : 0;
}

template <class Traits> void TypedCache<Traits>::move_pages(const IndexView& pages, void* packed, bool to_packed) {
  if (!desc().paged())
    throw UnsupportedError(std::string(desc().name) + ": pack_pages and unpack_pages are for paged layouts");
  detail::check_index_view("pages", pages, DType::i32, pages.size, config_.device);
  if (pages.size == 0) return;
  if (!packed) throw ArgumentError("packed", "data is null");
  check_indices(pages, pages.size, 0, capacity_.pages, false, detail::kCheckPageList);
  detail::MovePagesArgs<storage_t> a{pool_.as<storage_t>(), geometry_.strides, scale_ref(),
                                    static_cast<const int32_t*>(pages.data), pages.size, layers(),
                                    static_cast<unsigned char*>(packed), packed_page_bytes(), to_packed, status()};
  a.ext = extents();
  ops_->move_pages(launch(), a);
}

template <class Traits> void TypedCache<Traits>::pack_pages(const IndexView& pages, void* packed) {
  move_pages(pages, packed, true);
}

template <class Traits> void TypedCache<Traits>::unpack_pages(const void* packed, const IndexView& pages) {
  move_pages(pages, const_cast<void*>(packed), false);
}

}  // namespace kvforge
