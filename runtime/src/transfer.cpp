#include "kvforge/transfer.hpp"

#include <algorithm>
#include <cstring>
#include <optional>
#include <random>

#include "kvforge/checks.hpp"

namespace kvforge {
namespace {

constexpr uint32_t kMagic = 0x6b76666bu;  // "kvfk"
constexpr uint32_t kVersion = 3;
constexpr uint16_t kCanWritePhysical = 1;  // TransferHeader::flags
constexpr uint16_t kWithdrawn = 2;         // TransferHeader::flags: the sender gave this attempt up
// A request's tags: its header and the receiver's answer in slots 0 and 1 of epoch 0, then layer l in
// slot 2 + l mod 254 of the epoch the receiver picked for this transfer (1 of 16).
constexpr int kHeaderSlot = 0, kAnswerSlot = 1, kFirstLayerSlot = 2, kEpochs = 16;

int tag_of(const Transport& t, int64_t request_id, int slot, int epoch = 0) {
  const int64_t requests = (int64_t(t.max_tag()) + 1) >> 12;
  return int(((request_id % requests + requests) % requests) << 12 | int64_t(epoch) << 8 | slot);
}

int layer_tag(const Transport& t, int64_t request_id, int layer, int epoch) {
  return tag_of(t, request_id, kFirstLayerSlot + layer % (256 - kFirstLayerSlot), epoch);
}

int64_t tag_bits(const Transport& t, int64_t request_id) { return tag_of(t, request_id, kHeaderSlot) >> 12; }

// Before anything is posted or allocated: the request's tags are free, and every peer is a rank.
template <class InFlight>
void check_request(const Transport& t, const InFlight& in_flight, int64_t request_id, const PeerGroup& peers,
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
bool drain(Transport& t, std::vector<Transport::Handle>& handles) {
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
TensorView staging_view(void* base, const VariantDescriptor& d, Device device, int heads, int64_t tokens, int kv,
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

std::vector<int64_t> encode_answer(const TransferHeader& h, int epoch, const char* refused_field, const Placement* p) {
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
size_t answer_capacity(int64_t tokens, int heads) {
  return kAnswerWords + 4 * size_t(std::max<int64_t>(tokens, 1)) * size_t(std::max(heads, 1));
}

// The sender's reading of a physical answer, checked before it writes anything by it: every value of
// `heads` heads and `tokens` positions must fall inside the wire. Empty on success, else the problem.
std::string read_placement(const Answer& a, const int64_t* words, size_t count, int64_t tokens, int heads, int64_t D,
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
std::optional<Placement> physical_placement(const Cache& c, const Transport& t, const TransferHeader& h,
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
void write_physical(const LayerView& src, const int32_t* pages, int64_t src_page_size, int64_t row, int head_offset,
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
void check_physical_range(const Cache& c, const GatherRange& range, int64_t tokens) {
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

}  // namespace

Staging StagingPool::take(Transport& transport, Device device, int64_t bytes) {
  bytes = std::max<int64_t>(bytes, 1);
  auto best = spare_.end();
  for (auto it = spare_.begin(); it != spare_.end(); ++it)
    if (it->on == device && it->device.bytes() >= bytes && (best == spare_.end() || it->device.bytes() < best->device.bytes()))
      best = it;
  if (best != spare_.end()) {
    Staging s = std::move(*best);
    spare_.erase(best);
    return s;
  }
  Backend& b = backend(device);
  Staging s;
  s.on = device;
  s.device = Buffer(b, bytes);
  if (!transport.takes_memory_of(device)) s.wire = Buffer(b.host(), bytes);
  transport.register_memory(s.wire_data(), bytes);
  return s;
}

void StagingPool::give(Staging s) {
  if (!s.device.data()) return;
  spare_.push_back(std::move(s));
  std::sort(spare_.begin(), spare_.end(), [](const Staging& a, const Staging& b) { return a.device.bytes() > b.device.bytes(); });
  if (spare_.size() > size_t(std::max(keep, 0))) spare_.resize(size_t(std::max(keep, 0)));
}

uint64_t token_hash(const std::vector<int32_t>& tokens) {
  uint64_t h = 1469598103934665603ull;
  for (int32_t t : tokens)
    for (int i = 0; i < 4; ++i) h = (h ^ ((uint32_t(t) >> (8 * i)) & 0xffu)) * 1099511628211ull;
  return h;
}

// ---- the sender ----------------------------------------------------------------------------------

struct KvSender::Outgoing {
  int64_t request_id;
  GatherRange range;
  Buffer pages;  // its own copy of the range's page list: the caller's may be scratch reused next call
  int64_t tokens;
  PeerGroup receivers;
  std::vector<ShardPiece> pieces;  // this rank's
  std::vector<TransferHeader> headers;
  std::vector<Transport::Handle> header_sends;
  std::vector<std::vector<int64_t>> answers;  // per piece
  std::vector<Transport::Handle> answer_recvs;  // per piece; kNone once its answer is in
  std::vector<TransferHeader> withdrawals;      // sent where an answer never came (posted sends point here)
  std::vector<int> epochs;                      // per piece: its receiver's layer-tag epoch
  bool answered = false;
  uint64_t attempt = 0;
  std::vector<std::optional<Placement>> placements;  // per piece: physical, or logical (empty)
  std::vector<Slot> ring;
  int next_layer = 0;
  bool abandoned = false;
  std::chrono::steady_clock::time_point started;
};

namespace {
constexpr Transport::Handle kNone = -1;

// A random start, so that two senders (or two runs of one program) never number attempts alike.
uint64_t first_attempt() {
  std::random_device seed;
  return uint64_t(seed()) << 32 ^ seed();
}
}  // namespace

KvSender::KvSender(Cache& cache, int tp_rank, Transport& transport, TransferOptions options)
    : cache_(cache), tp_rank_(tp_rank), transport_(transport), options_(options), next_attempt_(first_attempt()) {
  shard_heads(cache.descriptor(), tp_rank);  // checks the rank
  if (options_.ring_layers < 1) throw OutOfRangeError("options.ring_layers", options_.ring_layers, 1, 1025);
  spare_.keep = 2 * options_.ring_layers;
}

KvSender::~KvSender() {
  for (auto& [id, o] : outgoing_)
    for (Transport::Handle h : o->answer_recvs)
      if (h != kNone) transport_.cancel(h);
}

void KvSender::send(int64_t request_id, const GatherRange& range, const std::vector<int32_t>& tokens,
                    const PeerGroup& receivers) {
  const VariantDescriptor& d = cache_.descriptor();
  const Device device = cache_.config().device;
  check_request(transport_, outgoing_, request_id, receivers, "receivers");
  // The physical format reads the pool with plain loops: host memory, one value per element.
  const int64_t T = int64_t(tokens.size());
  bool physical = options_.physical && d.quant == Quant::none && !d.is_hybrid() && device == Device::cpu &&
                  transport_.takes_memory_of(Device::cpu);
  if (physical) check_physical_range(cache_, range, T);
  if (physical && d.addressing == Addressing::ring) {
    // A ring holds position p in cell p mod window: [0, T) is in place while no position has wrapped.
    // Otherwise the logical format goes, and gather says what is wrong with the range.
    const int64_t length = cache_.row_length(range.row);
    physical = T <= length && length <= d.window;
  }
  auto o = std::make_unique<Outgoing>();
  o->request_id = request_id;
  o->range = range;
  o->range.begin = 0;
  o->range.end = int64_t(tokens.size());
  if (range.pages.size > 0) {
    Backend& b = backend(device);
    const int64_t bytes = range.pages.size * dtype_size(range.pages.dtype);
    o->pages = Buffer(b, bytes);
    if (range.pages.device == device) b.copy(o->pages.data(), range.pages.data, bytes, cache_.config().stream);
    else b.from_host(o->pages.data(), range.pages.data, bytes, cache_.config().stream);
    o->range.pages.data = o->pages.data();
    o->range.pages.device = device;
  }
  o->tokens = int64_t(tokens.size());
  o->receivers = receivers;
  for (const ShardPiece& p : shard_pieces(d.model_heads, d.tensor_parallel, receivers.tp()))
    if (p.sender == tp_rank_) o->pieces.push_back(p);
  TransferHeader h{};
  h.magic = kMagic, h.version = kVersion;
  copy_name(h.layout, d.layout);
  h.page_size = d.page_size;
  h.storage = uint8_t(d.storage), h.input = uint8_t(d.input);
  h.flags = physical ? kCanWritePhysical : 0;
  h.model_heads = d.model_heads, h.layers = d.layers, h.head_dim = d.head_dim;
  h.sender_tp = d.tensor_parallel, h.sender_rank = tp_rank_;
  h.layer_begin = 0, h.layer_count = d.layers;
  h.tokens = o->tokens, h.request_id = request_id, h.token_hash = token_hash(tokens);
  h.attempt = o->attempt = next_attempt_++;
  o->headers.reserve(o->pieces.size());  // posted sends and receives point into these
  o->answers.reserve(o->pieces.size());
  o->withdrawals.reserve(o->pieces.size());
  o->epochs.assign(o->pieces.size(), 0);
  for (const ShardPiece& p : o->pieces) {
    const int peer = receivers.ranks[size_t(p.receiver)];
    h.head_begin = p.heads.begin, h.head_count = p.heads.count;
    o->headers.push_back(h);
    o->header_sends.push_back(transport_.post_send(&o->headers.back(), sizeof h, peer, tag_of(transport_, request_id, kHeaderSlot)));
    ++messages_;
    o->answers.emplace_back(answer_capacity(o->tokens, p.heads.count));
    o->answer_recvs.push_back(transport_.post_recv(o->answers.back().data(), int64_t(o->answers.back().size() * sizeof(int64_t)),
                                                   peer, tag_of(transport_, request_id, kAnswerSlot)));
  }
  o->started = std::chrono::steady_clock::now();
  outgoing_.emplace(request_id, std::move(o));  // poll() goes on once the receivers answer
}

namespace {
// Where a piece's receiver has not answered, its header may wait there unread: withdraw it, so that a
// later expect() of the same id drops it instead of judging it.
void withdraw_unanswered(Transport& t, std::vector<Transport::Handle>& answer_recvs, std::vector<TransferHeader>& headers,
                         std::vector<TransferHeader>& withdrawals, std::vector<Transport::Handle>& sends,
                         const std::vector<ShardPiece>& pieces, const PeerGroup& receivers, int64_t& messages) {
  for (size_t i = 0; i < answer_recvs.size(); ++i) {
    if (answer_recvs[i] == kNone) continue;
    t.cancel(answer_recvs[i]);
    answer_recvs[i] = kNone;
    withdrawals.push_back(headers[i]);
    withdrawals.back().flags |= kWithdrawn;
    sends.push_back(t.post_send(&withdrawals.back(), sizeof(TransferHeader), receivers.ranks[size_t(pieces[i].receiver)],
                                tag_of(t, headers[i].request_id, kHeaderSlot)));
    ++messages;
  }
}
}  // namespace

void KvSender::fail(int64_t request_id, const std::string& field, const std::string& message) {
  auto it = outgoing_.find(request_id);
  std::unique_ptr<Outgoing> o = std::move(it->second);
  outgoing_.erase(it);
  withdraw_unanswered(transport_, o->answer_recvs, o->headers, o->withdrawals, o->header_sends, o->pieces, o->receivers,
                      messages_);
  if (!drain(transport_, o->header_sends)) retired_.push_back(std::move(o));  // its headers are still being read
  throw TransferError(field, "request " + std::to_string(request_id) + ": " + message + "; nothing more is sent");
}

bool KvSender::progress(Outgoing& o) {
  const VariantDescriptor& d = cache_.descriptor();
  const Device device = cache_.config().device;
  const HeadRange mine = shard_heads(d, tp_rank_);
  const int64_t T = o.tokens, es = dtype_size(d.input), unit = 2 * T * d.head_dim * es;  // one head's K and V
  drain(transport_, o.header_sends);
  if (!o.answered) {
    if (o.abandoned) {
      withdraw_unanswered(transport_, o.answer_recvs, o.headers, o.withdrawals, o.header_sends, o.pieces, o.receivers,
                          messages_);
      drain(transport_, o.header_sends);
      return o.header_sends.empty();
    }
    // Each answer as it comes: a refusal stops the transfer at once; an answer to an earlier attempt of
    // this id (its sender gave up on it) is dropped, and the receive posted again.
    bool all_in = true;
    for (size_t i = 0; i < o.pieces.size(); ++i) {
      if (o.answer_recvs[i] == kNone) continue;
      if (!transport_.poll(o.answer_recvs[i])) {
        all_in = false;
        continue;
      }
      o.answer_recvs[i] = kNone;
      Answer a;
      std::memcpy(&a, o.answers[i].data(), sizeof a);
      const int peer_rank = o.receivers.ranks[size_t(o.pieces[i].receiver)];
      const std::string peer = "receiver rank " + std::to_string(peer_rank);
      if (a.magic == kMagic && a.version == kVersion && (a.request_id != o.request_id || a.attempt != o.attempt)) {
        o.answer_recvs[i] = transport_.post_recv(o.answers[i].data(), int64_t(o.answers[i].size() * sizeof(int64_t)),
                                                 peer_rank, tag_of(transport_, o.request_id, kAnswerSlot));
        all_in = false;
        continue;
      }
      if (a.magic != kMagic || a.version != kVersion)
        fail(o.request_id, "answer", peer + " answered with something other than this request's answer");
      if (a.refused) {
        a.field[sizeof a.field - 1] = 0;
        fail(o.request_id, a.field, peer + " refused the transfer");
      }
      if (a.epoch < 0 || a.epoch >= kEpochs) fail(o.request_id, "answer.epoch", peer + " named no epoch of the 16");
      o.epochs[i] = int(a.epoch);
    }
    if (!all_in) {
      if (std::chrono::steady_clock::now() - o.started > options_.timeout)
        fail(o.request_id, "timeout", "no answer from the receivers in " + std::to_string(options_.timeout.count()) + " ms");
      return false;
    }
    // Every receiver has accepted: take each piece's wire format.
    for (size_t i = 0; i < o.pieces.size(); ++i) {
      Answer a;
      std::memcpy(&a, o.answers[i].data(), sizeof a);
      const std::string peer = "receiver rank " + std::to_string(o.receivers.ranks[size_t(o.pieces[i].receiver)]);
      if (!a.physical) {
        o.placements.emplace_back();
        ++logical_pieces_;
        continue;
      }
      Placement p;
      const std::string problem = read_placement(a, o.answers[i].data(), o.answers[i].size(), T, o.pieces[i].heads.count,
                                                 d.head_dim, es, p);
      if (!(o.headers[i].flags & kCanWritePhysical) || !problem.empty())
        fail(o.request_id, "answer.placement",
             peer + " asked for the physical format with " + (problem.empty() ? "a sender that cannot write it" : problem));
      o.placements.emplace_back(std::move(p));
      ++physical_pieces_;
    }
    o.answers.clear();
    o.answered = true;
    const bool any_logical = std::any_of(o.placements.begin(), o.placements.end(), [](const auto& p) { return !p; });
    for (int i = 0; i < std::min(options_.ring_layers, d.layers); ++i) {
      Slot slot;
      if (any_logical) slot.logical = spare_.take(transport_, device, int64_t(mine.count) * unit);
      for (const auto& p : o.placements)
        slot.physical.push_back(p ? spare_.take(transport_, device, p->wire_bytes) : Staging{});
      o.ring.push_back(std::move(slot));
    }
  }
  for (Slot& s : o.ring) {
    if (s.layer >= 0 && drain(transport_, s.pending)) s.layer = -1;
    if (s.layer >= 0 || o.abandoned || o.next_layer >= d.layers) continue;
    // Read the next layer into this free slot, and post its messages.
    const int layer = o.next_layer++;
    if (s.logical.device.data()) {
      try {
        cache_.gather(layer, o.range, staging_view(s.logical.device.data(), d, device, mine.count, T, 0, false),
                      staging_view(s.logical.device.data(), d, device, mine.count, T, 1, false));
      } catch (...) {
        // A range that cannot be read (the caller's error, raised here): the rest is never sent, so
        // the receiver times out and commits nothing, and this transfer winds down at the next poll.
        o.abandoned = true;
        throw;
      }
      if (s.logical.staged())
        backend(device).to_host(s.logical.wire.data(), s.logical.device.data(), s.logical.device.bytes(), cache_.config().stream);
      cache_.synchronize();
    }
    const LayerView view = cache_.view(layer);
    for (size_t i = 0; i < o.pieces.size(); ++i) {
      const ShardPiece& p = o.pieces[i];
      const int peer = o.receivers.ranks[size_t(p.receiver)];
      const int tag = layer_tag(transport_, o.request_id, layer, o.epochs[i]);
      if (!o.placements[i]) {
        const auto* at = static_cast<const char*>(s.logical.wire_data()) + (p.heads.begin - mine.begin) * unit;
        s.pending.push_back(transport_.post_send(at, p.heads.count * unit, peer, tag));
        ++messages_;
        continue;
      }
      const Placement& place = *o.placements[i];
      auto* wire = static_cast<char*>(s.physical[i].device.data());
      write_physical(view, d.paged() ? o.pages.as<const int32_t>() : nullptr, d.page_size, o.range.row,
                     p.heads.begin - mine.begin, p.heads.count, T, d.head_dim, place, wire);
      for (int64_t bytes : place.runs) {
        s.pending.push_back(transport_.post_send(wire, bytes, peer, tag));
        wire += bytes;
        ++messages_;
      }
    }
    s.layer = layer;
  }
  const bool sent = o.abandoned || o.next_layer >= d.layers;
  const bool done = sent && o.header_sends.empty() &&
                    std::all_of(o.ring.begin(), o.ring.end(), [](const Slot& s) { return s.layer < 0; });
  if (done)
    for (Slot& s : o.ring) {
      spare_.give(std::move(s.logical));
      for (Staging& w : s.physical) spare_.give(std::move(w));
    }
  return done;
}

bool KvSender::poll() {
  retired_.erase(std::remove_if(retired_.begin(), retired_.end(),
                                [&](const std::unique_ptr<Outgoing>& o) { return drain(transport_, o->header_sends); }),
                 retired_.end());
  std::vector<int64_t> ids;
  for (const auto& [id, o] : outgoing_) ids.push_back(id);
  for (int64_t id : ids)
    if (progress(*outgoing_.at(id))) outgoing_.erase(id);
  return outgoing_.empty();
}

void KvSender::abandon(int64_t request_id) {
  auto it = outgoing_.find(request_id);
  if (it == outgoing_.end()) throw StateError("request_id", "no transfer " + std::to_string(request_id) + " in flight");
  it->second->abandoned = true;
}

// ---- the receiver --------------------------------------------------------------------------------

struct KvReceiver::Incoming {
  int64_t request_id;
  int64_t tokens;
  uint64_t hash;
  PeerGroup senders;
  SequenceManager* manager;
  int64_t seq_or_row;
  std::vector<int32_t> pages;  // paged: the sequence's pages
  std::vector<ShardPiece> pieces;  // this rank's
  std::vector<TransferHeader> headers;
  std::vector<Transport::Handle> header_recvs;  // per piece; kNone while none is posted
  std::vector<bool> header_in, judged;          // per piece: a header received; it passed every check
  bool headers_checked = false;
  int epoch = 0;
  std::vector<std::vector<int64_t>> answers;  // per piece, while being sent
  std::vector<Transport::Handle> answer_sends;
  std::optional<Placement> placement;  // the physical format (one piece); else logical
  std::vector<std::vector<Transport::Handle>> layer_recvs;  // physical: every layer's, posted at once
  std::vector<Slot> ring;  // logical
  int next_post = 0;  // logical: the next layer whose receives are to be posted
  int ready = 0;      // layers written into the cache
  std::vector<int64_t> slots;
  std::vector<int32_t> rows, positions;
  Buffer device_targets[2];  // the targets on a CUDA cache's device
  TokenTargets targets;
  std::chrono::steady_clock::time_point last_progress;
};

KvReceiver::KvReceiver(Cache& cache, int tp_rank, Transport& transport, TransferOptions options)
    : cache_(cache), tp_rank_(tp_rank), transport_(transport), options_(options) {
  shard_heads(cache.descriptor(), tp_rank);
  if (options_.ring_layers < 1) throw OutOfRangeError("options.ring_layers", options_.ring_layers, 1, 1025);
  spare_.keep = 2 * options_.ring_layers;
}

namespace {
template <class In> void cancel_receives(Transport& t, In& in) {
  for (Transport::Handle h : in.header_recvs)
    if (h != kNone) t.cancel(h);
  in.header_recvs.clear();
  for (Slot& s : in.ring) {
    for (Transport::Handle h : s.pending) t.cancel(h);
    s.pending.clear();
  }
  for (auto& layer : in.layer_recvs) {
    for (Transport::Handle h : layer) t.cancel(h);
    layer.clear();
  }
}
}  // namespace

KvReceiver::~KvReceiver() {
  for (auto& [id, in] : incoming_) cancel_receives(transport_, *in);
}

void KvReceiver::expect(int64_t request_id, const std::vector<int32_t>& tokens, const PeerGroup& senders,
                        SequenceManager* manager, int64_t seq_or_row) {
  const VariantDescriptor& d = cache_.descriptor();
  if (incoming_.count(request_id)) throw StateError("request_id", std::to_string(request_id) + " is already expected");
  check_request(transport_, incoming_, request_id, senders, "senders");
  if (d.paged() != (manager != nullptr))
    throw ArgumentError("manager", d.paged() ? "a paged cache receives through its sequence manager"
                                             : "a contiguous or ring cache receives into a row, without a manager");
  auto in = std::make_unique<Incoming>();
  in->request_id = request_id;
  in->tokens = int64_t(tokens.size());
  in->hash = token_hash(tokens);
  in->senders = senders;
  in->manager = manager;
  in->seq_or_row = seq_or_row;
  for (const ShardPiece& p : shard_pieces(d.model_heads, senders.tp(), d.tensor_parallel))
    if (p.receiver == tp_rank_) in->pieces.push_back(p);
  const int64_t T = in->tokens;
  if (manager) {
    // All or nothing, and sharing no cached page: the transfer writes every position.
    manager->add(seq_or_row, tokens, std::nullopt, 0);
    in->pages = manager->pages(seq_or_row);
    const int64_t P = d.page_size;
    for (int64_t p = 0; p < T; ++p) {
      const int32_t page = in->pages[size_t(p / P)];
      in->slots.push_back(page < 0 ? -1 : page * P + p % P);
    }
  } else {
    if (seq_or_row < 0 || seq_or_row >= cache_.config().rows) throw OutOfRangeError("row", seq_or_row, 0, cache_.config().rows);
    // The transfer is the row's whole content: positions an earlier occupant left would count as its.
    if (const int64_t held = cache_.row_length(seq_or_row); held != 0)
      throw StateError("row", "row " + std::to_string(seq_or_row) + " holds " + std::to_string(held) +
                                  " positions; reset_row() it before receiving into it");
    in->rows.assign(size_t(T), int32_t(seq_or_row));
    for (int64_t p = 0; p < T; ++p) in->positions.push_back(int32_t(p));
  }
  if (cache_.config().device == Device::cpu) {
    in->targets = manager ? TokenTargets::paged(IndexView::of(in->slots.data(), T))
                          : TokenTargets::row_positions(IndexView::of(in->rows.data(), T), IndexView::of(in->positions.data(), T));
  } else {
    Backend& b = backend(cache_.config().device);
    auto put = [&](Buffer& buf, const auto& host) {
      using V = typename std::decay_t<decltype(host)>::value_type;
      buf = Buffer(b, std::max<int64_t>(1, int64_t(host.size() * sizeof(V))));
      b.from_host(buf.data(), host.data(), int64_t(host.size() * sizeof(V)), cache_.config().stream);
      return IndexView{buf.data(), dtype_of<V>::value, cache_.config().device, T};
    };
    in->targets = manager ? TokenTargets::paged(put(in->device_targets[0], in->slots))
                          : TokenTargets::row_positions(put(in->device_targets[0], in->rows), put(in->device_targets[1], in->positions));
  }
  in->headers.resize(in->pieces.size());
  in->header_recvs.assign(in->pieces.size(), kNone);
  in->header_in.assign(in->pieces.size(), false);
  in->judged.assign(in->pieces.size(), false);
  in->epoch = next_epoch_;
  next_epoch_ = (next_epoch_ + 1) % kEpochs;
  in->last_progress = std::chrono::steady_clock::now();
  Incoming& ref = *in;
  incoming_.emplace(request_id, std::move(in));
  progress(ref);
}

// Piece `piece`'s header, once one that is live has come: true with it in in.headers[piece]. Drops
// withdrawals, headers of another request id on the same tag, and a header that a withdrawal of its
// attempt already follows (its sender gave up on it before this receiver expected it).
bool KvReceiver::take_header(Incoming& in, size_t piece) {
  const int peer = in.senders.ranks[size_t(in.pieces[piece].sender)];
  const int tag = tag_of(transport_, in.request_id, kHeaderSlot);
  std::vector<TransferHeader>& early = early_[{peer, tag}];
  TransferHeader& h = in.headers[piece];
  for (;;) {
    if (!in.header_in[piece]) {
      if (in.header_recvs[piece] == kNone && !early.empty()) {
        h = early.front();
        early.erase(early.begin());
        in.header_in[piece] = true;
      } else if (in.header_recvs[piece] == kNone) {
        in.header_recvs[piece] = transport_.post_recv(&h, sizeof h, peer, tag);
      }
      if (!in.header_in[piece]) {
        if (!transport_.poll(in.header_recvs[piece])) return false;
        in.header_recvs[piece] = kNone;
        in.header_in[piece] = true;
      }
    }
    const bool ours = h.magic == kMagic && h.version == kVersion;
    if (ours && ((h.flags & kWithdrawn) || h.request_id != in.request_id)) {
      in.header_in[piece] = false;
      continue;
    }
    // What follows it from the same sender on the same tag, where it has come already.
    if (early.empty() && transport_.arrived(peer, tag)) {
      TransferHeader next{};
      const Transport::Handle r = transport_.post_recv(&next, sizeof next, peer, tag);
      while (!transport_.poll(r)) {
      }
      early.push_back(next);
    }
    if (ours && !early.empty() && (early.front().flags & kWithdrawn) && early.front().attempt == h.attempt &&
        early.front().request_id == h.request_id) {
      early.erase(early.begin());
      in.header_in[piece] = false;
      continue;
    }
    if (early.empty()) early_.erase({peer, tag});
    return true;
  }
}

void KvReceiver::answer(Incoming& in, size_t piece, const char* refused_field) {
  in.answers.reserve(in.pieces.size());  // posted sends point into these
  in.answers.push_back(encode_answer(in.headers[piece], in.epoch, refused_field, in.placement ? &*in.placement : nullptr));
  in.answer_sends.push_back(transport_.post_send(in.answers.back().data(), int64_t(in.answers.back().size() * sizeof(int64_t)),
                                                 in.senders.ranks[size_t(in.pieces[piece].sender)],
                                                 tag_of(transport_, in.request_id, kAnswerSlot)));
}

void KvReceiver::fail(int64_t request_id, const std::string& field, const std::string& message) {
  auto it = incoming_.find(request_id);
  std::unique_ptr<Incoming> in = std::move(it->second);
  incoming_.erase(it);
  cancel_receives(transport_, *in);
  if (in->manager) in->manager->free(in->seq_or_row);
  else cache_.reset_row(in->seq_or_row);
  for (Slot& s : in->ring) spare_.give(std::move(s.logical));
  if (!drain(transport_, in->answer_sends)) retired_.push_back(std::move(in));  // its answers are still being read
  throw TransferError(field, "request " + std::to_string(request_id) + ": " + message + "; nothing was committed");
}

void KvReceiver::progress(Incoming& in) {
  const VariantDescriptor& d = cache_.descriptor();
  const Device device = cache_.config().device;
  const HeadRange mine = shard_heads(d, tp_rank_);
  const int64_t T = in.tokens, unit = 2 * T * d.head_dim * dtype_size(d.input);
  const auto now = std::chrono::steady_clock::now();
  bool moved = false;
  drain(transport_, in.answer_sends);
  // Each header is checked as it comes, so that a mismatch is refused without waiting for the others.
  bool all_judged = !in.headers_checked;
  for (size_t i = 0; i < in.pieces.size() && !in.headers_checked; ++i) {
    if (in.judged[i]) continue;
    if (!take_header(in, i)) {
      all_judged = false;
      continue;
    }
    {
      const TransferHeader& h = in.headers[i];
      const ShardPiece& p = in.pieces[i];
      auto check = [&](const char* field, int64_t got, int64_t want) {
        if (got == want) return;
        const std::string name = std::string("header.") + field;
        // Every sender whose header is in stops too; one whose header has not come withdraws it
        // when its own wait runs out.
        for (size_t j = 0; j < in.pieces.size(); ++j)
          if (in.header_in[j]) answer(in, j, name.c_str());
        fail(in.request_id, name,
             "sender rank " + std::to_string(in.senders.ranks[size_t(p.sender)]) + " sent " + std::to_string(got) +
                 ", this receiver expects " + std::to_string(want));
      };
      check("magic", h.magic, kMagic);
      check("version", h.version, kVersion);
      check("request_id", h.request_id, in.request_id);
      check("tokens", h.tokens, T);
      check("token_hash", int64_t(h.token_hash), int64_t(in.hash));
      check("input", h.input, int64_t(d.input));
      check("model_heads", h.model_heads, d.model_heads);
      check("layers", h.layers, d.layers);
      check("head_dim", h.head_dim, d.head_dim);
      check("sender_tp", h.sender_tp, in.senders.tp());
      check("sender_rank", h.sender_rank, p.sender);
      check("head_begin", h.head_begin, p.heads.begin);
      check("head_count", h.head_count, p.heads.count);
      check("layer_begin", h.layer_begin, 0);
      check("layer_count", h.layer_count, d.layers);
      in.judged[i] = true;
      moved = true;
    }
  }
  if (all_judged) {
    if (options_.physical)
      in.placement = physical_placement(cache_, transport_, in.headers[0], in.pieces, mine.count,
                                      in.manager ? in.pages.data() : nullptr, in.seq_or_row, T);
    for (size_t i = 0; i < in.pieces.size(); ++i) answer(in, i, nullptr);
    if (in.placement) {
      // Straight into the pool: every layer's receives go up now, one per run of consecutive pages.
      const int sender = in.senders.ranks[size_t(in.pieces[0].sender)];
      in.layer_recvs.resize(size_t(d.layers));
      for (int layer = 0; layer < d.layers; ++layer) {
        auto* base = const_cast<char*>(static_cast<const char*>(cache_.view(layer).k));
        for (size_t r = 0; r < in.placement->runs.size(); ++r)
          in.layer_recvs[size_t(layer)].push_back(transport_.post_recv(base + in.placement->run_at[r],
                                                                       in.placement->runs[r], sender,
                                                                       layer_tag(transport_, in.request_id, layer, in.epoch)));
      }
    } else {
      for (int i = 0; i < std::min(options_.ring_layers, d.layers); ++i) {
        Slot slot;
        slot.logical = spare_.take(transport_, device, int64_t(mine.count) * unit);
        in.ring.push_back(std::move(slot));
      }
    }
    in.headers_checked = moved = true;
  }
  if (in.headers_checked && in.placement) {
    while (in.ready < d.layers && drain(transport_, in.layer_recvs[size_t(in.ready)])) ++in.ready, moved = true;
  } else if (in.headers_checked) {
    // Post the receives of the next layers into free buffers; write completed layers in order.
    for (bool again = true; again;) {
      again = false;
      for (Slot& s : in.ring) {
        // Layer receives go up once the headers are checked, so a message is never longer than the
        // buffer that takes it.
        if (s.layer < 0 && in.next_post < d.layers) {
          s.layer = in.next_post++;
          const int tag = layer_tag(transport_, in.request_id, s.layer, in.epoch);
          for (const ShardPiece& p : in.pieces) {
            auto* at = static_cast<char*>(s.logical.wire_data()) + (p.heads.begin - mine.begin) * unit;
            s.pending.push_back(transport_.post_recv(at, p.heads.count * unit, in.senders.ranks[size_t(p.sender)], tag));
          }
        }
        if (s.layer == in.ready && drain(transport_, s.pending)) {
          void* staging = s.logical.device.data();
          if (s.logical.staged())
            backend(device).from_host(staging, s.logical.wire.data(), s.logical.device.bytes(), cache_.config().stream);
          cache_.append(s.layer, staging_view(staging, d, device, mine.count, T, 0, true),
                        staging_view(staging, d, device, mine.count, T, 1, true), in.targets);
          cache_.commit();
          ++in.ready;
          s.layer = -1;
          moved = again = true;
        }
      }
    }
  }
  if (in.ready == d.layers) {
    if (in.placement && !in.manager) {
      // A row written straight into the pool: its length is the cache's to keep, so the last position
      // of each layer goes through the cache once more, with the values it already holds.
      const int64_t es = dtype_size(d.input), row_bytes = d.head_dim * es;
      std::vector<unsigned char> k(size_t(mine.count * row_bytes)), v(k.size());
      const TokenTargets target = TokenTargets::row_positions(IndexView::of(in.rows.data() + T - 1, 1),
                                                              IndexView::of(in.positions.data() + T - 1, 1));
      for (int layer = 0; layer < d.layers; ++layer) {
        const LayerView view = cache_.view(layer);
        const int64_t at = in.seq_or_row * view.strides.row_or_page + (T - 1) * view.strides.seq_or_slot;
        for (int h = 0; h < mine.count; ++h) {
          std::memcpy(&k[size_t(h * row_bytes)], static_cast<const char*>(view.k) + (at + h * view.strides.head) * es, size_t(row_bytes));
          std::memcpy(&v[size_t(h * row_bytes)], static_cast<const char*>(view.v) + (at + h * view.strides.head) * es, size_t(row_bytes));
        }
        cache_.append(layer, TensorView::contiguous(k.data(), d.input, device, 1, mine.count, d.head_dim),
                      TensorView::contiguous(v.data(), d.input, device, 1, mine.count, d.head_dim), target);
      }
      cache_.commit();
    }
    if (in.manager) in.manager->step({in.seq_or_row});  // written: from now on its full blocks may be shared
    for (Slot& s : in.ring) spare_.give(std::move(s.logical));
    in.ring.clear();
    return;
  }
  if (moved) in.last_progress = now;
  else if (now - in.last_progress > options_.timeout)
    fail(in.request_id, "timeout",
         "no progress for " + std::to_string(options_.timeout.count()) + " ms after " + std::to_string(in.ready) + " of " +
             std::to_string(d.layers) + " layers");
}

void KvReceiver::poll() {
  retired_.erase(std::remove_if(retired_.begin(), retired_.end(),
                                [&](const std::unique_ptr<Incoming>& in) { return drain(transport_, in->answer_sends); }),
                 retired_.end());
  std::vector<int64_t> ids;
  for (const auto& [id, in] : incoming_)
    if (in->ready < cache_.descriptor().layers) ids.push_back(id);
  for (int64_t id : ids) progress(*incoming_.at(id));
}

int KvReceiver::layers_ready(int64_t request_id) const {
  auto it = incoming_.find(request_id);
  if (it == incoming_.end()) throw StateError("request_id", "no transfer " + std::to_string(request_id) + " is expected");
  return it->second->ready;
}

bool KvReceiver::done(int64_t request_id) const { return layers_ready(request_id) == cache_.descriptor().layers; }

void KvReceiver::release(int64_t request_id) {
  if (!done(request_id)) throw StateError("request_id", "transfer " + std::to_string(request_id) + " is not complete");
  auto it = incoming_.find(request_id);
  std::unique_ptr<Incoming> in = std::move(it->second);
  incoming_.erase(it);
  if (!drain(transport_, in->answer_sends)) retired_.push_back(std::move(in));
}

}  // namespace kvforge
