// The disk tier's promotion (SequenceManager, docs/memory.md "Disk tier") against a direct read of the
// same records in the same run, and what prefetch() overlaps: memory/disk/...
#include <benchmark/benchmark.h>
#include <fcntl.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "kvforge/kvforge.hpp"
#include "memory_bench.hpp"

namespace kvforge_bench {
namespace {

using namespace kvforge;
using Clock = std::chrono::steady_clock;

constexpr int64_t kPages = 64;  // 128 MiB of llama3-8b bf16 pages

std::string bench_file(const char* name) {
  const std::string path = "/tmp/kvforge_bench_" + std::string(name) + "_" + std::to_string(getpid());
  std::remove(path.c_str());
  return path;
}

double seconds_since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

// The baseline: `kPages` records of the tier's file read with direct I/O, one pread each, as the tier
// reads them; seconds.
double direct_read(const std::string& path, int64_t record) {
  int fd = ::open(path.c_str(), O_RDONLY | O_DIRECT);
  if (fd < 0) fd = ::open(path.c_str(), O_RDONLY);
  void* buffer = std::aligned_alloc(4096, size_t(record));
  const auto t0 = Clock::now();
  for (int64_t r = 0; r < kPages; ++r)
    if (::pread(fd, buffer, size_t(record), r * record) != record) std::fprintf(stderr, "direct_read: short read\n");
  const double seconds = seconds_since(t0);
  std::free(buffer);
  ::close(fd);
  return seconds;
}

// A prompt of `kPages` blocks that lives on the disk tier only, served by add() each iteration: one
// direct read a record, then one unpack into device pages. Between iterations two other prompts push
// it down again (its records stay on disk, so nothing is rewritten). `work_bytes` > 0: before the add,
// the caller does a step's worth of other work (a copy of that many bytes), which is timed with it;
// with `prefetch`, the prompt's reads are queued first and overlap that work.
void run_promote_from_disk(benchmark::State& state, int64_t work_bytes, bool prefetch) {
  CacheConfig config;
  config.pages = kPages + 1;
  auto cache = registry().at(kMemoryVariant).create(config);
  const int P = cache->descriptor().page_size;
  const std::string path = bench_file("tier");
  SequenceManagerOptions o;
  o.host_blocks = int32_t(kPages);
  o.disk_path = path;
  o.disk_blocks = 4 * kPages;
  o.read_ahead_blocks = int32_t(kPages);
  SequenceManager m(*cache, o);
  std::vector<std::vector<int32_t>> prompts;
  for (int32_t p = 0; p < 3; ++p) prompts.emplace_back(size_t(kPages * P + 1), p + 1);
  int64_t id = 0;
  auto serve = [&](const std::vector<int32_t>& prompt) {
    m.add(id, prompt);
    m.step({id});
    m.free(id++);
  };
  auto push_down = [&] {  // prompts[0] to the host tier, then to the disk tier
    serve(prompts[1]);
    serve(prompts[2]);
  };
  serve(prompts[0]);
  push_down();
  std::vector<unsigned char> from(size_t(std::max<int64_t>(work_bytes, 1)), 1), to(from.size());
  int64_t reads = 0;  // of the timed add()s only
  auto once = [&]() {
    const auto t0 = Clock::now();
    if (prefetch) m.prefetch(prompts[0]);
    if (work_bytes > 0) std::memcpy(to.data(), from.data(), from.size());
    const int64_t before = m.stats().disk_reads;
    m.add(id, prompts[0]);
    const double seconds = seconds_since(t0);
    reads += m.stats().disk_reads - before;
    m.step({id});
    m.free(id++);
    push_down();
    return seconds;
  };
  once();  // warm: the read-ahead thread and its buffers, the work's buffers, the pool's pages
  reads = 0;
  const int64_t ahead = m.stats().read_ahead_hits;
  // The add() alone goes beside a direct read of as many records of the same file, in turn: the
  // ratio is this run's, whatever the disk does meanwhile. (With other work timed too, no ratio.)
  const bool baseline = work_bytes == 0 && !prefetch;
  const int64_t record = file_store_record_bytes(cache->packed_page_bytes(), P);
  double promoted = 0, direct = 0;
  for (auto _ : state) {
    const double seconds = once();
    state.SetIterationTime(seconds);
    promoted += seconds;
    if (baseline) direct += direct_read(path, record);
  }
  if (baseline) {
    state.counters["direct_read_ms"] = 1e3 * direct / double(state.iterations());
    state.counters["x_direct_read"] = direct / promoted;  // >= 1: as fast as the direct read
  }
  state.SetBytesProcessed(state.iterations() * kPages * cache->packed_page_bytes());
  state.counters["disk_reads_per_add"] = double(reads) / double(state.iterations());
  state.counters["read_ahead_per_add"] = double(m.stats().read_ahead_hits - ahead) / double(state.iterations());
  benchmark::DoNotOptimize(to.data());
  std::remove(path.c_str());
}

}  // namespace

void register_disk_tier_benchmarks() {
  benchmark::RegisterBenchmark("memory/disk/promote/pages:64", run_promote_from_disk, int64_t(0), false)
      ->UseManualTime()
      ->Iterations(10);
  // The other work: a copy of 1 GiB, about as long as the reads here (128 MiB at 0.5-0.7 GB/s).
  for (const bool prefetch : {false, true})
    benchmark::RegisterBenchmark(
        (std::string("memory/disk/work_then_promote/pages:64/prefetch:") + (prefetch ? "1" : "0")).c_str(),
        run_promote_from_disk, int64_t(1) << 30, prefetch)
        ->UseManualTime()
        ->Iterations(10);
}

}  // namespace kvforge_bench
