// The wire between KvSender and KvReceiver (transfer.hpp): tags, the answer and its placement, the
// physical format's two sides, and the checks both sides share. Internal to transfer_*.cpp.
#pragma once

#include <algorithm>
#include <cstring>
#include <optional>
#include <string>
#include <vector>

#include "kvforge/physical_wire.hpp"
#include "kvforge/transfer.hpp"

namespace kvforge::transfer_wire {

constexpr uint32_t kMagic = 0x6b76666bu;  // "kvfk"
constexpr uint32_t kVersion = 6;
constexpr uint16_t kCanWritePhysical = 1;  // TransferHeader::flags
constexpr uint16_t kWithdrawn = 2;         // TransferHeader::flags: the sender gave this attempt up
// A request's tags: its header and the receiver's answer in slots 0 and 1 of epoch 0, then layer l in
// slot 2 + l mod 253 and the state slot in slot 255 of the epoch the receiver picked for this transfer
// (1 of 16).
constexpr int kHeaderSlot = 0, kAnswerSlot = 1, kFirstLayerSlot = 2, kStateSlot = 255, kEpochs = 16;

inline int tag_of(const Transport& t, int64_t request_id, int slot, int epoch = 0) {
  const int64_t requests = (int64_t(t.max_tag()) + 1) >> 12;
  return int(((request_id % requests + requests) % requests) << 12 | int64_t(epoch) << 8 | slot);
}

inline int layer_tag(const Transport& t, int64_t request_id, int layer, int epoch) {
  return tag_of(t, request_id, kFirstLayerSlot + layer % (kStateSlot - kFirstLayerSlot), epoch);
}

inline int64_t tag_bits(const Transport& t, int64_t request_id) { return tag_of(t, request_id, kHeaderSlot) >> 12; }

// Before anything is posted or allocated: the request's tags are free, and every peer is a rank.
template <class InFlight>
inline void check_request(const Transport& t, const InFlight& in_flight, int64_t request_id, const PeerGroup& peers,
                   const char* peers_argument) {
  for (const auto& [id, transfer] : in_flight)
    if (tag_bits(t, id) == tag_bits(t, request_id))
      throw ArgumentError("request_id", std::to_string(request_id) + " shares its message tags with request " +
                                            std::to_string(id) + ", still in flight");
  for (size_t i = 0; i < peers.ranks.size(); ++i)
    if (peers.ranks[i] < 0 || peers.ranks[i] >= t.size())
      throw OutOfRangeError(std::string(peers_argument) + ".ranks", peers.ranks[i], 0, t.size(), int64_t(i));
}

// Polls each handle, dropping the completed ones; true when none is left.
inline bool drain(Transport& t, std::vector<Transport::Handle>& handles) {
  handles.erase(std::remove_if(handles.begin(), handles.end(), [&](Transport::Handle h) { return t.poll(h); }),
                handles.end());
  return handles.empty();
}

// One layer in flight: its buffers (logical staging, and one wire per physical piece) and messages.
struct Slot {
  Staging logical;
  std::vector<Staging> physical;  // per piece; empty for a logical piece
  int layer = -1;
  std::vector<Transport::Handle> pending;
};

// A slot's buffers back to the pool, for the next layer or transfer.
inline void give_back(StagingPool& pool, Slot& s) {
  pool.give(std::move(s.logical));
  for (Staging& w : s.physical) pool.give(std::move(w));
}

// k and v views of a logical staging buffer holding `heads` heads: [tokens, heads, head_dim] (append)
// or [heads, tokens, head_dim] (gather), strided over the [heads, 2, tokens, head_dim] block.
inline TensorView staging_view(void* base, const VariantDescriptor& d, Device device, int heads, int64_t tokens, int kv,
                        bool tokens_outside) {
  const int64_t D = d.head_dim, head_stride = 2 * tokens * D;
  TensorView t;
  t.data = static_cast<char*>(base) + kv * tokens * D * dtype_size(d.input);
  t.dtype = d.input;
  t.device = device;
  if (tokens_outside) t.shape = {tokens, heads, D}, t.stride = {D, head_stride, 1};
  else t.shape = {heads, tokens, D}, t.stride = {head_stride, D, 1};
  return t;
}

// A host view of a gathered layer in logical staging ([heads, K|V, tokens, head_dim], the input dtype):
// one row of `tokens` positions, which the physical wire's writer reads as it reads a pool.
inline LayerView gathered_view(const Staging& s, const VariantDescriptor& d, int heads, int64_t tokens) {
  const char* host = static_cast<const char*>(s.staged() ? s.wire.data() : s.device.data());
  LayerView v;
  v.k = host;
  v.v = host + tokens * d.head_dim * dtype_size(d.input);
  v.dtype = d.input;
  v.device = Device::cpu;
  v.strides.seq_or_slot = d.head_dim;
  v.strides.head = 2 * tokens * d.head_dim;
  v.rows_or_pages = 1, v.seq_or_slots = tokens, v.heads = heads, v.head_dim = d.head_dim;
  return v;
}

template <size_t N> void copy_name(char (&out)[N], const char* name) {
  std::memset(out, 0, N);
  std::strncpy(out, name, N - 1);
}

// The receiver's answer to one piece's header. A physical piece's answer goes on with its Placement:
// its `blocks` int64 block offsets, then `runs` int64 message lengths.
struct Answer {
  uint32_t magic, version;
  int64_t request_id;
  uint64_t attempt;  // the header's, echoed: a sender drops answers to its earlier attempts
  int64_t epoch;     // the layer tags' epoch for this transfer
  int32_t refused;   // 0: accepted
  int32_t physical;  // 1: the physical wire format, placed as below
  char field[48];    // refused: the field the receiver's TransferError names
  int64_t page_size, slot_stride, head_stride, pages, head_blocks, runs, wire_bytes;
};
static_assert(sizeof(Answer) % sizeof(int64_t) == 0, "an answer is whole int64 words");
constexpr size_t kAnswerWords = sizeof(Answer) / sizeof(int64_t);

using Placement = PhysicalPlacement;

inline std::vector<int64_t> encode_answer(const TransferHeader& h, int epoch, const char* refused_field, const Placement* p) {
  Answer a{};
  a.magic = kMagic, a.version = kVersion, a.request_id = h.request_id, a.attempt = h.attempt, a.epoch = epoch;
  a.refused = refused_field != nullptr;
  if (refused_field) copy_name(a.field, refused_field);
  a.physical = p != nullptr;
  std::vector<int64_t> out(kAnswerWords);
  if (p) {
    a.page_size = p->page_size, a.slot_stride = p->slot_stride, a.head_stride = p->head_stride;
    a.pages = p->pages, a.head_blocks = p->head_blocks, a.runs = int64_t(p->runs.size()), a.wire_bytes = p->wire_bytes;
    out.insert(out.end(), p->block.begin(), p->block.end());
    out.insert(out.end(), p->runs.begin(), p->runs.end());
  }
  std::memcpy(out.data(), &a, sizeof a);
  return out;
}

// The words a sender posts for an answer about `heads` heads and `tokens` positions: the longest
// placement can have (pages of one position, a block per head, none adjacent).
inline size_t answer_capacity(int64_t tokens, int heads) {
  return kAnswerWords + 4 * size_t(std::max<int64_t>(tokens, 1)) * size_t(std::max(heads, 1));
}

// The sender's reading of a physical answer, checked before it writes anything by it
// (placement_problem). Empty on success, else the problem.
inline std::string read_placement(const Answer& a, const int64_t* words, size_t count, int64_t tokens, int heads, int64_t D,
                           int64_t es, Placement& p) {
  p.page_size = a.page_size, p.slot_stride = a.slot_stride, p.head_stride = a.head_stride;
  p.pages = a.pages, p.head_blocks = a.head_blocks, p.wire_bytes = a.wire_bytes;
  if (p.page_size < 1 || p.pages < 0 || p.head_blocks < 1 || a.runs < 0) return "a negative size or stride";
  if (!pages_cover(p, tokens)) return "a page count that does not cover the tokens";
  if (p.head_blocks != 1 && p.head_blocks != heads) return "blocks that are not per page or per head";
  const size_t blocks = 2 * size_t(p.pages) * size_t(p.head_blocks);
  if (kAnswerWords + blocks + size_t(a.runs) > count) return "a placement longer than its message";
  p.block.assign(words + kAnswerWords, words + kAnswerWords + blocks);
  p.runs.assign(words + kAnswerWords + blocks, words + kAnswerWords + blocks + a.runs);
  return placement_problem(p, tokens, heads, D, es);
}

// The receiver's side of the physical format: a Placement when both caches are unquantized host
// caches of one storage dtype, the piece is all of this rank's heads, and each page's slots and
// dims (and maybe heads) are dense, the same way in every layer. `pages`: the sequence's pages
// (paged), else null for row `row`.
inline std::optional<Placement> physical_placement(const Cache& c, const Transport& t, const TransferHeader& h,
                                            const std::vector<ShardPiece>& pieces, int heads, const int32_t* pages,
                                            int64_t row, int64_t tokens) {
  if (!(h.flags & kCanWritePhysical) || h.storage != uint8_t(c.descriptor().storage) || !t.takes_memory_of(Device::cpu))
    return std::nullopt;
  if (pieces.size() != 1 || pieces[0].heads.count != heads) return std::nullopt;
  return kvforge::physical_placement(c, pages, row, tokens);
}

constexpr Transport::Handle kNone = -1;

}  // namespace kvforge::transfer_wire
