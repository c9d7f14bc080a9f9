// A hybrid model's state slot between tensor-parallel groups (transfer_sender.cpp, transfer_receiver.cpp):
// what each piece of a transfer (a sender and a receiver that exchange K/V heads, shard_pieces) carries
// of a sequence's state, and how it is packed. Internal to transfer_*.cpp.
//
// A part split on an axis (its spec's shard_axis) goes in slabs of that axis: piece (s, r) carries the
// model's [begin, end) there that both sender s and receiver r hold. A part that every rank holds whole,
// or one whose spec gives each degree's shape (shard_shapes, between groups of one degree only), goes
// whole from one sender to each receiver: the sender of the receiver's first piece. A message packs its
// slabs in (layer, part) order, each slab's rows one after another, from and into StatePool's host image.
#pragma once

#include <cstdint>
#include <vector>

#include "kvforge/descriptor.hpp"
#include "kvforge/shard.hpp"
#include "kvforge/state_pool.hpp"

namespace kvforge::transfer_state {

struct Slab {
  int layer, part;
  int64_t begin, end;  // along the part's split axis (axis 0 of a whole part), in the model's coordinates
};

class StateShards {
 public:
  // The state this rank (`rank` of a group of degree `own_tp`) holds in `pool`, to go between groups of
  // degrees sender_tp and receiver_tp. ArgumentError(argument) where it cannot: a degree above 1 with a
  // pool whose record is not the variant's (whose spec says how each part splits), a part given per
  // degree between groups of two degrees, or a slab between two ranks that exchange no K/V heads.
  StateShards(const StatePool& pool, const VariantDescriptor& d, int rank, int own_tp, int sender_tp, int receiver_tp,
              const char* argument);

  std::vector<Slab> slabs(const ShardPiece& piece) const;  // empty: the piece carries no state
  int64_t bytes(const std::vector<Slab>& slabs) const;     // of the packed message
  // What the model's state record is, whichever degree holds it: layers, and each part's name, dtype,
  // split and the model's shape. Both groups must agree.
  uint64_t model_record_hash() const { return hash_; }
  // Between this rank's host image (StatePool::read_slot's) and a piece's packed message.
  void pack(const std::vector<Slab>& slabs, const unsigned char* image, unsigned char* message) const;
  void unpack(const std::vector<Slab>& slabs, const unsigned char* message, unsigned char* image) const;

 private:
  struct Part {
    std::vector<int64_t> shape;  // this rank's
    int64_t element_bytes;
    int axis;    // the split axis, or 0
    bool split;  // on `axis`, extent / degree a rank
  };
  template <class Move> void walk(const std::vector<Slab>& slabs, Move&& move) const;

  const StatePool& pool_;
  std::vector<Part> parts_;
  int rank_, own_tp_, sender_tp_, receiver_tp_;
  std::vector<ShardPiece> pieces_;  // every piece of the transfer, both groups' ranks
  uint64_t hash_ = 0;
};

}  // namespace kvforge::transfer_state
