// The CUDA bench's state rows: a hybrid model's per-sequence state pool (StatePool, state_pool.hpp) on the
// device, for the variant of each model whose spec names linear layers, at its real size (test models
// only where no real one has states). Three operations, each timed eagerly and replayed in a graph against
// a same-run D2D copy of the same bytes (one slot's image: every part of every linear layer):
//   copy_slot    a fork or a beam: one slot's whole state into another
//   checkpoint   a slot's state into a checkpoint record
//   restore      a checkpoint record back into a slot
// Before timing, each row checks the device pool against the CPU backend's: the same slot images written
// to both, the same copy, checkpoint and restore run on both, every slot read back and compared byte for
// byte.
// Part of kvforge_cuda_bench (cuda_bench.cu includes it once, after the cases and the timer).
#pragma once

namespace {

constexpr int64_t kStateSlots = 8, kStateCheckpoints = 4;

// One variant for each model whose spec names linear layers (the first by name: the pool is the model's
// record, whichever layout), real models' where any has states, else the test models' (tiny*).
std::vector<const VariantDescriptor*> state_variants() {
  std::map<std::string, const VariantDescriptor*> chosen;
  for (const VariantEntry& e : registry().variants()) {
    const VariantDescriptor& d = *e.descriptor;
    if (!d.states || d.is_hybrid()) continue;
    auto [at, fresh] = chosen.emplace(d.model, &d);
    if (!fresh && std::string(d.name) < at->second->name) at->second = &d;  // one a model, by name
  }
  std::vector<const VariantDescriptor*> real, test;
  for (const auto& [model, d] : chosen) (model.rfind("tiny", 0) == 0 ? test : real).push_back(d);
  return real.empty() ? test : real;
}

// The slot images after the check's sequence of operations, from either backend's pool.
std::vector<unsigned char> state_check_images(StatePool& pool, const std::vector<unsigned char>& written) {
  const int64_t bytes = pool.slot_bytes();
  for (int64_t s = 0; s < kStateSlots; ++s) pool.write_slot(s, written.data() + s * bytes);
  pool.copy_slot(0, 1);
  pool.checkpoint(2, 0);
  pool.copy_slot(5, 2);
  pool.restore(0, 3);
  std::vector<unsigned char> images(size_t(kStateSlots * bytes));
  for (int64_t s = 0; s < kStateSlots; ++s) pool.read_slot(s, images.data() + s * bytes);
  pool.synchronize();
  return images;
}

// Prints one table row per operation; returns how many variants' pools differed from the CPU's.
int state_rows(Timer& timer, const DeviceBuffer& d2d_src, const DeviceBuffer& d2d_dst, const std::string& filter) {
  int failures = 0;
  bool header = false;
  for (const VariantDescriptor* d : state_variants()) {
    if (!filter.empty() && (std::string("states/") + d->name).find(filter) == std::string::npos) continue;
    if (!header) {
      std::printf("\n| states of | op | slot bytes | eager us | graph us | GB/s | / D2D | check |\n"
                  "|---|---|---|---|---|---|---|---|\n");
      header = true;
    }
    StatePool device(*d, StatePoolConfig{Device::cuda, kStateSlots, kStateCheckpoints, timer.stream});
    StatePool host(*d, StatePoolConfig{Device::cpu, kStateSlots, kStateCheckpoints, nullptr});
    const int64_t bytes = device.slot_bytes();
    std::vector<unsigned char> written(size_t(kStateSlots * bytes));
    std::mt19937 rng(11);
    fill_small_values(written.data(), written.size(), rng);
    const bool same = state_check_images(device, written) == state_check_images(host, written);
    failures += !same;
    // Each call moves to other slots, so that consecutive calls do not copy the same bytes.
    const std::pair<const char*, std::function<void(int)>> ops[] = {
        {"copy_slot", [&](int i) { device.copy_slot(i % kStateSlots, (i + 1) % kStateSlots); }},
        {"checkpoint", [&](int i) { device.checkpoint(i % kStateSlots, i % kStateCheckpoints); }},
        {"restore", [&](int i) { device.restore(i % kStateCheckpoints, i % kStateSlots); }},
    };
    Timing d2d;
    const int64_t span = std::max<int64_t>(bytes, d2d_src.bytes / std::max<int64_t>(bytes, 1) * bytes);
    if (bytes <= d2d_src.bytes)
      timer.eager([&](int i) {
        const int64_t at = (int64_t(i) * bytes) % span;
        check(cudaMemcpyAsync(d2d_dst.as<char>() + at, d2d_src.as<char>() + at, size_t(bytes),
                              cudaMemcpyDeviceToDevice, timer.stream), "d2d");
      }, d2d);
    for (const auto& [op, run] : ops) {
      Timing t;
      timer.eager(run, t);
      timer.graph(run, int(kStateSlots), t);
      // Read and written: a slot's image crosses the memory bus twice.
      std::printf("| %s | %s | %lld | %.2f | %.2f | %.0f | %.2f | %s |\n", d->name, op, (long long)bytes, t.eager_us,
                  t.graph_us, 2.0 * double(bytes) / t.eager_us / 1e3, d2d.eager_us / t.eager_us,
                  same ? "ok" : "differs from the CPU backend");
      std::fflush(stdout);
    }
  }
  return failures;
}

}  // namespace
