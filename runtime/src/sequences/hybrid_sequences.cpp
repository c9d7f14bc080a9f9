#include "kvforge/hybrid.hpp"

#include <algorithm>
#include <string>

namespace kvforge {

HybridSequenceManager::HybridSequenceManager(Cache& cache, SequenceManagerOptions options) : cache_(cache) {
  const HybridDescriptor* h = cache.descriptor().hybrid;
  for (int g = 0; g < cache.num_groups(); ++g) {
    SequenceManagerOptions o = options;
    o.window = h ? h->groups[g].sliding_window : 0;
    managers_.push_back(std::make_unique<SequenceManager>(cache.group(g), o));
  }
}

int64_t HybridSequenceManager::add(int64_t seq, const std::vector<int32_t>& prompt, std::optional<uint64_t> salt) {
  int64_t cached = INT64_MAX;
  for (auto& m : managers_) cached = std::min(cached, m->cached_prefix(prompt, salt));
  for (auto& m : managers_) {
    const int32_t need = m->pages_to_add(prompt, cached);
    if (need > m->available_blocks()) throw CapacityError("pages", need, m->available_blocks());
  }
  for (auto& m : managers_) m->add(seq, prompt, salt, cached);
  return cached;
}

void HybridSequenceManager::append(int64_t seq, const std::vector<int32_t>& tokens) {
  for (auto& m : managers_) {
    const int32_t need = m->pages_to_append(seq, int64_t(tokens.size()));
    if (need > m->available_blocks()) throw CapacityError("pages", need, m->available_blocks());
  }
  for (auto& m : managers_) m->append(seq, tokens);
}

void HybridSequenceManager::fork(int64_t parent, int64_t child) {
  for (auto& m : managers_) m->fork(parent, child);
}

void HybridSequenceManager::free(int64_t seq) {
  for (auto& m : managers_) m->free(seq);
}

std::vector<BatchMetadata> HybridSequenceManager::step(const std::vector<int64_t>& seqs) {
  std::vector<BatchMetadata> out;
  for (auto& m : managers_) out.push_back(m->step(seqs));
  return out;
}

void HybridSequenceManager::set_retention(int64_t seq, const std::vector<RetentionRange>& ranges) {
  managers_[0]->set_retention(seq, ranges);  // checks the ranges once, before any group changes
  for (size_t g = 1; g < managers_.size(); ++g) managers_[g]->set_retention(seq, ranges);
}

std::vector<KvEvent> HybridSequenceManager::take_kv_events() {
  std::vector<KvEvent> out;
  for (size_t g = 0; g < managers_.size(); ++g)
    for (KvEvent& e : managers_[g]->take_kv_events()) {
      e.group = int(g);
      out.push_back(std::move(e));
    }
  return out;
}

GatherRange HybridSequenceManager::range(int layer, int64_t seq, int64_t begin, int64_t end) {
  return managers_[size_t(cache_.group_of(layer))]->range(seq, begin, end);
}

}  // namespace kvforge
