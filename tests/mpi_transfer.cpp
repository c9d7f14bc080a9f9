// Transfers between processes, under mpirun (tests/CMakeLists.txt runs each scenario):
//   layouts            np 2: every ordered pair of the tiny model's default float layouts, bitwise
//   tp S R             np S+R: a prefill group of degree S feeds a decode group of degree R, bitwise
//   dtypes             np 2: bf16 sent, int8 and fp8 stored on arrival, equal to the reference quantizer
//   inflight N         np 2: N requests of random lengths in flight at once, interleaved; no mixing
//   refused            np 2: every header mismatch is refused, and nothing is committed
//   timeout            np 2: a sender that stops midway; the receiver times out and commits nothing
//   retry              np 2: an id used again at once after a sender's timeout with nobody expecting it,
//                      after a refusal, and by an id whose tags are the same; each retry arrives whole
//   tp_mismatch        np 3: a receiver that expects two senders, fed by one whole-model sender, refuses
//                      its header at once, naming header.sender_tp, and so does the sender
//   capacity           np any: plan_memory over the ranks takes the smallest page count; then each rank in
//                      turn has a budget that holds no page, and every rank raises its CapacityError
// Every value is a function of (request, layer, head of the full model, position, dim), exact in
// bf16, so the receiver checks what it holds against plain loops over those coordinates.
#include <mpi.h>

#include <cstdio>
#include <cstdlib>
#include <random>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "kvforge/kvforge.hpp"
#include "kvforge/memory_plan.hpp"
#include "kvforge/mpi_transport.hpp"
#include "kvforge/shard.hpp"
#include "kvforge/transfer.hpp"
#include "quant_reference.hpp"

