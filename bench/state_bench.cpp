// StatePool's operations (state_pool.hpp) against a plain copy of the same bytes, timed in the same
// loop: a whole slot (copy_slot, checkpoint, restore, zero_slot against memset) and one part of one
// layer (write from and read into host memory). Three records: one whose slot stays in the caches (hot,
// 8 layers of a 1024 x 4 bf16 conv window and an 8 x 64 x 64 fp32 state, 1.1 MiB), Qwen3-Next-80B's
// (36 layers of conv [8192, 4] bf16 and recurrent [32, 128, 128] fp32, 74.25 MiB a slot), and one kept
// in a paged cache's own pages (in_pages); and the hot record in vLLM's order (hot_by_layer: a run a
// layer) and SGLang's (hot_by_part: a run a part of a layer). Counters: GB/s of the op and of the copy,
// and their ratio.
#include <benchmark/benchmark.h>

#include <chrono>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "kvforge/kvforge.hpp"
#include "memory_bench.hpp"

namespace kvforge_bench {
namespace {

using namespace kvforge;

struct Record {
  const char* name;
  int layers;
  std::vector<StatePart> parts;
  const char* in_pages_of = nullptr;  // a variant whose pages hold the states (StatePool over a cache)
  StateAxes axes = kSlotMajor;        // a pool of its own's order
};

// The last keeps a record sized for Llama-3-8B's 32 KiB K and V blocks of a 16-token page in that cache's
// pages: 10 spans a state (8 runs of one 32 KiB part, 2 of four 8 KiB parts), against one in a pool of
// its own.
const Record kRecords[] = {
    {"hot", 8, {{"conv", {1024, 4}, DType::bf16}, {"ssm", {8, 64, 64}, DType::f32}}},
    {"qwen3_next_80b", 36, {{"conv", {8192, 4}, DType::bf16}, {"ssm", {32, 128, 128}, DType::f32}}},
    {"in_pages", 8, {{"conv", {1024, 4}, DType::bf16}, {"ssm", {8, 32, 32}, DType::f32}}, "vllm_paged_nhd.llama3_8b.bf16"},
    {"hot_by_layer", 8, {{"conv", {1024, 4}, DType::bf16}, {"ssm", {8, 64, 64}, DType::f32}}, nullptr,
     {StateAxis::layer, StateAxis::slot, StateAxis::part}},
    {"hot_by_part", 8, {{"conv", {1024, 4}, DType::bf16}, {"ssm", {8, 64, 64}, DType::f32}}, nullptr,
     {StateAxis::part, StateAxis::layer, StateAxis::slot}},
};

enum class StateOp { copy_slot, checkpoint, restore, zero_slot, write_part, read_part };
constexpr const char* kStateOpNames[] = {"copy_slot", "checkpoint", "restore", "zero_slot", "write_part", "read_part"};

double seconds_of(const std::chrono::steady_clock::time_point& t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

void run_state_op(benchmark::State& state, const Record* r, StateOp op) {
  std::unique_ptr<Cache> cache;
  if (r->in_pages_of) {
    const VariantEntry* e = registry().find(r->in_pages_of);
    if (!e) return state.SkipWithError((std::string(r->in_pages_of) + " is not in this build").c_str());
    CacheConfig cfg;
    cfg.pages = 3;
    cache = e->create(cfg);
  }
  // A checkpoint record: the third in a pool of its own, page 2 in the cache's.
  const int64_t kept = cache ? 2 : 0;
  StatePool pool = cache ? StatePool(r->parts, r->layers, *cache, 1) : StatePool(r->parts, r->layers, StatePoolConfig{Device::cpu, 2, 1}, r->axes);
  const bool whole = op != StateOp::write_part && op != StateOp::read_part;
  const int64_t bytes = whole ? pool.slot_bytes() : pool.part_bytes(1);
  std::vector<char> a(size_t(bytes), 1), b(size_t(bytes), 2);
  double op_seconds = 0, copy_seconds = 0;
  for (auto _ : state) {
    auto t0 = std::chrono::steady_clock::now();
    switch (op) {
      case StateOp::copy_slot: pool.copy_slot(0, 1); break;
      case StateOp::checkpoint: pool.checkpoint(0, kept); break;
      case StateOp::restore: pool.restore(kept, 1); break;
      case StateOp::zero_slot: pool.zero_slot(1); break;
      case StateOp::write_part: pool.write(1, r->layers - 1, 1, a.data(), Device::cpu); break;
      case StateOp::read_part: pool.read(1, r->layers - 1, 1, b.data(), Device::cpu); break;
    }
    const double s = seconds_of(t0);
    op_seconds += s;
    state.SetIterationTime(s);
    t0 = std::chrono::steady_clock::now();
    if (op == StateOp::zero_slot) std::memset(b.data(), 0, size_t(bytes));
    else std::memcpy(b.data(), a.data(), size_t(bytes));
    copy_seconds += seconds_of(t0);
    benchmark::DoNotOptimize(b.data());
  }
  const double n = double(state.iterations());
  state.SetBytesProcessed(int64_t(n) * bytes);
  state.counters["bytes"] = double(bytes);
  state.counters["GBps"] = n * double(bytes) / op_seconds / 1e9;
  state.counters["copy_GBps"] = n * double(bytes) / copy_seconds / 1e9;
  state.counters["ratio_to_copy"] = copy_seconds / op_seconds;
}

}  // namespace

void register_state_benchmarks() {
  for (const Record& r : kRecords)
    for (int op = 0; op < int(std::size(kStateOpNames)); ++op)
      benchmark::RegisterBenchmark(("memory/state/" + std::string(r.name) + "/" + kStateOpNames[op]).c_str(),
                                   run_state_op, &r, StateOp(op))
          ->UseManualTime();
}

}  // namespace kvforge_bench
