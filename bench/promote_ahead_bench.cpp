// Host-tier promotion copied ahead on the manager's thread (SequenceManagerOptions::promote_ahead)
// against the same promotion in add() itself, with a step's worth of other work between add() and
// step(): memory/host/promote_then_work/...
#include <benchmark/benchmark.h>

#include <chrono>
#include <cstring>
#include <vector>

#include "kvforge/kvforge.hpp"
#include "memory_bench.hpp"
#include "promotion_setup.hpp"

namespace kvforge_bench {
namespace {

using namespace kvforge;
using Clock = std::chrono::steady_clock;

// The caller's other work between add() and step(), of two kinds: a copy of 128 MiB (bound by memory,
// as the promotion is; 16-21 ms here alone) or arithmetic on one core (bound by it, as a step's compute
// is; 13 ms), each timed alone in the same run (memory/host/work_alone).
enum class Work { none, copy, compute };

constexpr int64_t kWorkBytes = int64_t(128) << 20;
constexpr int64_t kComputeSteps = int64_t(13) << 19;

struct OtherWork {
  std::vector<unsigned char> from = std::vector<unsigned char>(size_t(kWorkBytes), 1), to = from;
  float sum = 0;
  void run(Work w) {
    if (w == Work::copy) std::memcpy(to.data(), from.data(), from.size());
    if (w != Work::compute) return;
    float x = sum + 1.0f;
    for (int64_t i = 0; i < kComputeSteps; ++i) x = x * 0.999999f + 1e-7f;  // one dependent chain
    sum = x;
  }
};

const char* name_of(Work w) { return w == Work::none ? "none" : w == Work::copy ? "copy_128mib" : "compute"; }

// A prompt of PromotionSetup::kPages blocks that lives on the host tier only, served each iteration:
// add() (which promotes it), the caller's other work, then step(), all timed. Without `ahead` add() copies the
// pages itself; with it the copy runs beside the work and step() waits for what is left. Between
// iterations another prompt pushes it down again.
void run_promote_then_work(benchmark::State& state, Work work, bool ahead) {
  PromotionSetup setup(CacheConfig{}, ahead);
  SequenceManager& m = *setup.manager;
  const std::vector<int32_t>&a = setup.a, &b = setup.b;
  OtherWork other;
  int64_t id = 0;
  auto serve = [&](const std::vector<int32_t>& prompt, bool work, Work kind) {
    const auto t0 = Clock::now();
    m.add(id, prompt);
    if (work) other.run(kind);
    m.step({id});
    const double seconds = std::chrono::duration<double>(Clock::now() - t0).count();
    m.free(id++);
    return seconds;
  };
  serve(a, true, work);
  serve(b, true, work);  // a is on the host tier now, and every buffer is touched
  const int64_t promoted = m.stats().promoted_blocks, copied_ahead = m.stats().promoted_ahead;
  for (auto _ : state) {
    state.SetIterationTime(serve(a, true, work));  // a comes back, b goes down
    serve(b, false, work);
  }
  state.counters["promoted_per_add"] = double(m.stats().promoted_blocks - promoted) / double(2 * state.iterations());
  state.counters["ahead_per_add"] = double(m.stats().promoted_ahead - copied_ahead) / double(2 * state.iterations());
  benchmark::DoNotOptimize(other.to.data());
  benchmark::DoNotOptimize(other.sum);
}

}  // namespace

void register_promote_ahead_benchmarks() {
  for (const Work work : {Work::none, Work::copy, Work::compute}) {
    for (const bool ahead : {false, true})
      benchmark::RegisterBenchmark(("memory/host/promote_then_work/pages:64/work:" + std::string(name_of(work)) +
                                    "/ahead:" + (ahead ? "1" : "0")).c_str(),
                                   run_promote_then_work, work, ahead)
          ->UseManualTime()
          ->Iterations(20);
    if (work == Work::none) continue;
    benchmark::RegisterBenchmark(("memory/host/work_alone/work:" + std::string(name_of(work))).c_str(),
                                 [work](benchmark::State& state) {
                                   OtherWork other;
                                   other.run(work);
                                   for (auto _ : state) {
                                     const auto t0 = Clock::now();
                                     other.run(work);
                                     state.SetIterationTime(std::chrono::duration<double>(Clock::now() - t0).count());
                                   }
                                   benchmark::DoNotOptimize(other.to.data());
                                   benchmark::DoNotOptimize(other.sum);
                                 })
        ->UseManualTime()
        ->Iterations(20);
  }
}

}  // namespace kvforge_bench
