// StatePool's operations (state_pool.hpp) against a plain copy of the same bytes, timed in the same
// loop: a whole slot (copy_slot, checkpoint, restore, zero_slot against memset) and one part of one
// layer (write from and read into host memory). Two records: one whose slot stays in the caches (hot,
// 8 layers of a 1024 x 4 bf16 conv window and an 8 x 64 x 64 fp32 state, 1.1 MiB), and
// Qwen3-Next-80B's (36 layers of conv [8192, 4] bf16 and recurrent [32, 128, 128] fp32, 74.25 MiB a
// slot). Counters: GB/s of the op and of the copy, and their ratio.
#include <benchmark/benchmark.h>

#include <chrono>
#include <cstring>
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
};

const Record kRecords[] = {
    {"hot", 8, {{"conv", {1024, 4}, DType::bf16}, {"ssm", {8, 64, 64}, DType::f32}}},
    {"qwen3_next_80b", 36, {{"conv", {8192, 4}, DType::bf16}, {"ssm", {32, 128, 128}, DType::f32}}},
};

enum class StateOp { copy_slot, checkpoint, restore, zero_slot, write_part, read_part };
constexpr const char* kStateOpNames[] = {"copy_slot", "checkpoint", "restore", "zero_slot", "write_part", "read_part"};

double seconds_of(const std::chrono::steady_clock::time_point& t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

void run_state_op(benchmark::State& state, const Record* r, StateOp op) {
  StatePool pool(r->parts, r->layers, StatePoolConfig{Device::cpu, 2, 1});
  const bool whole = op != StateOp::write_part && op != StateOp::read_part;
  const int64_t bytes = whole ? pool.slot_bytes() : pool.part_bytes(1);
  std::vector<char> a(size_t(bytes), 1), b(size_t(bytes), 2);
  double op_seconds = 0, copy_seconds = 0;
  for (auto _ : state) {
    auto t0 = std::chrono::steady_clock::now();
    switch (op) {
      case StateOp::copy_slot: pool.copy_slot(0, 1); break;
      case StateOp::checkpoint: pool.checkpoint(0, 0); break;
      case StateOp::restore: pool.restore(0, 1); break;
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
