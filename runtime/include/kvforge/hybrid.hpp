// A hybrid model's sequences: one sequence manager per layer group of its HybridCache
// (hybrid_cache.hpp), which this header also brings, so that one include serves a hybrid model.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <vector>

#include "kvforge/hybrid_cache.hpp"
#include "kvforge/sequence_manager.hpp"

namespace kvforge {

// One sequence manager per layer group behind one set of calls, all or nothing across the groups. A
// group with a sliding window frees pages as they leave it. Prefix reuse covers what every group
// still holds, so all groups agree on which tokens need computing.
class HybridSequenceManager {
 public:
  explicit HybridSequenceManager(Cache& cache, SequenceManagerOptions options = {});
  HybridSequenceManager(const HybridSequenceManager&) = delete;  // its managers hold pages of one cache
  HybridSequenceManager& operator=(const HybridSequenceManager&) = delete;
  int64_t add(int64_t seq, const std::vector<int32_t>& prompt, std::optional<uint64_t> salt = {});
  void append(int64_t seq, const std::vector<int32_t>& tokens);
  void fork(int64_t parent, int64_t child);
  void free(int64_t seq);
  // Per group: the batch arrays for that group's layers (append layer l with step[cache.group_of(l)]).
  std::vector<BatchMetadata> step(const std::vector<int64_t>& seqs);
  // A gather of one layer; a windowed layer can only read the positions still in its window.
  GatherRange range(int layer, int64_t seq, int64_t begin, int64_t end);
  int64_t length(int64_t seq) const { return managers_[0]->length(seq); }
  int num_groups() const { return int(managers_.size()); }
  SequenceManager& group(int g) { return *managers_[size_t(g)]; }
  // Retention (RetentionRange) for the sequence's blocks in every group.
  void set_retention(int64_t seq, const std::vector<RetentionRange>& ranges);
  // Every group's KV events since the last call, group by group, each naming its group.
  std::vector<KvEvent> take_kv_events();

 private:
  Cache& cache_;
  std::vector<std::unique_ptr<SequenceManager>> managers_;
};

}  // namespace kvforge
