// kvforge_bench --kvf_tune: CPU launch parameters measured on this machine, the winner written where
// the next build reads it.
#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <string>
#include <vector>

#include "matrix_bench.hpp"

namespace kvforge_bench {
namespace {

using namespace kvforge;

// Seconds per operation: the median of 5 timed batches of repeated runs, each batch ~10 ms.
double time_op(Prepared& p, const VariantDescriptor& d, const Shape& s) {
  auto once = [&] { run_once(p, d, s, Impl::generated); };
  using clock = std::chrono::steady_clock;
  once();
  const auto t0 = clock::now();
  once();
  const double single = std::max(1e-7, std::chrono::duration<double>(clock::now() - t0).count());
  const int reps = std::max(1, int(0.01 / single));
  std::vector<double> batches;
  for (int b = 0; b < 5; ++b) {
    const auto start = clock::now();
    for (int r = 0; r < reps; ++r) once();
    batches.push_back(std::chrono::duration<double>(clock::now() - start).count() / reps);
  }
  std::sort(batches.begin(), batches.end());
  return batches[2];
}

}  // namespace

int tune(const std::string& model, const std::string& out_dir) {
  const std::vector<Shape> shapes = {{"append_decode", "batch", 1}, {"append_decode", "batch", 8},
                                     {"append_decode", "batch", 64}, {"append_prefill", "chunk", 512},
                                     {"gather", "ctx", 1024}};
  std::vector<Tuning> candidates;
  for (int64_t bytes : {int64_t(4) << 10, int64_t(16) << 10, int64_t(64) << 10, int64_t(256) << 10, int64_t(1) << 20})
    for (int chunk : {0, 8}) {
      Tuning t;
      t.cpu_parallel_bytes = bytes;
      t.cpu_chunk_items = chunk;
      candidates.push_back(t);
    }
  std::vector<double> log_sum(candidates.size(), 0.0);
  int pairs = 0;
  for (const auto& e : registry().variants()) {
    const VariantDescriptor& d = *e.descriptor;
    if (model != d.model || d.is_hybrid() || d.update == UpdateMode::lazy) continue;
    if (d.storage != DType::bf16 && !d.quantized()) continue;
    for (const Shape& s : shapes) {
      auto p = prepare(e, s, Impl::generated);
      if (!p) continue;
      std::vector<double> times;
      for (const Tuning& t : candidates) {
        p->cache->set_tuning(t);
        times.push_back(time_op(*p, d, s));
      }
      for (size_t c = 0; c < candidates.size(); ++c) log_sum[c] += std::log(times[c] / times[4]);  // vs the defaults
      ++pairs;
      std::fprintf(stderr, "tune: %s %s:%lld measured\n", d.name, s.key, static_cast<long long>(s.n));
    }
  }
  if (pairs == 0) {
    std::fprintf(stderr, "kvforge_bench: --kvf_tune=%s: no eager bf16 or quantized variant of that model is registered\n",
                 model.c_str());
    return 2;
  }
  const size_t best = size_t(std::min_element(log_sum.begin(), log_sum.end()) - log_sum.begin());
  const double ratio = std::exp(log_sum[best] / pairs);
  const std::string path = out_dir + "/" + model + ".yaml";
  FILE* f = std::fopen(path.c_str(), "w");
  if (!f) {
    std::fprintf(stderr, "kvforge_bench: cannot write %s\n", path.c_str());
    return 1;
  }
  std::fprintf(f,
               "# Written by `kvforge_bench --kvf_tune=%s` on the CPU backend (%d threads): %zu candidates over %d\n"
               "# (variant, shape) pairs. The winner's geometric-mean time is %.3f of the defaults'.\n"
               "# The next build bakes these into every %s variant; CUDA parameters keep their defaults\n"
               "# until a tuning run on a GPU measures them.\n"
               "model: %s\ncpu:\n  parallel_bytes: %lld\n  chunk_items: %lld\n",
               model.c_str(), omp_get_max_threads(), candidates.size(), pairs, ratio, model.c_str(), model.c_str(),
               static_cast<long long>(candidates[best].cpu_parallel_bytes),
               static_cast<long long>(candidates[best].cpu_chunk_items));
  std::fclose(f);
  std::printf("tune: %s: cpu parallel_bytes=%lld chunk_items=%lld, %.3f of the defaults' time; wrote %s\n",
              model.c_str(), static_cast<long long>(candidates[best].cpu_parallel_bytes),
              static_cast<long long>(candidates[best].cpu_chunk_items), ratio, path.c_str());
  return 0;
}

}  // namespace kvforge_bench
