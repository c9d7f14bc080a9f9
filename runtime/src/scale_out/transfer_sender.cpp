// KvSender: the prefill side of a transfer (transfer.hpp).
#include <random>

#include "kvforge/transfer.hpp"
#include "kvforge/state_shards.hpp"
#include "scale_out/transfer_wire.hpp"

namespace kvforge {

using namespace transfer_wire;

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
  StateSource state;   // the state slot that goes too, if any
  std::optional<StateShards> shards;   // what of it each piece carries
  std::vector<std::vector<StateRow>> state_rows;  // per piece; empty: no state message
  std::vector<Staging> state_wires;                     // per piece: its packed share, until sent
  std::vector<Transport::Handle> state_sends;
  int next_layer = 0;
  bool abandoned = false;
  std::chrono::steady_clock::time_point started;
};

namespace {
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
                    const PeerGroup& receivers, StateSource state) {
  const VariantDescriptor& d = cache_.descriptor();
  const Device device = cache_.config().device;
  check_request(transport_, outgoing_, request_id, receivers, "receivers");
  std::optional<StateShards> shards;  // checked here, before anything is allocated
  if (state.pool) {
    if (state.slot < 0 || state.slot >= state.pool->config().slots)
      throw OutOfRangeError("state.slot", state.slot, 0, state.pool->config().slots);
    shards.emplace(state.pool->parts(), state.pool->layers(), d, d.tensor_parallel, d.tensor_parallel, receivers.tp(), "state");
    shards->require_paired_with_heads("state");
  }
  // The physical format writes the wire with plain loops on the host, one value per element: from the
  // pool where it is host memory, else from a host copy of each gathered layer (staged_physical()),
  // which holds the input dtype, so only where that is the storage dtype. A device pool that the
  // transport takes as it is goes logical: its staging has no host copy to write from.
  const int64_t T = int64_t(tokens.size());
  bool physical = options_.physical && d.plain_values() && !d.is_hybrid() && transport_.takes_memory_of(Device::cpu) &&
                  (!staged_physical() || (d.storage == d.input && (device == Device::cpu || !transport_.takes_memory_of(device))));
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
  o->state = state;
  for (const ShardPiece& p : shard_pieces(d.model_heads, d.tensor_parallel, receivers.tp()))
    if (p.sender == tp_rank_) o->pieces.push_back(p);
  if (shards) {
    o->state_rows = shards->piece_rows(o->pieces);
    o->shards = std::move(shards);
  }
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
  h.state_record = state.pool ? o->shards->model_record_hash() : 0;
  h.record_kind = d.record_kind(), h.record_first = d.record_first(), h.record_second = d.record_second();
  o->headers.reserve(o->pieces.size());  // posted sends and receives point into these
  o->answers.reserve(o->pieces.size());
  o->withdrawals.reserve(o->pieces.size());
  o->epochs.assign(o->pieces.size(), 0);
  for (const ShardPiece& p : o->pieces) {
    const int peer = receivers.ranks[size_t(p.receiver)];
    h.head_begin = p.heads.begin, h.head_count = p.heads.count;
    h.state_bytes = state.pool ? StateShards::bytes(o->state_rows[o->headers.size()]) : 0;
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
    const bool any_physical = std::any_of(o.placements.begin(), o.placements.end(), [](const auto& p) { return bool(p); });
    const bool gathers = any_logical || (staged_physical() && any_physical);
    for (int i = 0; i < std::min(options_.ring_layers, d.layers); ++i) {
      Slot slot;
      if (gathers) slot.logical = spare_.take(transport_, device, int64_t(mine.count) * unit);
      for (const auto& p : o.placements)
        slot.physical.push_back(p ? spare_.take_host(transport_, device, p->wire_bytes) : Staging{});
      o.ring.push_back(std::move(slot));
    }
    if (o.state.pool && !o.abandoned) {
      // Read now, not at send(): nothing is read before the receivers answer. Each piece's receiver
      // gets its share of the slot in one message.
      const StatePool& pool = *o.state.pool;
      std::vector<unsigned char> image(size_t(pool.slot_bytes()));
      pool.read_slot(o.state.slot, image.data());
      pool.synchronize();
      for (size_t i = 0; i < o.pieces.size(); ++i) {
        const int64_t bytes = StateShards::bytes(o.state_rows[i]);
        if (bytes == 0) continue;
        o.state_wires.push_back(spare_.take_host(transport_, pool.config().device, bytes));
        auto* wire = static_cast<unsigned char*>(o.state_wires.back().device.data());
        StateShards::pack(o.state_rows[i], pool, image.data(), wire);
        o.state_sends.push_back(transport_.post_send(wire, bytes, o.receivers.ranks[size_t(o.pieces[i].receiver)],
                                                     tag_of(transport_, o.request_id, kStateSlot, o.epochs[i])));
        ++messages_;
      }
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
    // Where the physical wire is written from: the pool, or the host copy of the layer just gathered,
    // [heads, K|V, tokens, head_dim] (one row of T positions).
    const bool from_pool = !staged_physical();
    const LayerView view = from_pool ? cache_.view(layer) : gathered_view(s.logical, d, mine.count, T);
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
      if (from_pool)
        write_physical(view, d.paged() ? o.pages.as<const int32_t>() : nullptr, d.page_size, o.range.row,
                       p.heads.begin - mine.begin, p.heads.count, T, d.head_dim, place, wire);
      else
        write_physical(view, nullptr, T, 0, p.heads.begin - mine.begin, p.heads.count, T, d.head_dim, place, wire);
      for (int64_t bytes : place.runs) {
        s.pending.push_back(transport_.post_send(wire, bytes, peer, tag));
        wire += bytes;
        ++messages_;
      }
    }
    s.layer = layer;
  }
  const bool states_sent = drain(transport_, o.state_sends);
  const bool sent = o.abandoned || o.next_layer >= d.layers;
  const bool done = sent && o.header_sends.empty() && states_sent &&
                    std::all_of(o.ring.begin(), o.ring.end(), [](const Slot& s) { return s.layer < 0; });
  if (done) {
    for (Slot& s : o.ring) give_back(spare_, s);
    for (Staging& w : o.state_wires) spare_.give(std::move(w));
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

}  // namespace kvforge
