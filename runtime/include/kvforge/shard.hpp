// Tensor-parallel shards. A model spec's `tensor_parallel: [1, 2, 4]` generates, beside each of the
// model's variants, one per degree whose caches hold one rank's slice of the KV heads (the model
// `<model>_tp<N>`). When there are fewer KV heads than ranks, each head is replicated on
// tp / kv_heads ranks, as vLLM does. This header says which heads a rank holds, and finds the shard
// variant for a degree.
#pragma once

#include <string_view>
#include <vector>

#include "kvforge/registry.hpp"

namespace kvforge {

struct HeadRange {
  int begin = 0;
  int count = 0;
  int end() const { return begin + count; }
};

// The heads of the full model (descriptor().model_heads of them) that `rank` holds; rank in
// [0, d.tensor_parallel). A whole-model variant (degree 1) holds every head at rank 0.
HeadRange shard_heads(const VariantDescriptor& d, int rank);

// The registered variant of `name`'s layout and dtypes holding one rank's shard at degree `tp` (tp 1:
// the whole model). UnknownVariantError lists the degrees the model was generated for.
const VariantEntry& shard_variant(const Registry& registry, std::string_view name, int tp);

// One piece of a transfer between two tensor-parallel groups: heads [heads.begin, heads.end()) of the
// full model go from sender rank `sender` to receiver rank `receiver` (ranks within each group).
struct ShardPiece {
  int sender = 0;
  int receiver = 0;
  HeadRange heads;
};

// Every receiver's heads, each from exactly one sender: where senders replicate a head, receivers
// spread over the replicas. Consecutive heads from one sender to one receiver make one piece.
std::vector<ShardPiece> shard_pieces(int model_heads, int sender_tp, int receiver_tp);

}  // namespace kvforge
