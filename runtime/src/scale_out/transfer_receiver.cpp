// KvReceiver: the decode side of a transfer (transfer.hpp).
#include "kvforge/transfer.hpp"
#include "kvforge/state_shards.hpp"
#include "scale_out/transfer_wire.hpp"

namespace kvforge {

using namespace transfer_wire;

struct KvReceiver::Incoming {
  int64_t request_id;
  int64_t tokens;
  uint64_t hash;
  PeerGroup senders;
  SequenceManager* manager;
  int64_t seq_or_row;
  StateSlots* states = nullptr;  // the sequence's state slot arrives too
  int64_t state_slot = -1;
  std::optional<StateShards> shards;   // what of the state each piece carries
  std::vector<std::vector<StateRow>> state_rows;  // per piece; empty: no state message
  std::vector<Staging> state_wires;  // per piece with a share: it as it arrives
  std::vector<Transport::Handle> state_recvs;
  bool state_in = false;  // written into the slot, with the last layer
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
  std::vector<std::vector<Transport::Handle>> layer_recvs;  // physical into the pool: every layer's, posted at once
  std::vector<Slot> ring;  // logical, and physical through host staging
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
  for (Transport::Handle h : in.state_recvs) t.cancel(h);
  in.state_recvs.clear();
}
}  // namespace

KvReceiver::~KvReceiver() {
  for (auto& [id, in] : incoming_) cancel_receives(transport_, *in);
}

void KvReceiver::expect(int64_t request_id, const std::vector<int32_t>& tokens, const PeerGroup& senders,
                        SequenceManager* manager, int64_t seq_or_row) {
  begin(request_id, tokens, senders, manager, seq_or_row, nullptr);
}

void KvReceiver::expect(int64_t request_id, const std::vector<int32_t>& tokens, const PeerGroup& senders,
                        StateSlots& states, int64_t seq) {
  const VariantDescriptor& d = cache_.descriptor();
  StateShards(states.pool().parts(), states.pool().layers(), d, d.tensor_parallel, senders.tp(), d.tensor_parallel, "states")
      .require_paired_with_heads("states");
  if (states.free_slots() < 1) throw CapacityError("states", 1, 0, "every state slot is held");
  begin(request_id, tokens, senders, &states.manager(), seq, &states);
}

