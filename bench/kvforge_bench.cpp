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

namespace {

using namespace kvforge;

struct Shape {
  const char* op;    // append_decode, append_prefill, gather
  const char* key;   // batch, chunk, ctx
  int64_t n;
  bool cold = false;  // flush the last-level cache before every iteration
};

struct Preset {
  std::vector<Shape> shapes;
  bool (*keeps)(const VariantDescriptor&);
  bool cold = false;  // also run every shape with a flushed cache
};

bool llama_bf16_or_quantized(const VariantDescriptor& d) {
  return std::string(d.model) == "llama3_8b" && (d.storage == DType::bf16 || d.quantized());
}
// Hybrid variants are measured through their members, which are ordinary paged variants.
bool any_variant(const VariantDescriptor& d) { return !d.is_hybrid(); }

const std::map<std::string, Preset>& presets() {
  static const std::map<std::string, Preset> p = {
      // The main job's preset: every llama3-8b layout (float and quantized), decode, prefill and gather.
      {"short",
       {{{"append_decode", "batch", 64}, {"append_prefill", "chunk", 512}, {"gather", "ctx", 1024}},
        llama_bf16_or_quantized}},
      // Quantized variants and their bf16 twins: the cost of quantizing on append and dequantizing on gather.
      {"quant", {{{"append_decode", "batch", 64}, {"gather", "ctx", 1024}}, llama_bf16_or_quantized}},
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
        true}},
  };
  return p;
}

int64_t layer_token_bytes(const VariantDescriptor& d) { return d.bytes_per_token / d.layers; }
int64_t input_token_bytes(const VariantDescriptor& d) { return int64_t(2) * d.heads * d.head_dim * dtype_size(d.input); }

// Layers one append step writes: a lazy variant stages every layer and commits once, as an engine
// drives it; an eager one is measured one layer at a time.
int layers_per_append(const VariantDescriptor& d) { return d.update == UpdateMode::lazy ? d.layers : 1; }

int64_t bytes_moved(const VariantDescriptor& d, const Shape& s) {
  if (std::string(s.op) == "gather") return s.n * (layer_token_bytes(d) + input_token_bytes(d));
  return s.n * (input_token_bytes(d) + 8 + layer_token_bytes(d)) * layers_per_append(d);
}

// One benchmark's cache and inputs. Only one is alive at a time: the next benchmark replaces it.
struct Prepared {
  std::unique_ptr<Cache> cache;
  std::vector<unsigned char> k, v, k_out, v_out;
  std::vector<int32_t> rows, positions, pages;
  std::vector<int64_t> slots;
  int64_t tokens = 0;
  int64_t positions_per_row = 0;
};

// Which implementation serves the descriptor: the generated variant, the generic runtime-strided
// path, or a naive engine's per-token memcpy scatter (appends only).
// `untuned`: the generated variant with the default launch parameters, against its tuned ones.
enum class Impl { generated, generic, naive, untuned };
const char* impl_suffix(Impl i) {
  return i == Impl::generic ? "/generic" : i == Impl::naive ? "/naive" : i == Impl::untuned ? "/untuned" : "";
}

bool is_tuned(const VariantDescriptor& d) {
  const Tuning t = d.tuning, def{};
  return t.cpu_parallel_bytes != def.cpu_parallel_bytes || t.cpu_chunk_items != def.cpu_chunk_items ||
         t.cuda_block_threads != def.cuda_block_threads;
}

