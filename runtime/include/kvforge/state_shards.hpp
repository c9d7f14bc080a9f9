// A hybrid model's state slot between tensor-parallel groups (KvSender and KvReceiver, transfer.hpp;
// kvforge.nixl's pull_state): what a sender rank gives a receiver rank of a sequence's state, row by row,
// with where each row lies in the part on either side.
//
// A part split on an axis (its spec's shard_axis) goes in slabs of that axis: sender s gives receiver r
// the model's [begin, end) there that both hold, a row for each index of the axes before it. A part that
// every rank holds whole, or one whose spec gives each degree's shape (shard_shapes, between groups of
// one degree only), goes whole from one sender to each receiver: the sender of the receiver's first
// piece of heads (shard_pieces). A message holds its rows in (layer, part) order, one after another.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "kvforge/descriptor.hpp"
#include "kvforge/shard.hpp"
#include "kvforge/state_pool.hpp"

namespace kvforge {

struct StateRow {
  int layer, part;
  int64_t sender_offset, receiver_offset;  // bytes from the part's start, in each side's own shape
  int64_t bytes;
};

class StateShards {
 public:
  // The state record `parts` over `layers` layers, held at degree own_tp by a variant `d` (a shard, or the
  // whole model), to go from a group of degree sender_tp to one of receiver_tp. Where the record is the
  // variant's, each part splits as its spec says; another record goes whole. ArgumentError(argument)
  // where it cannot go: a degree above 1 with a record other than the variant's, or a part given per
  // degree between groups of two degrees.
  StateShards(const std::vector<StatePart>& parts, int layers, const VariantDescriptor& d, int own_tp, int sender_tp,
              int receiver_tp, const char* argument);

  // For a transfer whose messages go with the heads (KvSender, KvReceiver): every pair of ranks that
  // has rows to exchange exchanges heads too, and a part given per degree goes only from rank r to r.
  void require_paired_with_heads(const char* argument) const;
  std::vector<StateRow> rows(int sender, int receiver) const;  // empty: nothing goes between them
  // rows() for each of a side's pieces of heads, where the first piece of each (sender, receiver) pair
  // carries them and any other none.
  std::vector<std::vector<StateRow>> piece_rows(const std::vector<ShardPiece>& pieces) const;
  static int64_t bytes(const std::vector<StateRow>& rows);
  // What the model's state record is, whichever degree holds it: layers, and each part's name, dtype,
  // split and the model's shape. Both groups must agree.
  uint64_t model_record_hash() const { return hash_; }
  // Between a side's host image (StatePool::read_slot's, of `pool`) and a message.
  static void pack(const std::vector<StateRow>& rows, const StatePool& pool, const unsigned char* image, unsigned char* message);
  static void unpack(const std::vector<StateRow>& rows, const StatePool& pool, const unsigned char* message, unsigned char* image);

 private:
  struct Part {
    std::string name;
    std::vector<int64_t> model_shape;
    int64_t element_bytes;
    int axis;    // the split axis, or 0
    bool split;  // on `axis`, extent / degree a rank
    bool per_degree;
  };
  std::vector<Part> parts_;
  int layers_, sender_tp_, receiver_tp_, model_heads_;
  std::vector<ShardPiece> pieces_;  // every piece of heads, both groups' ranks
  uint64_t hash_ = 0;
};

}  // namespace kvforge
