// The benchmark matrix. Benchmarks are registered at run time from the registry, so a new spec appears
// here with no edit. Names are `<op>/<variant>/<shape>` (`copy/bytes:<n>` for the baseline), so
// --benchmark_filter selects variant, operation and shape.
//
// Bytes moved are counted the same way for every op: everything read plus everything written, at the
// types actually stored (report.py prints the rule with the table):
//   append: the K and V input, the 8-byte target of each token, and the codes and scales written;
//   gather: the codes and scales read, and the K and V output written.
// A streaming copy of half that many bytes (so the same bytes cross the memory bus) runs in the
// same process, and the report divides by it: absolute times on a shared machine drift.
#include <benchmark/benchmark.h>
#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <map>
#include <memory>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "kvforge/kvforge.hpp"
#include "bench_cli.hpp"
#include "matrix_bench.hpp"
#include "memory_bench.hpp"
#include "matrix_rules.hpp"
#include "torch_peers.hpp"

namespace kvforge_bench {

using namespace kvforge;

bool llama_bf16_or_quantized(const VariantDescriptor& d) {
  return std::string(d.model) == "llama3_8b" && (d.storage == DType::bf16 || d.quantized());
}
// Hybrid variants are measured through their members, which are ordinary paged variants.
bool any_variant(const VariantDescriptor& d) { return !d.is_hybrid(); }

const std::map<std::string, Preset>& presets() {
  static const std::map<std::string, Preset> p = {
      // The main job's preset: every llama3-8b layout (float and quantized), decode, prefill and gather,
      // beside PyTorch's forms of the same jobs where this build has PyTorch.
      {"short",
       {{{"append_decode", "batch", 64}, {"append_prefill", "chunk", 512}, {"gather", "ctx", 1024}},
        llama_bf16_or_quantized,
        {Mode::hot},
        true}},
      // Quantized variants and their bf16 twins: the cost of quantizing on append and dequantizing on gather.
      {"quant", {{{"append_decode", "batch", 64}, {"gather", "ctx", 1024}}, llama_bf16_or_quantized}},
      // kvforge beside PyTorch's forms of each job, hot, cold and out of cache.
      {"peers",
       {{{"append_decode", "batch", 64}, {"append_prefill", "chunk", 512}, {"gather", "ctx", 1024}},
        llama_bf16_or_quantized,
        {Mode::hot, Mode::cold, Mode::big},
        true}},
      // The memory-management layer only (allocator, step metadata, offload, a synthetic trace).
      {"memory", {{}, any_variant}},
      {"full",
       {{{"append_decode", "batch", 1},
         {"append_decode", "batch", 8},
         {"append_decode", "batch", 64},
         {"append_decode", "batch", 256},
         {"append_prefill", "chunk", 512},
         {"append_prefill", "chunk", 2048},
         {"gather", "ctx", 1024},
         {"gather", "ctx", 8192}},
        any_variant,
        {Mode::hot, Mode::cold, Mode::big}}},
  };
  return p;
}

bool is_tuned(const VariantDescriptor& d) {
  const Tuning t = d.tuning, def{};
  return t.cpu_parallel_bytes != def.cpu_parallel_bytes || t.cpu_chunk_items != def.cpu_chunk_items ||
         t.cuda_block_threads != def.cuda_block_threads;
}

constexpr int64_t kBigPoolBytes = int64_t(1) << 30;

std::unique_ptr<Prepared> prepare(const VariantEntry& e, const Shape& s, Impl impl) {
  const VariantDescriptor& d = *e.descriptor;
  auto p = std::make_unique<Prepared>();
  const bool gather = std::string(s.op) == "gather";
  const bool decode = std::string(s.op) == "append_decode";
  const bool big = s.mode == Mode::big;
  // Decode: one token for each of n rows. Prefill: n tokens of one row. Gather: n positions of one row.
  // Big mode makes rows longer (decode) or adds rows (prefill, gather) until the pool holds 1 GiB.
  int64_t rows = decode ? s.n : 1;
  int64_t per_row = decode ? 16 : s.n;
  if (big) {
    if (d.addressing == Addressing::ring) return nullptr;  // a ring holds one window per row: never 1 GiB of a row
    const int64_t cap = d.addressing == Addressing::contiguous ? d.max_seq_len : (int64_t(1) << 20);
    if (decode) {
      per_row = std::min(cap, std::max<int64_t>(16, (kBigPoolBytes / d.bytes_per_token + rows - 1) / rows));
    } else {
      per_row = std::min(cap, std::max<int64_t>(s.n, 8192)) / s.n * s.n;
      if (per_row < s.n) return nullptr;
      rows = std::max<int64_t>(1, (kBigPoolBytes / d.bytes_per_token + per_row - 1) / per_row);
    }
  }
  CacheConfig cfg;
  cfg.rows = rows;
  cfg.max_seq_len = d.addressing == Addressing::contiguous ? per_row : 0;
  if (d.paged()) {
    p->pages_per_row = (per_row + d.page_size - 1) / d.page_size;
    cfg.pages = rows * p->pages_per_row;
  }
  cfg.max_staged_tokens = decode ? rows : std::max(s.n, rows);
  if (d.addressing == Addressing::ring && per_row > d.window) return nullptr;  // a ring cannot hold it
  // A ring holds a whole window per row whatever the shape; keep every cache within 4 GiB of this
  // 24 GiB machine (mistral's 4096-token ring at batch 256 would need 128 GiB).
  const int64_t capacity_tokens = rows * (d.addressing == Addressing::ring ? d.window : per_row);
  if (capacity_tokens * d.bytes_per_token > (int64_t(4) << 30)) return nullptr;
  try {
    p->cache = impl == Impl::generic ? make_generic_cache(d, cfg) : e.create(cfg);
  } catch (const Error&) {
    return nullptr;  // the shape does not fit the model (a 512-token chunk of a 64-token model)
  }
  p->tokens = gather ? 0 : (decode ? rows : s.n);
  const int64_t row_bytes = int64_t(d.heads) * d.head_dim * dtype_size(d.input);
  const int64_t in_bytes = (gather ? s.n : p->tokens) * row_bytes;
  std::mt19937 rng(1);
  p->k.resize(size_t(in_bytes));
  p->v.resize(size_t(in_bytes));
  fill_small_values(p->k.data(), p->k.size(), rng);
  p->v = p->k;
  // Pages handed out in a shuffled order, as an allocator under churn would.
  for (int64_t i = 0; i < rows * p->pages_per_row; ++i) p->pages.push_back(int32_t(i));
  std::shuffle(p->pages.begin(), p->pages.end(), rng);
  auto slot_of = [&](int64_t row, int64_t pos) {
    return int64_t(p->pages[size_t(row * p->pages_per_row + pos / d.page_size)]) * d.page_size + pos % d.page_size;
  };
  auto append_all = [&](const Targets& t, int64_t count) {
    const TokenTargets tt = d.paged() ? TokenTargets::paged(IndexView::of(t.slots.data(), count))
                                      : TokenTargets::row_positions(IndexView::of(t.rows.data(), count),
                                                                    IndexView::of(t.positions.data(), count));
    for (int layer = 0; layer < d.layers; ++layer)
      p->cache->append(layer, TensorView::contiguous(p->k.data(), d.input, Device::cpu, count, d.heads, d.head_dim),
                       TensorView::contiguous(p->v.data(), d.input, Device::cpu, count, d.heads, d.head_dim), tt);
    p->cache->commit();
  };
  auto targets_at = [&](int64_t row, int64_t first_pos, int64_t count, bool one_per_row) {
    Targets t;
    for (int64_t i = 0; i < count; ++i) {
      const int64_t r = one_per_row ? i : row, pos = one_per_row ? first_pos : first_pos + i;
      t.rows.push_back(int32_t(r));
      t.positions.push_back(int32_t(pos));
      if (d.paged()) t.slots.push_back(slot_of(r, pos));
    }
    return t;
  };
  if (big) {
    // Every page of the pool touched, so that no read comes from the kernel's shared zero page.
    std::memset(const_cast<void*>(p->cache->storage()), 1,
                size_t(p->cache->geometry().total_elems * dtype_size(d.storage)));
  }
  const int64_t runs_per_row = big && !decode ? per_row / s.n : 1;
  const int64_t epochs = !big ? 1 : decode ? std::min<int64_t>(per_row, 16) : std::min<int64_t>(rows * runs_per_row, 64);
  for (int64_t e = 0; e < epochs; ++e) {
    if (decode) {
      p->epochs.push_back(targets_at(0, e * (per_row / epochs), rows, true));
    } else {
      const int64_t row = e % rows, first = (e / rows % runs_per_row) * s.n;
      if (gather) {
        Targets t;
        t.row = row;
        t.begin = first;
        p->epochs.push_back(t);
      } else {
        p->epochs.push_back(targets_at(row, first, s.n, false));
      }
    }
  }
  if (gather) {
    // Fill what is read once (in big mode, the last position of every row, so that its whole
    // length is readable); the benchmark reads it back.
    if (big) {
      p->k.resize(size_t(std::max(in_bytes, rows * row_bytes)));
      p->v.resize(p->k.size());
      const int64_t last = d.addressing == Addressing::contiguous ? per_row - 1 : 0;
      append_all(targets_at(0, last, rows, true), rows);
    } else {
      append_all(targets_at(0, 0, s.n, false), s.n);
    }
    p->out_slice_bytes = in_bytes;
    p->out_slices = big ? std::max<int64_t>(1, (int64_t(64) << 20) / std::max<int64_t>(1, in_bytes)) : 1;
    p->k_out.resize(size_t(in_bytes * p->out_slices));
    p->v_out.resize(size_t(in_bytes * p->out_slices));
  }
  return p;
}

// Evicts the last-level cache (32 MiB here) by writing twice its size. Cold benchmarks time each
// iteration themselves (manual time) around the operation only: pausing Google Benchmark's timer
// costs about a microsecond each way, as much as a decode append.
void flush_caches() {
  static std::vector<unsigned char> junk(size_t(64) << 20);
  std::memset(junk.data(), int(junk[0]) + 1, junk.size());
  benchmark::ClobberMemory();
}

// Runs `op` once per iteration; a cold iteration flushes the caches first, untimed.
template <class Op> void timed_loop(benchmark::State& state, Mode mode, Op op) {
  for (auto _ : state) {
    if (mode != Mode::cold) {
      op();
      benchmark::ClobberMemory();
      continue;
    }
    flush_caches();
    const auto start = std::chrono::steady_clock::now();
    op();
    benchmark::ClobberMemory();
    state.SetIterationTime(std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
  }
}

// What a naive engine does: one memcpy per token, K or V and head, on one thread, through the
// layout's strides. Same dtype in and out only.
void naive_scatter(Prepared& p, const VariantDescriptor& d, int layer, const Targets& t) {
  const Strides& st = p.cache->geometry().strides;
  auto* pool = static_cast<unsigned char*>(const_cast<void*>(p.cache->storage()));
  const int64_t es = dtype_size(d.storage), row = int64_t(d.head_dim) * es;
  const unsigned char* in[2] = {p.k.data(), p.v.data()};
  for (int64_t i = 0; i < p.tokens; ++i) {
    int64_t unit, slot;
    if (d.paged()) {
      unit = t.slots[size_t(i)] / d.page_size;
      slot = t.slots[size_t(i)] % d.page_size;
    } else {
      unit = t.rows[size_t(i)];
      slot = d.addressing == Addressing::ring ? t.positions[size_t(i)] % d.window : t.positions[size_t(i)];
    }
    for (int kv = 0; kv < 2; ++kv)
      for (int h = 0; h < d.heads; ++h)
        std::memcpy(pool + (st.layer * layer + st.kv * kv + st.row_or_page * unit + st.seq_or_slot * slot + st.head * h) * es,
                    in[kv] + (i * d.heads + h) * row, size_t(row));
  }
}

// One step of the shape's operation: a gather, or an append (every layer, then commit, for a lazy
// variant). Hot and cold steps repeat layer 0 and the first targets; big steps move to the next layer
// and, after a pass over the layers, to the next targets and output slice.
void run_once(Prepared& p, const VariantDescriptor& d, const Shape& s, Impl impl, TorchPeer* peer) {
  const int64_t it = s.mode == Mode::big ? p.iteration++ : 0;
  const int passes = layers_per_append(d) == 1 ? d.layers : 1;
  const int layer = int(it % passes);
  const int64_t epoch = (it / passes) % int64_t(p.epochs.size());
  const int64_t slice = (it / passes) % p.out_slices;
  const Targets& t = p.epochs[size_t(epoch)];
  if (peer) {
    run_torch_peer(*peer, layer, epoch, slice);
  } else if (std::string(s.op) == "gather") {
    GatherRange g;
    g.row = t.row;
    g.begin = t.begin;
    g.end = t.begin + s.n;
    g.pages = IndexView::of(p.pages.data() + t.row * p.pages_per_row, p.pages_per_row);
    unsigned char* k_out = p.k_out.data() + slice * p.out_slice_bytes;
    unsigned char* v_out = p.v_out.data() + slice * p.out_slice_bytes;
    p.cache->gather(layer, g, TensorView::contiguous(k_out, d.input, Device::cpu, d.heads, s.n, d.head_dim),
                    TensorView::contiguous(v_out, d.input, Device::cpu, d.heads, s.n, d.head_dim));
  } else if (impl == Impl::naive) {
    naive_scatter(p, d, layer, t);
  } else {
    const TokenTargets tt = d.paged() ? TokenTargets::paged(IndexView::of(t.slots.data(), p.tokens))
                                      : TokenTargets::row_positions(IndexView::of(t.rows.data(), p.tokens),
                                                                    IndexView::of(t.positions.data(), p.tokens));
    auto append = [&] {
      for (int l = 0; l < layers_per_append(d); ++l)
        p.cache->append(layers_per_append(d) == 1 ? layer : l,
                        TensorView::contiguous(p.k.data(), d.input, Device::cpu, p.tokens, d.heads, d.head_dim),
                        TensorView::contiguous(p.v.data(), d.input, Device::cpu, p.tokens, d.heads, d.head_dim), tt);
    };
    if (d.update != UpdateMode::lazy) {  // an eager step, timed as a whole
      append();
      p.cache->commit();
      return;
    }
    // A lazy step: its appends and its commit each timed too (the counters append_us and commit_us).
    using clock = std::chrono::steady_clock;
    const auto staged = clock::now();
    append();
    const auto committed = clock::now();
    p.cache->commit();
    p.append_seconds += std::chrono::duration<double>(committed - staged).count();
    p.commit_seconds += std::chrono::duration<double>(clock::now() - committed).count();
    p.appends += layers_per_append(d);
    ++p.commits;
  }
}

void run_variant(benchmark::State& state, const VariantEntry* e, Shape s, Impl impl, TorchForm form) {
  static std::unique_ptr<Prepared> current;
  static std::string current_key;
  const VariantDescriptor& d = *e->descriptor;
  // The generated variant, its baselines and torch's forms share one prepared cache; the generic path
  // needs its own.
  const std::string key = std::string(d.name) + s.op + std::to_string(s.n) + mode_suffix(s.mode) +
                          (impl == Impl::generic ? "/generic" : "");
  if (key != current_key) {
    current.reset();  // free the previous benchmark's cache before allocating this one
    current = prepare(*e, s, impl);
    current_key = key;
  }
  if (!current) {
    state.SkipWithError("this variant cannot hold the shape (the model's max_seq_len, or the bench's 4 GiB budget)");
    return;
  }
  Prepared& p = *current;
  TorchPeer* peer = nullptr;
  if (impl == Impl::torch) {
    auto& slot = p.torch[form];
    if (!slot) slot = make_torch_peer(p.peer_setup(s), form);
    peer = slot.get();
    if (!peer) {
      state.SkipWithError("this torch form cannot serve the layout");
      return;
    }
  }
  if (impl != Impl::generic) p.cache->set_tuning(impl == Impl::untuned ? Tuning{} : d.tuning);
  p.iteration = 0;
  p.append_seconds = p.commit_seconds = 0;
  p.appends = p.commits = 0;
  timed_loop(state, s.mode, [&] { run_once(p, d, s, impl, peer); });
  const int64_t bytes = bytes_moved(d, s.op, s.n);
  state.SetBytesProcessed(state.iterations() * bytes);
  state.counters["bytes_moved"] = double(bytes);
  state.counters["bytes_per_token"] = double(d.bytes_per_token);
  if (p.commits > 0) {  // a lazy variant's step, per call (its time above is a whole step's)
    state.counters["append_us"] = 1e6 * p.append_seconds / double(p.appends);
    state.counters["commit_us"] = 1e6 * p.commit_seconds / double(p.commits);
  }
}

// The roofline: a streaming copy of bytes/2 with every core, so that `bytes` cross the bus. In big
// mode it walks through 512 MiB source and destination buffers, so that neither is in cache.
void run_copy(benchmark::State& state, int64_t bytes, Mode mode) {
  const int64_t half = bytes / 2;
  const int64_t span = mode == Mode::big ? std::max(half, int64_t(512) << 20) / half * half : half;
  static std::vector<unsigned char> src, dst;
  if (int64_t(src.size()) < span) {
    src.assign(size_t(span), 1);
    dst.assign(size_t(span), 0);
  }
  int64_t offset = 0;
  timed_loop(state, mode, [&] {
#pragma omp parallel
    {
      const int threads = omp_get_num_threads(), t = omp_get_thread_num();
      const int64_t chunk = (half + threads - 1) / threads, begin = std::min(half, t * chunk),
                    end = std::min(half, begin + chunk);
      std::memcpy(dst.data() + offset + begin, src.data() + offset + begin, size_t(end - begin));
    }
    offset = (offset + half) % span;
  });
  state.SetBytesProcessed(state.iterations() * bytes);
  state.counters["bytes_moved"] = double(bytes);
}

}  // namespace kvforge_bench

using namespace kvforge_bench;

// kvforge's own flags, printed above Google Benchmark's own --help; the presets are read off presets().
void print_usage() {
  std::printf("kvforge_bench: the generated matrix on the CPU, beside a same-run streaming copy (bench/report.py\n"
              "turns its JSON into the report). kvforge's flags:\n"
              "  --kvf_preset=NAME     one of:");
  for (const auto& [name, _] : presets()) std::printf(" %s", name.c_str());
  std::printf(" (default: short)\n"
              "  --kvf_tune=MODEL      measure the CPU launch parameters for MODEL's variants and write the cpu\n"
              "                        section of MODEL's tuning file, instead of benchmarking\n"
              "  --kvf_tune_out=DIR    where --kvf_tune writes (default: specs/tuning)\n"
              "  --kvf_threads=N       bound kvforge's CPU threads (kvforge::set_cpu_threads) and torch's to N\n"
              "                        (default 0: OpenMP's own count for both)\n"
              "  --kvf_busy_core       keep one core busy with another process while benchmarking, as an\n"
              "                        engine's own threads would (the report says so)\n"
              "Google Benchmark's flags (--benchmark_filter=<op>/<variant>/<shape>, ...):\n");
  std::fflush(stdout);
}

int main(int argc, char** argv) {
  for (int i = 1; i < argc; ++i)
    if (std::strcmp(argv[i], "--help") == 0) print_usage();
  const std::string tune_model = take_flag(argc, argv, "--kvf_tune", "");
  const std::string tune_out = take_flag(argc, argv, "--kvf_tune_out", "specs/tuning");
  if (!tune_model.empty()) return tune(tune_model, tune_out);
  const std::string preset_name = take_flag(argc, argv, "--kvf_preset", "short");
  auto it = presets().find(preset_name);
  if (it == presets().end()) {
    std::fprintf(stderr, "kvforge_bench: unknown --kvf_preset=%s (allowed: ", preset_name.c_str());
    for (const auto& [name, _] : presets()) std::fprintf(stderr, "%s ", name.c_str());
    std::fprintf(stderr, ")\n");
    return 2;
  }
  const Preset& preset = it->second;
  const std::string threads_flag = take_flag(argc, argv, "--kvf_threads", "0");
  char* end = nullptr;
  const long threads = std::strtol(threads_flag.c_str(), &end, 10);
  if (*end != '\0' || threads < 0 || threads > 4096) {
    std::fprintf(stderr, "kvforge_bench: --kvf_threads=%s: not a thread count (allowed: 0..4096)\n", threads_flag.c_str());
    return 2;
  }
  set_cpu_threads(int(threads));
  const bool busy_core = take_switch(argc, argv, "--kvf_busy_core");
  if (busy_core) keep_a_core_busy();
  std::set<std::pair<int64_t, Mode>> copies;
  for (const auto& e : registry().variants()) {
    if (!preset.keeps(*e.descriptor)) continue;
    for (const Shape& shape : preset.shapes) {
      // The baselines, for the layouts they can serve; the generic path last, because it is the one
      // that needs a cache of its own (the others share the generated variant's prepared cache).
      const VariantDescriptor& d = *e.descriptor;
      const bool append = std::string(shape.op) != "gather";
      std::vector<std::pair<Impl, TorchForm>> impls{{Impl::generated, TorchForm{}}};
      if (append && d.storage == d.input && !d.quantized() && d.update == UpdateMode::eager && d.stacked() == false)
        impls.push_back({Impl::naive, TorchForm{}});
      if (is_tuned(d)) impls.push_back({Impl::untuned, TorchForm{}});
      if (preset.torch) {
        // The forms torch has for this layout and op, read off a cache of the tiny shape: which ones
        // serve depends on the layout, not the capacity.
        PeerSetup probe;
        CacheConfig small;
        small.rows = 1;
        small.max_seq_len = d.addressing == Addressing::contiguous ? 1 : 0;
        small.pages = d.paged() ? 1 : 0;
        std::unique_ptr<Cache> c;
        try {
          c = e.create(small);
        } catch (const Error&) {
        }
        probe.cache = c.get();
        probe.gather = !append;
        if (c)
          for (TorchForm f : torch_forms(probe)) impls.push_back({Impl::torch, f});
      }
      if (generic_unsupported_reason(d, CacheConfig{}).empty()) impls.push_back({Impl::generic, TorchForm{}});
      // Mode outside, so that the implementations of one mode share one prepared cache in turn.
      for (Mode mode : preset.modes)
        for (const auto& [impl, form] : impls) {
          Shape s = shape;
          s.mode = mode;
          const std::string suffix = impl == Impl::generic   ? "/generic"
                                     : impl == Impl::naive   ? "/naive"
                                     : impl == Impl::untuned ? "/untuned"
                                     : impl == Impl::torch   ? std::string("/torch_") + torch_form_name(form)
                                                             : "";
          const std::string name = std::string(s.op) + "/" + d.name + "/" + s.key + ":" + std::to_string(s.n) +
                                   mode_suffix(mode) + suffix;
          auto* b = benchmark::RegisterBenchmark(name.c_str(), run_variant, &e, s, impl, form);
          if (mode == Mode::cold) {
            b->UseManualTime()->Iterations(100);  // each iteration also flushes 64 MiB, untimed (timed_loop)
          } else {
            b->UseRealTime();
          }
          copies.insert({bytes_moved(d, s.op, s.n), mode});
        }
    }
  }
  if (preset_name == "memory" || preset_name == "full" || preset_name == "short") {
    register_memory_benchmarks();
    register_multiturn_benchmarks(preset_name != "short");
    register_simulations();
    register_state_benchmarks();
    if (preset_name != "short") {  // 128 MiB of disk reads, or of promotion and other work, an iteration
      register_disk_tier_benchmarks();
      register_promote_ahead_benchmarks();
    }
    const VariantEntry& e = registry().at(kMemoryVariant);
    copies.insert({2 * 64 * e.descriptor->bytes_per_token * e.descriptor->page_size, Mode::hot});
  }
  for (const auto& [b, mode] : copies) {
    auto* r =
        benchmark::RegisterBenchmark(("copy/bytes:" + std::to_string(b) + mode_suffix(mode)).c_str(), run_copy, b, mode);
    if (mode == Mode::cold) {
      r->UseManualTime()->Iterations(100);
    } else {
      r->UseRealTime();
    }
  }
  if (preset.torch && torch_version().empty())
    std::fprintf(stderr, "kvforge_bench: PyTorch was not found when this bench was built, so the report has no "
                         "torch column (tools/setup installs it; then reconfigure)\n");
  // Which of the kernels' builds runs here (report.py prints it in the header).
  benchmark::AddCustomContext("kvforge_cpu_level", cpu_level_name(cpu_level()));
  benchmark::AddCustomContext("torch_version", torch_version().empty() ? "not built" : torch_version());
  benchmark::AddCustomContext("torch_threads", std::to_string(cpu_threads()));
  benchmark::AddCustomContext("kvforge_cpu_threads", std::to_string(cpu_threads()));
  benchmark::AddCustomContext("busy_core", busy_core ? "another process keeps one core busy" : "none");
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 2;
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
