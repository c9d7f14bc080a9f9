// SequenceManager's host tier: offload() moves a sequence's pages to host memory, restore() brings them
// back into free pages, both through the layout's own pack and unpack (sequence_manager.hpp). Eviction
// demotes cached blocks into the same tier (sequence_retention.cpp) through the same copies.
#include <algorithm>
#include <cstring>

#include "kvforge/sequence_manager.hpp"

namespace kvforge {

namespace {
// Calls fn(first, count) for each run of consecutive values in `pages`: transfers merge along runs.
template <class Fn> void for_each_run(const std::vector<int32_t>& pages, Fn fn) {
  const int32_t n = int32_t(pages.size());
  for (int32_t i = 0; i < n;) {
    int32_t run = 1;
    while (i + run < n && pages[size_t(i + run)] == pages[size_t(i)] + run) ++run;
    fn(i, run);
    i += run;
  }
}
}  // namespace

void SequenceManager::pages_to_host(const std::vector<int32_t>& pages, const std::vector<int32_t>& host_pages) {
  const int32_t n = int32_t(pages.size());
  if (n == 0) return;
  const int64_t ppb = cache_.packed_page_bytes();
  auto* pool = static_cast<unsigned char*>(host_pool_.data());
  if (&backend_.host() == &backend_) {
    // The CPU: the host tier is this device's own memory, so pages pack straight into it.
    for_each_run(host_pages, [&](int32_t i, int32_t run) {
      const std::vector<int32_t> part(pages.begin() + i, pages.begin() + i + run);
      cache_.pack_pages(device_index(part, 0), pool + host_pages[size_t(i)] * ppb);
    });
  } else {
    // CUDA: one pack launch into device staging, then one copy per run of consecutive host pages.
    if (staging_.bytes() < n * ppb) staging_ = Buffer(backend_, n * ppb);
    cache_.pack_pages(device_index(pages, 0), staging_.data());
    const auto* staged = static_cast<const unsigned char*>(staging_.data());
    for_each_run(host_pages, [&](int32_t i, int32_t run) {
      backend_.to_host(pool + host_pages[size_t(i)] * ppb, staged + i * ppb, run * ppb, cache_.config().stream);
    });
  }
}

void SequenceManager::pages_from_host(const std::vector<int32_t>& host_pages, const std::vector<int32_t>& pages) {
  const int32_t n = int32_t(pages.size());
  if (n == 0) return;
  const int64_t ppb = cache_.packed_page_bytes();
  const auto* pool = static_cast<const unsigned char*>(host_pool_.data());
  if (&backend_.host() == &backend_) {
    for_each_run(host_pages, [&](int32_t i, int32_t run) {
      const std::vector<int32_t> part(pages.begin() + i, pages.begin() + i + run);
      cache_.unpack_pages(pool + host_pages[size_t(i)] * ppb, device_index(part, 0));
    });
  } else {
    if (staging_.bytes() < n * ppb) staging_ = Buffer(backend_, n * ppb);
    auto* staged = static_cast<unsigned char*>(staging_.data());
    for_each_run(host_pages, [&](int32_t i, int32_t run) {
      backend_.from_host(staged + i * ppb, pool + host_pages[size_t(i)] * ppb, run * ppb, cache_.config().stream);
    });
    cache_.unpack_pages(staging_.data(), device_index(pages, 0));
  }
}

void SequenceManager::offload(int64_t seq) {
  Sequence& s = live(seq, "seq");
  if (s.pending) throw StateError("seq", "sequence " + std::to_string(seq) + " has tokens no step() has written yet");
  const std::vector<int32_t> pages = held(s);
  const int32_t n = int32_t(pages.size());
  settle_pages(pages);  // before host_free(): a settled copy's host blocks are evictable again
  if (n > host_free()) throw CapacityError("host_blocks", n, host_free());
  host_room(n);
  std::vector<int32_t> host_pages;
  host_.allocate(n, host_pages);
  pages_to_host(pages, host_pages);
  release(pages);
  s.pages.assign(s.pages.size(), -1);
  unsync(s);
  last_batch_.clear();  // an offloaded sequence is no longer live
  s.host_pages = std::move(host_pages);
  s.offloaded = true;
  stats_.offloaded_pages += n;
}

void SequenceManager::restore(int64_t seq) {
  auto it = sequences_.find(seq);
  if (it == sequences_.end()) throw StateError("seq", "sequence " + std::to_string(seq) + " does not exist");
  Sequence& s = it->second;
  if (!s.offloaded) throw StateError("seq", "sequence " + std::to_string(seq) + " is not offloaded");
  const int32_t n = int32_t(s.host_pages.size());
  std::vector<int32_t> pages;
  allocate(n, pages);  // may demote cached blocks: their host pages are others than this sequence's
  pages_from_host(s.host_pages, pages);
  host_.release(s.host_pages);
  s.host_pages.clear();
  std::copy(pages.begin(), pages.end(), s.pages.begin() + s.dropped);
  unsync(s);
  // The restored pages are not registered in the prefix cache; the hash chain (a function of the
  // tokens alone) stays valid, so later full pages register under the right keys.
  s.offloaded = false;
  stats_.restored_pages += n;
}

}  // namespace kvforge
