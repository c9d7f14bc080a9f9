#include "transfer_state.hpp"

#include <algorithm>
#include <cstring>
#include <string>

#include "kvforge/errors.hpp"

namespace kvforge::transfer_state {
namespace {

constexpr uint64_t kFnvBasis = 1469598103934665603ull, kFnvPrime = 1099511628211ull;

void mix(uint64_t& h, int64_t x) {
  for (int i = 0; i < 8; ++i) h = (h ^ uint64_t((x >> (8 * i)) & 0xff)) * kFnvPrime;
}

std::string degrees(int s, int r) { return "from a group of degree " + std::to_string(s) + " to one of " + std::to_string(r); }

}  // namespace

StateShards::StateShards(const StatePool& pool, const VariantDescriptor& d, int rank, int own_tp, int sender_tp,
                         int receiver_tp, const char* argument)
    : pool_(pool), rank_(rank), own_tp_(own_tp), sender_tp_(sender_tp), receiver_tp_(receiver_tp),
      pieces_(shard_pieces(d.model_heads, sender_tp, receiver_tp)) {
  const bool sharded = sender_tp > 1 || receiver_tp > 1;
  const StateRecord* r = d.states;
  if (sharded) {
    // The split of each part is the variant's spec's: the pool must hold that record.
    bool same = r && r->num_linear == pool.layers() && r->num_parts == int(pool.parts().size());
    for (int i = 0; same && i < r->num_parts; ++i) {
      const StatePart& p = pool.parts()[size_t(i)];
      same = p.name == r->parts[i].name && p.dtype == r->parts[i].dtype &&
             p.shape == std::vector<int64_t>(r->parts[i].shape, r->parts[i].shape + r->parts[i].rank);
    }
    if (!same)
      throw ArgumentError(argument, std::string("a state goes ") + degrees(sender_tp, receiver_tp) +
                                       " only from a pool of the variant's own record (" + d.name +
                                       "'s model spec says how each part splits); this pool's record is another");
  }
  hash_ = kFnvBasis;
  mix(hash_, pool.layers());
  for (size_t i = 0; i < pool.parts().size(); ++i) {
    const StatePart& p = pool.parts()[i];
    const int spec_axis = sharded ? r->parts[i].shard_axis : StatePartSpec::kWhole;
    Part part{p.shape, dtype_size(p.dtype), std::max(spec_axis, 0), spec_axis >= 0};
    if (spec_axis == StatePartSpec::kShapesPerDegree && sender_tp != receiver_tp)
      throw ArgumentError(argument, "part '" + p.name + "' has a shape of its own at each degree (shard_shapes), so it goes " +
                                       "only between groups of one degree, not " + degrees(sender_tp, receiver_tp));
    for (char c : p.name) mix(hash_, c);
    mix(hash_, int64_t(p.dtype));
    mix(hash_, spec_axis);
    for (size_t a = 0; a < p.shape.size(); ++a) mix(hash_, p.shape[a] * (part.split && int(a) == part.axis ? own_tp : 1));
    parts_.push_back(std::move(part));
  }
  // Every slab goes with a piece: the two ranks must exchange K/V heads too.
  for (int to = 0; to < receiver_tp; ++to)
    for (int from = 0; from < sender_tp; ++from) {
      const bool paired = std::any_of(pieces_.begin(), pieces_.end(), [&](const ShardPiece& p) {
        return p.sender == from && p.receiver == to;
      });
      // Split parts overlap where the two ranks' shares of the model's extent do; a share is 1 / degree.
      const bool overlap = int64_t(from) * receiver_tp < int64_t(to + 1) * sender_tp &&
                           int64_t(to) * sender_tp < int64_t(from + 1) * receiver_tp;
      const bool any_split = std::any_of(parts_.begin(), parts_.end(), [](const Part& p) { return p.split; });
      if (any_split && overlap && !paired)
        throw ArgumentError(argument, "sender rank " + std::to_string(from) + " holds part of receiver rank " + std::to_string(to) +
                                         "'s state but none of its K/V heads (" + degrees(sender_tp, receiver_tp) + " over " +
                                         std::to_string(d.model_heads) + " KV heads); a state goes where the heads split alike");
    }
  for (size_t i = 0; i < parts_.size(); ++i)
    if (r && sharded && r->parts[i].shard_axis == StatePartSpec::kShapesPerDegree)
      for (const ShardPiece& p : pieces_)
        if (p.sender != p.receiver)
          throw ArgumentError(argument, "part '" + pool.parts()[i].name + "' has a shape of its own at each rank " +
                                           "(shard_shapes), and receiver rank " + std::to_string(p.receiver) +
                                           " takes its heads from sender rank " + std::to_string(p.sender));
}

std::vector<Slab> StateShards::slabs(const ShardPiece& piece) const {
  const auto first = std::find_if(pieces_.begin(), pieces_.end(), [&](const ShardPiece& p) { return p.receiver == piece.receiver; });
  const bool source = first != pieces_.end() && first->sender == piece.sender;
  std::vector<Slab> out;
  for (int layer = 0; layer < pool_.layers(); ++layer)
    for (size_t i = 0; i < parts_.size(); ++i) {
      const Part& p = parts_[i];
      if (!p.split) {
        if (source) out.push_back({layer, int(i), 0, p.shape[0]});
        continue;
      }
      const int64_t extent = p.shape[size_t(p.axis)] * own_tp_;  // the model's, the same in both groups
      const int64_t begin = std::max(extent * piece.sender / sender_tp_, extent * piece.receiver / receiver_tp_);
      const int64_t end = std::min(extent * (piece.sender + 1) / sender_tp_, extent * (piece.receiver + 1) / receiver_tp_);
      if (begin < end) out.push_back({layer, int(i), begin, end});
    }
  return out;
}

// Calls move(image offset, message offset, bytes) for each row of each slab, in the message's order.
template <class Move> void StateShards::walk(const std::vector<Slab>& slabs, Move&& move) const {
  int64_t at = 0;
  for (const Slab& s : slabs) {
    const Part& p = parts_[size_t(s.part)];
    int64_t outer = 1, inner = p.element_bytes;
    for (size_t a = 0; a < p.shape.size(); ++a) {
      if (int(a) < p.axis) outer *= p.shape[a];
      if (int(a) > p.axis) inner *= p.shape[a];
    }
    const int64_t extent = p.shape[size_t(p.axis)];
    const int64_t mine = p.split ? int64_t(rank_) * extent : 0;  // where this rank's share begins
    const int64_t row = (s.end - s.begin) * inner;
    const int64_t base = pool_.image_offset(s.layer, s.part);
    for (int64_t o = 0; o < outer; ++o, at += row) move(base + (o * extent + s.begin - mine) * inner, at, row);
  }
}

int64_t StateShards::bytes(const std::vector<Slab>& slabs) const {
  int64_t total = 0;
  walk(slabs, [&](int64_t, int64_t, int64_t n) { total += n; });
  return total;
}

void StateShards::pack(const std::vector<Slab>& slabs, const unsigned char* image, unsigned char* message) const {
  walk(slabs, [&](int64_t in_image, int64_t in_message, int64_t n) { std::memcpy(message + in_message, image + in_image, size_t(n)); });
}

void StateShards::unpack(const std::vector<Slab>& slabs, const unsigned char* message, unsigned char* image) const {
  walk(slabs, [&](int64_t in_image, int64_t in_message, int64_t n) { std::memcpy(image + in_image, message + in_message, size_t(n)); });
}

}  // namespace kvforge::transfer_state