std::unique_ptr<Prepared> prepare(const VariantEntry& e, const Shape& s, Impl impl) {
  const VariantDescriptor& d = *e.descriptor;
  auto p = std::make_unique<Prepared>();
  const bool gather = std::string(s.op) == "gather";
  const bool decode = std::string(s.op) == "append_decode";
  // Decode: one token for each of n rows. Prefill: n tokens of one row. Gather: n positions of one row.
  const int64_t rows = decode ? s.n : 1;
  const int64_t per_row = decode ? 16 : s.n;
  p->positions_per_row = per_row;
  CacheConfig cfg;
  cfg.rows = rows;
  cfg.max_seq_len = d.addressing == Addressing::contiguous ? per_row : 0;
  cfg.pages = d.paged() ? rows * ((per_row + d.page_size - 1) / d.page_size) : 0;
  cfg.max_staged_tokens = decode ? rows : per_row;
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
  p->tokens = gather ? 0 : (decode ? rows : per_row);
  const int64_t in_bytes = (gather ? per_row : p->tokens) * d.heads * d.head_dim * dtype_size(d.input);
  std::mt19937 rng(1);
  p->k.resize(size_t(in_bytes));
  p->v.resize(size_t(in_bytes));
  // Small random values that are finite in every input dtype (bf16/fp16 bit patterns of |x| < 2).
  for (size_t i = 0; i + 1 < p->k.size(); i += 2) {
    const uint16_t bits = uint16_t(0x3000 + rng() % 0x0c00) | (rng() & 1 ? 0x8000 : 0);
    std::memcpy(&p->k[i], &bits, 2);
    std::memcpy(&p->v[i], &bits, 2);
  }
  const int64_t pages_per_row = d.paged() ? (per_row + d.page_size - 1) / d.page_size : 0;
  // Pages handed out in a shuffled order, as an allocator under churn would.
  for (int64_t i = 0; i < rows * pages_per_row; ++i) p->pages.push_back(int32_t(i));
  std::shuffle(p->pages.begin(), p->pages.end(), rng);
  auto slot_of = [&](int64_t row, int64_t pos) {
    return int64_t(p->pages[size_t(row * pages_per_row + pos / d.page_size)]) * d.page_size + pos % d.page_size;
  };
  if (gather) {
    // Fill the row once; the benchmark reads it back.
    std::vector<int32_t> r(static_cast<size_t>(per_row), 0), pos(static_cast<size_t>(per_row));
    std::vector<int64_t> sl(static_cast<size_t>(per_row));
    for (int64_t t = 0; t < per_row; ++t) {
      pos[size_t(t)] = int32_t(t);
      if (d.paged()) sl[size_t(t)] = slot_of(0, t);
    }
    const TokenTargets tt = d.paged() ? TokenTargets::paged(IndexView::of(sl.data(), per_row))
                                      : TokenTargets::row_positions(IndexView::of(r.data(), per_row),
                                                                    IndexView::of(pos.data(), per_row));
    p->cache->append(0, TensorView::contiguous(p->k.data(), d.input, Device::cpu, per_row, d.heads, d.head_dim),
                     TensorView::contiguous(p->v.data(), d.input, Device::cpu, per_row, d.heads, d.head_dim), tt);
    p->cache->commit();
    p->k_out.resize(size_t(in_bytes));
    p->v_out.resize(size_t(in_bytes));
  } else {
    for (int64_t t = 0; t < p->tokens; ++t) {
      const int64_t row = decode ? t : 0, pos = decode ? 0 : t;
      p->rows.push_back(int32_t(row));
      p->positions.push_back(int32_t(pos));
      if (d.paged()) p->slots.push_back(slot_of(row, pos));
    }
  }
  return p;
}

// Evicts the last-level cache (32 MiB here) by writing twice its size, outside the timed region.
void flush_caches(benchmark::State& state) {
  static std::vector<unsigned char> junk(size_t(64) << 20);
  state.PauseTiming();
  std::memset(junk.data(), int(junk[0]) + 1, junk.size());
  benchmark::ClobberMemory();
  state.ResumeTiming();
}

// What a naive engine does: one memcpy per token, K or V and head, on one thread, through the
// layout's strides. Same dtype in and out only.
void naive_scatter(Prepared& p, const VariantDescriptor& d) {
  const Strides& st = p.cache->geometry().strides;
  auto* pool = static_cast<unsigned char*>(const_cast<void*>(p.cache->storage()));
  const int64_t es = dtype_size(d.storage), row = int64_t(d.head_dim) * es;
  const unsigned char* in[2] = {p.k.data(), p.v.data()};
  for (int64_t t = 0; t < p.tokens; ++t) {
    int64_t unit, slot;
    if (d.paged()) {
      unit = p.slots[size_t(t)] / d.page_size;
      slot = p.slots[size_t(t)] % d.page_size;
    } else {
      unit = p.rows[size_t(t)];
      slot = d.addressing == Addressing::ring ? p.positions[size_t(t)] % d.window : p.positions[size_t(t)];
    }
    for (int kv = 0; kv < 2; ++kv)
      for (int h = 0; h < d.heads; ++h)
        std::memcpy(pool + (st.kv * kv + st.row_or_page * unit + st.seq_or_slot * slot + st.head * h) * es,
                    in[kv] + (t * d.heads + h) * row, size_t(row));
  }
}

