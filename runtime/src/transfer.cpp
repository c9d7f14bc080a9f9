#include "kvforge/transfer.hpp"

#include <algorithm>
#include <cstring>

namespace kvforge {
namespace {

constexpr uint32_t kMagic = 0x6b76666bu;  // "kvfk"
constexpr uint32_t kVersion = 1;
constexpr int kHeaderSlot = 0;  // tag slot of the header; layer l travels in slot 1 + l mod 255

int tag_of(const Transport& t, int64_t request_id, int layer_or_header) {
  const int64_t requests = (int64_t(t.max_tag()) + 1) >> 8;
  const int slot = layer_or_header < 0 ? kHeaderSlot : 1 + layer_or_header % 255;
  return int(((request_id % requests + requests) % requests) << 8 | slot);
}

int64_t tag_bits(const Transport& t, int64_t request_id) { return tag_of(t, request_id, -1) >> 8; }

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

// Staging for one layer: [heads, K|V, tokens, head_dim] of the input dtype, where the cache's
// operations can reach it, and a host copy where the transport cannot take device memory.
struct Staging {
  Buffer device, wire;
  int layer = -1;
  std::vector<Transport::Handle> pending;
  bool staged() const { return wire.data() != nullptr; }
  void* wire_data() const { return staged() ? wire.data() : device.data(); }
};

Staging make_staging(Backend& b, Transport& t, Device d, int64_t bytes) {
  Staging s;
  s.device = Buffer(b, bytes);
  if (!t.takes_memory_of(d)) s.wire = Buffer(b.host(), bytes);
  t.register_memory(s.wire_data(), bytes);
  return s;
}

// k and v views of a staging buffer holding `heads` heads: [tokens, heads, head_dim] (append) or
// [heads, tokens, head_dim] (gather), strided over the [heads, 2, tokens, head_dim] block.
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

void copy_name(char (&out)[48], const char* name) {
  std::memset(out, 0, sizeof out);
  std::strncpy(out, name, sizeof out - 1);
}

}  // namespace

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
  std::vector<Staging> ring;
  int next_layer = 0;
  bool abandoned = false;
};

KvSender::KvSender(Cache& cache, int tp_rank, Transport& transport, TransferOptions options)
    : cache_(cache), tp_rank_(tp_rank), transport_(transport), options_(options) {
  shard_heads(cache.descriptor(), tp_rank);  // checks the rank
  if (options_.ring_layers < 1) throw OutOfRangeError("options.ring_layers", options_.ring_layers, 1, 1025);
}

KvSender::~KvSender() = default;

