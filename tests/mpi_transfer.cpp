// Transfers between processes, under mpirun (tests/CMakeLists.txt runs each scenario):
//   layouts            np 2: every ordered pair of the tiny model's default float layouts, bitwise, in
//                      the physical format (into the pool, and through host staging) and the logical
//   tp S R             np S+R: a prefill group of degree S feeds a decode group of degree R, bitwise; at
//                      degrees up to 2, a hybrid model's state slot too (mpi_transfer_states.cpp)
//   dtypes             np 2: bf16 sent, int8, fp8 and FlashMLA's fp8 records stored on arrival, equal to the
//                      reference quantizer and the reference record encoder
//   inflight N         np 2: N requests of random lengths in flight at once, interleaved; no mixing
//   refused            np 2: every header mismatch is refused, and nothing is committed
//   timeout            np 2: a sender that stops midway; the receiver times out and commits nothing
//   retry              np 2: an id used again at once after a sender's timeout with nobody expecting it,
//                      after a refusal, and by an id whose tags are the same; each retry arrives whole
//   tp_mismatch        np 3: a receiver that expects two senders, fed by one whole-model sender, refuses
//                      its header at once, naming header.sender_tp, and so does the sender
//   states             np 2: a hybrid model's sequence with its state slot (mpi_transfer_states.cpp)
//   capacity           np any: plan_memory over the ranks takes the smallest page count; then each rank in
//                      turn has a budget that holds no page, and every rank raises its CapacityError
// Every value is a function of (request, layer, head of the full model, position, dim), exact in
// bf16, so the receiver checks what it holds against plain loops over those coordinates.
#include <map>

#include "part_record_reference.hpp"
#include "mpi_harness.hpp"

namespace mpitest {

void layouts(MpiTransport& t) {
  const std::vector<std::string> names = tiny_float_variants();
  require(names.size() >= 4, "fewer than 4 float layouts of the tiny model");
  int64_t request = 1;
  // Every pair three times: in the format the receiver picks (the physical one, straight into its
  // pool, wherever its pages are dense blocks); in it again through host staging on both sides, the
  // path a device pool takes (the sender writes from a gathered copy, the receiver copies runs into its
  // pool); and with the physical format turned off (gather, append).
  struct Mode {
    bool physical, staged;
    const char* label;
  };
  for (const Mode mode : {Mode{true, false, ""}, Mode{true, true, " (physical, staged)"}, Mode{false, false, " (logical)"}}) {
    const bool physical = mode.physical;
    TransferOptions options;
    options.physical = physical;
    options.stage_physical = mode.staged;
    const auto before = pieces_sent();
    for (const std::string& a : names)
      for (const std::string& b : names) {
        const VariantDescriptor& da = *registry().at(a).descriptor;
        const VariantDescriptor& db = *registry().at(b).descriptor;
        // A ring holds its window only: a transfer to or from one carries at most that many tokens.
        const bool ring = da.addressing == Addressing::ring || db.addressing == Addressing::ring;
        const int64_t tokens = ring ? std::max(1, std::min(da.window ? da.window : 64, db.window ? db.window : 64) - 3) : 45;
        transfer(t, a, b, PeerGroup{{0}}, PeerGroup{{1}}, {request, request + 1}, {tokens, std::max<int64_t>(1, tokens - 7)},
                 a + " -> " + b + mode.label, options);
        request += 2;
      }
    const auto after = pieces_sent();
    const int64_t physical_count = after.first - before.first, logical_count = after.second - before.second;
    require(physical ? physical_count > 0 : physical_count == 0,
            physical ? "layouts: no pair used the physical format" : "layouts: the physical format was used while off");
    if (t.rank() == 0)
      std::printf("layouts: %zu x %zu layout pairs, bitwise: %lld pieces physical, %lld logical%s\n", names.size(),
                  names.size(), (long long)physical_count, (long long)logical_count, mode.label);
  }
}

void tp_states(MpiTransport& t, int S, int R);  // mpi_transfer_states.cpp

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
  if (S <= 2 && R <= 2) tp_states(t, S, R);  // tiny_gdn's degrees
}

void dtypes(MpiTransport& t) {
  const std::vector<std::pair<std::string, std::string>> pairs = {
      {"vllm_paged_nhd.tiny_tp.bf16", "flashinfer_paged_hnd.tiny_tp.int8_in_bf16"},
      {"vllm_paged_nhd.tiny.bf16", "vllm_paged_nhd.tiny.fp8_e4m3_in_bf16"},
      {"vllm_paged_nhd.tiny.bf16", "deepspeed_blocked.tiny.int8_in_bf16"},
      {"jetstream_contiguous.tiny.bf16", "jetstream_contiguous.tiny.int8_in_bf16"},
      // MLA records in bf16 to FlashMLA's fp8 records, encoded where they land.
      {"vllm_mla.tiny_mla_tiles.bf16", "flashmla_paged.tiny_mla_tiles.flashmla_fp8_in_bf16"}};
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
      if (d.takes_tensor_scale())
        for (int layer = 0; layer < d.layers; ++layer) side.cache->set_tensor_scale(layer, 0.0625f, 0.125f);
      KvReceiver receiver(*side.cache, 0, t);
      receiver.expect(request, tokens_of(request, tokens), PeerGroup{{0}}, side.manager.get(), 0);
      while (!receiver.done(request)) receiver.poll(), pause();
      // What the reference quantizer (tests/quant_reference.hpp) says each token reads back as; for a
      // FlashMLA record, what the reference encoder (tests/flashmla_reference.hpp) makes of its latent.
      std::map<std::pair<int, int64_t>, kvtest::RefRecord> records;
      check_receiver(side, 0, 0, tokens, a + " -> " + b, [&](int layer, int head, int64_t p, int x, int kv) {
        if (d.coded_records()) {
          auto it = records.find({layer, p});
          if (it == records.end()) {
            std::vector<float> latent;
            for (int side_kv = 0; side_kv < 2; ++side_kv)
              for (int i = 0; i < d.head_dim; ++i) latent.push_back(value(request, layer, 0, p, i, side_kv));
            it = records.emplace(std::make_pair(layer, p), kvtest::ref_record(d, latent)).first;
          }
          return it->second.gathered[size_t(kv) * d.head_dim + x];
        }
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
  if (t.rank() == 0) std::printf("dtypes: bf16 sent, int8, fp8 and FlashMLA records stored on arrival, as the references say\n");
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

// mpi_transfer_failures.cpp
void refused(MpiTransport& t);
void timeout(MpiTransport& t);
void retry(MpiTransport& t);
void tp_mismatch(MpiTransport& t);
void capacity(MpiTransport& t);
// mpi_transfer_states.cpp
void states(MpiTransport& t);

}  // namespace mpitest

using namespace mpitest;

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
    else if (what == "states") states(t);
    else die("usage: kvforge_mpi_tests layouts | tp S R | dtypes | inflight N | refused | timeout | capacity | retry | "
             "tp_mismatch | states");
  } catch (const std::exception& e) {
    die(e.what());
  }
  MPI_Finalize();
  return 0;
}
