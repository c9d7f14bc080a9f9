// A downstream program over two MPI ranks: rank 0 writes one sequence of its own variant and sends it
// with kvforge's MPI transport, as installed (kvforge::mpi); rank 1 receives it into the same layout and
// checks every value against the function that wrote it. Exits 1 on any mismatch.
#include <mpi.h>

#include <cstdio>
#include <thread>
#include <vector>

#include "consumer_registry.hpp"  // declares consumer::registry(), the REGISTRY_FUNCTION
#include "kvforge/kvforge.hpp"
#include "kvforge/mpi_transport.hpp"
#include "kvforge/transfer.hpp"

namespace {
// Exact in fp32: small multiples of 1/8.
float value(int layer, int64_t t, int64_t h, int64_t x, int kv) {
  return float((layer * 7 + t * 5 + h * 3 + x + kv * 11) % 64) / 8.0f;
}
}  // namespace

int main(int argc, char** argv) {
  using namespace kvforge;
  MPI_Init(&argc, &argv);
  int status = 0;
  try {
    MpiTransport transport;
    if (transport.size() != 2) throw ArgumentError("ranks", "run with mpirun -np 2");
    CacheConfig config;
    config.pages = 8;
    auto cache = consumer::registry().create("consumer_paged.odd_model.fp32", config);
    const VariantDescriptor& d = cache->descriptor();
    const int64_t H = d.heads, D = d.head_dim;
    SequenceManager manager(*cache);
    const std::vector<int32_t> tokens{3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9};
    const int64_t T = int64_t(tokens.size());
    std::vector<float> k(size_t(T * H * D)), v(k.size());
    if (transport.rank() == 0) {
      manager.add(0, tokens);
      const BatchMetadata step = manager.step({0});
      for (int layer = 0; layer < d.layers; ++layer) {
        for (int64_t t = 0; t < T; ++t)
          for (int64_t h = 0; h < H; ++h)
            for (int64_t x = 0; x < D; ++x) {
              k[size_t((t * H + h) * D + x)] = value(layer, t, h, x, 0);
              v[size_t((t * H + h) * D + x)] = value(layer, t, h, x, 1);
            }
        cache->append(layer, TensorView::contiguous(k.data(), d.input, Device::cpu, T, H, D),
                      TensorView::contiguous(v.data(), d.input, Device::cpu, T, H, D),
                      TokenTargets::paged(IndexView::of(step.slots.data(), T)));
      }
      KvSender sender(*cache, 0, transport);
      sender.send(551, manager.range(0, 0, T), tokens, PeerGroup{{1}});
      while (!sender.poll()) std::this_thread::yield();
    } else {
      KvReceiver receiver(*cache, 0, transport);
      receiver.expect(551, tokens, PeerGroup{{0}}, &manager, 0);
      while (!receiver.done(551)) receiver.poll();
      for (int layer = 0; layer < d.layers && status == 0; ++layer) {
        cache->gather(layer, manager.range(0, 0, T), TensorView::contiguous(k.data(), d.input, Device::cpu, H, T, D),
                      TensorView::contiguous(v.data(), d.input, Device::cpu, H, T, D));
        for (int64_t h = 0; h < H; ++h)
          for (int64_t t = 0; t < T; ++t)
            for (int64_t x = 0; x < D; ++x)
              if (k[size_t((h * T + t) * D + x)] != value(layer, t, h, x, 0) ||
                  v[size_t((h * T + t) * D + x)] != value(layer, t, h, x, 1)) {
                std::printf("transfer: layer %d position %lld head %lld dim %lld differs\n", layer, (long long)t,
                            (long long)h, (long long)x);
                status = 1;
              }
      }
      if (status == 0) std::printf("transfer over the installed kvforge::mpi: %lld tokens of %s, ok\n", (long long)T, d.name);
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "transfer: %s\n", e.what());
    status = 1;
  }
  MPI_Finalize();
  return status;
}