void KvSender::send(int64_t request_id, const GatherRange& range, const std::vector<int32_t>& tokens,
                    const PeerGroup& receivers) {
  const VariantDescriptor& d = cache_.descriptor();
  check_request(transport_, outgoing_, request_id, receivers, "receivers");
  auto o = std::make_unique<Outgoing>();
  o->request_id = request_id;
  o->range = range;
  o->range.begin = 0;
  o->range.end = int64_t(tokens.size());
  if (range.pages.size > 0) {
    Backend& b = backend(cache_.config().device);
    const int64_t bytes = range.pages.size * dtype_size(range.pages.dtype);
    o->pages = Buffer(b, bytes);
    if (range.pages.device == cache_.config().device) b.copy(o->pages.data(), range.pages.data, bytes, cache_.config().stream);
    else b.from_host(o->pages.data(), range.pages.data, bytes, cache_.config().stream);
    o->range.pages.data = o->pages.data();
    o->range.pages.device = cache_.config().device;
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
  h.model_heads = d.model_heads, h.layers = d.layers, h.head_dim = d.head_dim;
  h.sender_tp = d.tensor_parallel, h.sender_rank = tp_rank_;
  h.layer_begin = 0, h.layer_count = d.layers;
  h.tokens = o->tokens, h.request_id = request_id, h.token_hash = token_hash(tokens);
  const int header_tag = tag_of(transport_, request_id, -1);
  o->headers.reserve(o->pieces.size());  // posted sends point into it
  for (const ShardPiece& p : o->pieces) {
    h.head_begin = p.heads.begin, h.head_count = p.heads.count;
    o->headers.push_back(h);
    o->header_sends.push_back(
        transport_.post_send(&o->headers.back(), sizeof h, receivers.ranks[size_t(p.receiver)], header_tag));
    ++messages_;
  }
  const int heads = shard_heads(d, tp_rank_).count;
  const int64_t bytes = int64_t(heads) * 2 * o->tokens * d.head_dim * dtype_size(d.input);
  Backend& b = backend(cache_.config().device);
  for (int i = 0; i < std::min(options_.ring_layers, d.layers); ++i)
    o->ring.push_back(make_staging(b, transport_, cache_.config().device, std::max<int64_t>(bytes, 1)));
  Outgoing& ref = *o;
  outgoing_.emplace(request_id, std::move(o));
  progress(ref);
}

bool KvSender::progress(Outgoing& o) {
  const VariantDescriptor& d = cache_.descriptor();
  const Device device = cache_.config().device;
  const HeadRange mine = shard_heads(d, tp_rank_);
  const int64_t T = o.tokens, unit = 2 * T * d.head_dim * dtype_size(d.input);  // one head's K and V
  drain(transport_, o.header_sends);
  for (Staging& s : o.ring) {
    if (s.layer >= 0 && drain(transport_, s.pending)) s.layer = -1;
    if (s.layer >= 0 || o.abandoned || o.next_layer >= d.layers) continue;
    // Read the next layer into this free buffer, dequantized, and post one message per piece.
    const int layer = o.next_layer++;
    try {
      cache_.gather(layer, o.range, staging_view(s.device.data(), d, device, mine.count, T, 0, false),
                    staging_view(s.device.data(), d, device, mine.count, T, 1, false));
    } catch (...) {
      // A range that cannot be read (the caller's error, raised here): the rest is never sent, so
      // the receiver times out and commits nothing, and this transfer winds down at the next poll.
      o.abandoned = true;
      throw;
    }
    if (s.staged()) backend(device).to_host(s.wire.data(), s.device.data(), s.device.bytes(), cache_.config().stream);
    cache_.synchronize();
    const int tag = tag_of(transport_, o.request_id, layer);
    for (const ShardPiece& p : o.pieces) {
      const auto* at = static_cast<const char*>(s.wire_data()) + (p.heads.begin - mine.begin) * unit;
      s.pending.push_back(transport_.post_send(at, p.heads.count * unit, o.receivers.ranks[size_t(p.receiver)], tag));
      ++messages_;
    }
    s.layer = layer;
  }
  const bool sent = o.abandoned || o.next_layer >= d.layers;
  return sent && o.header_sends.empty() &&
         std::all_of(o.ring.begin(), o.ring.end(), [](const Staging& s) { return s.layer < 0; });
}

bool KvSender::poll() {
  for (auto it = outgoing_.begin(); it != outgoing_.end();)
    it = progress(*it->second) ? outgoing_.erase(it) : std::next(it);
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
  std::vector<ShardPiece> pieces;  // this rank's
  std::vector<TransferHeader> headers;
  std::vector<Transport::Handle> header_recvs;
  bool headers_checked = false;
  std::vector<Staging> ring;
  int next_post = 0;  // the next layer whose receives are to be posted
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
}

KvReceiver::~KvReceiver() {
  for (auto& [id, in] : incoming_) {
    for (Transport::Handle h : in->header_recvs) transport_.cancel(h);
    for (Staging& s : in->ring)
      for (Transport::Handle h : s.pending) transport_.cancel(h);
  }
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
    const std::vector<int32_t>& pages = manager->pages(seq_or_row);
    const int64_t P = d.page_size;
    for (int64_t p = 0; p < T; ++p) {
      const int32_t page = pages[size_t(p / P)];
      in->slots.push_back(page < 0 ? -1 : page * P + p % P);
    }
  } else {
    if (seq_or_row < 0 || seq_or_row >= cache_.config().rows) throw OutOfRangeError("row", seq_or_row, 0, cache_.config().rows);
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
  const int header_tag = tag_of(transport_, request_id, -1);
  for (size_t i = 0; i < in->pieces.size(); ++i)
    in->header_recvs.push_back(transport_.post_recv(&in->headers[i], sizeof(TransferHeader),
                                                    senders.ranks[size_t(in->pieces[i].sender)], header_tag));
  const int heads = shard_heads(d, tp_rank_).count;
  const int64_t bytes = int64_t(heads) * 2 * T * d.head_dim * dtype_size(d.input);
  Backend& b = backend(cache_.config().device);
  for (int i = 0; i < std::min(options_.ring_layers, d.layers); ++i)
    in->ring.push_back(make_staging(b, transport_, cache_.config().device, std::max<int64_t>(bytes, 1)));
  in->last_progress = std::chrono::steady_clock::now();
  Incoming& ref = *in;
  incoming_.emplace(request_id, std::move(in));
  progress(ref);
}

void KvReceiver::fail(int64_t request_id, const std::string& field, const std::string& message) {
  auto it = incoming_.find(request_id);
  Incoming& in = *it->second;
  for (Transport::Handle h : in.header_recvs) transport_.cancel(h);
  for (Staging& s : in.ring)
    for (Transport::Handle h : s.pending) transport_.cancel(h);
  if (in.manager) in.manager->free(in.seq_or_row);
  else cache_.reset_row(in.seq_or_row);
  incoming_.erase(it);
  throw TransferError(field, "request " + std::to_string(request_id) + ": " + message + "; nothing was committed");
}

void KvReceiver::progress(Incoming& in) {
  const VariantDescriptor& d = cache_.descriptor();
  const Device device = cache_.config().device;
  const HeadRange mine = shard_heads(d, tp_rank_);
  const int64_t T = in.tokens, unit = 2 * T * d.head_dim * dtype_size(d.input);
  const auto now = std::chrono::steady_clock::now();
  bool moved = false;
  if (!in.headers_checked && drain(transport_, in.header_recvs)) {
    for (size_t i = 0; i < in.pieces.size(); ++i) {
      const TransferHeader& h = in.headers[i];
      const ShardPiece& p = in.pieces[i];
      auto check = [&](const char* field, int64_t got, int64_t want) {
        if (got != want)
          fail(in.request_id, std::string("header.") + field,
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
    }
    in.headers_checked = moved = true;
  }
  // Post the receives of the next layers into free buffers; write completed layers in order.
  for (bool again = true; again;) {
    again = false;
    for (Staging& s : in.ring) {
      // Layer receives go up once the headers are checked, so a message is never longer than the
      // buffer that takes it.
      if (s.layer < 0 && in.headers_checked && in.next_post < d.layers) {
        s.layer = in.next_post++;
        const int tag = tag_of(transport_, in.request_id, s.layer);
        for (const ShardPiece& p : in.pieces) {
          auto* at = static_cast<char*>(s.wire_data()) + (p.heads.begin - mine.begin) * unit;
          s.pending.push_back(transport_.post_recv(at, p.heads.count * unit, in.senders.ranks[size_t(p.sender)], tag));
        }
      }
      if (s.layer == in.ready && in.headers_checked && drain(transport_, s.pending)) {
        if (s.staged()) backend(device).from_host(s.device.data(), s.wire.data(), s.device.bytes(), cache_.config().stream);
        cache_.append(s.layer, staging_view(s.device.data(), d, device, mine.count, T, 0, true),
                      staging_view(s.device.data(), d, device, mine.count, T, 1, true), in.targets);
        cache_.commit();
        ++in.ready;
        s.layer = -1;
        moved = again = true;
      }
    }
  }
  if (in.ready == d.layers) {
    if (in.manager) in.manager->step({in.seq_or_row});  // written: from now on its full blocks may be shared
    return;
  }
  if (moved) in.last_progress = now;
  else if (in.ready < d.layers && now - in.last_progress > options_.timeout)
    fail(in.request_id, "timeout",
         "no progress for " + std::to_string(options_.timeout.count()) + " ms after " + std::to_string(in.ready) + " of " +
             std::to_string(d.layers) + " layers");
}

void KvReceiver::poll() {
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
  incoming_.erase(request_id);
}

}  // namespace kvforge
