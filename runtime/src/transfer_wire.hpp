// The wire between KvSender and KvReceiver (transfer.hpp): tags, the answer and its placement, the
// physical format's two sides, and the checks both sides share. Internal to transfer_*.cpp.
#pragma once

#include <algorithm>
#include <cstring>
#include <optional>
#include <string>
#include <vector>

#include "kvforge/checks.hpp"
#include "kvforge/transfer.hpp"

namespace kvforge::transfer_wire {

constexpr uint32_t kMagic = 0x6b76666bu;  // "kvfk"
constexpr uint32_t kVersion = 3;
constexpr uint16_t kCanWritePhysical = 1;  // TransferHeader::flags
constexpr uint16_t kWithdrawn = 2;         // TransferHeader::flags: the sender gave this attempt up
// A request's tags: its header and the receiver's answer in slots 0 and 1 of epoch 0, then layer l in
// slot 2 + l mod 254 of the epoch the receiver picked for this transfer (1 of 16).
constexpr int kHeaderSlot = 0, kAnswerSlot = 1, kFirstLayerSlot = 2, kEpochs = 16;

inline int tag_of(const Transport& t, int64_t request_id, int slot, int epoch = 0) {
  const int64_t requests = (int64_t(t.max_tag()) + 1) >> 12;
  return int(((request_id % requests + requests) % requests) << 12 | int64_t(epoch) << 8 | slot);
}

inline int layer_tag(const Transport& t, int64_t request_id, int layer, int epoch) {
  return tag_of(t, request_id, kFirstLayerSlot + layer % (256 - kFirstLayerSlot), epoch);
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

template <size_t N> void copy_fixed(char* to, const char* from) { std::memcpy(to, from, N); }

// One head's row of head_dim values; the common widths get a copy of known size.
inline void copy_row(char* to, const char* from, int64_t bytes) {
  switch (bytes) {
    case 64: return copy_fixed<64>(to, from);
    case 128: return copy_fixed<128>(to, from);
    case 256: return copy_fixed<256>(to, from);
    case 512: return copy_fixed<512>(to, from);
    default: std::memcpy(to, from, size_t(bytes));
  }
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

// Where a physical piece's values go on the wire: the receiver's dense blocks in the order its pool
// holds them, so that each run of adjacent blocks is one message received straight into the pool. A
// block is a wire page's values (page_size positions: a pool page, a whole row of a contiguous or ring
// cache, or one position where K and V interleave by position), or one head's of them where the
// receiver's heads lie apart. The value of (K|V kv, position t, head h) starts at wire element
//   block[((kv * pages + t / page_size) * head_blocks + (head_blocks > 1 ? h : 0)]
//     + (t % page_size) * slot_stride + h * head_stride          (head_stride is 0 when head_blocks > 1)
struct Placement {
  int64_t page_size = 1, slot_stride = 0, head_stride = 0, pages = 0, head_blocks = 1, wire_bytes = 0;
  std::vector<int64_t> block;  // [2][pages][head_blocks], elements
  std::vector<int64_t> runs;   // message lengths in bytes, in wire order
  std::vector<int64_t> run_at;  // the receiver's: where each run starts, bytes from layer 0's K
  int64_t at(int kv, int64_t t, int h) const {
    return block[size_t((kv * pages + t / page_size) * head_blocks + (head_blocks > 1 ? h : 0))] +
           (t % page_size) * slot_stride + h * head_stride;
  }
};

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

// The sender's reading of a physical answer, checked before it writes anything by it: every value of
// `heads` heads and `tokens` positions must fall inside the wire. Empty on success, else the problem.
inline std::string read_placement(const Answer& a, const int64_t* words, size_t count, int64_t tokens, int heads, int64_t D,
                           int64_t es, Placement& p) {
  p.page_size = a.page_size, p.slot_stride = a.slot_stride, p.head_stride = a.head_stride;
  p.pages = a.pages, p.head_blocks = a.head_blocks, p.wire_bytes = a.wire_bytes;
  if (p.page_size < 1 || p.slot_stride < 0 || p.head_stride < 0 || p.wire_bytes < 0 || a.runs < 0)
    return "a negative size or stride";
  if (p.head_blocks != 1 && (p.head_blocks != heads || p.head_stride != 0)) return "blocks that are not per page or per head";
  if (p.pages != (tokens + p.page_size - 1) / p.page_size) return "a page count that does not cover the tokens";
  const size_t blocks = 2 * size_t(p.pages) * size_t(p.head_blocks);
  if (kAnswerWords + blocks + size_t(a.runs) > count) return "a placement longer than its message";
  p.block.assign(words + kAnswerWords, words + kAnswerWords + blocks);
  p.runs.assign(words + kAnswerWords + blocks, words + kAnswerWords + blocks + a.runs);
  int64_t total = 0;
  for (int64_t r : p.runs) {
    if (r <= 0) return "an empty message";
    total += r;
  }
  if (total != p.wire_bytes || p.wire_bytes % es) return "message lengths that do not add up to the wire";
  const int64_t extent = (p.page_size - 1) * p.slot_stride + (heads - 1) * p.head_stride + D;
  for (int64_t base : p.block)
    if (base < 0 || base + extent > p.wire_bytes / es) return "a block outside the wire";
  return {};
}

// The receiver's side of the physical format: a Placement when both caches are unquantized host
// caches of one storage dtype, the piece is all of this rank's heads, and each page's slots and
// dims (and maybe heads) are dense, the same way in every layer. `pages`: the sequence's pages
// (paged), else null for row `row`.
inline std::optional<Placement> physical_placement(const Cache& c, const Transport& t, const TransferHeader& h,
                                            const std::vector<ShardPiece>& pieces, int heads, const int32_t* pages,
                                            int64_t row, int64_t tokens) {
  const VariantDescriptor& d = c.descriptor();
  if (!(h.flags & kCanWritePhysical) || h.storage != uint8_t(d.storage) || d.quant != Quant::none || d.is_hybrid() ||
      c.config().device != Device::cpu || !t.takes_memory_of(Device::cpu) || tokens == 0)
    return std::nullopt;
  if (pieces.size() != 1 || pieces[0].heads.count != heads) return std::nullopt;
  if (d.addressing == Addressing::ring && tokens > d.window) return std::nullopt;  // positions wrap: not one block
  const LayerView first = c.view(0);
  const Strides& s = first.strides;
  const int64_t P = d.paged() ? d.page_size : tokens, D = d.head_dim, es = dtype_size(first.dtype);
  // The dense block: a page's slots and dims, with its heads too if they follow on; or a page's heads
  // and dims and slots; or, where K and V interleave by position, one position's heads and dims (the
  // wire then has pages of one position, W = 1).
  int64_t dense = D, head_blocks = heads, W = P;
  if (P == 1 || s.seq_or_slot == D) {
    dense = P * D;
    if (heads == 1 || s.head == dense) dense *= heads, head_blocks = 1;
  } else if (heads == 1 || s.head == D) {
    head_blocks = 1;
    if (s.seq_or_slot == heads * D) dense = P * heads * D;
    else dense = heads * D, W = 1;
  } else {
    return std::nullopt;  // one row of head_dim values per block: as many messages as rows
  }
  const auto* k0 = static_cast<const char*>(first.k);
  const int64_t v_at = static_cast<const char*>(first.v) - k0;
  for (int layer = 1; layer < d.layers; ++layer) {
    const LayerView v = c.view(layer);
    if (v.strides.row_or_page != s.row_or_page || v.strides.seq_or_slot != s.seq_or_slot || v.strides.head != s.head ||
        static_cast<const char*>(v.v) - static_cast<const char*>(v.k) != v_at)
      return std::nullopt;
  }
  Placement p;
  p.page_size = W, p.slot_stride = W > 1 ? s.seq_or_slot : 0, p.head_stride = head_blocks > 1 ? 0 : s.head;
  p.pages = (tokens + W - 1) / W, p.head_blocks = head_blocks;
  const int64_t bytes = dense * es;  // one block
  struct Block {
    int64_t at;
    size_t entry;
  };
  std::vector<Block> blocks;
  for (int kv = 0; kv < 2; ++kv)
    for (int64_t i = 0; i < p.pages; ++i) {
      // Wire page i is pool page i (W = P) or position i (W = 1).
      const int64_t position = i * W, page = pages ? pages[position / P] : row, slot = position % P;
      for (int64_t hb = 0; hb < head_blocks; ++hb)
        blocks.push_back({(kv ? v_at : 0) + (page * s.row_or_page + slot * s.seq_or_slot + (head_blocks > 1 ? hb * s.head : 0)) * es,
                          size_t((kv * p.pages + i) * head_blocks + hb)});
    }
  std::sort(blocks.begin(), blocks.end(), [](const Block& a, const Block& b) { return a.at < b.at; });
  p.block.assign(blocks.size(), 0);
  for (const Block& b : blocks) {
    if (!p.runs.empty() && b.at < p.run_at.back() + p.runs.back()) return std::nullopt;  // blocks overlap
    if (!p.runs.empty() && b.at == p.run_at.back() + p.runs.back()) p.runs.back() += bytes;
    else p.run_at.push_back(b.at), p.runs.push_back(bytes);
    p.block[b.entry] = p.wire_bytes / es;
    p.wire_bytes += bytes;
  }
  return p;
}

// The sender's side: one layer of its heads [head_offset, head_offset + heads) into a physical
// piece's wire, in one pass over its pool. `pages` is the sequence's page list (paged) or null
// (contiguous: row `row`).
inline void write_physical(const LayerView& src, const int32_t* pages, int64_t src_page_size, int64_t row, int head_offset,
                    int heads, int64_t tokens, int64_t D, const Placement& p, char* wire) {
  const Strides& s = src.strides;
  const int64_t es = dtype_size(src.dtype), row_bytes = D * es;
  // A token's heads adjacent on both sides: one copy per token.
  const bool whole_tokens = heads == 1 || (s.head == D && p.head_blocks == 1 && p.head_stride == D);
  for (int kv = 0; kv < 2; ++kv) {
    const char* base = static_cast<const char*>(kv ? src.v : src.k) + head_offset * s.head * es;
    for (int64_t t = 0; t < tokens; ++t) {
      const int64_t at = pages ? pages[t / src_page_size] * s.row_or_page + (t % src_page_size) * s.seq_or_slot
                               : row * s.row_or_page + t * s.seq_or_slot;
      const char* from = base + at * es;
      if (whole_tokens) std::memcpy(wire + p.at(kv, t, 0) * es, from, size_t(heads * row_bytes));
      else
        for (int h = 0; h < heads; ++h) copy_row(wire + p.at(kv, t, h) * es, from + h * s.head * es, row_bytes);
    }
    // The last page past the sequence: zeros, never bytes a buffer held for another request.
    for (int64_t t = tokens; t < p.pages * p.page_size; ++t)
      for (int h = 0; h < heads; ++h) std::memset(wire + p.at(kv, t, h) * es, 0, size_t(row_bytes));
  }
}

// The physical format reads the sender's pool with plain loops, not through gather: the range is
// checked here first, as gather would check it.
inline void check_physical_range(const Cache& c, const GatherRange& range, int64_t tokens) {
  const VariantDescriptor& d = c.descriptor();
  const Capacity capacity = detail::capacity_of(d, c.config());
  if (d.paged()) {
    const int64_t pages = (tokens + d.page_size - 1) / d.page_size;
    detail::check_index_view("range.pages", range.pages, DType::i32, pages, c.config().device);
    detail::check_indices_on_host(
        detail::IndexCheckArgs{range.pages.data, false, pages, 0, capacity.pages, false, detail::kCheckPages, nullptr});
  } else {
    if (range.row < 0 || range.row >= capacity.rows) throw OutOfRangeError("range.row", range.row, 0, capacity.rows);
    if (tokens > capacity.positions)
      throw OutOfRangeError("tokens.size()", tokens, 0, capacity.positions + 1, -1,
                            "the cache holds max_seq_len=" + std::to_string(capacity.positions) + " positions per row");
  }
}

constexpr Transport::Handle kNone = -1;

}  // namespace kvforge::transfer_wire