void KvReceiver::begin(int64_t request_id, const std::vector<int32_t>& tokens, const PeerGroup& senders,
                       SequenceManager* manager, int64_t seq_or_row, StateSlots* states) {
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
    if (states) {
      try {
        in->state_slot = states->attach(seq_or_row);
      } catch (...) {
        manager->free(seq_or_row);
        throw;
      }
      in->states = states;
      in->shards.emplace(states->pool().parts(), states->pool().layers(), d, d.tensor_parallel, senders.tp(), d.tensor_parallel,
                         "states");
      in->state_rows = in->shards->piece_rows(in->pieces);
    }
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
        if (!transport_.poll(in.header_recvs[piece])) {
          if (early.empty()) early_.erase({peer, tag});  // no empty entry left per tag waited on
          return false;
        }
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
  if (in->states) in->states->free(in->seq_or_row);  // its pages and its slot
  else if (in->manager) in->manager->free(in->seq_or_row);
  else cache_.reset_row(in->seq_or_row);
  for (Slot& s : in->ring) give_back(spare_, s);
  for (Staging& w : in->state_wires) spare_.give(std::move(w));
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
    check("record_kind", h.record_kind, d.record_kind());
    check("record_first", h.record_first, d.record_first());
    check("record_second", h.record_second, d.record_second());
    check("sender_tp", h.sender_tp, in.senders.tp());
    check("sender_rank", h.sender_rank, p.sender);
    check("head_begin", h.head_begin, p.heads.begin);
    check("head_count", h.head_count, p.heads.count);
    check("layer_begin", h.layer_begin, 0);
    check("layer_count", h.layer_count, d.layers);
    check("state_bytes", h.state_bytes, in.states ? StateShards::bytes(in.state_rows[i]) : 0);
    if (in.states) check("state_record", int64_t(h.state_record), int64_t(in.shards->model_record_hash()));
    in.judged[i] = true;
    moved = true;
  }
  if (all_judged) {
    if (options_.physical)
      in.placement = physical_placement(cache_, transport_, in.headers[0], in.pieces, mine.count,
                                      in.manager ? in.pages.data() : nullptr, in.seq_or_row, T);
    for (size_t i = 0; i < in.pieces.size(); ++i) answer(in, i, nullptr);
    if (in.states)
      for (size_t i = 0; i < in.pieces.size(); ++i) {
        const int64_t bytes = StateShards::bytes(in.state_rows[i]);
        if (bytes == 0) continue;
        in.state_wires.push_back(spare_.take_host(transport_, in.states->pool().config().device, bytes));
        in.state_recvs.push_back(transport_.post_recv(in.state_wires.back().device.data(), bytes,
                                                      in.senders.ranks[size_t(in.pieces[i].sender)],
                                                      tag_of(transport_, in.request_id, kStateSlot, in.epoch)));
      }
    if (in.placement && !staged_physical()) {
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
        if (in.placement) slot.physical.push_back(spare_.take_host(transport_, device, in.placement->wire_bytes));
        else slot.logical = spare_.take(transport_, device, int64_t(mine.count) * unit);
        in.ring.push_back(std::move(slot));
      }
    }
    in.headers_checked = moved = true;
  }
  if (in.headers_checked && !in.layer_recvs.empty()) {
    while (in.ready < d.layers && drain(transport_, in.layer_recvs[size_t(in.ready)]) &&
           (in.ready + 1 < d.layers || state_landed(in)))
      ++in.ready, moved = true;
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
          if (in.placement) {
            // The layer's runs back to back, as the sender writes them.
            auto* at = static_cast<char*>(s.physical[0].device.data());
            const int sender = in.senders.ranks[size_t(in.pieces[0].sender)];
            for (int64_t bytes : in.placement->runs) {
              s.pending.push_back(transport_.post_recv(at, bytes, sender, tag));
              at += bytes;
            }
          } else {
            for (const ShardPiece& p : in.pieces) {
              auto* at = static_cast<char*>(s.logical.wire_data()) + (p.heads.begin - mine.begin) * unit;
              s.pending.push_back(transport_.post_recv(at, p.heads.count * unit, in.senders.ranks[size_t(p.sender)], tag));
            }
          }
        }
        if (s.layer == in.ready && drain(transport_, s.pending) && (s.layer + 1 < d.layers || state_landed(in))) {
          if (in.placement) {
            // Each run to where it goes in the pool, then wait: the buffer takes the next layer.
            auto* pool = const_cast<char*>(static_cast<const char*>(cache_.view(s.layer).k));
            const auto* at = static_cast<const char*>(s.physical[0].device.data());
            for (size_t r = 0; r < in.placement->runs.size(); ++r) {
              backend(device).from_host(pool + in.placement->run_at[r], at, in.placement->runs[r], cache_.config().stream);
              at += in.placement->runs[r];
            }
            backend(device).synchronize(cache_.config().stream);
          } else {
            void* staging = s.logical.device.data();
            if (s.logical.staged())
              backend(device).from_host(staging, s.logical.wire.data(), s.logical.device.bytes(), cache_.config().stream);
            cache_.append(s.layer, staging_view(staging, d, device, mine.count, T, 0, true),
                          staging_view(staging, d, device, mine.count, T, 1, true), in.targets);
            cache_.commit();
          }
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
      // of each layer goes through the cache once more, with the values it already holds (copied
      // within the cache's device, which the pool may be).
      Backend& b = backend(device);
      const int64_t es = dtype_size(d.input), row_bytes = d.head_dim * es;
      Buffer last(b, 2 * mine.count * row_bytes);
      char* k = last.as<char>();
      char* v = k + mine.count * row_bytes;
      auto entry = [&](const IndexView& all) {
        return IndexView{static_cast<const int32_t*>(all.data) + T - 1, DType::i32, all.device, 1};
      };
      const TokenTargets target = TokenTargets::row_positions(entry(in.targets.rows), entry(in.targets.positions));
      for (int layer = 0; layer < d.layers; ++layer) {
        const LayerView view = cache_.view(layer);
        const int64_t at = in.seq_or_row * view.strides.row_or_page + (T - 1) * view.strides.seq_or_slot;
        for (int h = 0; h < mine.count; ++h) {
          const int64_t from = (at + h * view.strides.head) * es;
          b.copy(k + h * row_bytes, static_cast<const char*>(view.k) + from, row_bytes, cache_.config().stream);
          b.copy(v + h * row_bytes, static_cast<const char*>(view.v) + from, row_bytes, cache_.config().stream);
        }
        cache_.append(layer, TensorView::contiguous(k, d.input, device, 1, mine.count, d.head_dim),
                      TensorView::contiguous(v, d.input, device, 1, mine.count, d.head_dim), target);
      }
      cache_.commit();
      cache_.synchronize();  // `last` goes when this scope ends
    }
    if (in.manager) in.manager->step({in.seq_or_row});  // written: from now on its full blocks may be shared
    for (Slot& s : in.ring) give_back(spare_, s);
    in.ring.clear();
    return;
  }
  if (moved) in.last_progress = now;
  else if (now - in.last_progress > options_.timeout)
    fail(in.request_id, "timeout",
         "no progress for " + std::to_string(options_.timeout.count()) + " ms after " + std::to_string(in.ready) + " of " +
             std::to_string(d.layers) + " layers");
}

// The state slot, once it has come: written into the sequence's slot (only the last layer waits for it).
bool KvReceiver::state_landed(Incoming& in) {
  if (!in.states || in.state_in) return true;
  if (!drain(transport_, in.state_recvs)) return false;
  // Every share in: the slot's image is their union (each part wholly covered), written at once.
  StatePool& pool = in.states->pool();
  std::vector<unsigned char> image(size_t(pool.slot_bytes()), 0);
  size_t wire = 0;
  for (size_t i = 0; i < in.pieces.size(); ++i)
    if (!in.state_rows[i].empty())
      StateShards::unpack(in.state_rows[i], pool, static_cast<const unsigned char*>(in.state_wires[wire++].device.data()),
                                          image.data());
  pool.write_slot(in.state_slot, image.data());
  pool.synchronize();
  for (Staging& w : in.state_wires) spare_.give(std::move(w));
  in.state_wires.clear();
  in.state_in = true;
  return true;
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
