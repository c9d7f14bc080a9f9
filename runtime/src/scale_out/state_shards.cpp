#include "kvforge/state_shards.hpp"

#include <algorithm>
#include <cstring>
#include <string>

#include "kvforge/errors.hpp"
#include "base/fnv.hpp"

namespace kvforge {
namespace {

std::string degrees(int s, int r) { return "from a group of degree " + std::to_string(s) + " to one of " + std::to_string(r); }

}  // namespace

StateShards::StateShards(const std::vector<StatePart>& parts, int layers, const VariantDescriptor& d, int own_tp,
                         int sender_tp, int receiver_tp, const char* argument)
    : layers_(layers), sender_tp_(sender_tp), receiver_tp_(receiver_tp), model_heads_(d.model_heads),
      pieces_(shard_pieces(d.model_heads, sender_tp, receiver_tp)) {
  // Each part splits as the variant's spec says, where the record is the variant's; a record of its own
  // goes whole, between groups of one rank only.
  const StateRecord* r = d.states;
  bool own = r && r->num_linear == layers && r->num_parts == int(parts.size());
  for (int i = 0; own && i < r->num_parts; ++i)
    own = parts[size_t(i)].name == r->parts[i].name && parts[size_t(i)].dtype == r->parts[i].dtype &&
          parts[size_t(i)].shape == std::vector<int64_t>(r->parts[i].shape, r->parts[i].shape + r->parts[i].rank);
  if (!own && (sender_tp > 1 || receiver_tp > 1))
    throw ArgumentError(argument, std::string("a state goes ") + degrees(sender_tp, receiver_tp) +
                                     " only from and into a pool of the variant's own record (" + d.name +
                                     "'s model spec says how each part splits); this pool's record is another");
  hash_ = kFnvBasis;
  fnv_mix(hash_, uint64_t(layers));
  for (size_t i = 0; i < parts.size(); ++i) {
    const StatePart& p = parts[i];
    const int spec_axis = own ? r->parts[i].shard_axis : StatePartSpec::kWhole;
    if (spec_axis == StatePartSpec::kShapesPerDegree && sender_tp != receiver_tp)
      throw ArgumentError(argument, "part '" + p.name + "' has a shape of its own at each degree (shard_shapes), so it goes " +
                                       "only between groups of one degree, not " + degrees(sender_tp, receiver_tp));
    Part part{p.name, p.shape, dtype_size(p.dtype), std::max(spec_axis, 0), spec_axis >= 0,
              spec_axis == StatePartSpec::kShapesPerDegree};
    if (part.split) part.model_shape[size_t(part.axis)] *= own_tp;
    for (char c : p.name) fnv_mix(hash_, uint64_t(int64_t(c)));
    fnv_mix(hash_, uint64_t(p.dtype));
    fnv_mix(hash_, uint64_t(int64_t(spec_axis)));
    for (int64_t e : part.model_shape) fnv_mix(hash_, uint64_t(e));
    parts_.push_back(std::move(part));
  }
}

void StateShards::require_paired_with_heads(const char* argument) const {
  const bool any_split = std::any_of(parts_.begin(), parts_.end(), [](const Part& p) { return p.split; });
  for (int to = 0; to < receiver_tp_; ++to)
    for (int from = 0; from < sender_tp_; ++from) {
      const bool paired = std::any_of(pieces_.begin(), pieces_.end(), [&](const ShardPiece& p) {
        return p.sender == from && p.receiver == to;
      });
      if (any_split && !paired && !rows(from, to).empty())
        throw ArgumentError(argument, "sender rank " + std::to_string(from) + " holds part of receiver rank " + std::to_string(to) +
                                         "'s state but none of its K/V heads (" + degrees(sender_tp_, receiver_tp_) + " over " +
                                         std::to_string(model_heads_) + " KV heads); a state goes where the heads split alike");
    }
  for (size_t i = 0; i < parts_.size(); ++i)
    if (parts_[i].per_degree)
      for (const ShardPiece& p : pieces_)
        if (p.sender != p.receiver)
          throw ArgumentError(argument, "part '" + parts_[i].name + "' has a shape of its own at each rank (shard_shapes), and " +
                                           "receiver rank " + std::to_string(p.receiver) + " takes its heads from sender rank " +
                                           std::to_string(p.sender));
}

std::vector<StateRow> StateShards::rows(int sender, int receiver) const {
  const auto first = std::find_if(pieces_.begin(), pieces_.end(), [&](const ShardPiece& p) { return p.receiver == receiver; });
  const bool source = first != pieces_.end() && first->sender == sender;
  std::vector<StateRow> out;
  for (int layer = 0; layer < layers_; ++layer)
    for (size_t i = 0; i < parts_.size(); ++i) {
      const Part& p = parts_[i];
      int64_t outer = 1, inner = p.element_bytes;
      for (size_t a = 0; a < p.model_shape.size(); ++a) {
        if (int(a) < p.axis) outer *= p.model_shape[a];
        if (int(a) > p.axis) inner *= p.model_shape[a];
      }
      if (!p.split) {
        if (source) out.push_back({layer, int(i), 0, 0, outer * p.model_shape[size_t(p.axis)] * inner});
        continue;
      }
      // Each side's share of the model's extent along the axis: [rank * share, (rank + 1) * share).
      const int64_t extent = p.model_shape[size_t(p.axis)], on_sender = extent / sender_tp_, on_receiver = extent / receiver_tp_;
      const int64_t begin = std::max(sender * on_sender, receiver * on_receiver);
      const int64_t end = std::min((sender + 1) * on_sender, (receiver + 1) * on_receiver);
      if (begin >= end) continue;
      for (int64_t o = 0; o < outer; ++o)
        out.push_back({layer, int(i), (o * on_sender + begin - sender * on_sender) * inner,
                       (o * on_receiver + begin - receiver * on_receiver) * inner, (end - begin) * inner});
    }
  return out;
}

std::vector<std::vector<StateRow>> StateShards::piece_rows(const std::vector<ShardPiece>& pieces) const {
  std::vector<std::vector<StateRow>> out;
  for (size_t i = 0; i < pieces.size(); ++i) {
    const bool first = std::none_of(pieces.begin(), pieces.begin() + int64_t(i), [&](const ShardPiece& p) {
      return p.sender == pieces[i].sender && p.receiver == pieces[i].receiver;
    });
    out.push_back(first ? rows(pieces[i].sender, pieces[i].receiver) : std::vector<StateRow>{});
  }
  return out;
}

int64_t StateShards::bytes(const std::vector<StateRow>& rows) {
  int64_t total = 0;
  for (const StateRow& r : rows) total += r.bytes;
  return total;
}

void StateShards::pack(const std::vector<StateRow>& rows, const StatePool& pool, const unsigned char* image, unsigned char* message) {
  for (const StateRow& r : rows) {
    std::memcpy(message, image + pool.image_offset(r.layer, r.part) + r.sender_offset, size_t(r.bytes));
    message += r.bytes;
  }
}

void StateShards::unpack(const std::vector<StateRow>& rows, const StatePool& pool, const unsigned char* message, unsigned char* image) {
  for (const StateRow& r : rows) {
    std::memcpy(image + pool.image_offset(r.layer, r.part) + r.receiver_offset, message, size_t(r.bytes));
    message += r.bytes;
  }
}

}  // namespace kvforge
