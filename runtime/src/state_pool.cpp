#include "kvforge/state_pool.hpp"

#include <algorithm>
#include <climits>
#include <set>

#include "kvforge/errors.hpp"

namespace kvforge {
namespace {

constexpr int64_t kPartAlign = 64, kSlotAlign = 256, kMaxRank = 4, kMaxLayers = 1024, kMaxParts = 64;
constexpr int64_t kMaxPartBytes = int64_t(1) << 40, kMaxPoolBytes = int64_t(1) << 50;

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

}  // namespace

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
    : StatePool(state_parts(d), d.states ? d.states->num_linear : 0, config) {}

StatePool::StatePool(std::vector<StatePart> parts, int layers, StatePoolConfig config)
    : parts_(std::move(parts)), layers_(layers), config_(config) {
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
  if (layers < 1 || layers > kMaxLayers) throw OutOfRangeError("layers", layers, 1, kMaxLayers + 1);
  if (config_.slots < 1 || config_.slots > (int64_t(1) << 24)) throw OutOfRangeError("slots", config_.slots, 1, int64_t(1) << 24);
  if (config_.checkpoints < 0 || config_.checkpoints > (int64_t(1) << 24))
    throw OutOfRangeError("checkpoints", config_.checkpoints, 0, int64_t(1) << 24);
  for (const StatePart& p : parts_) {
    part_offset_.push_back(record_bytes_);
    record_bytes_ += round_up(elements(p) * dtype_size(p.dtype), kPartAlign);
  }
  slot_bytes_ = round_up(record_bytes_ * layers_, kSlotAlign);  // at most 64 x 2^40 x 1024 bytes: no wrap
  if (__int128(slot_bytes_) * (config_.slots + config_.checkpoints) > kMaxPoolBytes)
    throw CapacityError("slots", int64_t(std::min<__int128>(__int128(slot_bytes_) * (config_.slots + config_.checkpoints),
                                                            INT64_MAX)), kMaxPoolBytes);
  pool_ = Buffer(backend(config_.device), bytes());
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
  int64_t used = 0;
  for (size_t i = 0; i < parts_.size(); ++i) used += part_bytes(int(i));
  return bytes() - used * layers_ * (config_.slots + config_.checkpoints);
}

char* StatePool::slot_at(int64_t slot) const { return pool_.as<char>() + slot * slot_bytes_; }
char* StatePool::checkpoint_at(int64_t index) const { return slot_at(config_.slots + index); }

void StatePool::check_slot(const char* argument, int64_t slot) const {
  if (slot < 0 || slot >= config_.slots) throw OutOfRangeError(argument, slot, 0, config_.slots);
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
  v.data = pool_.as<char>() + layer * record_bytes_ + part_offset_[size_t(part)];
  v.dtype = p.dtype;
  v.device = config_.device;
  v.shape.push_back(config_.slots);
  v.shape.insert(v.shape.end(), p.shape.begin(), p.shape.end());
  v.strides.assign(v.shape.size(), 1);
  for (size_t d = v.shape.size() - 1; d > 1; --d) v.strides[d - 1] = v.strides[d] * v.shape[d];
  v.strides[0] = slot_bytes_ / es;  // 256-byte slots, 64-byte parts: a whole number of elements
  return v;
}

void StatePool::write(int64_t slot, int layer, int part, const void* src, Device device) {
  check_slot("slot", slot);
  check_part(layer, part);
  if (device != config_.device && device != Device::cpu)
    throw DeviceError("src", std::string("must be on the pool's device (") + name_of(config_.device) + ") or the host");
  char* at = slot_at(slot) + layer * record_bytes_ + part_offset_[size_t(part)];
  Backend& b = backend(config_.device);
  if (device == config_.device) b.copy(at, src, part_bytes(part), config_.stream);
  else b.from_host(at, src, part_bytes(part), config_.stream);
}

void StatePool::read(int64_t slot, int layer, int part, void* dst, Device device) const {
  check_slot("slot", slot);
  check_part(layer, part);
  if (device != config_.device && device != Device::cpu)
    throw DeviceError("dst", std::string("must be on the pool's device (") + name_of(config_.device) + ") or the host");
  const char* at = slot_at(slot) + layer * record_bytes_ + part_offset_[size_t(part)];
  Backend& b = backend(config_.device);
  if (device == config_.device) b.copy(dst, at, part_bytes(part), config_.stream);
  else b.to_host(dst, at, part_bytes(part), config_.stream);
}

void StatePool::copy_slot(int64_t src, int64_t dst) {
  check_slot("src", src);
  check_slot("dst", dst);
  if (src != dst) backend(config_.device).copy(slot_at(dst), slot_at(src), slot_bytes_, config_.stream);
}

void StatePool::read_slot(int64_t slot, void* host) const {
  check_slot("slot", slot);
  backend(config_.device).to_host(host, slot_at(slot), slot_bytes_, config_.stream);
}

void StatePool::write_slot(int64_t slot, const void* host) {
  check_slot("slot", slot);
  backend(config_.device).from_host(slot_at(slot), host, slot_bytes_, config_.stream);
}

void StatePool::zero_slot(int64_t slot) {
  check_slot("slot", slot);
  backend(config_.device).fill(slot_at(slot), 0, slot_bytes_, config_.stream);
}

void StatePool::checkpoint(int64_t slot, int64_t index) {
  check_slot("slot", slot);
  if (index < 0 || index >= config_.checkpoints) throw OutOfRangeError("index", index, 0, config_.checkpoints);
  backend(config_.device).copy(checkpoint_at(index), slot_at(slot), slot_bytes_, config_.stream);
}

void StatePool::restore(int64_t index, int64_t slot) {
  if (index < 0 || index >= config_.checkpoints) throw OutOfRangeError("index", index, 0, config_.checkpoints);
  check_slot("slot", slot);
  backend(config_.device).copy(slot_at(slot), checkpoint_at(index), slot_bytes_, config_.stream);
}

void StatePool::synchronize() const { backend(config_.device).synchronize(config_.stream); }

}  // namespace kvforge
