#include "kvforge/state_pool.hpp"

#include <algorithm>
#include <climits>
#include <cstring>
#include <set>

#include "kvforge/cache.hpp"

#include "kvforge/errors.hpp"

namespace kvforge {
namespace {

constexpr int64_t kPartAlign = 64, kSlotAlign = 256, kMaxRank = 4, kMaxLayers = 1024, kMaxParts = 64;
constexpr int64_t kMaxPartBytes = int64_t(1) << 40, kMaxPoolBytes = int64_t(1) << 50;
// Runs a page may split into for a state to be placed in them: a layout whose rows lie apart (a slot
// axis outside its layers) has a run a row, and past this many a page search would only grow lists.
constexpr int64_t kMaxRuns = int64_t(1) << 16;

int64_t round_up(int64_t n, int64_t to) { return (n + to - 1) / to * to; }

bool valid_name(const std::string& s) {
  if (s.empty() || s[0] < 'a' || s[0] > 'z') return false;
  for (char c : s)
    if (!((c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || c == '_')) return false;
  return true;
}

int64_t elements(const StatePart& p) {
  int64_t n = 1;
  for (int64_t e : p.shape) n *= e;
  return n;
}

// The contiguous runs of page 0 in a paged layout: byte offsets from the storage, each `bytes` long;
// page p's are `stride` bytes further. The axes inside a page, innermost first, are merged while each
// steps exactly over the ones before it (a whole K or V block of a layer, or the whole page).
struct PageRuns {
  std::vector<int64_t> starts;
  int64_t bytes = 0, stride = 0;
};

PageRuns page_runs(const VariantDescriptor& d, const Geometry& g) {
  struct Axis {
    int64_t stride, extent;
  };
  std::vector<Axis> axes;
  for (Axis a : {Axis{1, d.stored_dim()}, Axis{g.strides.head, d.heads}, Axis{g.strides.seq_or_slot, d.page_size},
                 Axis{g.strides.kv, 2}, Axis{g.strides.layer, d.layers}})
    if (a.extent > 1 && a.stride > 0) axes.push_back(a);
  std::stable_sort(axes.begin(), axes.end(), [](const Axis& a, const Axis& b) { return a.stride < b.stride; });
  int64_t run = 1;
  size_t merged = 0;
  for (; merged < axes.size() && axes[merged].stride == run; ++merged) run *= axes[merged].extent;
  const int64_t es = dtype_size(d.storage);
  PageRuns out;
  out.bytes = run * es;
  out.stride = g.strides.row_or_page * es;
  out.starts = {0};
  int64_t count = 1;  // a page of more runs than this holds no record's part in any: none
  for (size_t a = merged; a < axes.size(); ++a) count = std::min<int64_t>(count * axes[a].extent, kMaxRuns + 1);
  if (count > kMaxRuns) out.starts.clear();
  for (size_t a = merged; a < axes.size() && !out.starts.empty(); ++a) {
    std::vector<int64_t> next;
    for (int64_t i = 0; i < axes[a].extent; ++i)
      for (int64_t s : out.starts) next.push_back(s + i * axes[a].stride * es);
    out.starts = std::move(next);
  }
  std::sort(out.starts.begin(), out.starts.end());
  return out;
}

// Every part of every layer placed in page 0's runs, largest first, each in the first run with room
// (first-fit decreasing), on `align` bytes. An empty `problem` when all fit.
struct PagePlacement {
  std::vector<int64_t> place;  // [layer][part]: byte offset from the storage
  std::vector<std::pair<int64_t, int64_t>> spans;  // (offset, bytes): what a state uses of each run
  std::string problem;
};

PagePlacement place_in_pages(const std::vector<StatePart>& parts, int layers, const PageRuns& runs, int64_t align) {
  PagePlacement out;
  out.place.assign(size_t(layers) * parts.size(), -1);
  std::vector<size_t> order(out.place.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = i;
  auto bytes_of = [&](size_t item) { return elements(parts[item % parts.size()]) * dtype_size(parts[item % parts.size()].dtype); };
  std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) { return bytes_of(a) > bytes_of(b); });
  std::vector<int64_t> used(runs.starts.size(), 0), first(runs.starts.size(), -1);
  for (size_t item : order) {
    const StatePart& p = parts[item % parts.size()];
    if (align < dtype_size(p.dtype)) {
      out.problem = "the cache's pages lie " + std::to_string(runs.stride) + " bytes apart, which does not align part '" +
                    p.name + "''s " + std::string(dtype_name(p.dtype)) + " elements";
      return out;
    }
    for (size_t r = 0; r < runs.starts.size() && out.place[item] < 0; ++r) {
      const int64_t at = round_up(runs.starts[r] + used[r], align);
      if (at + bytes_of(item) > runs.starts[r] + runs.bytes) continue;
      out.place[item] = at;
      if (first[r] < 0) first[r] = at;
      used[r] = at + bytes_of(item) - runs.starts[r];
    }
    if (out.place[item] < 0) {
      out.problem = "layer " + std::to_string(item / parts.size()) + "'s part '" + p.name + "' (" +
                    std::to_string(bytes_of(item)) + " bytes) fits in none of a page's " +
                    std::to_string(runs.starts.size()) + " runs of " + std::to_string(runs.bytes) + " bytes";
      return out;
    }
  }
  for (size_t r = 0; r < runs.starts.size(); ++r)
    if (first[r] >= 0) out.spans.push_back({first[r], runs.starts[r] + used[r] - first[r]});
  return out;
}

// The alignment every page keeps: the largest power of two up to kPartAlign dividing the page stride
// and the storage's address.
int64_t page_align(int64_t stride, uintptr_t base) {
  int64_t a = kPartAlign;
  while (a > 1 && (stride % a != 0 || base % uintptr_t(a) != 0)) a /= 2;
  return a;
}

}  // namespace

int64_t state_page_size(const VariantDescriptor& d) {
  if (!d.states) return 0;
  return state_page_size(d, state_parts(d), d.states->num_linear);
}

int64_t state_page_size(const VariantDescriptor& d, const std::vector<StatePart>& parts, int layers) {
  if (!d.paged() || d.hybrid || d.page_size < 1 || parts.empty() || layers < 1) return 0;
  auto fits = [&](int64_t k) {
    VariantDescriptor at = d;
    at.page_size = int(k * d.page_size);
    const PageRuns runs = page_runs(at, make_geometry(at, Capacity{0, 0, 2}));
    return place_in_pages(parts, layers, runs, page_align(runs.stride, kPartAlign)).problem.empty();
  };
  const int64_t most = (int64_t(1) << 20) / d.page_size;
  int64_t hi = 1;
  while (hi < most && !fits(hi)) hi = std::min(hi * 2, most);
  if (!fits(hi)) return 0;
  int64_t lo = hi / 2;  // fits(lo) is false, or lo is 0
  while (hi - lo > 1) {
    const int64_t mid = (lo + hi) / 2;
    (fits(mid) ? hi : lo) = mid;
  }
  return hi * d.page_size;
}

std::vector<StatePart> state_parts(const VariantDescriptor& d) {
  if (!d.states)
    throw UnsupportedError(std::string("variant: ") + d.name + "'s model names no linear_layers, so it keeps no state");
  std::vector<StatePart> out;
  for (int i = 0; i < d.states->num_parts; ++i) {
    const StatePartSpec& p = d.states->parts[i];
    out.push_back({p.name, std::vector<int64_t>(p.shape, p.shape + p.rank), p.dtype});
  }
  return out;
}

StatePool::StatePool(const VariantDescriptor& d, StatePoolConfig config)
    : StatePool(state_parts(d), d.states ? d.states->num_linear : 0, config, d.state_axes) {}

StatePool::StatePool(std::vector<StatePart> parts, int layers, StatePoolConfig config, StateAxes axes)
    : parts_(std::move(parts)), layers_(layers), config_(config), axes_(axes) {
  for (StateAxis a : {StateAxis::slot, StateAxis::layer, StateAxis::part})
    if (std::count(axes_.begin(), axes_.end(), a) != 1)
      throw ArgumentError("axes", std::string("[") + name_of(axes_[0]) + ", " + name_of(axes_[1]) + ", " + name_of(axes_[2]) +
                                      "] does not name '" + name_of(a) + "' once (allowed: an order of slot, layer and part)");
  check_parts();
  if (__int128(slot_bytes_) * (config_.slots + config_.checkpoints) > kMaxPoolBytes)
    throw CapacityError("slots", int64_t(std::min<__int128>(__int128(slot_bytes_) * (config_.slots + config_.checkpoints),
                                                            INT64_MAX)), kMaxPoolBytes);
  place_own();
  pool_ = Buffer(backend(config_.device), bytes());
  base_ = pool_.as<char>();
}

// Each (layer, part) of slot 0 and its slot step, walking the axes outermost first: a part takes whole
// 64-byte units, and a slot outermost steps slot_bytes_ (256-byte padded); an axis inside another is
// repeated whole for each of its indices. The slots' runs are the items merged where they touch.
void StatePool::place_own() {
  const int64_t records = config_.slots + config_.checkpoints;
  const size_t n = parts_.size();
  std::vector<int64_t> unit;
  for (size_t p = 0; p < n; ++p) unit.push_back(round_up(part_bytes(int(p)), kPartAlign));
  // Bytes under axes_[i..] for part p (p does not matter where the part axis is among them).
  auto block = [&](auto&& self, size_t i, size_t p) -> int64_t {
    if (i == axes_.size()) return unit[p];
    if (axes_[i] == StateAxis::slot) return records * (i == 0 ? slot_bytes_ : self(self, i + 1, p));
    if (axes_[i] == StateAxis::layer) return layers_ * self(self, i + 1, p);
    int64_t all = 0;
    for (size_t q = 0; q < n; ++q) all += self(self, i + 1, q);
    return all;
  };
  const size_t slot_axis = size_t(std::find(axes_.begin(), axes_.end(), StateAxis::slot) - axes_.begin());
  std::vector<Span> items;
  for (int l = 0; l < layers_; ++l)
    for (size_t p = 0; p < n; ++p) {
      int64_t at = 0;
      for (size_t i = 0; i < axes_.size(); ++i) {
        if (axes_[i] == StateAxis::layer) at += l * block(block, i + 1, p);
        if (axes_[i] == StateAxis::part)
          for (size_t q = 0; q < p; ++q) at += block(block, i + 1, q);
      }
      const int64_t stride = slot_axis == 0 ? slot_bytes_ : block(block, slot_axis + 1, p);
      place_.push_back(at);
      stride_.push_back(stride);
      items.push_back({at, unit[p], stride});
    }
  std::sort(items.begin(), items.end(), [](const Span& a, const Span& b) { return a.offset < b.offset; });
  for (const Span& it : items) {
    if (!spans_.empty() && spans_.back().offset + spans_.back().bytes == it.offset && spans_.back().stride == it.stride)
      spans_.back().bytes += it.bytes;
    else
      spans_.push_back(it);
  }
}

StatePool::StatePool(Cache& cache, int64_t checkpoints)
    : StatePool(state_parts(cache.descriptor()), cache.descriptor().states ? cache.descriptor().states->num_linear : 0, cache,
                checkpoints) {}

StatePool::StatePool(std::vector<StatePart> parts, int layers, Cache& cache, int64_t checkpoints)
    : parts_(std::move(parts)), layers_(layers), cache_(&cache) {
  const VariantDescriptor& d = cache.descriptor();
  if (!d.paged() || d.hybrid)
    throw UnsupportedError(std::string("cache: a state lies in a page of a paged, non-hybrid cache; ") + d.name + " is not one");
  config_ = StatePoolConfig{cache.config().device, cache.config().pages, checkpoints, nullptr};
  check_parts();
  const PageRuns runs = page_runs(d, cache.geometry());
  base_ = static_cast<char*>(const_cast<void*>(cache.storage()));
  const PagePlacement at = place_in_pages(parts_, layers_, runs, page_align(runs.stride, reinterpret_cast<uintptr_t>(base_)));
  if (!at.problem.empty()) {
    const int64_t enough = state_page_size(d, parts_, layers_);  // the record given, not the variant's own
    throw ShapeError("cache", std::string(d.name) + "'s page of " + std::to_string(d.page_size) +
                                  " tokens cannot hold the state record: " + at.problem +
                                  (enough ? " (a page of " + std::to_string(enough) + " tokens would hold it)" : ""));
  }
  place_ = at.place;
  stride_.assign(place_.size(), runs.stride);
  for (const auto& [offset, bytes] : at.spans) spans_.push_back({offset, bytes, runs.stride});
  page_bytes_ = cache.memory().storage_bytes / std::max<int64_t>(config_.slots, 1);
}

void StatePool::check_parts() {
  if (parts_.empty() || int64_t(parts_.size()) > kMaxParts)
    throw ArgumentError("parts", "a state record has 1 to 64 parts, not " + std::to_string(parts_.size()));
  std::set<std::string> names;
  for (size_t i = 0; i < parts_.size(); ++i) {
    const StatePart& p = parts_[i];
    const std::string at = "parts[" + std::to_string(i) + "]";
    if (!valid_name(p.name)) throw ArgumentError(at + ".name", "'" + p.name + "' is not a name (allowed: [a-z][a-z0-9_]*)");
    if (!names.insert(p.name).second) throw ArgumentError(at + ".name", "'" + p.name + "' names two parts");
    if (p.shape.empty() || int64_t(p.shape.size()) > kMaxRank)
      throw ShapeError(at + ".shape", "has " + std::to_string(p.shape.size()) + " extents (allowed: 1 to 4)");
    int64_t bytes = dtype_size(p.dtype);
    for (size_t d = 0; d < p.shape.size(); ++d) {
      if (p.shape[d] < 1 || p.shape[d] > kMaxPartBytes) throw OutOfRangeError(at + ".shape", p.shape[d], 1, kMaxPartBytes, int64_t(d));
      bytes *= p.shape[d];
      if (bytes > kMaxPartBytes) throw OutOfRangeError(at + ".shape", bytes, 1, kMaxPartBytes, -1, "bytes of the part");
    }
    if (p.dtype != DType::f32 && p.dtype != DType::f16 && p.dtype != DType::bf16)
      throw DtypeError(at + ".dtype", std::string(dtype_name(p.dtype)) + " is not a state dtype (allowed: fp32, fp16, bf16)");
  }
  if (layers_ < 1 || layers_ > kMaxLayers) throw OutOfRangeError("layers", layers_, 1, kMaxLayers + 1);
  if (!cache_ && (config_.slots < 1 || config_.slots > (int64_t(1) << 24)))  // a cache's pages are its own to bound
    throw OutOfRangeError("slots", config_.slots, 1, int64_t(1) << 24);
  if (config_.checkpoints < 0 || config_.checkpoints > (int64_t(1) << 24))
    throw OutOfRangeError("checkpoints", config_.checkpoints, 0, int64_t(1) << 24);
  // The slot image, wherever the slots lie: each layer's record, each part on 64 bytes, the whole on 256.
  std::vector<int64_t> part_offset;
  for (const StatePart& p : parts_) {
    part_offset.push_back(record_bytes_);
    record_bytes_ += round_up(elements(p) * dtype_size(p.dtype), kPartAlign);
  }
  slot_bytes_ = round_up(record_bytes_ * layers_, kSlotAlign);  // at most 64 x 2^40 x 1024 bytes: no wrap
  for (int l = 0; l < layers_; ++l)
    for (int64_t offset : part_offset) image_.push_back(l * record_bytes_ + offset);
}

int StatePool::part_index(const std::string& name) const {
  std::string allowed;
  for (size_t i = 0; i < parts_.size(); ++i) {
    if (parts_[i].name == name) return int(i);
    allowed += (i ? ", " : "") + parts_[i].name;
  }
  throw ArgumentError("part", "'" + name + "' is not a part of this record (allowed: " + allowed + ")");
}

int64_t StatePool::part_bytes(int part) const {
  if (part < 0 || part >= int(parts_.size())) throw OutOfRangeError("part", part, 0, int64_t(parts_.size()));
  return elements(parts_[size_t(part)]) * dtype_size(parts_[size_t(part)].dtype);
}

int64_t StatePool::record_bytes() const { return record_bytes_; }

int64_t StatePool::padding_bytes() const {
  if (cache_) return 0;
  int64_t used = 0;
  for (size_t i = 0; i < parts_.size(); ++i) used += part_bytes(int(i));
  return bytes() - used * layers_ * (config_.slots + config_.checkpoints);
}

int64_t StatePool::page_padding_bytes() const {
  if (!cache_) return 0;
  int64_t used = 0;
  for (size_t i = 0; i < parts_.size(); ++i) used += part_bytes(int(i));
  return page_bytes_ - used * layers_;
}

void* StatePool::stream() const { return cache_ ? cache_->config().stream : config_.stream; }

void StatePool::check_slot(const char* argument, int64_t slot) const {
  if (slot < 0 || slot >= config_.slots) throw OutOfRangeError(argument, slot, 0, config_.slots);
}

void StatePool::check_index(int64_t index) const {
  if (cache_) check_slot("index", index);
  else if (index < 0 || index >= config_.checkpoints) throw OutOfRangeError("index", index, 0, config_.checkpoints);
}

void StatePool::check_part(int layer, int part) const {
  if (layer < 0 || layer >= layers_) throw OutOfRangeError("layer", layer, 0, layers_);
  if (part < 0 || part >= int(parts_.size())) throw OutOfRangeError("part", part, 0, int64_t(parts_.size()));
}

StateView StatePool::view(int layer, int part) const {
  check_part(layer, part);
  const StatePart& p = parts_[size_t(part)];
  const int64_t es = dtype_size(p.dtype);
  StateView v;
  v.data = part_at(0, layer, part);
  v.dtype = p.dtype;
  v.device = config_.device;
  v.shape.push_back(config_.slots);
  v.shape.insert(v.shape.end(), p.shape.begin(), p.shape.end());
  v.strides.assign(v.shape.size(), 1);
  for (size_t d = v.shape.size() - 1; d > 1; --d) v.strides[d - 1] = v.strides[d] * v.shape[d];
  // Slot steps are whole 64-byte units, or pages aligned for the part: whole elements.
  v.strides[0] = slot_stride(layer, part) / es;
  return v;
}

int64_t StatePool::image_offset(int layer, int part) const {
  check_part(layer, part);
  return image_[size_t(layer) * parts_.size() + size_t(part)];
}

int64_t StatePool::slot_stride(int layer, int part) const {
  check_part(layer, part);
  return stride_[size_t(layer) * parts_.size() + size_t(part)];
}

int64_t StatePool::offset(int64_t slot, int layer, int part) const {
  if (slot < 0 || slot >= (cache_ ? config_.slots : config_.slots + config_.checkpoints))
    throw OutOfRangeError("slot", slot, 0, cache_ ? config_.slots : config_.slots + config_.checkpoints);
  check_part(layer, part);
  return part_at(slot, layer, part) - base_;
}

void StatePool::write(int64_t slot, int layer, int part, const void* src, Device device) {
  check_slot("slot", slot);
  check_part(layer, part);
  if (device != config_.device && device != Device::cpu)
    throw DeviceError("src", std::string("must be on the pool's device (") + name_of(config_.device) + ") or the host");
  char* at = part_at(slot, layer, part);
  Backend& b = backend(config_.device);
  if (device == config_.device) b.copy(at, src, part_bytes(part), stream());
  else b.from_host(at, src, part_bytes(part), stream());
}

void StatePool::read(int64_t slot, int layer, int part, void* dst, Device device) const {
  check_slot("slot", slot);
  check_part(layer, part);
  if (device != config_.device && device != Device::cpu)
    throw DeviceError("dst", std::string("must be on the pool's device (") + name_of(config_.device) + ") or the host");
  const char* at = part_at(slot, layer, part);
  Backend& b = backend(config_.device);
  if (device == config_.device) b.copy(dst, at, part_bytes(part), stream());
  else b.to_host(dst, at, part_bytes(part), stream());
}

void StatePool::copy_record(int64_t src, int64_t dst) {
  if (src == dst) return;
  for (const Span& s : spans_)
    backend(config_.device).copy(base_ + s.offset + dst * s.stride, base_ + s.offset + src * s.stride, s.bytes, stream());
}

void StatePool::copy_slot(int64_t src, int64_t dst) {
  check_slot("src", src);
  check_slot("dst", dst);
  copy_record(src, dst);
}

// The image is a slot-major pool's slot: one copy there; in another order or a cache's pages a copy a
// part, gaps zeroed.
void StatePool::read_slot(int64_t slot, void* host) const {
  check_slot("slot", slot);
  auto* out = static_cast<char*>(host);
  if (!cache_ && axes_ == kSlotMajor) return backend(config_.device).to_host(out, part_at(slot, 0, 0), slot_bytes_, stream());
  std::memset(out, 0, size_t(slot_bytes_));
  for (int l = 0; l < layers_; ++l)
    for (int p = 0; p < int(parts_.size()); ++p)
      backend(config_.device).to_host(out + image_[size_t(l) * parts_.size() + size_t(p)], part_at(slot, l, p), part_bytes(p), stream());
}

void StatePool::write_slot(int64_t slot, const void* host) {
  check_slot("slot", slot);
  const auto* in = static_cast<const char*>(host);
  if (!cache_ && axes_ == kSlotMajor) return backend(config_.device).from_host(part_at(slot, 0, 0), in, slot_bytes_, stream());
  for (int l = 0; l < layers_; ++l)
    for (int p = 0; p < int(parts_.size()); ++p)
      backend(config_.device).from_host(part_at(slot, l, p), in + image_[size_t(l) * parts_.size() + size_t(p)], part_bytes(p), stream());
}

void StatePool::zero_slot(int64_t slot) {
  check_slot("slot", slot);
  for (const Span& s : spans_) backend(config_.device).fill(base_ + s.offset + slot * s.stride, 0, s.bytes, stream());
}

// A pool of its own keeps checkpoint i as record slots + i; in a cache's pages it is page i.
void StatePool::checkpoint(int64_t slot, int64_t index) {
  check_slot("slot", slot);
  check_index(index);
  copy_record(slot, cache_ ? index : config_.slots + index);
}

void StatePool::restore(int64_t index, int64_t slot) {
  check_index(index);
  check_slot("slot", slot);
  copy_record(cache_ ? index : config_.slots + index, slot);
}

void StatePool::synchronize() const { backend(config_.device).synchronize(stream()); }

}  // namespace kvforge
