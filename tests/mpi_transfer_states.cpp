// A hybrid model's sequence moved with its state slot (transfer.hpp), np 2: every linear layer's state
// arrives with the K/V, bitwise, in the physical and the logical format, into another slot than the
// sender's, while the receiver's other sequence keeps its state; a record that differs and a state one
// side does not expect are refused naming the header field, with the pages and the slot given back; a
// sender that stops leaves no state and no pages behind; arguments that cannot carry a state are
// refused before anything is posted.
#include "mpi_harness.hpp"

namespace mpitest {
namespace {

// Element i of part `part` of layer `layer` of request `request`'s state: a multiple of 1/8 below 16,
// exact in every float dtype a state part takes.
float state_value(int64_t request, int layer, int part, int64_t i) {
  return float((request * 613 + layer * 37 + part * 11 + i * 3) % 251 - 125) / 8.0f;
}

std::vector<unsigned char> state_bytes(const StatePool& pool, int64_t request, int layer, int part) {
  const DType dtype = pool.parts()[size_t(part)].dtype;
  const int es = dtype_size(dtype);
  std::vector<unsigned char> out(size_t(pool.part_bytes(part)));
  for (int64_t i = 0; i < pool.part_bytes(part) / es; ++i) store_as(dtype, state_value(request, layer, part, i), &out[size_t(i * es)]);
  return out;
}

void fill_state(StatePool& pool, int64_t slot, int64_t request) {
  for (int layer = 0; layer < pool.layers(); ++layer)
    for (int part = 0; part < int(pool.parts().size()); ++part)
      pool.write(slot, layer, part, state_bytes(pool, request, layer, part).data(), Device::cpu);
}

void check_state(const StatePool& pool, int64_t slot, int64_t request, const std::string& what) {
  for (int layer = 0; layer < pool.layers(); ++layer)
    for (int part = 0; part < int(pool.parts().size()); ++part) {
      std::vector<unsigned char> got(size_t(pool.part_bytes(part)));
      pool.read(slot, layer, part, got.data(), Device::cpu);
      require(got == state_bytes(pool, request, layer, part),
              what + ": layer " + std::to_string(layer) + " part " + pool.parts()[size_t(part)].name + " of slot " +
                  std::to_string(slot) + " does not hold request " + std::to_string(request) + "'s state");
    }
}

// The registered paged float variants whose model has linear layers, of states small enough to set up
// within the refusal cases' timeout (a real model's slot is tens of MiB).
std::vector<std::string> hybrid_state_variants() {
  std::vector<std::string> out;
  for (const VariantEntry& e : registry().variants()) {
    const VariantDescriptor& d = *e.descriptor;
    if (!d.states || !d.paged() || d.quant != Quant::none || d.tensor_parallel != 1 || d.max_seq_len < 40) continue;
    int64_t bytes = 0;
    for (const StatePart& p : state_parts(d)) {
      int64_t elements = 1;
      for (int64_t e : p.shape) elements *= e;
      bytes += elements * dtype_size(p.dtype) * d.states->num_linear;
    }
    if (bytes <= (int64_t(1) << 20)) out.push_back(d.name);
  }
  return out;
}

struct Receiving {
  Side side;
  std::unique_ptr<StatePool> pool;
  std::unique_ptr<StateSlots> slots;
};

// A receiving side with `sequences` slots, one of them held by sequence 50 with request 999's state.
// in_pages: its states lie in its cache's pages (StatePool over the cache), taken from its manager.
Receiving receiving(const std::string& name, int64_t sequences, std::vector<StatePart> parts = {}, bool in_pages = false) {
  Receiving r{make_side(name, sequences + 1), nullptr, nullptr};
  StatePoolConfig c;
  c.slots = sequences + 1;
  const VariantDescriptor& d = r.side.d();
  if (in_pages) r.pool = std::make_unique<StatePool>(*r.side.cache);
  else if (parts.empty()) r.pool = std::make_unique<StatePool>(d, c);
  else r.pool = std::make_unique<StatePool>(parts, d.states->num_linear, c);
  r.slots = std::make_unique<StateSlots>(*r.side.manager, *r.pool, 1);
  r.slots->add(50, tokens_of(999, 9));
  fill_state(*r.pool, r.slots->slot(50), 999);
  return r;
}

// One transfer from rank 0 (sequence 1, slot 1) to rank 1 (sequence 7), rank 1's record given by
// `parts` (the variant's where empty); `send_state`/`expect_state` say whether each side takes part
// with a state. Returns the TransferError field of the rank that raised one, else "".
std::string one(MpiTransport& t, const std::string& name, int64_t request, int64_t tokens, bool send_state, bool expect_state,
                TransferOptions options, std::vector<StatePart> parts = {}, bool in_pages = false) {
  std::string field;
  if (t.rank() == 0) {
    Side side = make_side(name, 2);
    StatePoolConfig c;
    c.slots = 2;
    StatePool pool(side.d(), c);
    const GatherRange range = fill_sender(side, 0, request, 1, tokens);
    fill_state(pool, 1, request);
    KvSender sender(*side.cache, 0, t, options);
    sender.send(request, range, tokens_of(request, tokens), PeerGroup{{1}}, send_state ? StateSource{&pool, 1} : StateSource{});
    try {
      while (!sender.poll()) pause();
    } catch (const TransferError& e) {
      field = e.field();
    }
    check_state(pool, 1, request, "the sender's own state");
  } else if (t.rank() == 1) {
    Receiving r = receiving(name, 2, parts, in_pages);
    const int32_t blocks = r.side.manager->available_blocks();
    const int64_t free_slots = r.slots->free_slots();
    KvReceiver receiver(*r.side.cache, 0, t, options);
    try {
      if (expect_state) receiver.expect(request, tokens_of(request, tokens), PeerGroup{{0}}, *r.slots, 7);
      else receiver.expect(request, tokens_of(request, tokens), PeerGroup{{0}}, r.side.manager.get(), 7);
      while (!receiver.done(request)) receiver.poll(), pause();
      check_receiver(r.side, 0, 7, tokens, name + " with its state", [&](int layer, int head, int64_t p, int x, int kv) {
        return value(request, layer, head, p, x, kv);
      });
      if (expect_state) check_state(*r.pool, r.slots->slot(7), request, name + " with its state");
    } catch (const TransferError& e) {
      field = e.field();
      require(!r.side.manager->contains(7) && r.side.manager->available_blocks() == blocks,
              field + ": the failed transfer's pages were kept");
      require(r.slots->free_slots() == free_slots, field + ": the failed transfer's state slot was kept");
    }
    check_state(*r.pool, r.slots->slot(50), 999, "the receiver's other sequence");
    r.side.manager->check_invariants();
  }
  MPI_Barrier(MPI_COMM_WORLD);
  return field;
}

}  // namespace

// Where element `flat` of part `part` of a rank's record lies in the model's part: a part split on an
// axis (its spec's shard_axis) holds, at rank r of degree tp, the model's indices [r e, (r + 1) e) of that
// axis, e its own extent there; a part whole on every rank is the model's.
static int64_t model_index(const VariantDescriptor& d, int part, int rank, int64_t flat) {
  const StatePartSpec& p = d.states->parts[part];
  if (p.shard_axis < 0) return flat;
  int64_t inner = 1;
  for (int a = p.shard_axis + 1; a < p.rank; ++a) inner *= p.shape[a];
  const int64_t extent = p.shape[p.shard_axis];
  const int64_t outer = flat / (extent * inner), along = flat / inner % extent, within = flat % inner;
  return (outer * extent * d.tensor_parallel + rank * extent + along) * inner + within;
}

static std::vector<unsigned char> shard_state(const StatePool& pool, const VariantDescriptor& d, int rank, int64_t request,
                                              int layer, int part) {
  const DType dtype = pool.parts()[size_t(part)].dtype;
  const int es = dtype_size(dtype);
  std::vector<unsigned char> out(size_t(pool.part_bytes(part)));
  for (int64_t i = 0; i < pool.part_bytes(part) / es; ++i)
    store_as(dtype, state_value(request, layer, part, model_index(d, part, rank, i)), &out[size_t(i * es)]);
  return out;
}

// tp S R with states: a hybrid model's sequence from a prefill group of degree S to a decode group of
// degree R, each rank's state its share of the model's (split parts by their spec's shard_axis), checked
// against the model's values by plain loops over its coordinates. tiny_gdn has shards at degree 2.
void tp_states(MpiTransport& t, int S, int R) {
  const int64_t request = 700 + S * 10 + R;
  const int64_t tokens = 29;
  PeerGroup senders, receivers;
  for (int i = 0; i < S; ++i) senders.ranks.push_back(i);
  for (int i = 0; i < R; ++i) receivers.ranks.push_back(S + i);
  const int me = t.rank();
  if (me < S) {
    Side side = make_side(shard_variant(registry(), "vllm_paged_nhd.tiny_gdn.fp32", S).descriptor->name, 1);
    StatePool pool(side.d(), StatePoolConfig{Device::cpu, 1, 0, nullptr});
    const GatherRange range = fill_sender(side, me, request, 0, tokens);
    for (int layer = 0; layer < pool.layers(); ++layer)
      for (int part = 0; part < int(pool.parts().size()); ++part)
        pool.write(0, layer, part, shard_state(pool, side.d(), me, request, layer, part).data(), Device::cpu);
    KvSender sender(*side.cache, me, t);
    sender.send(request, range, tokens_of(request, tokens), receivers, StateSource{&pool, 0});
    while (!sender.poll()) pause();
  } else if (me < S + R) {
    const int rank = me - S;
    Side side = make_side(shard_variant(registry(), "paged_state_pages.tiny_gdn.fp32", R).descriptor->name, 2);
    StatePool pool(side.d(), StatePoolConfig{Device::cpu, 2, 0, nullptr});
    StateSlots slots(*side.manager, pool, 1);
    KvReceiver receiver(*side.cache, rank, t);
    receiver.expect(request, tokens_of(request, tokens), senders, slots, 7);
    while (!receiver.done(request)) receiver.poll(), pause();
    const std::string what = "tp " + std::to_string(S) + " -> " + std::to_string(R) + " with states";
    check_receiver(side, rank, 7, tokens, what, [&](int layer, int head, int64_t p, int x, int kv) {
      return value(request, layer, head, p, x, kv);
    });
    for (int layer = 0; layer < pool.layers(); ++layer)
      for (int part = 0; part < int(pool.parts().size()); ++part) {
        std::vector<unsigned char> got(size_t(pool.part_bytes(part)));
        pool.read(slots.slot(7), layer, part, got.data(), Device::cpu);
        require(got == shard_state(pool, side.d(), rank, request, layer, part),
                what + ": receiver rank " + std::to_string(rank) + " layer " + std::to_string(layer) + " part " +
                    pool.parts()[size_t(part)].name + " is not its share of the model's state");
      }
  }
  MPI_Barrier(MPI_COMM_WORLD);
  if (me == 0) std::printf("tp %d -> %d: every linear layer's state, each rank's share of the model's, bitwise\n", S, R);
}

void states(MpiTransport& t) {
  const std::vector<std::string> names = hybrid_state_variants();
  require(!names.empty(), "no paged float variant of a model with linear layers");
  int64_t request = 9000;
  for (const std::string& name : names)
    for (const bool physical : {true, false}) {
      TransferOptions o;
      o.physical = physical;
      const std::string field = one(t, name, request++, 37, true, true, o);
      require(field.empty(), name + ": the transfer with its state failed at " + field);
    }
  if (t.rank() == 0) std::printf("states: %zu hybrid variants, K/V and every linear layer's state bitwise, both formats\n", names.size());
  // Into a receiver whose states lie in its cache's pages, from a sender's pool of its own: one image.
  int in_pages = 0;
  for (const std::string& name : names) {
    const VariantDescriptor& d = *registry().at(name).descriptor;
    const int64_t fits = state_page_size(d);
    if (fits == 0 || fits > d.page_size) continue;
    const std::string field = one(t, name, request++, 37, true, true, TransferOptions{}, {}, true);
    require(field.empty(), name + ": the transfer into states in pages failed at " + field);
    ++in_pages;
  }
  require(in_pages > 0, "no hybrid variant whose page holds its state");
  if (t.rank() == 0) std::printf("states: %d hybrid variants into states kept in the receiver's pages\n", in_pages);

  // Refusals, each named on both sides, nothing kept.
  const std::string name = names.front();
  TransferOptions o;
  o.timeout = std::chrono::milliseconds(400);
  std::vector<StatePart> renamed = state_parts(*registry().at(name).descriptor);
  renamed.front().name += "_other";  // the same bytes, another record
  const std::pair<std::string, std::string> cases[] = {
      {"header.state_record", one(t, name, request++, 20, true, true, o, renamed)},
      {"header.state_bytes", one(t, name, request++, 20, true, false, o)},
      {"header.state_bytes", one(t, name, request++, 20, false, true, o)}};
  for (const auto& [want, got] : cases) require(got == want, "expected a refusal naming " + want + ", got '" + got + "'");

  // A sender that stops after its header: the receiver times out, and neither pages nor slot stay.
  const int64_t stopped = request++;
  if (t.rank() == 0) {
    Side side = make_side(name, 1);
    StatePool pool(side.d(), StatePoolConfig{Device::cpu, 1, 0, nullptr});
    KvSender sender(*side.cache, 0, t, o);
    sender.send(stopped, fill_sender(side, 0, stopped, 0, 12), tokens_of(stopped, 12), PeerGroup{{1}}, StateSource{&pool, 0});
    sender.abandon(stopped);
    while (!sender.poll()) pause();
    // Arguments that cannot carry a state: refused before anything is posted.
    const int64_t posted = sender.messages();
    std::string argument;
    StatePool other(renamed, pool.layers(), StatePoolConfig{Device::cpu, 1, 0, nullptr});
    try {  // to a group of degree 2, a record whose split the variant's spec does not state
      sender.send(stopped + 1, side.manager->range(0, 0, 12), tokens_of(stopped, 12), PeerGroup{{1, 1}}, StateSource{&other, 0});
    } catch (const ArgumentError& e) {
      argument = e.argument();
    }
    require(argument == "state", "a state of another record sent to two receivers was not refused (got '" + argument + "')");
    argument.clear();
    try {
      sender.send(stopped + 1, side.manager->range(0, 0, 12), tokens_of(stopped, 12), PeerGroup{{1}}, StateSource{&pool, 1});
    } catch (const OutOfRangeError& e) {
      argument = e.argument();
    }
    require(argument == "state.slot" && sender.messages() == posted, "a state slot outside the pool was not refused first");
  } else if (t.rank() == 1) {
    Receiving r = receiving(name, 1);
    const int32_t blocks = r.side.manager->available_blocks();
    KvReceiver receiver(*r.side.cache, 0, t, o);
    std::string field;
    try {
      receiver.expect(stopped, tokens_of(stopped, 12), PeerGroup{{0}}, *r.slots, 7);
      while (!receiver.done(stopped)) receiver.poll(), pause();
    } catch (const TransferError& e) {
      field = e.field();
    }
    require(field == "timeout", "a stopped sender did not time the receiver out (got '" + field + "')");
    require(!r.side.manager->contains(7) && r.side.manager->available_blocks() == blocks && r.slots->free_slots() == 1,
            "timeout: pages or a state slot were kept");
    // Every slot held: refused before a page is taken.
    r.slots->add(51, tokens_of(998, 5));
    const int32_t before = r.side.manager->available_blocks();
    std::string argument;
    try {
      receiver.expect(stopped + 2, tokens_of(stopped, 12), PeerGroup{{0}}, *r.slots, 8);
    } catch (const CapacityError& e) {
      argument = e.argument();
    }
    require(argument == "states" && !r.side.manager->contains(8) && r.side.manager->available_blocks() == before,
            "a receiver with no free state slot was not refused before allocating");
    check_state(*r.pool, r.slots->slot(50), 999, "the receiver's other sequence");
  }
  MPI_Barrier(MPI_COMM_WORLD);
  if (t.rank() == 0) std::printf("states: refusals name the field, a stopped sender leaves nothing, bad arguments refused first\n");
}

}  // namespace mpitest
