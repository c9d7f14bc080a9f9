// Host-tier promotion on a CUDA cache (issue 32), for tools/gpu-check. A llama3-8b bf16 prompt of 64
// blocks (128 MiB of packed pages) lives on the pinned host tier only. Each iteration times, on the
// host clock, add() (which promotes it), a kernel standing for the step's other work on the cache's
// stream (one thread spinning for --work-us, so the promotion's unpack has the other SMs), step(), and
// the cache's stream to its end; between iterations another prompt pushes it down again.
// - ahead:0: add() copies itself, and the host waits for the host-to-device copies inside it;
// - ahead:1: SequenceManagerOptions::promote_ahead, the copies on the manager's stream beside the work,
//   which step() makes the cache's stream wait for by an event.
// Beside them, in the same run: the work alone, and a cudaMemcpyAsync of the same bytes from pinned
// memory, the baseline of the goal "promotion from host >= 0.8x the same-run copy of its bytes"
// (ahead:0 with no work is the promotion alone). Prints one markdown table of means, ms.
#include <cuda_runtime.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "kvforge/kvforge.hpp"
#include "memory_bench.hpp"
#include "promotion_setup.hpp"

namespace {

using namespace kvforge;
using Clock = std::chrono::steady_clock;

using kvforge_bench::PromotionSetup;

__global__ void spin(long long cycles) {
  const long long start = clock64();
  while (clock64() - start < cycles) {
  }
}

void check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) {
    std::fprintf(stderr, "kvforge_cuda_promote_bench: %s: %s\n", what, cudaGetErrorString(e));
    std::exit(1);
  }
}

double since(Clock::time_point t0) { return std::chrono::duration<double, std::milli>(Clock::now() - t0).count(); }

// The mean ms of `iterations` served promotions: add(), the work (if any), step(), the stream's end.
double promotions(cudaStream_t stream, bool ahead, long long work_cycles, int iterations, int64_t* copied_ahead) {
  CacheConfig config;
  config.device = Device::cuda;
  config.stream = stream;
  PromotionSetup setup(config, ahead);
  SequenceManager& m = *setup.manager;
  Cache* cache = setup.cache.get();
  const std::vector<int32_t>&a = setup.a, &b = setup.b;
  int64_t id = 0;
  auto serve = [&](const std::vector<int32_t>& prompt, bool work) {
    const auto t0 = Clock::now();
    m.add(id, prompt);
    if (work && work_cycles > 0) spin<<<1, 1, 0, stream>>>(work_cycles);
    m.step({id});
    cache->synchronize();
    const double ms = since(t0);
    m.free(id++);
    return ms;
  };
  serve(a, true);
  serve(b, true);  // a is on the host tier now, and every buffer is touched
  const int64_t before = m.stats().promoted_ahead;
  double total = 0;
  for (int i = 0; i < iterations; ++i) {
    total += serve(a, true);  // a comes back, b goes down
    serve(b, false);
  }
  *copied_ahead = m.stats().promoted_ahead - before;
  return total / iterations;
}

}  // namespace

int main(int argc, char** argv) {
  int iterations = 10;
  double work_us = 3000;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--iterations" && i + 1 < argc) {
      iterations = std::atoi(argv[++i]);
    } else if (a == "--work-us" && i + 1 < argc) {
      work_us = std::atof(argv[++i]);
    } else {
      std::printf("usage: kvforge_cuda_promote_bench [--iterations N (10)] [--work-us X (3000)]\n");
      return a == "--help" ? 0 : 2;
    }
  }
  if (iterations < 1 || work_us < 0) {
    std::fprintf(stderr, "kvforge_cuda_promote_bench: --iterations must be >= 1 and --work-us >= 0\n");
    return 2;
  }
  std::string why;
  if (!cuda_available(&why)) {
    std::fprintf(stderr, "kvforge_cuda_promote_bench: %s\n", why.c_str());
    return 1;
  }
  cudaStream_t stream = nullptr;
  check(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "stream");
  int clock_khz = 0;
  check(cudaDeviceGetAttribute(&clock_khz, cudaDevAttrClockRate, 0), "clock rate");
  const long long cycles = (long long)(work_us * clock_khz / 1000.0);

  // The same bytes as one copy from pinned memory, and the work alone.
  const int64_t bytes = PromotionSetup::kPages * [] {
    CacheConfig c;
    c.device = Device::cuda;
    c.pages = 1;
    return registry().at(kvforge_bench::kMemoryVariant).create(c)->packed_page_bytes();
  }();
  Buffer host(backend(Device::cuda).host(), bytes), device(backend(Device::cuda), bytes);
  double copy_ms = 0, work_ms = 0;
  for (int i = 0; i <= iterations; ++i) {
    auto t0 = Clock::now();
    check(cudaMemcpyAsync(device.data(), host.data(), size_t(bytes), cudaMemcpyHostToDevice, stream), "copy");
    check(cudaStreamSynchronize(stream), "copy");
    if (i > 0) copy_ms += since(t0);  // the first one warms up
    t0 = Clock::now();
    spin<<<1, 1, 0, stream>>>(cycles);
    check(cudaStreamSynchronize(stream), "work");
    if (i > 0) work_ms += since(t0);
  }
  copy_ms /= iterations;
  work_ms /= iterations;

  std::printf("| what | ms | promoted ahead | ÷ copy of the bytes |\n|---|---:|---:|---:|\n");
  std::printf("| copy of %.0f MiB, pinned to device | %.3f | | 1.00 |\n", double(bytes) / (1 << 20), copy_ms);
  std::printf("| work alone (%.0f µs asked) | %.3f | | |\n", work_us, work_ms);
  for (const bool work : {false, true})
    for (const bool ahead : {false, true}) {
      int64_t copied = 0;
      const double ms = promotions(stream, ahead, work ? cycles : 0, iterations, &copied);
      std::printf("| promotion%s, ahead:%d | %.3f | %lld | %s |\n", work ? " + work" : "", ahead ? 1 : 0, ms,
                  (long long)copied, work ? "" : std::to_string(copy_ms / ms).substr(0, 4).c_str());
    }
  cudaStreamDestroy(stream);
  return 0;
}