// One step of the shape's operation: a gather of the prepared row, or an append (every layer, then
// commit, for a lazy variant).
void run_once(Prepared& p, const VariantDescriptor& d, const Shape& s, Impl impl) {
  if (std::string(s.op) == "gather") {
    GatherRange g;
    g.end = p.positions_per_row;
    g.pages = IndexView::of(p.pages.data(), int64_t(p.pages.size()));
    p.cache->gather(0, g, TensorView::contiguous(p.k_out.data(), d.input, Device::cpu, d.heads, s.n, d.head_dim),
                    TensorView::contiguous(p.v_out.data(), d.input, Device::cpu, d.heads, s.n, d.head_dim));
  } else if (impl == Impl::naive) {
    naive_scatter(p, d);
  } else {
    const TokenTargets tt = d.paged() ? TokenTargets::paged(IndexView::of(p.slots.data(), p.tokens))
                                      : TokenTargets::row_positions(IndexView::of(p.rows.data(), p.tokens),
                                                                    IndexView::of(p.positions.data(), p.tokens));
    for (int layer = 0; layer < layers_per_append(d); ++layer)
      p.cache->append(layer, TensorView::contiguous(p.k.data(), d.input, Device::cpu, p.tokens, d.heads, d.head_dim),
                      TensorView::contiguous(p.v.data(), d.input, Device::cpu, p.tokens, d.heads, d.head_dim), tt);
    p.cache->commit();
  }
}

void run_variant(benchmark::State& state, const VariantEntry* e, Shape s, Impl impl) {
  static std::unique_ptr<Prepared> current;
  static std::string current_key;
  const VariantDescriptor& d = *e->descriptor;
  const std::string key = std::string(d.name) + s.op + std::to_string(s.n) + (impl == Impl::generic ? "/generic" : "");
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
  if (impl != Impl::generic) p.cache->set_tuning(impl == Impl::untuned ? Tuning{} : d.tuning);
  for (auto _ : state) {
    if (s.cold) flush_caches(state);
    run_once(p, d, s, impl);
    benchmark::ClobberMemory();
  }
  const int64_t bytes = bytes_moved(d, s);
  state.SetBytesProcessed(state.iterations() * bytes);
  state.counters["bytes_moved"] = double(bytes);
  state.counters["bytes_per_token"] = double(d.bytes_per_token);
}

// The roofline: a streaming copy of bytes/2 with every core, so that `bytes` cross the bus.
void run_copy(benchmark::State& state, int64_t bytes, bool cold) {
  const int64_t half = bytes / 2;
  static std::vector<unsigned char> src, dst;
  if (int64_t(src.size()) < half) {
    src.assign(size_t(half), 1);
    dst.assign(size_t(half), 0);
  }
  for (auto _ : state) {
    if (cold) flush_caches(state);
#pragma omp parallel
    {
      const int threads = omp_get_num_threads(), t = omp_get_thread_num();
      const int64_t chunk = (half + threads - 1) / threads, begin = std::min(half, t * chunk),
                    end = std::min(half, begin + chunk);
      std::memcpy(dst.data() + begin, src.data() + begin, size_t(end - begin));
    }
    benchmark::ClobberMemory();
  }
  state.SetBytesProcessed(state.iterations() * bytes);
  state.counters["bytes_moved"] = double(bytes);
}

// ---- memory management (issue: allocator, sequence manager, offload) ------------------------------

const char* kMemoryVariant = "vllm_paged_nhd.llama3_8b.bf16";

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

// step() for `batch` sequences decoding one token each: the metadata build cost per token.
void run_step_metadata(benchmark::State& state, int64_t batch, int64_t context) {
  const VariantEntry& e = registry().at(kMemoryVariant);
  CacheConfig cfg;
  const int P = e.descriptor->page_size;
  cfg.pages = batch * ((context + 1024) / P + 1);
  // The pool is never written here, so a tiny-model twin of the same page size stands in for it.
  const VariantEntry& small = registry().at("vllm_paged_nhd.tiny.bf16");
  auto cache = small.create(cfg);
  SequenceManagerOptions o;
  o.prefix_caching = false;
  SequenceManager m(*cache, o);
  std::vector<int64_t> ids;
  for (int64_t i = 0; i < batch; ++i) {
    m.add(i, std::vector<int32_t>(size_t(context), int32_t(i)));
    ids.push_back(i);
  }
  m.step(ids);
  int64_t steps = 0;
  for (auto _ : state) {
    state.PauseTiming();
    if (++steps * 1 >= 1000) {  // keep sequences from outgrowing the pool
      for (int64_t i = 0; i < batch; ++i) {
        m.free(i);
        m.add(i, std::vector<int32_t>(size_t(context), int32_t(i)));
      }
      m.step(ids);
      steps = 0;
    }
    for (int64_t i = 0; i < batch; ++i) m.append(i, {7});
    state.ResumeTiming();
    benchmark::DoNotOptimize(m.step(ids));
  }
  state.SetItemsProcessed(state.iterations() * batch);
  (void)e;
}

