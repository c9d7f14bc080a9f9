// The generated matrix on a CUDA device. Variants come from the registry, so a new spec appears here
// with no edit. Every figure that counts is a ratio to a baseline timed in the same process on the
// same bytes (the same rule as kvforge_bench, bench/report.py):
//   - D2D:        cudaMemcpyAsync device to device of half the bytes moved (so the same bytes cross
//                 the memory bus);
//   - empty:      an empty kernel, eager and replayed in a graph: the launch floor;
//   - naive:      one thread per element, every index recomputed with run-time division;
//   - reference:  written here from scratch on vLLM's strategy: a block per token (or position),
//                 16-byte vectors, __restrict__, slot -1 skipped; its gather mirror; for fp8 storage,
//                 the hardware saturating convert;
//   - bf16 twin:  for quantized variants, the same layout storing bf16.
// The variants: one for each layout and (storage, input) pair at a real model's size (matrix_rules.hpp's
// timed_variants: every storage family and record kind), then the state pools of hybrid models
// (cuda_states.cuh). Three timings per case: cudaEvents around repeated eager calls, CUDA-graph replay
// (of one op, and of a whole 32-layer decode step for decode shapes), and the host's enqueue time per
// call. A lazy variant's decode shape also times its commit alone: one graph launch that writes every
// staged layer. Each case rotates layers and inputs so that its working set stays above L2; --cold also
// flushes L2 before every timed call, outside the timed region. Each case's pool bytes (and scales) are
// checked against the CPU backend's for the same inputs.
//
//   kvforge_cuda_bench [--preset short|full] [--filter S] [--cold] [--iterations N] [--json F]
//   kvforge_cuda_bench --tune=<model> [--tune_out specs/tuning]
//
// --tune (or --kvf_tune, as the CPU bench spells it) measures cuda.block_threads and
// cuda.items_per_thread for every eager float and quantized variant of the model and writes the
// `cuda` section of specs/tuning/<model>.yaml. Render the JSON with bench/report.py.
#include "kvforge/backends/cuda/target.cuh"  // first: every CUDA source names its target

#include <cuda_bf16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <functional>
#include <map>
#include <memory>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "kvforge/kvforge.hpp"
#include "matrix_rules.hpp"
#include "torch_peers.hpp"

using namespace kvforge;
using namespace kvforge_bench;

#include "cuda_baselines.cuh"
#include "cuda_cases.cuh"
#include "cuda_timer.cuh"
#include "cuda_states.cuh"

