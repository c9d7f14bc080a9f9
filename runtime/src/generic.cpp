#include "kvforge/generic.hpp"

#include <algorithm>
#include <array>
#include <cstring>
#include <vector>

#include "kvforge/backend.hpp"
#include "kvforge/checks.hpp"

namespace kvforge {

namespace {

bool is_float(DType t) { return t == DType::f32 || t == DType::f16 || t == DType::bf16; }

// The descriptor with its strings owned here, so that a synthesized one can outlive its source.
struct OwnedDescriptor {
  explicit OwnedDescriptor(const VariantDescriptor& d) : name(d.name), layout(d.layout), model(d.model), d(d) {
    this->d.name = name.c_str();
    this->d.layout = layout.c_str();
    this->d.model = model.c_str();
    this->d.generic = true;
  }
  std::string name, layout, model;
  VariantDescriptor d;
};

// Every loop reads its dimensions and strides at run time: nothing is a compile-time constant.
template <class Store, class In> class GenericCache final : public Cache {
 public:
  GenericCache(const VariantDescriptor& d, const CacheConfig& config) : owned_(d), config_(config), tuning_(d.tuning) {
    detail::check_config(owned_.d, config_);
    const VariantDescriptor& v = owned_.d;
    if (v.addressing == Addressing::contiguous && config_.max_seq_len == 0) config_.max_seq_len = v.max_seq_len;
    capacity_ = detail::capacity_of(v, config_);
    geometry_ = make_geometry(v, capacity_);
    pool_ = Buffer(backend(Device::cpu), geometry_.total_elems * int64_t(sizeof(Store)));
    if (!v.paged()) row_length_.assign(size_t(capacity_.rows), 0);
  }

  const VariantDescriptor& descriptor() const override { return owned_.d; }
  const CacheConfig& config() const override { return config_; }
  const Geometry& geometry() const override { return geometry_; }

  void append(int layer, const TensorView& k, const TensorView& v, const TokenTargets& t) override {
    const VariantDescriptor& d = owned_.d;
    detail::check_layer(layer, d.layers);
    const int64_t tokens = k.shape[0];
    detail::check_tensor("k", k, {tokens, d.heads, d.head_dim}, d.input, Device::cpu);
    detail::check_tensor("v", v, {tokens, d.heads, d.head_dim}, d.input, Device::cpu);
    const int32_t* rows = nullptr;
    const int32_t* positions = nullptr;
    const int64_t* slots = nullptr;
    if (d.paged()) {
      detail::check_index_view("targets.slots", t.slots, DType::i64, tokens, Device::cpu, tokens);
      slots = static_cast<const int64_t*>(t.slots.data);
      check_targets(detail::kCheckSlots, slots, tokens, capacity_.pages * d.page_size);
    } else {
      detail::check_index_view("targets.rows", t.rows, DType::i32, tokens, Device::cpu, tokens);
      detail::check_index_view("targets.positions", t.positions, DType::i32, tokens, Device::cpu, tokens);
      rows = static_cast<const int32_t*>(t.rows.data);
      positions = static_cast<const int32_t*>(t.positions.data);
      check_targets(detail::kCheckRows, rows, tokens, capacity_.rows);
      check_targets(detail::kCheckPositions, positions, tokens,
                    d.addressing == Addressing::ring ? INT64_MAX : capacity_.positions);
    }
    if (!d.paged())  // lengths first: a ring skips positions this same append pushes out of its window
      for (int64_t i = 0; i < tokens; ++i)
        if (rows[i] >= 0 && positions[i] >= 0)
          row_length_[size_t(rows[i])] = std::max(row_length_[size_t(rows[i])], positions[i] + 1);
    const Strides& s = geometry_.strides;
    Store* pool = static_cast<Store*>(pool_.data());
    const int H = d.heads, D = d.head_dim, P = d.page_size, W = d.window;
    const bool paged = d.paged(), ring = d.addressing == Addressing::ring;
#pragma omp parallel for schedule(static) if (tokens * H * D * int64_t(sizeof(Store)) >= tuning_.cpu_parallel_bytes)
    for (int64_t i = 0; i < tokens; ++i) {
      int64_t unit, slot;
      if (paged) {
        if (slots[i] < 0) continue;
        unit = slots[i] / P;
        slot = slots[i] % P;
      } else {
        if (rows[i] < 0 || positions[i] < 0) continue;
        if (ring && positions[i] < row_length_[size_t(rows[i])] - W) continue;
        unit = rows[i];
        slot = ring ? positions[i] % W : positions[i];
      }
      const In* src[2] = {static_cast<const In*>(k.data) + i * k.stride[0], static_cast<const In*>(v.data) + i * v.stride[0]};
      const int64_t head_stride[2] = {k.stride[1], v.stride[1]};
      for (int kv = 0; kv < 2; ++kv)
        for (int h = 0; h < H; ++h) {
          Store* dst = pool + element_offset(s, layer, kv, unit, slot) + s.head * h;
          const In* from = src[kv] + h * head_stride[kv];
          for (int x = 0; x < D; ++x) dst[x] = convert<Store>(from[x]);
        }
    }
  }

  void commit() override {}

  void gather(int layer, const GatherRange& range, const TensorView& k_out, const TensorView& v_out) override {
    const VariantDescriptor& d = owned_.d;
    detail::check_layer(layer, d.layers);
    if (range.begin < 0) throw OutOfRangeError("range.begin", range.begin, 0, INT64_MAX);
    if (range.end < range.begin) throw OutOfRangeError("range.end", range.end, range.begin, INT64_MAX);
    const int64_t count = range.end - range.begin;
    detail::check_tensor("k_out", k_out, {d.heads, count, d.head_dim}, d.input, Device::cpu);
    detail::check_tensor("v_out", v_out, {d.heads, count, d.head_dim}, d.input, Device::cpu);
    const int32_t* pages = nullptr;
    if (d.paged()) {
      const int64_t needed = (range.end + d.page_size - 1) / d.page_size;
      detail::check_index_view("range.pages", range.pages, DType::i32, needed, Device::cpu, -1);
      pages = static_cast<const int32_t*>(range.pages.data);
      if (count > 0) {
        const int64_t first = range.begin / d.page_size;
        check_targets(detail::kCheckPages, pages + first, needed - first, capacity_.pages, false);
      }
    } else {
      check_row(range.row);
      const int64_t length = row_length_[size_t(range.row)];
      if (d.addressing == Addressing::ring) {
        if (range.end > length) throw OutOfRangeError("range.end", range.end, range.begin, length + 1);
        const int64_t oldest = std::max<int64_t>(0, length - d.window);
        if (count > 0 && range.begin < oldest) throw OutOfRangeError("range.begin", range.begin, oldest, length);
      } else if (range.end > capacity_.positions) {
        throw OutOfRangeError("range.end", range.end, range.begin, capacity_.positions + 1);
      }
    }
    const Strides& s = geometry_.strides;
    const Store* pool = static_cast<const Store*>(pool_.data());
    const int H = d.heads, D = d.head_dim, P = d.page_size, W = d.window;
    In* out[2] = {static_cast<In*>(k_out.data), static_cast<In*>(v_out.data)};
    const int64_t token_stride[2] = {k_out.stride[1], v_out.stride[1]}, head_stride[2] = {k_out.stride[0], v_out.stride[0]};
#pragma omp parallel for schedule(static) if (count * H * D * int64_t(sizeof(Store)) >= tuning_.cpu_parallel_bytes)
    for (int64_t j = 0; j < count; ++j) {
      const int64_t pos = range.begin + j;
      int64_t unit = range.row, slot = pos;
      if (d.paged()) {
        unit = pages[pos / P];
        slot = pos % P;
      } else if (d.addressing == Addressing::ring) {
        slot = pos % W;
      }
      for (int kv = 0; kv < 2; ++kv)
        for (int h = 0; h < H; ++h) {
          const Store* src = pool + element_offset(s, layer, kv, unit, slot) + s.head * h;
          In* dst = out[kv] + j * token_stride[kv] + h * head_stride[kv];
          for (int x = 0; x < D; ++x) dst[x] = convert<In>(src[x]);
        }
    }
  }

  void reset() override {
    std::memset(pool_.data(), 0, size_t(pool_.bytes()));
    std::fill(row_length_.begin(), row_length_.end(), 0);
  }

  void reset_row(int64_t row) override {
    check_row(row);
    for_each_row_cell(row, [](Store* cell, int D) { std::memset(static_cast<void*>(cell), 0, size_t(D) * sizeof(Store)); });
    row_length_[size_t(row)] = 0;
  }

  void reorder(const IndexView& beam) override {
    const VariantDescriptor& d = owned_.d;
    if (d.paged()) throw UnsupportedError(std::string(d.name) + ": reorder is for contiguous and ring layouts");
    detail::check_index_view("beam", beam, DType::i32, capacity_.rows, Device::cpu, capacity_.rows);
    const int32_t* b = static_cast<const int32_t*>(beam.data);
    check_targets(detail::kCheckBeam, b, capacity_.rows, capacity_.rows, false);
    // Through a copy of the whole pool: simple, and this path is the baseline, not the fast one.
    std::vector<Store> old(static_cast<const Store*>(pool_.data()),
                           static_cast<const Store*>(pool_.data()) + geometry_.total_elems);
    const Strides& s = geometry_.strides;
    for (int64_t r = 0; r < capacity_.rows; ++r)
      for (int l = 0; l < d.layers; ++l)
        for (int kv = 0; kv < 2; ++kv)
          for (int64_t p = 0; p < capacity_.positions; ++p)
            for (int h = 0; h < d.heads; ++h) {
              std::memcpy(static_cast<Store*>(pool_.data()) + element_offset(s, l, kv, r, p) + s.head * h,
                          old.data() + element_offset(s, l, kv, b[r], p) + s.head * h, size_t(d.head_dim) * sizeof(Store));
            }
    std::vector<int32_t> lengths = row_length_;
    for (int64_t r = 0; r < capacity_.rows; ++r) row_length_[size_t(r)] = lengths[size_t(b[r])];
  }

  void copy_blocks(const IndexView& pairs) override {
    const VariantDescriptor& d = owned_.d;
    if (!d.paged()) throw UnsupportedError(std::string(d.name) + ": copy_blocks is for paged layouts");
    if (pairs.size % 2 != 0) throw ShapeError("pairs", "holds (src, dst) pairs, so its size must be even");
    detail::check_index_view("pairs", pairs, DType::i32, pairs.size, Device::cpu, -1);
    const int32_t* p = static_cast<const int32_t*>(pairs.data);
    check_targets(detail::kCheckBlockPairs, p, pairs.size, capacity_.pages, false);
    detail::check_pairs_disjoint_on_host(p, pairs.size / 2);
    const Strides& s = geometry_.strides;
    Store* pool = static_cast<Store*>(pool_.data());
    for (int64_t i = 0; i < pairs.size / 2; ++i)
      for (int l = 0; l < d.layers; ++l)
        for (int kv = 0; kv < 2; ++kv)
          for (int slot = 0; slot < d.page_size; ++slot)
            for (int h = 0; h < d.heads; ++h) {
              std::memcpy(pool + element_offset(s, l, kv, p[2 * i + 1], slot) + s.head * h,
                          pool + element_offset(s, l, kv, p[2 * i], slot) + s.head * h, size_t(d.head_dim) * sizeof(Store));
            }
  }

  LayerView view(int layer) const override {
    detail::check_layer(layer, owned_.d.layers);
    LayerView v;
    v.k = static_cast<const Store*>(pool_.data()) + geometry_.strides.layer * layer;
    v.v = static_cast<const Store*>(v.k) + geometry_.strides.kv;
    v.dtype = owned_.d.storage;
    v.strides = geometry_.strides;
    v.rows_or_pages = owned_.d.paged() ? capacity_.pages : capacity_.rows;
    v.seq_or_slots = owned_.d.paged() ? owned_.d.page_size : capacity_.positions;
    v.heads = owned_.d.heads;
    v.head_dim = owned_.d.head_dim;
    return v;
  }
  int64_t packed_page_bytes() const override { return 0; }
  void pack_pages(const IndexView&, void*) override { unsupported("pack_pages"); }
  void unpack_pages(const void*, const IndexView&) override { unsupported("unpack_pages"); }
  void set_tensor_scale(int, float, float) override { unsupported("set_tensor_scale"); }
  int64_t row_length(int64_t row) const override {
    check_row(row);
    return row_length_[size_t(row)];
  }
  void synchronize() override {}
  MemoryReport memory() const override {
    MemoryReport m;
    m.storage_bytes = pool_.bytes();
    m.bookkeeping_bytes = int64_t(row_length_.size() * sizeof(int32_t));
    return m;
  }
  const void* storage() const override { return pool_.data(); }
  const void* scale_storage() const override { return nullptr; }
  Tuning tuning() const override { return tuning_; }
  void set_tuning(const Tuning& t) override { tuning_ = t; }  // only the threshold is used here

 private:
  [[noreturn]] void unsupported(const char* what) const {
    throw UnsupportedError(std::string(owned_.d.name) + ": " + what + " is not on the generic path; generate the variant");
  }
  void check_row(int64_t row) const {
    if (owned_.d.paged()) throw UnsupportedError(std::string(owned_.d.name) + ": paged layouts have no rows");
    if (row < 0 || row >= capacity_.rows) throw OutOfRangeError("row", row, 0, capacity_.rows);
  }
  // The same host check, and so the same messages, as TypedCache's.
  template <class T> static void check_targets(int32_t code, const T* v, int64_t n, int64_t hi, bool padding = true) {
    detail::check_indices_on_host({v, sizeof(T) == 8, n, 0, hi, padding, code, nullptr});
  }
  template <class Fn> void for_each_row_cell(int64_t row, Fn fn) {
    const Strides& s = geometry_.strides;
    for (int l = 0; l < owned_.d.layers; ++l)
      for (int kv = 0; kv < 2; ++kv)
        for (int64_t p = 0; p < capacity_.positions; ++p)
          for (int h = 0; h < owned_.d.heads; ++h)
            fn(static_cast<Store*>(pool_.data()) + element_offset(s, l, kv, row, p) + s.head * h, owned_.d.head_dim);
  }

  OwnedDescriptor owned_;
  CacheConfig config_;
  Tuning tuning_;
  Capacity capacity_;
  Geometry geometry_;
  Buffer pool_;
  std::vector<int32_t> row_length_;
};

template <class Store> std::unique_ptr<Cache> with_input(const VariantDescriptor& d, const CacheConfig& c) {
  switch (d.input) {
    case DType::f32: return std::make_unique<GenericCache<Store, float>>(d, c);
    case DType::f16: return std::make_unique<GenericCache<Store, fp16>>(d, c);
    default: return std::make_unique<GenericCache<Store, bf16>>(d, c);
  }
}

}  // namespace

std::string generic_unsupported_reason(const VariantDescriptor& d, const CacheConfig& config) {
  if (d.is_hybrid()) return "hybrid layouts are served through their generated members";
  if (d.quantized() || !is_float(d.storage)) return "quantized storage needs a generated variant";
  if (!is_float(d.input)) return "the input dtype must be fp32, fp16 or bf16";
  if (d.update == UpdateMode::lazy) return "lazy staging needs a generated variant";
  if (config.device != Device::cpu) return "the generic path runs on the CPU only";
  return "";
}

std::unique_ptr<Cache> make_generic_cache(const VariantDescriptor& d, const CacheConfig& config) {
  const std::string why = generic_unsupported_reason(d, config);
  if (!why.empty()) throw UnsupportedError(std::string(d.name) + ": no generic path: " + why);
  switch (d.storage) {
    case DType::f32: return with_input<float>(d, config);
    case DType::f16: return with_input<fp16>(d, config);
    default: return with_input<bf16>(d, config);
  }
}

}  // namespace kvforge