// Offload one sequence of `pages` pages to the host tier and restore it, against a copy of the same
// bytes both ways.
void run_offload_restore(benchmark::State& state, int64_t pages) {
  const VariantEntry& e = registry().at(kMemoryVariant);
  const int P = e.descriptor->page_size;
  CacheConfig cfg;
  cfg.pages = pages + 1;
  auto cache = e.create(cfg);
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

void register_memory_benchmarks() {
  benchmark::RegisterBenchmark("memory/allocate_free/pages:16", run_allocator);
  for (int64_t batch : {64, 256})
    benchmark::RegisterBenchmark(("memory/step_metadata/batch:" + std::to_string(batch) + "/context:2048").c_str(),
                                 run_step_metadata, batch, int64_t(2048));
  benchmark::RegisterBenchmark("memory/offload_restore/pages:64", run_offload_restore, int64_t(64))->UseRealTime();
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

// ---- the tuner ----------------------------------------------------------------------------------

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

// Measures CPU launch-parameter candidates over a model's variants and shapes on this machine and
// writes the winner to <out>/<model>.yaml; the next build bakes it in.
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
               "model: %s\ncpu:\n  parallel_bytes: %lld\n  chunk_items: %d\n",
               model.c_str(), omp_get_max_threads(), candidates.size(), pairs, ratio, model.c_str(), model.c_str(),
               static_cast<long long>(candidates[best].cpu_parallel_bytes), candidates[best].cpu_chunk_items);
  std::fclose(f);
  std::printf("tune: %s: cpu parallel_bytes=%lld chunk_items=%d, %.3f of the defaults' time; wrote %s\n",
              model.c_str(), static_cast<long long>(candidates[best].cpu_parallel_bytes),
              candidates[best].cpu_chunk_items, ratio, path.c_str());
  return 0;
}

// Our own flags come first and are removed before Google Benchmark sees the rest.
std::string take_flag(int& argc, char** argv, const std::string& name, const std::string& fallback) {
  std::string value = fallback;
  int out = 1;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a.rfind(name + "=", 0) == 0) {
      value = a.substr(name.size() + 1);
    } else {
      argv[out++] = argv[i];
    }
  }
  argc = out;
  return value;
}

}  // namespace

int main(int argc, char** argv) {
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
  std::set<std::pair<int64_t, bool>> copies;  // (bytes, cold)
  for (const auto& e : registry().variants()) {
    if (!preset.keeps(*e.descriptor)) continue;
    for (const Shape& shape : preset.shapes) {
      // The baselines, for the layouts they can serve; the generic path last, because it is the one
      // that needs a cache of its own (the others share the generated variant's prepared cache).
      const VariantDescriptor& d = *e.descriptor;
      const bool append = std::string(shape.op) != "gather";
      std::vector<Impl> impls{Impl::generated};
      if (append && d.storage == d.input && !d.quantized() && d.update == UpdateMode::eager && d.stacked() == false)
        impls.push_back(Impl::naive);
      if (is_tuned(d)) impls.push_back(Impl::untuned);
      if (generic_unsupported_reason(d, CacheConfig{}).empty()) impls.push_back(Impl::generic);
      for (Impl impl : impls)
        for (bool cold : {false, true}) {
          if (cold && !preset.cold) continue;
          Shape s = shape;
          s.cold = cold;
          const std::string name = std::string(s.op) + "/" + d.name + "/" + s.key + ":" + std::to_string(s.n) +
                                   (cold ? "/cold" : "") + impl_suffix(impl);
          auto* b = benchmark::RegisterBenchmark(name.c_str(), run_variant, &e, s, impl)->UseRealTime();
          if (cold) b->Iterations(40);  // each iteration also flushes 64 MiB, untimed
          copies.insert({bytes_moved(d, s), cold});
        }
    }
  }
  if (preset_name == "memory" || preset_name == "full" || preset_name == "short") {
    register_memory_benchmarks();
    register_simulations();
    const VariantEntry& e = registry().at(kMemoryVariant);
    copies.insert({2 * 64 * e.descriptor->bytes_per_token * e.descriptor->page_size, false});
  }
  for (const auto& [b, cold] : copies) {
    auto* r = benchmark::RegisterBenchmark(("copy/bytes:" + std::to_string(b) + (cold ? "/cold" : "")).c_str(), run_copy,
                                           b, cold)
                  ->UseRealTime();
    if (cold) r->Iterations(40);
  }
  // Which of the kernels' builds runs here (report.py prints it in the header).
  benchmark::AddCustomContext("kvforge_cpu_level", cpu_level_name(cpu_level()));
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 2;
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