namespace {

// ---- one case --------------------------------------------------------------------------------------

struct Record {
  std::string variant, op, check = "not run";
  int64_t n = 0, bytes = 0;
  bool coded = false;  // stores scaled codes or coded records (the quantized goals' rows)
  Timing kvforge, untuned, reference, naive, twin, step, commit;
  double d2d_us = NAN;
  // --torch: each PyTorch form's eager µs per call (torch_peers.hpp), or why there is none.
  std::vector<std::pair<std::string, double>> torch;
  std::string torch_note;
  // A lazy variant's host time per call of its step, enqueued as an engine does: one layer's append
  // (staging) and the commit.
  double append_host_us = NAN, commit_host_us = NAN;
};

// Inputs for `sets` epochs, and a gather's output, on the device.
struct Inputs {
  std::vector<DeviceBuffer> k, v;
  DeviceBuffer k_out, v_out;
};

#include "cuda_torch.cuh"

// Pool bytes (and separate scales) of a cache, on the host.
std::vector<unsigned char> pool_bytes(const Cache& c) {
  const int64_t pool = c.geometry().total_elems * dtype_size(c.descriptor().storage);
  int64_t scales = 0;
  if (c.scale_storage()) scales = c.geometry().scale_elems * dtype_size(c.view(0).scale_dtype);
  std::vector<unsigned char> out(size_t(pool + scales));
  if (c.config().device == Device::cuda) {
    check(cudaMemcpy(out.data(), c.storage(), size_t(pool), cudaMemcpyDeviceToHost), "pool to host");
    if (scales) check(cudaMemcpy(out.data() + pool, c.scale_storage(), size_t(scales), cudaMemcpyDeviceToHost), "scales to host");
  } else {
    std::memcpy(out.data(), c.storage(), size_t(pool));
    if (scales) std::memcpy(out.data() + pool, c.scale_storage(), size_t(scales));
  }
  return out;
}

// The op on a small CUDA cache and on a CPU cache of the same variant, same inputs and targets: the
// pool bytes (append) or the output (gather) must be equal. Checked at min(n, 4096) tokens.
std::string check_against_cpu(const VariantEntry& e, const Shape& timed, cudaStream_t stream) {
  const VariantDescriptor& d = *e.descriptor;
  // The same kernels at no more than 4096 tokens, so that the CPU twin stays small.
  const Shape s{timed.op, std::min<int64_t>(timed.n, 4096)};
  const std::unique_ptr<Plan> p = plan(d, s, 1);
  if (!p) return "not run";
  CacheConfig cpu_config = p->config, gpu_config = p->config;
  cpu_config.device = Device::cpu;
  gpu_config.stream = stream;
  auto gpu = e.create(gpu_config);
  auto cpu = e.create(cpu_config);
  if (d.quant == Quant::per_tensor)
    for (Cache* c : {gpu.get(), cpu.get()})
      for (int l = 0; l < d.layers; ++l) c->set_tensor_scale(l, 0.0625f, 0.125f);
  const Epoch& ep = p->epochs[0];
  const int64_t T = s.n, row_bytes = int64_t(d.heads) * d.head_dim * dtype_size(d.input);
  const std::vector<unsigned char> k = random_rows(T * row_bytes, 7), v = random_rows(T * row_bytes, 8);
  const DeviceBuffer dk = upload(k), dv = upload(v);
  const DeviceEpoch de = to_device(ep);
  const TokenTargets cpu_targets = d.paged() ? TokenTargets::paged(IndexView::of(ep.slots.data(), T))
                                             : TokenTargets::row_positions(IndexView::of(ep.rows.data(), T),
                                                                           IndexView::of(ep.positions.data(), T));
  // Append writes layer 0 (every layer for a lazy variant); a gather reads layer 0 back.
  const int layers = s.op == "gather" ? 1 : layers_per_op(d, s);
  for (int l = 0; l < layers; ++l) {
    gpu->append(l, TensorView::contiguous(dk.data, d.input, Device::cuda, T, d.heads, d.head_dim),
                TensorView::contiguous(dv.data, d.input, Device::cuda, T, d.heads, d.head_dim), de.targets(d, T));
    cpu->append(l, TensorView::contiguous(const_cast<unsigned char*>(k.data()), d.input, Device::cpu, T, d.heads, d.head_dim),
                TensorView::contiguous(const_cast<unsigned char*>(v.data()), d.input, Device::cpu, T, d.heads, d.head_dim),
                cpu_targets);
  }
  gpu->commit();
  cpu->commit();
  gpu->synchronize();
  if (s.op != "gather") {
    const std::vector<unsigned char> a = pool_bytes(*gpu), b = pool_bytes(*cpu);
    int64_t differ = 0;
    for (size_t i = 0; i < a.size(); ++i) differ += a[i] != b[i];
    return differ ? std::to_string(differ) + " of " + std::to_string(a.size()) + " pool bytes differ" : "ok";
  }
  GatherRange r;
  r.row = 0, r.begin = 0, r.end = T;
  const DeviceBuffer pages = d.paged() ? upload(p->pages) : DeviceBuffer(16);
  std::vector<unsigned char> ck(k.size()), cv(v.size()), gk(k.size()), gv(v.size());
  DeviceBuffer ok(int64_t(k.size())), ov(int64_t(v.size()));
  if (d.paged()) r.pages = IndexView{pages.data, DType::i32, Device::cuda, int64_t(p->pages.size())};
  gpu->gather(0, r, TensorView::contiguous(ok.data, d.input, Device::cuda, d.heads, T, d.head_dim),
              TensorView::contiguous(ov.data, d.input, Device::cuda, d.heads, T, d.head_dim));
  gpu->synchronize();
  check(cudaMemcpy(gk.data(), ok.data, gk.size(), cudaMemcpyDeviceToHost), "gather out");
  check(cudaMemcpy(gv.data(), ov.data, gv.size(), cudaMemcpyDeviceToHost), "gather out");
  if (d.paged()) r.pages = IndexView::of(p->pages.data(), int64_t(p->pages.size()));
  cpu->gather(0, r, TensorView::contiguous(ck.data(), d.input, Device::cpu, d.heads, T, d.head_dim),
              TensorView::contiguous(cv.data(), d.input, Device::cpu, d.heads, T, d.head_dim));
  int64_t differ = 0;
  for (size_t i = 0; i < ck.size(); ++i) differ += (ck[i] != gk[i]) + (cv[i] != gv[i]);
  return differ ? std::to_string(differ) + " output bytes differ" : "ok";
}

PoolStrides pool_strides(const LayerView& v) { return {v.strides.row_or_page, v.strides.seq_or_slot, v.strides.head}; }

// The same bytes as the case moves, device to device: cudaMemcpyAsync of half of them.
void time_d2d(Record& rec, Timer& timer, DeviceBuffer& d2d_src, DeviceBuffer& d2d_dst) {
  const int64_t half = rec.bytes / 2, span = std::max<int64_t>(half, d2d_src.bytes / std::max<int64_t>(half, 1) * half);
  if (half <= 0 || half > d2d_src.bytes) return;
  Timing t;
  timer.eager([&](int i) {
    const int64_t at = (int64_t(i) * half) % span;
    check(cudaMemcpyAsync(d2d_dst.as<char>() + at, d2d_src.as<char>() + at, size_t(half), cudaMemcpyDeviceToDevice,
                          timer.stream), "d2d");
  }, t);
  rec.d2d_us = t.eager_us;
}

// Times every implementation of one (variant, shape). `twin`: the bf16 twin of a quantized variant.
// `torch` (--torch): kvforge's eager calls, the D2D copy and PyTorch's forms of the job on the same
// buffers (cuda_torch.cuh), nothing else.
Record run_case(const VariantEntry& e, const VariantEntry* twin, const Shape& s, Timer& timer, DeviceBuffer& d2d_src,
                DeviceBuffer& d2d_dst, int64_t l2_bytes, bool baselines = true, bool torch = false) {
  const VariantDescriptor& d = *e.descriptor;
  Record rec;
  rec.variant = d.name, rec.op = s.op, rec.n = s.n, rec.bytes = bytes_moved(d, s.op, s.n);
  rec.coded = d.quantized() || d.coded_records();
  // Enough epochs that the pool outgrows L2 four times over, at most 16.
  const int64_t per_epoch = int64_t(d.layers) * s.n * layer_token_bytes(d);
  const int epochs = int(std::clamp<int64_t>((4 * l2_bytes + per_epoch - 1) / std::max<int64_t>(per_epoch, 1), 1, 16));
  const std::unique_ptr<Plan> p = plan(d, s, epochs);
  if (!p) {
    rec.check = "cannot hold the shape";
    return rec;
  }
  CacheConfig config = p->config;
  config.stream = timer.stream;
  std::unique_ptr<Cache> cache;
  try {
    cache = e.create(config);
  } catch (const Error& err) {
    rec.check = std::string("cannot create: ") + err.what();
    return rec;
  }
  if (d.quant == Quant::per_tensor)
    for (int l = 0; l < d.layers; ++l) cache->set_tensor_scale(l, 0.0625f, 0.125f);
  std::vector<DeviceEpoch> targets;
  for (const Epoch& ep : p->epochs) targets.push_back(to_device(ep));
  const DeviceBuffer pages = d.paged() ? upload(p->pages) : DeviceBuffer(16);
  const bool gather = s.op == "gather";
  const int64_t row_bytes = int64_t(d.heads) * d.head_dim * dtype_size(d.input);
  Inputs in;
  const int sets = gather ? 1 : std::min(epochs, 4);
  for (int i = 0; i < sets; ++i) {
    in.k.push_back(upload(random_rows(s.n * row_bytes, uint32_t(2 * i + 1))));
    in.v.push_back(upload(random_rows(s.n * row_bytes, uint32_t(2 * i + 2))));
  }
  if (gather) {
    in.k_out = DeviceBuffer(2 * s.n * row_bytes);  // two slices, alternated
    in.v_out = DeviceBuffer(2 * s.n * row_bytes);
    for (int l = 0; l < d.layers; ++l)
      cache->append(l, TensorView::contiguous(in.k[0].data, d.input, Device::cuda, s.n, d.heads, d.head_dim),
                    TensorView::contiguous(in.v[0].data, d.input, Device::cuda, s.n, d.heads, d.head_dim),
                    targets[0].targets(d, s.n));
    cache->commit();
    cache->synchronize();
  }
  const int L = d.layers, per_op = layers_per_op(d, s);
  auto tensor = [&](const DeviceBuffer& b, int64_t d0, int64_t d1) {
    return TensorView::contiguous(b.data, d.input, Device::cuda, d0, d1, d.head_dim);
  };
  GatherRange range;
  range.row = 0, range.begin = 0, range.end = s.n;
  if (d.paged()) range.pages = IndexView{pages.data, DType::i32, Device::cuda, p->pages_per_seq};
  // Iteration i: layer i mod L, epoch (i / L) mod epochs.
  auto kvforge_op = [&](int i) {
    const int layer = i % L;
    const size_t epoch = size_t(i / L) % p->epochs.size(), set = epoch % in.k.size();
    if (gather) {
      const int64_t slice = (i / L) % 2 * s.n * row_bytes;
      cache->gather(layer, range,
                    TensorView::contiguous(in.k_out.as<unsigned char>() + slice, d.input, Device::cuda, d.heads, s.n, d.head_dim),
                    TensorView::contiguous(in.v_out.as<unsigned char>() + slice, d.input, Device::cuda, d.heads, s.n, d.head_dim));
      return;
    }
    for (int l = 0; l < per_op; ++l)
      cache->append(per_op == 1 ? layer : l, tensor(in.k[set], s.n, d.heads), tensor(in.v[set], s.n, d.heads),
                    targets[epoch].targets(d, s.n));
    cache->commit();
  };
  const int graphs = std::min(timer.iterations, L);
  timer.eager(kvforge_op, rec.kvforge);
  if (!baselines) return rec;
  if (torch) {
    cache->synchronize();
    time_d2d(rec, timer, d2d_src, d2d_dst);
    time_torch_forms(rec, *cache, s, *p, in, timer);
    rec.check = "not checked (--torch)";
    return rec;
  }
  timer.graph(kvforge_op, graphs, rec.kvforge);
  cache->synchronize();
  if (d.tuning.cuda_block_threads != Tuning{}.cuda_block_threads ||
      d.tuning.cuda_items_per_thread != Tuning{}.cuda_items_per_thread) {
    cache->set_tuning(Tuning{});
    timer.eager(kvforge_op, rec.untuned);
    cache->set_tuning(d.tuning);
  }
  // A whole decode step: every layer's append (and a lazy variant's commit) in one graph.
  if (s.op == "append_decode") {
    auto step = [&](int i) {
      const size_t epoch = size_t(i) % p->epochs.size(), set = epoch % in.k.size();
      for (int l = 0; l < L; ++l)
        cache->append(l, tensor(in.k[set], s.n, d.heads), tensor(in.v[set], s.n, d.heads), targets[epoch].targets(d, s.n));
      cache->commit();
    };
    timer.graph(step, int(std::min<size_t>(p->epochs.size(), 4)), rec.step);
    // A lazy variant's commit by itself, the one launch that writes every layer's staged tokens.
    if (lazy(d)) {
      auto stage_every_layer = [&](int i) {
        const size_t epoch = size_t(i) % p->epochs.size(), set = epoch % in.k.size();
        for (int l = 0; l < L; ++l)
          cache->append(l, tensor(in.k[set], s.n, d.heads), tensor(in.v[set], s.n, d.heads), targets[epoch].targets(d, s.n));
      };
      timer.graph_alone(stage_every_layer, [&](int) { cache->commit(); }, std::min(timer.iterations, 50), rec.commit);
      // The host's time per call, each call timed by itself (the eager column's host time is a whole
      // step's: every layer's append and the commit).
      using clock = std::chrono::steady_clock;
      const int rounds = std::max(1, std::min(timer.iterations, 50));
      double append_us = 0, commit_us = 0;
      for (int i = 0; i < rounds; ++i) {
        const auto staged = clock::now();
        stage_every_layer(i);
        const auto committed = clock::now();
        cache->commit();
        append_us += std::chrono::duration<double, std::micro>(committed - staged).count();
        commit_us += std::chrono::duration<double, std::micro>(clock::now() - committed).count();
      }
      cache->synchronize();
      rec.append_host_us = append_us / (double(rounds) * L);
      rec.commit_host_us = commit_us / rounds;
    }
  }
  cache->synchronize();
  time_d2d(rec, timer, d2d_src, d2d_dst);
  // The from-scratch kernels on the same pool, inputs and targets.
  const LayerView first = cache->view(0);
  const PoolStrides ps = pool_strides(first);
  const int64_t layer_stride = cache->geometry().strides.layer;
  const int esize = dtype_size(d.storage);
  const bool float_twin = d.storage == d.input && d.quant == Quant::none && (d.head_dim * dtype_size(d.input)) % 16 == 0;
  const bool fp8 = d.storage == DType::f8e4m3 && d.input == DType::bf16 && d.quant == Quant::per_tensor &&
                   d.head_dim % 8 == 0 && first.scale_dtype == DType::f32;
  auto pool_of = [&](int layer, int kv) {
    return static_cast<char*>(const_cast<void*>(kv ? first.v : first.k)) + int64_t(layer) * layer_stride * esize;
  };
  auto launch_reference = [&](int i, bool naive) {
    const int layer0 = i % L;
    const size_t epoch = size_t(i / L) % p->epochs.size(), set = epoch % in.k.size();
    for (int l = 0; l < per_op; ++l) {
      const int layer = per_op == 1 ? layer0 : l;
      if (gather) {
        const int64_t slice = (i / L) % 2 * s.n * row_bytes;
        const int64_t row = 0;
        using T = uint16_t;
        auto* ko = reinterpret_cast<T*>(in.k_out.as<char>() + slice);
        auto* vo = reinterpret_cast<T*>(in.v_out.as<char>() + slice);
        const auto* kp = reinterpret_cast<const T*>(pool_of(layer, 0));
        const auto* vp = reinterpret_cast<const T*>(pool_of(layer, 1));
        const int32_t* pg = d.paged() ? pages.as<const int32_t>() : nullptr;
        if (naive) {
          const int64_t elems = 2 * s.n * d.heads * d.head_dim;
          naive_gather<T><<<unsigned((elems + 255) / 256), 256, 0, timer.stream>>>(kp, vp, ko, vo, pg, d.page_size, row, ps,
                                                                                    s.n, d.heads, d.head_dim);
        } else {
          reference_gather<T><<<unsigned(s.n), 128, 0, timer.stream>>>(kp, vp, ko, vo, pg, d.page_size, row, ps, s.n, d.heads,
                                                                        d.head_dim);
        }
      } else if (fp8) {
        reference_append_fp8<<<unsigned(s.n), 128, 0, timer.stream>>>(
            reinterpret_cast<uint8_t*>(pool_of(layer, 0)), reinterpret_cast<uint8_t*>(pool_of(layer, 1)),
            in.k[set].as<const __nv_bfloat16>(), in.v[set].as<const __nv_bfloat16>(), targets[epoch].target(d), ps, d.heads,
            d.head_dim, static_cast<const float*>(cache->view(layer).k_scales), static_cast<const float*>(cache->view(layer).v_scales));
      } else {
        using T = uint16_t;
        auto* kp = reinterpret_cast<T*>(pool_of(layer, 0));
        auto* vp = reinterpret_cast<T*>(pool_of(layer, 1));
        if (naive) {
          const int64_t elems = 2 * s.n * d.heads * d.head_dim;
          naive_append<T><<<unsigned((elems + 255) / 256), 256, 0, timer.stream>>>(
              kp, vp, in.k[set].as<const T>(), in.v[set].as<const T>(), targets[epoch].target(d), ps, s.n, d.heads, d.head_dim);
        } else {
          reference_append<T><<<unsigned(s.n), 128, 0, timer.stream>>>(kp, vp, in.k[set].as<const T>(), in.v[set].as<const T>(),
                                                                        targets[epoch].target(d), ps, d.heads, d.head_dim);
        }
      }
    }
    check(cudaGetLastError(), "baseline launch");
  };
  // The from-scratch kernels move 16-bit floats (or bf16 into fp8): other storage has only its twin.
  if ((float_twin && dtype_size(d.input) == 2) || (fp8 && !gather)) {
    timer.eager([&](int i) { launch_reference(i, false); }, rec.reference);
    timer.graph([&](int i) { launch_reference(i, false); }, graphs, rec.reference);
    if (float_twin) timer.eager([&](int i) { launch_reference(i, true); }, rec.naive);
  }
  cache.reset();
  if (twin) {
    const Record t = run_case(*twin, nullptr, s, timer, d2d_src, d2d_dst, l2_bytes, false);
    rec.twin = t.kvforge;
  }
  rec.check = check_against_cpu(e, s, timer.stream);
  return rec;
}

}  // namespace

