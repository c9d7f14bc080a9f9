// The MPI transfer scenarios where something goes wrong (their list: mpi_transfer.cpp): refused
// headers, a sender that stops, retries of an id, a degree mismatch and a budget that holds no page.
#include "mpi_harness.hpp"

namespace mpitest {

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
      // Halves of tiny's shape (2 heads of 16) holding K 20 then V 12: the record tells them apart.
      {"header.record_kind", "paged_head_records.tiny_kv_widths.fp32", "vllm_paged_nhd.tiny.fp32", 9, 9, false},
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

}  // namespace mpitest