namespace {

using namespace kvforge;
using kvtest::load_as;
using kvtest::store_as;

// Poll loops yield: under mpirun --oversubscribe, six ranks may share two cores.
void pause() { std::this_thread::yield(); }

[[noreturn]] void die(const std::string& what) {
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  std::fprintf(stderr, "rank %d: FAILED: %s\n", rank, what.c_str());
  MPI_Abort(MPI_COMM_WORLD, 1);
  std::abort();
}

void require(bool ok, const std::string& what) {
  if (!ok) die(what);
}

float value(int64_t request, int layer, int head, int64_t position, int dim, int kv) {
  const int64_t k = request * 7919 + layer * 131 + head * 17 + position * 5 + dim * 3 + kv * 101;
  return float(k % 251 - 125) / 8.0f;  // a multiple of 1/8 below 16: exact in bf16 and fp32
}

std::vector<int32_t> tokens_of(int64_t request, int64_t count) {
  std::vector<int32_t> t;
  for (int64_t i = 0; i < count; ++i) t.push_back(int32_t((request * 31 + i * 7) % 50021));
  return t;
}

// One side's cache, and for a paged one its manager.
struct Side {
  std::unique_ptr<Cache> cache;
  std::unique_ptr<SequenceManager> manager;
  const VariantDescriptor& d() const { return cache->descriptor(); }
};

Side make_side(const std::string& name, int64_t sequences) {
  const VariantDescriptor& d = *registry().at(name).descriptor;
  CacheConfig c;
  if (d.paged()) c.pages = sequences * (d.max_seq_len / d.page_size + 1);
  else c.rows = sequences;
  c.max_staged_tokens = sequences * d.max_seq_len;
  Side s;
  s.cache = registry().create(name, c);
  if (d.paged()) {
    SequenceManagerOptions o;
    o.prefix_caching = false;
    s.manager = std::make_unique<SequenceManager>(*s.cache, o);
  }
  return s;
}

// Writes request `request`'s values for this rank's heads into the sender's cache: sequence or row
// `slot`. Returns the range that reads it.
GatherRange fill_sender(Side& s, int tp_rank, int64_t request, int64_t slot, int64_t tokens) {
  const VariantDescriptor& d = s.d();
  const HeadRange mine = shard_heads(d, tp_rank);
  const int es = dtype_size(d.input);
  std::vector<unsigned char> k(size_t(tokens * mine.count * d.head_dim * es)), v(k.size());
  for (int layer = 0; layer < d.layers; ++layer) {
    for (int64_t p = 0; p < tokens; ++p)
      for (int h = 0; h < mine.count; ++h)
        for (int x = 0; x < d.head_dim; ++x) {
          const size_t at = size_t((p * mine.count + h) * d.head_dim + x) * es;
          store_as(d.input, value(request, layer, mine.begin + h, p, x, 0), &k[at]);
          store_as(d.input, value(request, layer, mine.begin + h, p, x, 1), &v[at]);
        }
    TensorView kv = TensorView::contiguous(k.data(), d.input, Device::cpu, tokens, mine.count, d.head_dim);
    TensorView vv = TensorView::contiguous(v.data(), d.input, Device::cpu, tokens, mine.count, d.head_dim);
    if (s.manager) {
      if (layer == 0) s.manager->add(slot, tokens_of(request, tokens));
      const std::vector<int32_t>& pages = s.manager->pages(slot);
      std::vector<int64_t> slots;
      for (int64_t p = 0; p < tokens; ++p) slots.push_back(int64_t(pages[size_t(p / d.page_size)]) * d.page_size + p % d.page_size);
      s.cache->append(layer, kv, vv, TokenTargets::paged(IndexView::of(slots.data(), tokens)));
    } else {
      std::vector<int32_t> rows(static_cast<size_t>(tokens), static_cast<int32_t>(slot)), positions;
      for (int64_t p = 0; p < tokens; ++p) positions.push_back(int32_t(p));
      s.cache->append(layer, kv, vv,
                      TokenTargets::row_positions(IndexView::of(rows.data(), tokens), IndexView::of(positions.data(), tokens)));
    }
  }
  s.cache->commit();
  if (s.manager) {
    s.manager->step({slot});
    return s.manager->range(slot, 0, tokens);
  }
  GatherRange r;
  r.row = slot;
  return r;
}

// The receiver's holdings of request `request` (sequence or row `slot`) against the values, through
// `expect(layer, head, position, dim, kv)`.
template <class Expected>
void check_receiver(Side& s, int tp_rank, int64_t slot, int64_t tokens, const std::string& what, Expected expect) {
  const VariantDescriptor& d = s.d();
  const HeadRange mine = shard_heads(d, tp_rank);
  const int es = dtype_size(d.input);
  GatherRange r;
  if (s.manager) r = s.manager->range(slot, 0, tokens);
  else r.row = slot, r.end = tokens;
  std::vector<unsigned char> k(size_t(tokens * mine.count * d.head_dim * es)), v(k.size());
  for (int layer = 0; layer < d.layers; ++layer) {
    s.cache->gather(layer, r, TensorView::contiguous(k.data(), d.input, Device::cpu, mine.count, tokens, d.head_dim),
                    TensorView::contiguous(v.data(), d.input, Device::cpu, mine.count, tokens, d.head_dim));
    for (int h = 0; h < mine.count; ++h)
      for (int64_t p = 0; p < tokens; ++p)
        for (int x = 0; x < d.head_dim; ++x) {
          const size_t at = size_t((h * tokens + p) * d.head_dim + x) * es;
          for (int kv = 0; kv < 2; ++kv) {
            const float got = load_as(d.input, kv ? &v[at] : &k[at]);
            const float want = expect(layer, mine.begin + h, p, x, kv);
            if (got != want)
              die(what + ": " + d.name + " layer " + std::to_string(layer) + " head " + std::to_string(mine.begin + h) +
                  " position " + std::to_string(p) + " dim " + std::to_string(x) + (kv ? " V" : " K") + " holds " +
                  std::to_string(got) + ", expected " + std::to_string(want));
          }
        }
  }
}

// Runs one transfer of `tokens` tokens per request from the ranks `senders` (degree S, variant
// `sender_name`'s shards) to the ranks `receivers`; every rank plays its part.
// Pieces sent in each wire format by this rank's senders, over the scenario.
int64_t physical_pieces = 0, logical_pieces = 0;

void transfer(MpiTransport& t, const std::string& sender_name, const std::string& receiver_name, const PeerGroup& senders,
              const PeerGroup& receivers, const std::vector<int64_t>& requests, const std::vector<int64_t>& lengths,
              const std::string& what, TransferOptions options = {}) {
  const int me = t.rank();
  for (int s = 0; s < senders.tp(); ++s)
    if (senders.ranks[size_t(s)] == me) {
      Side side = make_side(shard_variant(registry(), sender_name, senders.tp()).descriptor->name, int64_t(requests.size()));
      KvSender sender(*side.cache, s, t, options);
      for (size_t i = 0; i < requests.size(); ++i)
        sender.send(requests[i], fill_sender(side, s, requests[i], int64_t(i), lengths[i]),
                    tokens_of(requests[i], lengths[i]), receivers);
      while (!sender.poll()) pause();
      physical_pieces += sender.physical_pieces();
      logical_pieces += sender.logical_pieces();
    }
  for (int r = 0; r < receivers.tp(); ++r)
    if (receivers.ranks[size_t(r)] == me) {
      Side side = make_side(shard_variant(registry(), receiver_name, receivers.tp()).descriptor->name, int64_t(requests.size()));
      KvReceiver receiver(*side.cache, r, t, options);
      for (size_t i = 0; i < requests.size(); ++i)
        receiver.expect(requests[i], tokens_of(requests[i], lengths[i]), senders, side.manager.get(), int64_t(i));
      bool all = false;
      while (!all) {
        receiver.poll();
        pause();
        all = true;
        for (int64_t id : requests) all = all && receiver.done(id);
      }
      for (size_t i = 0; i < requests.size(); ++i) {
        const int64_t id = requests[i];
        check_receiver(side, r, int64_t(i), lengths[i], what, [&](int layer, int head, int64_t p, int x, int kv) {
          return value(id, layer, head, p, x, kv);
        });
      }
      if (side.manager) side.manager->check_invariants();
    }
  MPI_Barrier(MPI_COMM_WORLD);
}

std::vector<std::string> tiny_float_variants() {
  std::vector<std::string> out;
  for (const VariantEntry& e : registry().variants()) {
    const VariantDescriptor& d = *e.descriptor;
    if (std::string(d.model) == "tiny" && d.storage == DType::f32 && !d.is_hybrid()) out.push_back(d.name);
  }
  return out;
}

// Pieces sent in each format over the scenario so far, by every rank.
std::pair<int64_t, int64_t> pieces_sent() {
  int64_t counts[2] = {physical_pieces, logical_pieces};
  MPI_Allreduce(MPI_IN_PLACE, counts, 2, MPI_INT64_T, MPI_SUM, MPI_COMM_WORLD);
  return {counts[0], counts[1]};
}

void layouts(MpiTransport& t) {
  const std::vector<std::string> names = tiny_float_variants();
  require(names.size() >= 4, "fewer than 4 float layouts of the tiny model");
  int64_t request = 1;
  // Every pair twice: in the format the receiver picks (the physical one, straight into its pool,
  // wherever its pages are dense blocks), and with the physical format turned off (gather, append).
  for (const bool physical : {true, false}) {
    TransferOptions options;
    options.physical = physical;
    const auto before = pieces_sent();
    for (const std::string& a : names)
      for (const std::string& b : names) {
        const VariantDescriptor& da = *registry().at(a).descriptor;
        const VariantDescriptor& db = *registry().at(b).descriptor;
        // A ring holds its window only: a transfer to or from one carries at most that many tokens.
        const bool ring = da.addressing == Addressing::ring || db.addressing == Addressing::ring;
        const int64_t tokens = ring ? std::max(1, std::min(da.window ? da.window : 64, db.window ? db.window : 64) - 3) : 45;
        transfer(t, a, b, PeerGroup{{0}}, PeerGroup{{1}}, {request, request + 1}, {tokens, std::max<int64_t>(1, tokens - 7)},
                 a + " -> " + b + (physical ? "" : " (logical)"), options);
        request += 2;
      }
    const auto after = pieces_sent();
    const int64_t physical_count = after.first - before.first, logical_count = after.second - before.second;
    require(physical ? physical_count > 0 : physical_count == 0,
            physical ? "layouts: no pair used the physical format" : "layouts: the physical format was used while off");
    if (t.rank() == 0)
      std::printf("layouts: %zu x %zu layout pairs, bitwise: %lld pieces physical, %lld logical%s\n", names.size(),
                  names.size(), (long long)physical_count, (long long)logical_count, physical ? "" : " (physical off)");
  }
}

void tp(MpiTransport& t, int S, int R) {
  require(t.size() == S + R, "tp " + std::to_string(S) + " " + std::to_string(R) + " needs " + std::to_string(S + R) + " ranks");
  PeerGroup senders, receivers;
  for (int i = 0; i < S; ++i) senders.ranks.push_back(i);
  for (int i = 0; i < R; ++i) receivers.ranks.push_back(S + i);
  // Different layouts on the two sides too: pages of vLLM's NHD feed FlashInfer's HND and DeepSpeed's blocks.
  transfer(t, "vllm_paged_nhd.tiny_tp.fp32", "flashinfer_paged_hnd.tiny_tp.fp32", senders, receivers, {11, 12, 13},
           {40, 17, 63}, "tp " + std::to_string(S) + "->" + std::to_string(R));
  transfer(t, "jetstream_contiguous.tiny_tp.fp32", "deepspeed_blocked.tiny_tp.fp32", senders, receivers, {21}, {33},
           "tp " + std::to_string(S) + "->" + std::to_string(R) + " contiguous to blocked");
  if (t.rank() == 0) std::printf("tp %d -> %d: bitwise, with heads assembled from the right senders\n", S, R);
}

void dtypes(MpiTransport& t) {
  const std::vector<std::pair<std::string, std::string>> pairs = {
      {"vllm_paged_nhd.tiny_tp.bf16", "flashinfer_paged_hnd.tiny_tp.int8_in_bf16"},
      {"vllm_paged_nhd.tiny.bf16", "vllm_paged_nhd.tiny.fp8_e4m3_in_bf16"},
      {"vllm_paged_nhd.tiny.bf16", "deepspeed_blocked.tiny.int8_in_bf16"},
      {"jetstream_contiguous.tiny.bf16", "jetstream_contiguous.tiny.int8_in_bf16"}};
  int64_t request = 100;
  for (const auto& [a, b] : pairs) {
    const int64_t tokens = 29;
    if (t.rank() == 0) {
      Side side = make_side(a, 1);
      KvSender sender(*side.cache, 0, t);
      sender.send(request, fill_sender(side, 0, request, 0, tokens), tokens_of(request, tokens), PeerGroup{{1}});
      while (!sender.poll()) pause();
    } else if (t.rank() == 1) {
      Side side = make_side(b, 1);
      const VariantDescriptor& d = side.d();
      if (d.quant == Quant::per_tensor)
        for (int layer = 0; layer < d.layers; ++layer) side.cache->set_tensor_scale(layer, 0.0625f, 0.125f);
      KvReceiver receiver(*side.cache, 0, t);
      receiver.expect(request, tokens_of(request, tokens), PeerGroup{{0}}, side.manager.get(), 0);
      while (!receiver.done(request)) receiver.poll(), pause();
      // What the reference quantizer (tests/quant_reference.hpp) says each token reads back as.
      check_receiver(side, 0, 0, tokens, a + " -> " + b, [&](int layer, int head, int64_t p, int x, int kv) {
        std::vector<float> token(size_t(d.heads) * d.head_dim);
        for (int h = 0; h < d.heads; ++h)
          for (int i = 0; i < d.head_dim; ++i) token[size_t(h) * d.head_dim + i] = value(request, layer, h, p, i, kv);
        const float scale = kv ? 0.125f : 0.0625f;
        return kvtest::ref_quantize(d, token, scale).gathered[size_t(head) * d.head_dim + x];
      });
    }
    ++request;
    MPI_Barrier(MPI_COMM_WORLD);
  }
  if (t.rank() == 0) std::printf("dtypes: bf16 sent, int8 and fp8 stored on arrival, as the reference quantizer says\n");
}

void inflight(MpiTransport& t, int count) {
  std::mt19937 rng(42);
  std::vector<int64_t> requests, lengths;
  for (int i = 0; i < count; ++i) {
    requests.push_back(1000 + i);
    lengths.push_back(1 + int64_t(rng() % 64));
  }
  // The sender starts them in a shuffled order, the receiver expects them in order: all are in flight
  // at once, interleaved on the wire.
  if (t.rank() == 0) {
    Side side = make_side("vllm_paged_nhd.tiny.fp32", count);
    KvSender sender(*side.cache, 0, t);
    std::vector<size_t> order(static_cast<size_t>(count));
    for (size_t i = 0; i < order.size(); ++i) order[i] = i;
    std::shuffle(order.begin(), order.end(), rng);
    for (size_t i : order) fill_sender(side, 0, requests[i], int64_t(i), lengths[i]);
    for (size_t i : order) {
      // range()'s page list lives in scratch its next call reuses: take it right before send(), which copies it.
      sender.send(requests[i], side.manager->range(int64_t(i), 0, lengths[i]), tokens_of(requests[i], lengths[i]),
                  PeerGroup{{1}});
      sender.poll();
    }
    while (!sender.poll()) pause();
  } else if (t.rank() == 1) {
    Side side = make_side("flashinfer_paged_hnd.tiny.fp32", count);
    KvReceiver receiver(*side.cache, 0, t);
    for (int i = 0; i < count; ++i) receiver.expect(requests[size_t(i)], tokens_of(requests[size_t(i)], lengths[size_t(i)]),
                                                    PeerGroup{{0}}, side.manager.get(), i);
    for (bool all = false; !all;) {
      receiver.poll();
      pause();
      all = true;
      for (int64_t id : requests) all = all && receiver.done(id);
    }
    for (int i = 0; i < count; ++i)
      check_receiver(side, 0, i, lengths[size_t(i)], "in flight", [&](int layer, int head, int64_t p, int x, int kv) {
        return value(requests[size_t(i)], layer, head, p, x, kv);
      });
    side.manager->check_invariants();
    std::printf("inflight: %d interleaved transfers, none mixed\n", count);
  }
  MPI_Barrier(MPI_COMM_WORLD);
}

// The receiver expects something other than what arrives: each case must be refused, naming the
// header field, with its pages back in the pool and the sequence unknown.
void refused(MpiTransport& t) {
  struct Case {
    const char* field;
    std::string sender, receiver;
    int64_t tokens_sent, tokens_expected;
    bool other_tokens;
  };
  const std::vector<Case> cases = {
      {"header.tokens", "vllm_paged_nhd.tiny.fp32", "vllm_paged_nhd.tiny.fp32", 9, 10, false},
      {"header.token_hash", "vllm_paged_nhd.tiny.fp32", "flashinfer_paged_hnd.tiny.fp32", 9, 9, true},
      {"header.input", "vllm_paged_nhd.tiny.fp32", "vllm_paged_nhd.tiny.bf16", 9, 9, false},
      // A receiver that takes itself for one rank of a degree-2 group gets both heads from a
      // degree-1 sender where it expects one.
      {"header.head_count", "vllm_paged_nhd.tiny_tp.fp32", "vllm_paged_nhd.tiny_tp_tp2.fp32", 9, 9, false}};
  int64_t request = 5000;
  for (const Case& c : cases) {
    if (t.rank() == 0) {
      Side side = make_side(c.sender, 1);
      KvSender sender(*side.cache, 0, t);
      sender.send(request, fill_sender(side, 0, request, 0, c.tokens_sent), tokens_of(request, c.tokens_sent), PeerGroup{{1}});
      // The receiver's refusal comes back: the sender raises it, naming the same field, and stops.
      std::string got = "nothing";
      try {
        while (!sender.poll()) pause();
      } catch (const TransferError& e) {
        got = e.field();
      }
      require(got == c.field, std::string("the sender heard ") + got + " where the receiver refused " + c.field);
      require(sender.poll(), std::string(c.field) + ": the refused transfer is still in flight at the sender");
    } else if (t.rank() == 1) {
      Side side = make_side(c.receiver, 1);
      const int32_t before = side.manager->available_blocks();
      std::vector<int32_t> tokens = tokens_of(request, c.tokens_expected);
      if (c.other_tokens) tokens[3] += 1;
      KvReceiver receiver(*side.cache, 0, t);
      bool refused = false;
      try {
        receiver.expect(request, tokens, PeerGroup{{0}}, side.manager.get(), 0);
        for (int i = 0; i < 1000000 && !receiver.done(request); ++i) receiver.poll(), pause();
      } catch (const TransferError& e) {
        refused = e.field() == c.field;
        require(refused, std::string("expected a refusal naming ") + c.field + ", got: " + e.what());
      }
      require(refused, std::string("a mismatch of ") + c.field + " was not refused");
      require(!side.manager->contains(0), std::string(c.field) + ": the refused sequence is still known");
      require(side.manager->available_blocks() == before, std::string(c.field) + ": pages were not returned");
      side.manager->check_invariants();
    }
    ++request;
    MPI_Barrier(MPI_COMM_WORLD);
  }
  if (t.rank() == 0) {  // a page list the pool does not hold: refused by send(), before anything is posted
    Side side = make_side("vllm_paged_nhd.tiny.fp32", 1);
    fill_sender(side, 0, request, 0, 9);
    GatherRange range = side.manager->range(0, 0, 9);
    std::vector<int32_t> pages(static_cast<const int32_t*>(range.pages.data),
                               static_cast<const int32_t*>(range.pages.data) + range.pages.size);
    pages.back() = int32_t(side.cache->config().pages);
    range.pages.data = pages.data();
    KvSender sender(*side.cache, 0, t);
    bool refused = false;
    try {
      sender.send(request, range, tokens_of(request, 9), PeerGroup{{1}});
    } catch (const OutOfRangeError& e) {
      refused = e.argument() == "range.pages";
    }
    require(refused && sender.poll() && sender.messages() == 0, "a page outside the pool was not refused before sending");
  }
  if (t.rank() == 1) {  // bad arguments: refused before anything is allocated or posted
    Side side = make_side("vllm_paged_nhd.tiny.fp32", 1);
    const int32_t before = side.manager->available_blocks();
    KvReceiver receiver(*side.cache, 0, t);
    bool refused = false;
    try {
      receiver.expect(request, tokens_of(request, 5), PeerGroup{{t.size()}}, side.manager.get(), 0);
    } catch (const OutOfRangeError& e) {
      refused = e.argument() == "senders.ranks";
    }
    require(refused && !side.manager->contains(0) && side.manager->available_blocks() == before,
            "a sender rank outside the transport was not refused before allocation");
    // A row that holds positions: refused, since the transfer would leave the old tail counted in.
    std::string contiguous;
    for (const std::string& name : tiny_float_variants())
      if (registry().at(name).descriptor->addressing == Addressing::contiguous) contiguous = name;
    require(!contiguous.empty(), "no contiguous float layout of the tiny model");
    Side rows = make_side(contiguous, 1);
    fill_sender(rows, 0, request, 0, 4);
    bool occupied = false;
    try {
      KvReceiver into_rows(*rows.cache, 0, t);
      into_rows.expect(request, tokens_of(request, 2), PeerGroup{{0}}, nullptr, 0);
    } catch (const StateError& e) {
      occupied = e.argument() == "row";
    }
    require(occupied && rows.cache->row_length(0) == 4, "receiving into a row that holds positions was not refused");
  }
  MPI_Barrier(MPI_COMM_WORLD);
  if (t.rank() == 0) std::printf("refused: every header mismatch, nothing committed\n");
}

void timeout(MpiTransport& t) {
  const int64_t request = 7000, tokens = 12;
  TransferOptions o;
  o.ring_layers = 1;  // one layer goes, then the sender stops
  o.timeout = std::chrono::milliseconds(300);
  if (t.rank() == 0) {
    Side side = make_side("vllm_paged_nhd.tiny.fp32", 1);
    KvSender sender(*side.cache, 0, t, o);
    sender.send(request, fill_sender(side, 0, request, 0, tokens), tokens_of(request, tokens), PeerGroup{{1}});
    while (sender.messages() < 2) sender.poll(), pause();  // the header, then layer 0 once the receiver answered
    sender.abandon(request);
    while (!sender.poll()) pause();
  } else if (t.rank() == 1) {
    Side side = make_side("deepspeed_blocked.tiny.fp32", 1);
    const int32_t before = side.manager->available_blocks();
    KvReceiver receiver(*side.cache, 0, t, o);
    bool timed_out = false;
    try {
      receiver.expect(request, tokens_of(request, tokens), PeerGroup{{0}}, side.manager.get(), 0);
      while (!receiver.done(request)) receiver.poll(), pause();
    } catch (const TransferError& e) {
      timed_out = e.field() == "timeout";
    }
    require(timed_out, "a stopped sender did not time the receiver out");
    require(!side.manager->contains(0) && side.manager->available_blocks() == before, "timeout: something was committed");
    std::printf("timeout: the receiver gave up and committed nothing\n");
  }
  MPI_Barrier(MPI_COMM_WORLD);
}

// One transfer of `request` with `sent` tokens from rank 0 to rank 1, which expects `expected` tokens
// (nobody expects it where `expected` is 0). Returns the TransferError's field on the rank that raised
// one, "" where the transfer completed and rank 1 holds every value.
std::string attempt(MpiTransport& t, int64_t request, int64_t sent, int64_t expected) {
  TransferOptions o;
  o.timeout = std::chrono::milliseconds(400);
  std::string field;
  if (t.rank() == 0) {
    Side side = make_side("vllm_paged_nhd.tiny.fp32", 1);
    KvSender sender(*side.cache, 0, t, o);
    sender.send(request, fill_sender(side, 0, request, 0, sent), tokens_of(request, sent), PeerGroup{{1}});
    try {
      while (!sender.poll()) pause();
    } catch (const TransferError& e) {
      field = e.field();
    }
  } else if (t.rank() == 1 && expected > 0) {
    Side side = make_side("flashinfer_paged_hnd.tiny.fp32", 1);
    KvReceiver receiver(*side.cache, 0, t, o);
    try {
      receiver.expect(request, tokens_of(request, expected), PeerGroup{{0}}, side.manager.get(), 0);
      while (!receiver.done(request)) receiver.poll(), pause();
      check_receiver(side, 0, 0, expected, "retry", [&](int layer, int head, int64_t p, int x, int kv) {
        return value(request, layer, head, p, x, kv);
      });
    } catch (const TransferError& e) {
      field = e.field();
    }
  }
  MPI_Barrier(MPI_COMM_WORLD);
  return field;
}

void retry(MpiTransport& t) {
  const int64_t request = 551, period = (int64_t(t.max_tag()) + 1) >> 12;  // ids this far apart share tags
  const bool sender = t.rank() == 0;
  // Nobody expects it: the sender times out, and its header is left at the receiver.
  require(attempt(t, request, 13, 0) == (sender ? "timeout" : ""), "an unexpected send did not time out");
  require(attempt(t, request, 16, 16).empty(), "the id was not usable again after a sender's timeout");
  require(attempt(t, request + period, 7, 0) == (sender ? "timeout" : ""), "an unexpected send did not time out");
  require(attempt(t, request + 2 * period, 9, 9).empty(), "an id whose tags a timed-out one shared was not usable");
  require(attempt(t, request, 13, 16) == "header.tokens", "a mismatch was not refused on both sides");
  require(attempt(t, request, 16, 16).empty(), "the id was not usable again after a refusal");
  if (t.rank() == 0) std::printf("retry: ids used again at once after timeouts and a refusal arrive whole\n");
}

void tp_mismatch(MpiTransport& t) {
  const int64_t request = 8000, tokens = 9;
  TransferOptions o;
  o.timeout = std::chrono::milliseconds(20000);
  const auto start = std::chrono::steady_clock::now();
  std::string field = "nothing";
  if (t.rank() == 0) {  // a whole-model sender, sending all heads to rank 2
    Side side = make_side("vllm_paged_nhd.tiny_tp.fp32", 1);
    KvSender sender(*side.cache, 0, t, o);
    sender.send(request, fill_sender(side, 0, request, 0, tokens), tokens_of(request, tokens), PeerGroup{{2}});
    try {
      while (!sender.poll()) pause();
    } catch (const TransferError& e) {
      field = e.field();
    }
  } else if (t.rank() == 2) {  // expects a group of two senders, ranks 0 and 1
    Side side = make_side("vllm_paged_nhd.tiny_tp.fp32", 1);
    KvReceiver receiver(*side.cache, 0, t, o);
    try {
      receiver.expect(request, tokens_of(request, tokens), PeerGroup{{0, 1}}, side.manager.get(), 0);
      while (!receiver.done(request)) receiver.poll(), pause();
    } catch (const TransferError& e) {
      field = e.field();
    }
  }
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  if (t.rank() != 1) {
    require(field == "header.sender_tp", "rank " + std::to_string(t.rank()) + " heard " + field);
    // Not a timing assertion: the timeout is 20 s, and a refusal that waited for it would take that long.
    require(seconds < 10, "the degree mismatch was refused only after " + std::to_string(seconds) + " s");
  }
  MPI_Barrier(MPI_COMM_WORLD);
  if (t.rank() == 0) std::printf("tp_mismatch: refused at once on both sides, naming header.sender_tp\n");
}

void capacity(MpiTransport& t) {
  const VariantDescriptor& d = *registry().at("vllm_paged_nhd.tiny.fp32").descriptor;
  MemoryRequest r;
  r.mode = PlanMode::reserve;
  r.budget_bytes = int64_t(t.rank() + 1) << 20;  // every rank has a different budget
  const MemoryPlan mine = plan_memory(d, r);
  const MemoryPlan agreed = plan_memory(d, r, t);
  r.budget_bytes = int64_t(1) << 20;
  const MemoryPlan smallest = plan_memory(d, r);
  require(agreed.pages == smallest.pages && agreed.pages <= mine.pages, "ranks did not agree on the smallest capacity");
  require(agreed.pool_bytes == smallest.pool_bytes && agreed.tokens == smallest.tokens, "agreed plan inconsistent");
  if (t.rank() == 0) std::printf("capacity: %d ranks agree on %lld pages\n", t.size(), (long long)agreed.pages);
  // One rank short of memory: the call must fail on every rank, with that rank's error, never hang
  // (ctest's timeout is the watchdog).
  for (int failing = 0; failing < t.size(); ++failing) {
    r.budget_bytes = t.rank() == failing ? 1000 : int64_t(1) << 20;
    try {
      plan_memory(d, r, t);
      die("capacity: rank " + std::to_string(failing) + " had no page, and plan_memory returned");
    } catch (const CapacityError& e) {
      const std::string where = "rank " + std::to_string(failing) + " of " + std::to_string(t.size()) + ": ";
      require(e.argument() == "budget_bytes" && e.available() == 1000 && std::string(e.what()).rfind(where, 0) == 0,
              std::string("capacity: the agreed error is not rank ") + std::to_string(failing) + "'s: " + e.what());
    }
  }
  if (t.rank() == 0) std::printf("capacity: each rank short of memory in turn, every rank raised its error\n");
}

}  // namespace

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  try {
    MpiTransport t;
    const std::string what = argc > 1 ? argv[1] : "";
    if (what == "layouts") layouts(t);
    else if (what == "tp" && argc == 4) tp(t, std::atoi(argv[2]), std::atoi(argv[3]));
    else if (what == "dtypes") dtypes(t);
    else if (what == "inflight") inflight(t, argc > 2 ? std::atoi(argv[2]) : 100);
    else if (what == "refused") refused(t);
    else if (what == "timeout") timeout(t);
    else if (what == "capacity") capacity(t);
    else if (what == "retry") retry(t);
    else if (what == "tp_mismatch") tp_mismatch(t);
    else die("usage: kvforge_mpi_tests layouts | tp S R | dtypes | inflight N | refused | timeout | capacity | retry | "
             "tp_mismatch");
  } catch (const std::exception& e) {
    die(e.what());
  }
  MPI_Finalize();
  return 0;
}