#include "cuda_output.cuh"

namespace {

std::string flag(int argc, char** argv, const std::string& name, const std::string& fallback) {
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a.rfind(name + "=", 0) == 0) return a.substr(name.size() + 1);
    if (a == name && i + 1 < argc) return argv[i + 1];
  }
  return fallback;
}

bool has(int argc, char** argv, const std::string& name) {
  for (int i = 1; i < argc; ++i)
    if (argv[i] == name) return true;
  return false;
}

}  // namespace

int main(int argc, char** argv) {
  if (has(argc, argv, "--help")) {
    std::printf(
        "kvforge_cuda_bench: the generated matrix on a CUDA device, against D2D copies, an empty kernel, a naive\n"
        "kernel, a from-scratch vLLM-strategy kernel and (quantized) the bf16 twin, in the same process.\n"
        "  --preset short|full   shapes (default short)\n"
        "  --filter S            only cases whose op/variant/n contains S\n"
        "  --cold                flush L2 before every timed call\n"
        "  --iterations N        timed calls per measurement (default 200)\n"
        "  --torch               PyTorch's forms of each job (index_put, index_copy, slice_copy, index_select;\n"
        "                        quantize-then-write) on the same buffers, beside kvforge's eager calls and the\n"
        "                        D2D copy only (no graphs, references or CPU check)\n"
        "  --json F              output (default cuda_bench.json); render with bench/report.py F\n"
        "  --tune=<model>        measure cuda.block_threads and cuda.items_per_thread, write\n"
        "                        specs/tuning/<model>.yaml's cuda section (also --kvf_tune=<model>)\n"
        "  --tune_out DIR        where tuning files go (default specs/tuning)\n");
    return 0;
  }
  std::string why;
  if (!cuda_available(&why)) {
    std::fprintf(stderr, "kvforge_cuda_bench: %s\n", why.c_str());
    return 2;
  }
  const DeviceInfo info = device_info();
  Timer timer{nullptr, std::max(1, std::atoi(flag(argc, argv, "--iterations", "200").c_str())), has(argc, argv, "--cold"),
              DeviceBuffer(2 * info.l2_bytes)};
  check(cudaStreamCreateWithFlags(&timer.stream, cudaStreamNonBlocking), "cudaStreamCreate");
  timer.spin_cycles = 30LL * std::max(info.sm_clock_mhz, 1000);
  // --kvf_tune is the CPU bench's spelling of the same thing.
  const std::string tune_model = flag(argc, argv, "--tune", flag(argc, argv, "--kvf_tune", ""));
  if (!tune_model.empty()) return tune(tune_model, flag(argc, argv, "--tune_out", "specs/tuning"), timer);
  const std::string preset_name = flag(argc, argv, "--preset", "short"), filter = flag(argc, argv, "--filter", "");
  const bool torch = has(argc, argv, "--torch");
  const auto preset = presets().find(preset_name);
  if (preset == presets().end()) {
    std::fprintf(stderr, "kvforge_cuda_bench: --preset: unknown %s (allowed: short, full)\n", preset_name.c_str());
    return 2;
  }
  Timing empty;
  timer.eager([&](int) { empty_kernel<<<1, 32, 0, timer.stream>>>(); }, empty);
  timer.graph([&](int) { empty_kernel<<<1, 32, 0, timer.stream>>>(); }, 1, empty);
  DeviceBuffer d2d_src(int64_t(1) << 30), d2d_dst(int64_t(1) << 30);
  check(cudaMemset(d2d_src.data, 1, size_t(d2d_src.bytes)), "memset");
  std::printf("%s: %d SMs, L2 %lld MiB; empty kernel %.2f us eager, %.2f us in a graph\n", info.name.c_str(), info.sms,
              (long long)(info.l2_bytes >> 20), empty.eager_us, empty.graph_us);
  std::printf("| variant | op | n | eager us | graph us | host us | step us | commit us | GB/s | / D2D | / reference | / naive | check |\n"
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|\n");
  std::vector<Record> records;
  const std::string json = flag(argc, argv, "--json", "cuda_bench.json");
  for (const VariantEntry* timed : timed_variants(registry())) {
    const VariantEntry& e = *timed;
    const VariantDescriptor& d = *e.descriptor;
    const VariantEntry* twin = nullptr;
    if (d.quantized()) twin = registry().find(variant_name(d.layout, d.model, d.input, d.input));
    for (const Shape& s : d.quantized() ? preset->second.quantized_shapes : preset->second.float_shapes) {
      const std::string key = s.op + "/" + d.name + "/" + std::to_string(s.n);
      if (!filter.empty() && key.find(filter) == std::string::npos) continue;
      const Record r = run_case(e, twin, s, timer, d2d_src, d2d_dst, info.l2_bytes, true, torch);
      records.push_back(r);
      const double us = r.kvforge.eager_us;
      std::printf("| %s | %s | %lld | %.2f | %.2f | %.2f | %.2f | %.2f | %.0f | %.2f | %.2f | %.2f | %s |\n", r.variant.c_str(),
                  r.op.c_str(), (long long)r.n, us, r.kvforge.graph_us, r.kvforge.host_us, r.step.graph_us, r.commit.graph_us,
                  double(r.bytes) / us / 1e3, r.d2d_us / us, r.reference.eager_us / us, r.naive.eager_us / us, r.check.c_str());
      std::fflush(stdout);
      // Rewritten after every case, so that a run stopped by a time limit keeps what it measured.
      write_json(json, info, preset_name, timer.cold, empty, records);
    }
  }
  write_json(json, info, preset_name, timer.cold, empty, records);  // also where no case ran
  std::printf("wrote %s\n", json.c_str());
  if (torch) return 0;  // no check against the CPU ran
  // The state pools of hybrid models (cuda_states.cuh), a table of their own.
  int failures = state_rows(timer, d2d_src, d2d_dst, filter);
  for (const Record& r : records) failures += r.check != "ok" && r.check != "cannot hold the shape";
  if (failures) std::fprintf(stderr, "kvforge_cuda_bench: %d cases did not match the CPU backend\n", failures);
  return failures ? 1 : 0;
}
