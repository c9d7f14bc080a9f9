// TypedCache<Traits>: the one implementation of the cache contract, specialized by a generated traits
// struct. It checks every argument on the host before anything is written, then runs the operation
// through the OpTable of its device (op_table.hpp), which that backend's instantiation file filled.
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

  // Generated traits carry everything as constants; runtime-sized traits (RuntimeTraits, runtime/src/generic.cpp) are
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

template <class Traits>
void TypedCache<Traits>::append(int layer, const TensorView& k, const TensorView& v, const TokenTargets& targets) {
  detail::check_layer(layer, layers());
  const int64_t tokens = k.shape[0];
  detail::check_tensor("k", k, {tokens, heads(), head_dim()}, dtype_of<input_t>::value, config_.device);
  detail::check_tensor("v", v, {tokens, heads(), head_dim()}, dtype_of<input_t>::value, config_.device);
  detail::check_targets_addressing(targets, addressing == Addressing::paged, tokens);
  if constexpr (addressing == Addressing::paged) {
    detail::check_index_view("targets.slots", targets.slots, DType::i64, tokens, config_.device, tokens);
  } else {
    detail::check_index_view("targets.rows", targets.rows, DType::i32, tokens, config_.device, tokens);
    detail::check_index_view("targets.positions", targets.positions, DType::i32, tokens, config_.device, tokens);
  }
  if constexpr (lazy) {
    if (staged_[layer] + tokens > staged_capacity_)
      throw OutOfRangeError("k.shape[0]", tokens, 0, staged_capacity_ - staged_[layer] + 1, -1,
                            "layer " + std::to_string(layer) + " already holds " + std::to_string(staged_[layer]) +
                                " of max_staged_tokens=" + std::to_string(staged_capacity_) +
                                " staged tokens; commit() first");
  }
  if (tokens == 0) return;
  detail::IndexChecks checks;
  if constexpr (addressing == Addressing::paged) {
    checks.add(index_check(targets.slots, tokens, 0, capacity_.pages * page_size(), true, detail::kCheckSlots));
  } else {
    checks.add(index_check(targets.rows, tokens, 0, capacity_.rows, true, detail::kCheckRows));
    // A ring's row length (int32) is its highest position + 1, so that position stays below INT32_MAX.
    const int64_t max_position = addressing == Addressing::ring ? INT32_MAX : capacity_.positions;
    checks.add(index_check(targets.positions, tokens, 0, max_position, true, detail::kCheckPositions));
  }

  if constexpr (lazy) {
    // One operation stages the tokens and their targets, after the targets' checks.
    const int64_t first = int64_t(layer) * staged_capacity_ + staged_[layer];
    const int64_t row_elems = int64_t(heads()) * head_dim();
    detail::StageArgs<input_t> s{detail::rows3<const input_t>(k), detail::rows3<const input_t>(v),
                                 stage_k_.as<input_t>() + first * row_elems,
                                 stage_v_.as<input_t>() + first * row_elems, tokens, status()};
    s.ext = extents();
    if constexpr (addressing == Addressing::paged) {
      s.targets = {static_cast<const int64_t*>(targets.slots.data), staged_slots() + first};
    } else {
      s.targets = {nullptr, nullptr, static_cast<const int32_t*>(targets.rows.data), staged_rows() + first,
                   static_cast<const int32_t*>(targets.positions.data), staged_positions() + first};
    }
    s.checks = checks;
    ops_->stage(launch(), s);
    staged_[layer] += tokens;
  } else {
    detail::WriteArgs<storage_t, input_t> a = write_args();
    a.k = detail::rows3<const input_t>(k);
    a.v = detail::rows3<const input_t>(v);
    a.rows = static_cast<const int32_t*>(targets.rows.data);
    a.positions = static_cast<const int32_t*>(targets.positions.data);
    a.slots = static_cast<const int64_t*>(targets.slots.data);
    a.tokens = tokens;
    a.first_layer = layer;
    a.num_layers = 1;
    a.checks = checks;
    ops_->write(launch_pool_writes(), a);
  }
}

template <class Traits> void TypedCache<Traits>::commit() {
  if constexpr (lazy) {
    // One launch covers every layer, over as many tokens as the fullest layer staged: entries past a
    // layer's own count hold target -1 and are skipped. The shape follows the step's token counts, as
    // an append's does, so a captured step replays with the same one. A decode step then skips the
    // padding of a staging sized for prefills (on an H200 the whole step did not change measurably:
    // bench/RESULTS.md, section 6).
    const int64_t staged = *std::max_element(staged_.begin(), staged_.end());
    if (staged == 0) return;
    const int64_t row_elems = int64_t(heads()) * head_dim();
    detail::WriteArgs<storage_t, input_t> a = write_args();
    a.k = {stage_k_.as<const input_t>(), row_elems, head_dim()};
    a.v = {stage_v_.as<const input_t>(), row_elems, head_dim()};
    a.input_layer_stride = staged_capacity_ * row_elems;
    if constexpr (addressing == Addressing::paged) {
      a.slots = staged_slots();
    } else {
      a.rows = staged_rows();
      a.positions = staged_positions();
    }
    a.target_layer_stride = staged_capacity_;
    a.tokens = staged;
    a.first_layer = 0;
    a.num_layers = layers();
    ops_->write(launch_pool_writes(), a);
    backend_->fill(stage_targets_.data(), 0xff, stage_targets_.bytes(), config_.stream);
    std::fill(staged_.begin(), staged_.end(), 0);
  }
}

