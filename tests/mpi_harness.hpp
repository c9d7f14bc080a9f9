// What every MPI transfer scenario shares (tests/mpi_transfer*.cpp): failing the whole job at once,
// the values a request holds at each logical coordinate, each side's cache and manager, and one
// transfer run by every rank.
#pragma once

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


namespace mpitest {


using namespace kvforge;
using kvtest::load_as;
using kvtest::store_as;

// Poll loops yield: under mpirun --oversubscribe, six ranks may share two cores.
inline void pause() { std::this_thread::yield(); }

[[noreturn]] inline void die(const std::string& what) {
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  std::fprintf(stderr, "rank %d: FAILED: %s\n", rank, what.c_str());
  MPI_Abort(MPI_COMM_WORLD, 1);
  std::abort();
}

inline void require(bool ok, const std::string& what) {
  if (!ok) die(what);
}

inline float value(int64_t request, int layer, int head, int64_t position, int dim, int kv) {
  const int64_t k = request * 7919 + layer * 131 + head * 17 + position * 5 + dim * 3 + kv * 101;
  return float(k % 251 - 125) / 8.0f;  // a multiple of 1/8 below 16: exact in bf16 and fp32
}

inline std::vector<int32_t> tokens_of(int64_t request, int64_t count) {
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

inline Side make_side(const std::string& name, int64_t sequences) {
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
inline GatherRange fill_sender(Side& s, int tp_rank, int64_t request, int64_t slot, int64_t tokens) {
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
inline void check_receiver(Side& s, int tp_rank, int64_t slot, int64_t tokens, const std::string& what, Expected expect) {
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
inline int64_t physical_pieces = 0, logical_pieces = 0;

inline void transfer(MpiTransport& t, const std::string& sender_name, const std::string& receiver_name, const PeerGroup& senders,
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

inline std::vector<std::string> tiny_float_variants() {
  std::vector<std::string> out;
  for (const VariantEntry& e : registry().variants()) {
    const VariantDescriptor& d = *e.descriptor;
    if (std::string(d.model) == "tiny" && d.storage == DType::f32 && !d.is_hybrid()) out.push_back(d.name);
  }
  return out;
}

// Pieces sent in each format over the scenario so far, by every rank.
inline std::pair<int64_t, int64_t> pieces_sent() {
  int64_t counts[2] = {physical_pieces, logical_pieces};
  MPI_Allreduce(MPI_IN_PLACE, counts, 2, MPI_INT64_T, MPI_SUM, MPI_COMM_WORLD);
  return {counts[0], counts[1]};
}

}  // namespace mpitest
