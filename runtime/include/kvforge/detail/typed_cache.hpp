// TypedCache<Traits>: the one implementation of the cache contract, specialized by a generated traits
// struct. It checks every argument on the host before anything is written, then runs the operation
// through the OpTable of its device (op_table.hpp), which that backend's instantiation file filled.
// This file: the class, its memory and its facts (view, scales, row lengths, status, tuning). Its
// operations by job: typed_cache_writes.hpp (append, commit), typed_cache_gather.hpp,
// typed_cache_upkeep.hpp (rows and pages); cache_impl.hpp is all of them.
#pragma once

#include <algorithm>
#include <cmath>
#include <array>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "kvforge/backend.hpp"
#include "kvforge/cache.hpp"
#include "kvforge/cpu_level.hpp"
#include "kvforge/detail/checks.hpp"
#include "kvforge/detail/op_table.hpp"
#include "kvforge/detail/ops.hpp"

namespace kvforge {

namespace detail {
template <class T> Rows3<T> rows3(const TensorView& t) {
  return Rows3<T>{static_cast<T*>(t.data), t.stride[0], t.stride[1]};
}
}  // namespace detail

template <class Traits> class TypedCache final : public Cache {
 public:
  using storage_t = typename Traits::storage_t;
  using input_t = typename Traits::input_t;
  using scale_t = typename Traits::scale_t;
  static constexpr Quant quant = Traits::quant;
  static constexpr Addressing addressing = Traits::addressing;
  static constexpr bool lazy = Traits::update == UpdateMode::lazy;
  static constexpr bool runtime_sized = detail::has_runtime_extents<Traits>::value;

  // Generated traits carry everything as constants; runtime-sized traits (RuntimeTraits, runtime/src/caches/generic.cpp) are
  // passed in with their descriptor and sizes.
  explicit TypedCache(const CacheConfig& config, Traits traits = {});

  KVFORGE_CACHE_OPS(KVFORGE_CACHE_OP_OVERRIDE)

  // Sizes: compile-time constants for generated traits (desc() is then a constexpr object).
  int layers() const { return desc().layers; }
  int heads() const { return desc().heads; }
  int head_dim() const { return desc().head_dim; }
  int page_size() const { return desc().page_size; }
  int window() const { return desc().window; }
  // Typed convenience: k and v are [tokens, heads, head_dim] contiguous on the cache's device.
  void append(int layer, const input_t* k, const input_t* v, int64_t tokens, const TokenTargets& targets) {
    append(layer, TensorView::contiguous(const_cast<input_t*>(k), dtype_of<input_t>::value, config_.device, tokens,
                                         heads(), head_dim()),
           TensorView::contiguous(const_cast<input_t*>(v), dtype_of<input_t>::value, config_.device, tokens, heads(),
                                  head_dim()),
           targets);
  }

 private:
  const VariantDescriptor& desc() const {
    if constexpr (runtime_sized) {
      return traits_.descriptor();
    } else {
      return descriptor_of<Traits>;
    }
  }
  detail::Extents extents() const { return {heads(), head_dim(), page_size(), window()}; }
  bool on_cpu() const { return config_.device == Device::cpu; }
  detail::Launch launch() const { return detail::Launch{config_.stream, tuning_}; }
  // For the operations that write the pool: past the caches where the pool dwarfs them.
  detail::Launch launch_pool_writes() const { return detail::Launch{config_.stream, tuning_, pool_dwarfs_cache_}; }
  detail::IndexCheckArgs index_check(const IndexView& v, int64_t count, int64_t lo, int64_t hi, bool allow_padding,
                                     int32_t code) const;
  // Runs checks on their own, for operations that do not take them into their launch.
  void check_indices(const detail::IndexChecks& checks);
  void check_indices(const IndexView& v, int64_t count, int64_t lo, int64_t hi, bool allow_padding,
                     int32_t code);
  void check_row(int64_t row) const;
  void move_pages(const IndexView& pages, void* packed, bool to_packed);
  void make_reorder_scratch();
  detail::DeviceStatus* status() const { return status_.as<detail::DeviceStatus>(); }
  detail::ScaleRef scale_ref() const;
  // A write's pool side (pool, strides, scales, row lengths, status, extents); append and commit fill
  // in its tokens and targets by name.
  detail::WriteArgs<storage_t, input_t> write_args();

  Traits traits_;  // empty for generated traits
  CacheConfig config_;
  const detail::OpTable<Traits>* ops_;  // the operations of the config's device
  Tuning tuning_ = desc().tuning;
  Capacity capacity_;
  Geometry geometry_;
  bool pool_dwarfs_cache_ = false;  // cpu_streams_pool(): a CPU pool far larger than the caches
  Backend* backend_;
  Buffer pool_;
  // Separate dynamic scales, or the per-tensor scales; a tensor-scaled layout's second-level scales,
  // [layers, 2] fp32, follow its group scales at tensor_scale_offset().
  Buffer scales_;
  int64_t tensor_scale_offset() const {
    return (geometry_.scale_elems * int64_t(sizeof(scale_t)) + int64_t(alignof(float)) - 1) / int64_t(alignof(float)) *
           int64_t(alignof(float));
  }
  float* tensor_scales() const {
    return desc().tensor_scaled ? reinterpret_cast<float*>(static_cast<char*>(scales_.data()) + tensor_scale_offset())
                                : nullptr;
  }
  Buffer row_length_;  // int32 per row: contiguous and ring
  Buffer status_;
  // Lazy staging: [layers, staged, heads, dim] K and V in the input dtype, and their targets.
  int64_t staged_capacity_ = 0;
  // Staged targets, -1 where nothing is staged: slots (paged), or rows then positions, in one buffer so
  // that a commit resets them all with one fill.
  Buffer stage_k_, stage_v_, stage_targets_;
  int64_t* staged_slots() const { return stage_targets_.as<int64_t>(); }
  int32_t* staged_rows() const { return stage_targets_.as<int32_t>(); }
  int32_t* staged_positions() const { return stage_targets_.as<int32_t>() + int64_t(layers()) * staged_capacity_; }
  std::vector<int64_t> staged_;
  // Reorder scratch, allocated on first use: one layer's rows.
  Buffer reorder_scratch_, scale_scratch_, length_scratch_;
  Buffer attend_partial_;  // attend's split partials (typed_cache_attend.hpp), grown as a launch needs
};


template <class Traits>
TypedCache<Traits>::TypedCache(const CacheConfig& config, Traits traits) : traits_(std::move(traits)), config_(config) {
  const VariantDescriptor& d = desc();
  detail::check_config(d, config_);
  ops_ = Traits::op_tables()[size_t(config_.device)];
  if (!ops_)
    throw BackendError(std::string(d.name) + ": this build has no " + name_of(config_.device) +
                       " kernels for this variant");
  backend_ = &backend(config_.device);
  if (d.addressing == Addressing::contiguous && config_.max_seq_len == 0) config_.max_seq_len = d.max_seq_len;
  capacity_ = detail::capacity_of(d, config_);
  geometry_ = make_geometry(d, capacity_);
  pool_ = Buffer(*backend_, geometry_.total_elems * int64_t(sizeof(storage_t)));
  pool_dwarfs_cache_ = on_cpu() && cpu_streams_pool(geometry_.total_elems * int64_t(sizeof(storage_t)));
  if (geometry_.scale_elems > 0) {
    const int64_t tensor_bytes = d.tensor_scaled ? int64_t(2) * layers() * int64_t(sizeof(float)) : 0;
    scales_ = Buffer(*backend_, (tensor_bytes ? tensor_scale_offset() : geometry_.scale_elems * int64_t(sizeof(scale_t))) +
                                    tensor_bytes);
    if constexpr (quant == Quant::per_tensor) {
      // Until calibrated scales are set, a scale of 1 stores values as they are (saturating).
      const std::vector<scale_t> ones(size_t(geometry_.scale_elems), detail::store_scale<scale_t>(1.0f));
      backend_->from_host(scales_.data(), ones.data(), scales_.bytes(), config_.stream);
    }
    if (tensor_bytes) {
      // Until calibrated scales are set, the group scales alone scale the codes.
      const std::vector<float> ones(size_t(2 * layers()), 1.0f);
      backend_->from_host(tensor_scales(), ones.data(), tensor_bytes, config_.stream);
    }
  }
  if (!d.paged()) row_length_ = Buffer(*backend_, capacity_.rows * int64_t(sizeof(int32_t)));
  // On CUDA a reorder may be captured in a graph, where nothing may allocate: its scratch (one layer
  // of rows) comes now. The CPU allocates it at the first reorder. Either way memory() reports it.
  if (!d.paged() && !on_cpu()) make_reorder_scratch();
  status_ = Buffer(*backend_, sizeof(detail::DeviceStatus));
  if constexpr (lazy) {
    staged_capacity_ = detail::staged_capacity(desc(), config_);
    const int64_t tokens = int64_t(layers()) * staged_capacity_;
    stage_k_ = Buffer(*backend_, tokens * heads() * head_dim() * int64_t(sizeof(input_t)));
    stage_v_ = Buffer(*backend_, tokens * heads() * head_dim() * int64_t(sizeof(input_t)));
    stage_targets_ = Buffer(*backend_, tokens * int64_t(d.paged() ? sizeof(int64_t) : 2 * sizeof(int32_t)));
    backend_->fill(stage_targets_.data(), 0xff, stage_targets_.bytes(), config_.stream);
    staged_.assign(layers(), 0);
  }
}

template <class Traits>
detail::IndexCheckArgs TypedCache<Traits>::index_check(const IndexView& v, int64_t count, int64_t lo, int64_t hi,
                                                       bool allow_padding, int32_t code) const {
  return detail::IndexCheckArgs{v.data, v.dtype == DType::i64, count, lo, hi, allow_padding, code, status()};
}

template <class Traits> void TypedCache<Traits>::check_indices(const detail::IndexChecks& checks) {
  ops_->check_indices(launch(), checks);
}

template <class Traits>
void TypedCache<Traits>::check_indices(const IndexView& v, int64_t count, int64_t lo, int64_t hi,
                                       bool allow_padding, int32_t code) {
  check_indices(detail::IndexChecks{{index_check(v, count, lo, hi, allow_padding, code)}, 1});
}

template <class Traits> detail::ScaleRef TypedCache<Traits>::scale_ref() const {
  void* base = desc().scales_in_page()
                   ? static_cast<void*>(static_cast<char*>(const_cast<void*>(pool_.data())) + geometry_.scale_offset_bytes)
                   : const_cast<void*>(scales_.data());
  return {base, geometry_.scale_strides, tensor_scales()};
}

template <class Traits> detail::WriteArgs<typename Traits::storage_t, typename Traits::input_t> TypedCache<Traits>::write_args() {
  detail::WriteArgs<storage_t, input_t> a{};
  a.pool = pool_.as<storage_t>();
  a.s = geometry_.strides;
  a.scales = scale_ref();
  a.row_length = row_length_.as<int32_t>();
  a.status = status();
  a.ext = extents();
  return a;
}

template <class Traits> void TypedCache<Traits>::check_row(int64_t row) const {
  if (desc().paged())
    throw UnsupportedError(std::string(desc().name) + ": paged layouts have no rows");
  if (row < 0 || row >= capacity_.rows) throw OutOfRangeError("row", row, 0, capacity_.rows);
}

template <class Traits> LayerView TypedCache<Traits>::view(int layer) const {
  detail::check_layer(layer, layers());
  const storage_t* base = pool_.as<const storage_t>() + geometry_.strides.layer * layer;
  LayerView v;
  v.k = base;
  v.v = base + geometry_.strides.kv;
  v.dtype = dtype_of<storage_t>::value;
  v.device = config_.device;
  if constexpr (quant != Quant::none) {
    const detail::ScaleRef r = scale_ref();
    const scale_t* scales = static_cast<const scale_t*>(r.base) + r.s.layer * layer;
    v.quant = quant;
    v.k_scales = scales;
    v.v_scales = scales + r.s.kv;
    v.scale_dtype = dtype_of<scale_t>::value;
    v.scale_strides = r.s;
    v.scale_groups = desc().scale_groups();
    if (r.tensor) v.tensor_scales = r.tensor + 2 * layer;
  }
  v.strides = geometry_.strides;
  v.rows_or_pages = desc().paged() ? capacity_.pages : capacity_.rows;
  v.seq_or_slots = desc().paged() ? page_size() : capacity_.positions;
  v.heads = heads();
  v.head_dim = head_dim();
  v.stored_dim = desc().stored_dim();
  return v;
}

template <class Traits> void TypedCache<Traits>::set_tensor_scale(int layer, float k_scale, float v_scale) {
  if (!desc().takes_tensor_scale())
    throw UnsupportedError(std::string(desc().name) + ": set_tensor_scale is for per_tensor quantized and "
                           "tensor-scaled per_group layouts; this one is " + name_of(quant));
  detail::check_layer(layer, layers());
  const float given[2] = {k_scale, v_scale};
  const char* names[2] = {"k_scale", "v_scale"};
  for (int kv = 0; kv < 2; ++kv)
    if (!(given[kv] > 0.0f && std::isfinite(given[kv])))
      throw ArgumentError(names[kv], "must be finite and positive, got " + std::to_string(given[kv]));
  if constexpr (quant == Quant::per_tensor) {
    const scale_t stored[2] = {detail::store_scale<scale_t>(k_scale), detail::store_scale<scale_t>(v_scale)};
    backend_->from_host(scales_.as<scale_t>() + geometry_.scale_strides.layer * layer, stored, sizeof(stored),
                        config_.stream);
  } else {
    // The group scales already stored stay as they are: tokens written before take the new scale too.
    backend_->from_host(tensor_scales() + 2 * layer, given, sizeof(given), config_.stream);
  }
}

template <class Traits> int64_t TypedCache<Traits>::row_length(int64_t row) const {
  check_row(row);
  int32_t length = 0;
  backend_->to_host(&length, row_length_.as<int32_t>() + row, sizeof(length), config_.stream);
  return length;
}

template <class Traits> void TypedCache<Traits>::synchronize() {
  backend_->synchronize(config_.stream);
  if (!on_cpu()) {
    detail::DeviceStatus s{};
    backend_->to_host(&s, status(), sizeof(s), config_.stream);
    if (s.code != 0) {
      backend_->fill(status(), 0, sizeof(s), config_.stream);
      detail::raise_status(s);
    }
  }
}

template <class Traits> MemoryReport TypedCache<Traits>::memory() const {
  MemoryReport m;
  m.storage_bytes = pool_.bytes() + scales_.bytes();
  m.scale_bytes = scales_.bytes();
  if (desc().scales_in_page())
    m.scale_bytes += pool_.bytes() / geometry_.page_block_bytes * (geometry_.page_block_bytes - geometry_.scale_offset_bytes);
  m.staging_bytes = stage_k_.bytes() + stage_v_.bytes() + stage_targets_.bytes();
  m.bookkeeping_bytes = row_length_.bytes() + status_.bytes() + reorder_scratch_.bytes() + scale_scratch_.bytes() + attend_partial_.bytes() +
                        length_scratch_.bytes();
  return m;
}

template <class Traits> const VariantDescriptor& TypedCache<Traits>::descriptor() const { return desc(); }
template <class Traits> const CacheConfig& TypedCache<Traits>::config() const { return config_; }
template <class Traits> const Geometry& TypedCache<Traits>::geometry() const { return geometry_; }
template <class Traits> void TypedCache<Traits>::set_stream(void* stream) { config_.stream = stream; }
template <class Traits> Tuning TypedCache<Traits>::tuning() const { return tuning_; }
template <class Traits> void TypedCache<Traits>::set_tuning(const Tuning& t) {
  detail::check_tuning(t);
  tuning_ = t;
}
template <class Traits> const void* TypedCache<Traits>::storage() const { return pool_.data(); }
template <class Traits> const void* TypedCache<Traits>::scale_storage() const { return scales_.data(); }
template <class Traits> const float* TypedCache<Traits>::tensor_scale_storage() const { return tensor_scales(); }

template <class Traits> std::unique_ptr<Cache> make_cache(const CacheConfig& config) {
  return std::make_unique<TypedCache<Traits>>(config);
}

}  // namespace kvforge
