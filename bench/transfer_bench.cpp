// Transfer bandwidth between two processes, against the same bytes sent as one contiguous buffer over
// the same transport in the same run.
//
//   mpirun -np 2 [--oversubscribe --allow-run-as-root] ./build/kvforge_transfer_bench
//       [--tokens 4096,32768] [--pairs prefill:decode,...] [--repeat 3] [--staged 1]
//
// For each layout pair and request length, rank 0 sends one sequence of every layer of a
// llama3-8b cache (KvSender), rank 1 receives it into the other layout (KvReceiver), and the time
// from a barrier to the receiver's last layer is taken. The baseline is MPI_Send of the same number
// of bytes from the sender's pool to the receiver's pool, in one message per GiB (MPI counts are
// int). Figures are medians; "÷ contiguous" is the baseline's time over the transfer's. The sender and
// receiver live across the repeats, as in a server, so their staging buffers are reused; "wire" says
// which format the receiver chose (physical: straight into its pool; logical: gather and append).
// --staged 1 sends the physical format through host staging on both sides (TransferOptions::
// stage_physical): the path a device pool takes, here on host pools.
#include <mpi.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "kvforge/kvforge.hpp"
#include "kvforge/mpi_transport.hpp"
#include "kvforge/transfer.hpp"

using namespace kvforge;

