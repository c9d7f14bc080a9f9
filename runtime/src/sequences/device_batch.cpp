// DeviceBatch: a step's host-built arrays (BatchMetadata) copied to the device its cache is on.
#include "kvforge/sequence_manager.hpp"

#include <algorithm>
#include <type_traits>

namespace kvforge {

DeviceBatch::DeviceBatch(const BatchMetadata& m, Device device, void* stream) {
  Backend& b = backend(device);
  auto put = [&](const auto& host) {
    using T = typename std::decay_t<decltype(host)>::value_type;
    buffers_.emplace_back(b, int64_t(std::max<size_t>(host.size(), 1) * sizeof(T)));
    if (!host.empty()) b.from_host(buffers_.back().data(), host.data(), int64_t(host.size() * sizeof(T)), stream);
    return IndexView{buffers_.back().data(), dtype_of<T>::value, device, int64_t(host.size())};
  };
  slots = put(m.slots);
  query_start = put(m.query_start);
  lengths = put(m.lengths);
  page_table = put(m.page_table);
  indptr = put(m.indptr);
  indices = put(m.indices);
  last_page_len = put(m.last_page_len);
}

}  // namespace kvforge
