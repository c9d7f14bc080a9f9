#include "kvforge/shard.hpp"

#include <string>

#include "kvforge/errors.hpp"

namespace kvforge {
namespace {

HeadRange heads_of(int model_heads, int tp, int rank) {
  if (model_heads >= tp) return {rank * (model_heads / tp), model_heads / tp};
  return {rank / (tp / model_heads), 1};  // replicated: each head on tp / model_heads ranks
}

void check_degree(int model_heads, int tp, const char* argument) {
  if (tp < 1 || tp > limits::kMaxTensorParallel)
    throw OutOfRangeError(argument, tp, 1, limits::kMaxTensorParallel + 1);
  if (model_heads % tp != 0 && tp % model_heads != 0)
    throw ArgumentError(argument, std::to_string(tp) + " ranks cannot share " + std::to_string(model_heads) +
                                      " KV heads: it neither divides them nor is a multiple of them");
}

}  // namespace

HeadRange shard_heads(const VariantDescriptor& d, int rank) {
  if (rank < 0 || rank >= d.tensor_parallel) throw OutOfRangeError("rank", rank, 0, d.tensor_parallel);
  return heads_of(d.model_heads, d.tensor_parallel, rank);
}

const VariantEntry& shard_variant(const Registry& registry, std::string_view name, int tp) {
  const VariantDescriptor& d = *registry.at(name).descriptor;
  const std::string model = d.shard_of ? d.shard_of : d.model;
  check_degree(d.model_heads, tp, "tp");
  const std::string wanted = tp == 1 ? model : model + "_tp" + std::to_string(tp);
  const std::string record = d.record_format ? d.record_format->name : "";
  const VariantQuery q{d.layout, wanted, d.storage, d.input, record};
  const std::vector<const VariantEntry*> found = registry.select(q);
  if (found.empty()) {
    std::vector<std::string> degrees;
    for (const VariantEntry* e : registry.select({d.layout, "", d.storage, d.input, record}))
      if ((e->descriptor->shard_of ? e->descriptor->shard_of : e->descriptor->model) == model)
        degrees.push_back(e->descriptor->name);
    throw UnknownVariantError(variant_name(d.layout, wanted, d.storage_name(), d.input), degrees);
  }
  return *found.front();
}

std::vector<ShardPiece> shard_pieces(int model_heads, int sender_tp, int receiver_tp) {
  check_degree(model_heads, sender_tp, "sender_tp");
  check_degree(model_heads, receiver_tp, "receiver_tp");
  std::vector<ShardPiece> pieces;
  for (int r = 0; r < receiver_tp; ++r) {
    const HeadRange want = heads_of(model_heads, receiver_tp, r);
    for (int h = want.begin; h < want.end(); ++h) {
      // The senders holding head h; receiver r takes replica r mod their count.
      int first = 0, replicas = 1;
      if (model_heads >= sender_tp) first = h / (model_heads / sender_tp);
      else replicas = sender_tp / model_heads, first = h * replicas;
      const int sender = first + r % replicas;
      if (!pieces.empty() && pieces.back().receiver == r && pieces.back().sender == sender &&
          pieces.back().heads.end() == h)
        ++pieces.back().heads.count;
      else
        pieces.push_back({sender, r, {h, 1}});
    }
  }
  return pieces;
}

}  // namespace kvforge