namespace {

std::vector<std::string> split(const std::string& text, char at) {
  std::vector<std::string> out;
  std::stringstream in(text);
  for (std::string part; std::getline(in, part, at);)
    if (!part.empty()) out.push_back(part);
  return out;
}

double seconds_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  std::string tokens_arg = "4096,32768";
  std::string pairs_arg =
      "vllm_paged_nhd.llama3_8b.bf16:flashinfer_paged_hnd.llama3_8b.bf16,"
      "deepspeed_blocked.llama3_8b.bf16:vllm_paged_nhd.llama3_8b.bf16,"
      "vllm_paged_nhd.llama3_8b.bf16:jetstream_paged.llama3_8b.bf16,"
      "flashinfer_paged_hnd.llama3_8b.bf16:deepspeed_blocked.llama3_8b.bf16,"
      "jetstream_contiguous.llama3_8b.bf16:vllm_paged_nhd.llama3_8b.bf16,"
      "vllm_paged_nhd.llama3_8b.bf16:jetstream_contiguous.llama3_8b.bf16,"
      "flashinfer_paged_hnd.llama3_8b.bf16:flashinfer_paged_hnd.llama3_8b.int8_in_bf16";
  int repeat = 3;
  TransferOptions transfer_options;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string flag = argv[i];
    if (flag == "--tokens") tokens_arg = argv[i + 1];
    else if (flag == "--pairs") pairs_arg = argv[i + 1];
    else if (flag == "--repeat") repeat = std::max(1, std::atoi(argv[i + 1]));
    else if (flag == "--staged") transfer_options.stage_physical = std::atoi(argv[i + 1]) != 0;
  }
  {  // the transport goes before MPI_Finalize
  MpiTransport transport;
  const int me = transport.rank();
  if (transport.size() != 2) {
    if (me == 0) std::fprintf(stderr, "transfer bench: run with mpirun -np 2\n");
    MPI_Abort(MPI_COMM_WORLD, 1);
  }
  if (me == 0)
    std::printf("| prefill layout | decode layout | tokens | bytes | wire | transfer ms | GB/s | contiguous ms | "
                "÷ contiguous | messages |\n|---|---|---|---|---|---|---|---|---|---|\n");
  int64_t request = 1;
  for (const std::string& pair : split(pairs_arg, ',')) {
    const std::vector<std::string> sides = split(pair, ':');
    for (const std::string& t : split(tokens_arg, ',')) {
      const int64_t tokens = std::atoll(t.c_str());
      const VariantDescriptor& d = *registry().at(sides[size_t(me)]).descriptor;
      // A contiguous cache holds one row of at most its model's max_seq_len: longer requests are skipped.
      bool fits = true;
      for (const std::string& side : sides) {
        const VariantDescriptor& e = *registry().at(side).descriptor;
        fits = fits && (e.paged() || tokens <= e.max_seq_len);
      }
      if (!fits) continue;
      CacheConfig config;
      if (d.paged()) config.pages = tokens / d.page_size + 2;
      else config.rows = 1, config.max_seq_len = tokens;
      auto cache = registry().create(d.name, config);
      SequenceManagerOptions options;
      options.prefix_caching = false;
      std::unique_ptr<SequenceManager> manager;
      if (d.paged()) manager = std::make_unique<SequenceManager>(*cache, options);
      GatherRange row;  // contiguous: row 0
      row.end = tokens;
      std::vector<int32_t> ids(static_cast<size_t>(tokens));
      for (int64_t i = 0; i < tokens; ++i) ids[size_t(i)] = int32_t(i % 32000);
      // The logical bytes a transfer carries: K and V of every layer and head, in the input dtype.
      const int64_t bytes = 2 * int64_t(d.layers) * d.heads * d.head_dim * tokens * dtype_size(d.input);
      std::vector<double> transfer_s, contiguous_s;
      int64_t messages = 0, physical = 0;
      KvSender sender(*cache, 0, transport, transfer_options);
      KvReceiver receiver(*cache, 0, transport, transfer_options);
      for (int r = 0; r < repeat; ++r, ++request) {
        if (me == 1 && !manager) cache->reset_row(0);  // a row receives into an empty row
        MPI_Barrier(MPI_COMM_WORLD);
        const auto start = std::chrono::steady_clock::now();
        if (me == 0) {
          if (manager) manager->add(request, ids), manager->step({request});
          const int64_t before = sender.messages();
          sender.send(request, manager ? manager->range(request, 0, tokens) : row, ids, PeerGroup{{1}});
          while (!sender.poll()) std::this_thread::yield();
          messages = sender.messages() - before;
          physical = sender.physical_pieces();
        } else {
          receiver.expect(request, ids, PeerGroup{{0}}, manager.get(), manager ? request : 0);
          while (!receiver.done(request)) receiver.poll();
          transfer_s.push_back(seconds_since(start));
          receiver.release(request);
        }
        if (manager) manager->free(request);
        // The baseline: the same bytes, pool to pool, as contiguous messages of at most 1 GiB.
        MPI_Barrier(MPI_COMM_WORLD);
        const auto base = std::chrono::steady_clock::now();
        auto* pool = static_cast<char*>(const_cast<void*>(cache->storage()));
        // Both sides cut the bytes alike: into the smaller pool, at most 1 GiB a message.
        const int64_t chunk = transport.all_min(std::min<int64_t>(int64_t(1) << 30, cache->memory().storage_bytes));
        for (int64_t off = 0; off < bytes;) {
          const int n = int(std::min(chunk, bytes - off));
          if (me == 0) MPI_Send(pool, n, MPI_BYTE, 1, 99, MPI_COMM_WORLD);
          else MPI_Recv(pool, n, MPI_BYTE, 0, 99, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
          off += n;
        }
        if (me == 1) contiguous_s.push_back(seconds_since(base));
      }
      int64_t counts[2] = {messages, physical};
      if (me == 0) MPI_Send(counts, 2, MPI_INT64_T, 1, 98, MPI_COMM_WORLD);
      if (me == 1) {
        MPI_Recv(counts, 2, MPI_INT64_T, 0, 98, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
        messages = counts[0], physical = counts[1];
        const double ts = median(transfer_s), cs = median(contiguous_s);
        char line[512];
        std::snprintf(line, sizeof line, "| %s | %s | %lld | %lld | %s | %.1f | %.2f | %.1f | %.2f | %lld |\n",
                      sides[0].c_str(), sides[1].c_str(), (long long)tokens, (long long)bytes,
                      physical ? (transfer_options.stage_physical ? "physical, staged" : "physical") : "logical", ts * 1e3, double(bytes) / ts / 1e9, cs * 1e3,
                      cs / ts, (long long)messages);
        MPI_Send(line, int(std::strlen(line)) + 1, MPI_CHAR, 0, 97, MPI_COMM_WORLD);
      }
      if (me == 0) {
        char line[512];
        MPI_Recv(line, sizeof line, MPI_CHAR, 1, 97, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
        std::fputs(line, stdout);
        std::fflush(stdout);
      }
    }
  }
  }
  MPI_Finalize();
  return 0;
}