template <class Traits>
void TypedCache<Traits>::gather(int layer, const GatherRange& range, const TensorView& k_out,
                                const TensorView& v_out) {
  detail::check_layer(layer, layers());
  if (range.begin < 0) throw OutOfRangeError("range.begin", range.begin, 0, INT64_MAX);
  if (range.end < range.begin) throw OutOfRangeError("range.end", range.end, range.begin, INT64_MAX);
  const int64_t count = range.end - range.begin;
  detail::check_tensor("k_out", k_out, {heads(), count, head_dim()}, dtype_of<input_t>::value, config_.device);
  detail::check_tensor("v_out", v_out, {heads(), count, head_dim()}, dtype_of<input_t>::value, config_.device);
  detail::IndexChecks checks;  // run by the gather itself, or below where it reads nothing
  if constexpr (addressing == Addressing::paged) {
    const int64_t pages_needed = (range.end + page_size() - 1) / page_size();
    detail::check_index_view("range.pages", range.pages, DType::i32, pages_needed, config_.device);
    if (count > 0) {
      // Only the pages the range touches must be valid: a sliding-window sequence's earlier entries
      // are -1 once their pages are freed.
      const int64_t first = range.begin / page_size();
      IndexView touched = range.pages;
      touched.data = static_cast<const int32_t*>(range.pages.data) + first;
      touched.size = pages_needed - first;
      checks.add(index_check(touched, touched.size, 0, capacity_.pages, false, detail::kCheckPages));
    }
  } else {
    check_row(range.row);
    if constexpr (addressing == Addressing::ring) {
      if (!on_cpu()) {
        // On the device, against the row's length where it lives: reading it back would synchronize,
        // and a captured graph could not hold the gather. The length must lie in [end, begin + window].
        const IndexView length{row_length_.as<int32_t>() + range.row, DType::i32, config_.device, 1};
        checks.add(index_check(length, 1, range.end, count > 0 ? range.begin + window() + 1 : INT64_MAX, false,
                               detail::kCheckRingLength));
      } else {
        const int64_t length = row_length(range.row);
        const int64_t oldest = std::max<int64_t>(0, length - window());
        if (range.begin > length)  // no end would do: name the begin
          throw OutOfRangeError("range.begin", range.begin, 0, length + 1, -1,
                                "row " + std::to_string(range.row) + " holds positions below " + std::to_string(length));
        if (range.end > length)
          throw OutOfRangeError("range.end", range.end, range.begin, length + 1, -1,
                                "row " + std::to_string(range.row) + " holds positions below " + std::to_string(length));
        if (count > 0 && range.begin < oldest)
          throw OutOfRangeError("range.begin", range.begin, oldest, length, -1,
                                "positions before " + std::to_string(oldest) + " have left the ring's window of " +
                                    std::to_string(window()));
      }
    } else {
      if (range.begin > capacity_.positions)  // no end would do: name the begin
        throw OutOfRangeError("range.begin", range.begin, 0, capacity_.positions + 1, -1,
                              "the cache holds max_seq_len=" + std::to_string(capacity_.positions) + " positions per row");
      if (range.end > capacity_.positions)
        throw OutOfRangeError("range.end", range.end, range.begin, capacity_.positions + 1, -1,
                              "the cache holds max_seq_len=" + std::to_string(capacity_.positions) + " positions per row");
    }
  }
  if (count == 0) {
    check_indices(checks);
    return;
  }
  detail::GatherArgs<storage_t, input_t> a{};
  a.pool = pool_.as<const storage_t>();
  a.s = geometry_.strides;
  a.scales = scale_ref();
  a.k = {static_cast<input_t*>(k_out.data), k_out.stride[1], k_out.stride[0]};  // [heads, tokens, head_dim]
  a.v = {static_cast<input_t*>(v_out.data), v_out.stride[1], v_out.stride[0]};
  a.layer = layer;
  a.row = range.row;
  a.pages = static_cast<const int32_t*>(range.pages.data);
  a.begin = range.begin;
  a.count = count;
  a.status = status();
  a.ext = extents();
  a.checks = checks;
  ops_->gather(launch(), a);
}

}  // namespace kvforge

#include "kvforge/detail/cache_upkeep.hpp"  // reset, reorder, copy_blocks, pack and unpack

namespace kvforge {

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
  m.bookkeeping_bytes = row_length_.bytes() + status_.bytes() + reorder_scratch_.bytes() + scale_scratch_.bytes() +
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
