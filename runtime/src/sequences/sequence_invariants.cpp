// SequenceManager::check_invariants: every count the manager keeps, recomputed from its owners (tests
// call it after every operation).
#include <string>
#include <vector>

#include "kvforge/errors.hpp"
#include "kvforge/sequence_manager.hpp"

namespace kvforge {

void SequenceManager::check_invariants() const {
  auto fail = [](const std::string& what) { throw StateError("invariant", what); };
  std::vector<int32_t> owners(size_t(device_.total()), 0), host_owners(size_t(host_.total()), 0);
  const int32_t P = page_size();
  for (const auto& [id, s] : sequences_) {
    if (s.offloaded) {
      for (int32_t b : s.pages)
        if (b >= 0) fail("offloaded sequence " + std::to_string(id) + " still holds device pages");
      if (int64_t(s.host_pages.size()) + s.dropped != (int64_t(s.tokens.size()) + P - 1) / P)
        fail("offloaded sequence " + std::to_string(id) + " holds the wrong number of host pages");
      for (int32_t b : s.host_pages) ++host_owners[size_t(b)];
      continue;
    }
    if (int64_t(s.pages.size()) != (int64_t(s.tokens.size()) + P - 1) / P)
      fail("sequence " + std::to_string(id) + " holds " + std::to_string(s.pages.size()) + " pages for " +
           std::to_string(s.tokens.size()) + " tokens");
    for (size_t j = 0; j < s.pages.size(); ++j) {
      const int32_t b = s.pages[j];
      if ((b < 0) != (int32_t(j) < s.dropped)) fail("sequence " + std::to_string(id) + " page " + std::to_string(j) + " is freed out of turn");
      if (b >= 0) ++owners[size_t(b)];
    }
    if (options_.window > 0 && (int64_t(s.dropped) + 1) * P <= int64_t(s.tokens.size()) - options_.window)
      fail("sequence " + std::to_string(id) + " holds a page wholly outside its window");
  }
  for (int32_t b : taken_) ++owners[size_t(b)];
  int32_t in_lru = 0;
  prefix_.for_each_evictable([&](int32_t b) {
    if (!prefix_.cached(b) || owners[size_t(b)] != 0) fail("page " + std::to_string(b) + " is evictable but in use");
    ++in_lru;
  });
  if (in_lru != prefix_.evictable_count()) fail("the LRU list and its size disagree");
  int32_t free_pages = 0;
  for (int32_t b = 0; b < device_.total(); ++b) {
    const int32_t want = owners[size_t(b)] + (prefix_.cached(b) ? 1 : 0);
    if (device_.ref_count(b) != want)
      fail("page " + std::to_string(b) + " has " + std::to_string(device_.ref_count(b)) + " references for " +
           std::to_string(want) + " owners");
    if (prefix_.cached(b) && owners[size_t(b)] == 0 && !prefix_.evictable(b))
      fail("cached page " + std::to_string(b) + " that nobody uses is not evictable");
    if (!prefix_.consistent(b)) fail("prefix map and page disagree");
    free_pages += want == 0;
  }
  if (free_pages != device_.free_count()) fail("the free count disagrees with the owners");
  std::vector<uint8_t> promoting_from(size_t(host_.total()), 0);  // held until their copy is settled
  for (const auto& copy : promoting_host_)
    for (int32_t h : copy.second) promoting_from[size_t(h)] = 1;
  for (int32_t b = 0; b < host_.total(); ++b)
    if (host_.ref_count(b) != host_owners[size_t(b)] + (host_prefix_.cached(b) ? 1 : 0))
      fail("host page " + std::to_string(b) + " has the wrong owners");
    else if (host_prefix_.cached(b) && (host_owners[size_t(b)] != 0 || !(host_prefix_.evictable(b) || promoting_from[size_t(b)]) ||
                                        !host_prefix_.consistent(b)))
      fail("host page " + std::to_string(b) + " holds a demoted block and something else");
  if (disk_) {  // every record is free or holds one cached block, never both
    std::vector<uint8_t> free(size_t(disk_->capacity()), 0);
    for (int32_t slot : disk_free_) {
      if (free[size_t(slot)] || disk_prefix_.cached(slot)) fail("disk record " + std::to_string(slot) + " is free twice or in use");
      free[size_t(slot)] = 1;
    }
    if (int64_t(disk_free_.size()) + disk_prefix_.size() != disk_->capacity())
      fail("the disk tier's free and cached records do not add up to its capacity");
  }
}

}  // namespace kvforge
