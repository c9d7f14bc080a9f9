// The memory-management benchmarks of kvforge_bench: the block allocator, a step's batch arrays on
// the host and on the device, offload and restore against a copy of the same bytes, and the
// serving-trace simulator over every paged layout of the tiny model.
#include <benchmark/benchmark.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <map>
#include <memory>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "kvforge/kvforge.hpp"
#include "memory_bench.hpp"

namespace kvforge_bench {
namespace {

using namespace kvforge;

// Allocate and free 16 pages: the allocator's rate, in pages per second.
void run_allocator(benchmark::State& state) {
  BlockAllocator a(1 << 16);
  std::vector<int32_t> got;
  for (auto _ : state) {
    got.clear();
    a.allocate(16, got);
    a.release(got);
  }
  state.SetItemsProcessed(state.iterations() * 16);
}

// How a step's batch arrays are built: on the host each step (step()), or on the cache's device from
// the persistent block table (step_on_device()), without or with FlashInfer's `indices`.
enum class StepPath { host, device, device_indices };
constexpr int64_t kStepIterations = 2000;
constexpr const char* kStepPathNames[] = {"host", "device", "device_indices"};

// One steady decode step of `batch` sequences of `context` tokens, each advancing by one token: the
// metadata build's cost per step. Only the build is timed (manual time): the appends that precede it
// are the engine's own work.
void run_step_metadata(benchmark::State& state, int64_t batch, int64_t context, StepPath path) {
  // The pool is never written here, so the smallest page of the memory variant's page size stands in.
  const VariantEntry& e = registry().at(kMemoryVariant);
  const int P = e.descriptor->page_size;
  const VariantEntry* small = nullptr;
  for (const auto& v : registry().variants())
    if (v.descriptor->paged() && !v.descriptor->is_hybrid() && v.descriptor->page_size == P &&
        (!small || v.descriptor->bytes_per_token < small->descriptor->bytes_per_token))
      small = &v;
  const int64_t steps_per_fill = kStepIterations;  // the pool holds every step's token: no refill while timed
  CacheConfig cfg;
  cfg.pages = batch * ((context + steps_per_fill) / P + 2);
  auto cache = small->create(cfg);
  SequenceManagerOptions o;
  o.prefix_caching = false;
  SequenceManager m(*cache, o);
  std::vector<int64_t> ids;
  auto fill = [&] {
    for (int64_t i = 0; i < batch; ++i) {
      if (m.contains(i)) m.free(i);
      m.add(i, std::vector<int32_t>(size_t(context), int32_t(i)));
    }
    if (path == StepPath::host) m.step(ids);
    else m.step_on_device(ids, path == StepPath::device_indices);
  };
  for (int64_t i = 0; i < batch; ++i) ids.push_back(i);
  // Sized up front, as an engine sizes it for its max batch and model length: the steady state.
  if (path != StepPath::host) m.reserve_device_steps(int32_t(batch), context + steps_per_fill + P);
  fill();
  int64_t steps = 0, uploaded = 0;
  const std::vector<int32_t> token{7};
  for (auto _ : state) {
    if (++steps >= steps_per_fill) {
      fill();
      steps = 0;
    }
    for (int64_t i = 0; i < batch; ++i) m.append(i, token);
    const auto start = std::chrono::steady_clock::now();
    if (path == StepPath::host) {
      benchmark::DoNotOptimize(m.step(ids));
    } else {
      const DeviceStep& d = m.step_on_device(ids, path == StepPath::device_indices);
      benchmark::DoNotOptimize(d.slots.data);
      uploaded += d.uploaded_bytes;
    }
    state.SetIterationTime(std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
  }
  state.SetItemsProcessed(state.iterations() * batch);
  state.counters["uploaded_B_per_step"] = double(uploaded) / double(std::max<int64_t>(1, state.iterations()));
}

// A cache of kMemoryVariant that holds one sequence of `pages` full pages and a token more.
std::unique_ptr<Cache> memory_cache(int64_t pages) {
  CacheConfig cfg;
  cfg.pages = pages + 1;
  return registry().at(kMemoryVariant).create(cfg);
}

// Offload one sequence of `pages` pages to the host tier and restore it, against a copy of the same
// bytes both ways.
void run_offload_restore(benchmark::State& state, int64_t pages) {
  const int P = registry().at(kMemoryVariant).descriptor->page_size;
  auto cache = memory_cache(pages);
  SequenceManagerOptions o;
  o.host_blocks = int32_t(pages);
  o.prefix_caching = false;
  SequenceManager m(*cache, o);
  m.add(0, std::vector<int32_t>(size_t(pages * P), 1));
  m.step({0});
  m.offload(0);  // first touch of the host tier and staging is not what is measured
  m.restore(0);
  for (auto _ : state) {
    m.offload(0);
    m.restore(0);
  }
  const int64_t bytes = 2 * pages * cache->packed_page_bytes();  // out and back
  state.SetBytesProcessed(state.iterations() * bytes);
  state.counters["bytes_moved"] = double(bytes);
}

// A prefix hit on the host tier under pressure: `pages` cached pages come back into device pages
// while as many leave for the host tier (a device pool that fits one prompt), timed around add()
// alone (manual time). Beside it, in the same run, a memcpy of the same bytes both ways: the host
// tier's baseline, since both sides are host memory on the CPU.
void run_promote_from_host(benchmark::State& state, int64_t pages) {
  const int P = registry().at(kMemoryVariant).descriptor->page_size;
  auto cache = memory_cache(pages);
  SequenceManagerOptions o;
  o.host_blocks = int32_t(2 * pages);
  SequenceManager m(*cache, o);
  const std::vector<int32_t> a(size_t(pages * P + 1), 1), b(size_t(pages * P + 1), 2);
  int64_t id = 0;
  auto serve = [&](const std::vector<int32_t>& prompt) {
    const auto t0 = std::chrono::steady_clock::now();
    m.add(id, prompt);
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    m.step({id});
    m.free(id++);
    return seconds;
  };
  serve(a);
  serve(b);  // a is on the host tier now, and the buffers are touched
  const int64_t promoted = m.stats().promoted_blocks;
  for (auto _ : state) {
    state.SetIterationTime(serve(a));  // a comes back, b goes down
    serve(b);
  }
  const int64_t bytes = 2 * pages * cache->packed_page_bytes();  // up and down
  state.SetBytesProcessed(state.iterations() * bytes);
  state.counters["promoted_per_add"] = double(m.stats().promoted_blocks - promoted) / double(2 * state.iterations());
  state.counters["bytes_moved"] = double(bytes);
}

// The serving-trace simulator: one synthetic trace replayed through a paged layout's cache, driven
// only by the sequence manager, with real appends of every layer.
//   - arrivals: Poisson, 2 requests per step; prompt and output lengths lognormal (medians about 245
//     and 90 tokens); a third of the prompts open with one of four shared 200-token system prompts;
//   - the pool holds 16k tokens whatever the page size, and a host tier a quarter of that;
//   - a request that does not fit waits; a running one that cannot grow is preempted: offloaded if
//     the host tier has room (restored when pages free up), else freed and recomputed later.
// Counters: memory utilization (token slots holding tokens / slots of pages held, averaged over
// steps), prefix hit rate, evictions, preemptions, offloaded bytes, completed requests, and the cache
// operations' throughput (appended tokens per second of append time, and their GB/s).
void run_serving_simulation(benchmark::State& state, const VariantEntry* e) {
  const VariantDescriptor& d = *e->descriptor;
  const int P = d.page_size;
  for (auto _ : state) {
    CacheConfig cfg;
    cfg.pages = 16384 / P;
    auto cache = e->create(cfg);
    SequenceManagerOptions o;
    o.host_blocks = int32_t(cfg.pages / 4);
    SequenceManager m(*cache, o);
    std::mt19937 rng(11);
    std::lognormal_distribution<double> prompt_len(5.5, 0.6), output_len(4.5, 0.7);
    std::vector<std::vector<int32_t>> systems(4);
    for (size_t i = 0; i < systems.size(); ++i) systems[i].assign(200, int32_t(1000 + i));
    struct Request {
      int64_t id;
      std::vector<int32_t> prompt;
      int64_t remaining;
    };
    std::vector<Request> waiting, running, offloaded;
    int64_t next = 0, completed = 0, preempted = 0, appended = 0;
    double util = 0, append_seconds = 0;
    const int steps = 400;
    const int64_t row = int64_t(d.heads) * d.head_dim * dtype_size(d.input);
    std::vector<unsigned char> k, v;
    for (int step = 0; step < steps; ++step) {
      for (int a = std::poisson_distribution<int>(2.0)(rng); a > 0; --a) {
        Request r{next++, {}, std::min<int64_t>(400, int64_t(output_len(rng)) + 1)};
        if (rng() % 3 == 0) r.prompt = systems[rng() % systems.size()];
        const int64_t n = std::min<int64_t>(1200, int64_t(prompt_len(rng)) + 1);
        for (int64_t i = 0; i < n; ++i) r.prompt.push_back(int32_t(rng() % 30000));
        waiting.push_back(std::move(r));
      }
      // Offloaded requests come back first, then waiting ones are admitted in order.
      for (size_t i = 0; i < offloaded.size();) {
        if (int64_t(m.pages(offloaded[i].id).size()) + 8 > m.available_blocks()) break;
        m.restore(offloaded[i].id);
        running.push_back(std::move(offloaded[i]));
        offloaded.erase(offloaded.begin() + int64_t(i));
      }
      while (!waiting.empty()) {
        try {
          m.add(waiting.front().id, waiting.front().prompt);
        } catch (const CapacityError&) {
          break;
        }
        running.push_back(std::move(waiting.front()));
        waiting.erase(waiting.begin());
      }
      // Decode one token for every running request; a request that cannot grow is preempted.
      std::vector<int64_t> ids;
      for (size_t i = 0; i < running.size();) {
        Request& r = running[i];
        bool keep = true;
        if (--r.remaining <= 0) {
          m.free(r.id);
          ++completed;
          keep = false;
        } else {
          try {
            m.append(r.id, {int32_t(rng() % 30000)});
          } catch (const CapacityError&) {
            ++preempted;
            m.step({r.id});  // its earlier tokens are written; the new one was refused whole
            try {
              m.offload(r.id);
              offloaded.push_back(std::move(r));
            } catch (const CapacityError&) {
              m.free(r.id);  // no room on the host either: recompute it later
              r.id = next++;
              waiting.insert(waiting.begin(), std::move(r));
            }
            keep = false;
          }
        }
        if (keep) {
          ids.push_back(r.id);
          ++i;
        } else {
          running.erase(running.begin() + int64_t(i));
        }
      }
      const BatchMetadata b = m.step(ids);
      const int64_t T = int64_t(b.slots.size());
      if (T > 0) {
        k.resize(size_t(T * row));
        v.resize(size_t(T * row));
        const auto t0 = std::chrono::steady_clock::now();
        for (int layer = 0; layer < d.layers; ++layer)
          cache->append(layer, TensorView::contiguous(k.data(), d.input, Device::cpu, T, d.heads, d.head_dim),
                        TensorView::contiguous(v.data(), d.input, Device::cpu, T, d.heads, d.head_dim),
                        TokenTargets::paged(IndexView::of(b.slots.data(), T)));
        cache->commit();
        append_seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
        appended += T;
      }
      util += m.utilization();
    }
    const SequenceStats& st = m.stats();
    state.counters["utilization"] = util / steps;
    state.counters["prefix_hit_rate"] =
        st.prefix_hits + st.prefix_misses ? double(st.prefix_hits) / double(st.prefix_hits + st.prefix_misses) : 0;
    state.counters["evictions"] = double(st.evictions);
    state.counters["preempted"] = double(preempted);
    state.counters["offloaded_bytes"] = double(st.offloaded_pages * cache->packed_page_bytes());
    state.counters["completed"] = double(completed);
    state.counters["append_tokens_per_s"] = append_seconds > 0 ? double(appended) / append_seconds : 0;
    state.counters["append_GBps"] =
        append_seconds > 0 ? double(appended) * double(d.bytes_per_token + 2 * d.layers * row) / append_seconds / 1e9 : 0;
  }
}

}  // namespace

void register_memory_benchmarks() {
  benchmark::RegisterBenchmark("memory/allocate_free/pages:16", run_allocator);
  for (int64_t context : {2048, 32768})
    for (int64_t batch : {1, 64, 256, 1024})
      for (StepPath path : {StepPath::host, StepPath::device, StepPath::device_indices})
        benchmark::RegisterBenchmark(("memory/step_metadata/batch:" + std::to_string(batch) + "/context:" +
                                      std::to_string(context) + "/" + kStepPathNames[int(path)]).c_str(),
                                     run_step_metadata, batch, context, path)
            ->UseManualTime()
            ->Iterations(kStepIterations - 1);
  benchmark::RegisterBenchmark("memory/offload_restore/pages:64", run_offload_restore, int64_t(64))->UseRealTime();
  benchmark::RegisterBenchmark("memory/promote_from_host/pages:64", run_promote_from_host, int64_t(64))->UseManualTime();
}

// One simulation per paged layout of the tiny model (every layout gets the same trace and budget).
void register_simulations() {
  for (const auto& e : registry().variants()) {
    const VariantDescriptor& d = *e.descriptor;
    if (!d.paged() || d.is_hybrid() || std::string(d.model) != "tiny" || d.storage != DType::bf16) continue;
    benchmark::RegisterBenchmark(("simulate/" + std::string(d.name)).c_str(), run_serving_simulation, &e)
        ->Iterations(1)
        ->UseRealTime();
  }
}

}  // namespace kvforge_bench
