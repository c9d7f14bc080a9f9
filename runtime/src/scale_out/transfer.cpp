#include "kvforge/transfer.hpp"

#include "base/fnv.hpp"
#include "scale_out/transfer_wire.hpp"

namespace kvforge {

namespace {
template <class Spare> Staging take_spare(Spare& spare, Device device, bool host, int64_t bytes) {
  auto best = spare.end();
  for (auto it = spare.begin(); it != spare.end(); ++it)
    if (it->on == device && it->host == host && it->device.bytes() >= bytes &&
        (best == spare.end() || it->device.bytes() < best->device.bytes()))
      best = it;
  if (best == spare.end()) return {};
  Staging s = std::move(*best);
  spare.erase(best);
  return s;
}
}  // namespace

Staging StagingPool::take(Transport& transport, Device device, int64_t bytes) {
  bytes = std::max<int64_t>(bytes, 1);
  if (Staging s = take_spare(spare_, device, false, bytes); s.device.data()) return s;
  Backend& b = backend(device);
  Staging s;
  s.on = device;
  s.device = Buffer(b, bytes);
  if (!transport.takes_memory_of(device)) s.wire = Buffer(b.host(), bytes);
  transport.register_memory(s.wire_data(), bytes);
  return s;
}

Staging StagingPool::take_host(Transport& transport, Device device, int64_t bytes) {
  bytes = std::max<int64_t>(bytes, 1);
  if (Staging s = take_spare(spare_, device, true, bytes); s.device.data()) return s;
  Staging s;
  s.on = device;
  s.host = true;
  s.device = Buffer(backend(device).host(), bytes);
  transport.register_memory(s.device.data(), bytes);
  return s;
}

void StagingPool::give(Staging s) {
  if (!s.device.data()) return;
  spare_.push_back(std::move(s));
  std::sort(spare_.begin(), spare_.end(), [](const Staging& a, const Staging& b) { return a.device.bytes() > b.device.bytes(); });
  if (spare_.size() > size_t(std::max(keep, 0))) spare_.resize(size_t(std::max(keep, 0)));
}

uint64_t token_hash(const std::vector<int32_t>& tokens) {
  uint64_t h = kFnvBasis;
  for (int32_t t : tokens) fnv_mix(h, uint32_t(t), 4);
  return h;
}

}  // namespace kvforge
