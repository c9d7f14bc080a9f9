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
// Three timings per case: cudaEvents around repeated eager calls, CUDA-graph replay (of one op, and of
// a whole 32-layer decode step for decode shapes), and the host's enqueue time per call. A lazy
// variant's decode shape also times its commit alone: one graph launch that writes every staged layer. Each case
// rotates layers and inputs so that its working set stays above L2; --cold also flushes L2 before
// every timed call, outside the timed region. Each case's pool bytes (and scales) are checked against
// the CPU backend's for the same inputs.
//
//   kvforge_cuda_bench [--preset short|full] [--filter S] [--cold] [--iterations N] [--json F]
//   kvforge_cuda_bench --tune=<model> [--tune_out specs/tuning]
//
// --tune (or --kvf_tune, as the CPU bench spells it) measures cuda.block_threads and
// cuda.items_per_thread for every eager float and quantized variant of the model and writes the
// `cuda` section of specs/tuning/<model>.yaml. Render the JSON with bench/report.py.
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
#include <map>
#include <memory>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "kvforge/kvforge.hpp"
#include "matrix_rules.hpp"

using namespace kvforge;
using namespace kvforge_bench;

namespace {

void check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) {
    std::fprintf(stderr, "kvforge_cuda_bench: %s: %s\n", what, cudaGetErrorString(e));
    std::exit(1);
  }
}

// ---- baselines, written from scratch --------------------------------------------------------------

__global__ void empty_kernel() {}

// Keeps the GPU busy for `cycles` clocks, so that a call enqueued behind it starts as soon as it ends,
// without waiting for the host.
__global__ void spin_kernel(long long cycles) {
  const long long start = clock64();
  while (clock64() - start < cycles) {
  }
}

// Where token t goes: paged slots (page * P + offset), or (row, position) pairs (a ring wraps the
// position by its window). False for padding (-1).
struct Target {
  const int64_t* slots;
  const int32_t* rows;
  const int32_t* positions;
  int64_t page_size;  // paged
  int64_t window;     // ring, else 0
  __device__ bool resolve(int64_t t, int64_t& unit, int64_t& slot) const {
    if (slots) {
      const int64_t s = slots[t];
      if (s < 0) return false;
      unit = s / page_size, slot = s % page_size;
      return true;
    }
    if (rows[t] < 0 || positions[t] < 0) return false;
    unit = rows[t], slot = window ? positions[t] % window : positions[t];
    return true;
  }
};

struct PoolStrides {
  int64_t unit, slot, head;  // elements: row or page, position or slot, head (dim is contiguous)
};

// One thread per element of K and V: [2][tokens][heads][head_dim] into the pool.
template <class T>
__global__ void naive_append(T* k_pool, T* v_pool, const T* k_in, const T* v_in, Target target, PoolStrides s,
                             int64_t tokens, int heads, int head_dim) {
  const int64_t e = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t per_kv = tokens * heads * head_dim;
  if (e >= 2 * per_kv) return;
  const int64_t kv = e / per_kv, r = e % per_kv, t = r / (int64_t(heads) * head_dim), h = r / head_dim % heads,
                x = r % head_dim;
  int64_t unit, slot;
  if (!target.resolve(t, unit, slot)) return;
  (kv ? v_pool : k_pool)[unit * s.unit + slot * s.slot + h * s.head + x] = (kv ? v_in : k_in)[r];
}

// One thread per element of K and V out: [2][heads][n][head_dim] from positions [0, n) of a sequence.
template <class T>
__global__ void naive_gather(const T* k_pool, const T* v_pool, T* k_out, T* v_out, const int32_t* pages,
                             int64_t page_size, int64_t row, PoolStrides s, int64_t n, int heads, int head_dim) {
  const int64_t e = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t per_kv = n * heads * head_dim;
  if (e >= 2 * per_kv) return;
  const int64_t kv = e / per_kv, r = e % per_kv, h = r / (n * head_dim), p = r / head_dim % n, x = r % head_dim;
  const int64_t unit = pages ? pages[p / page_size] : row, slot = pages ? p % page_size : p;
  (kv ? v_out : k_out)[r] = (kv ? v_pool : k_pool)[unit * s.unit + slot * s.slot + h * s.head + x];
}

// vLLM's strategy: a block per token, 16-byte vectors over (head, part of head_dim), both K and V.
template <class T>
__global__ void reference_append(T* __restrict__ k_pool, T* __restrict__ v_pool, const T* __restrict__ k_in,
                                 const T* __restrict__ v_in, Target target, PoolStrides s, int heads, int head_dim) {
  const int64_t t = blockIdx.x;
  int64_t unit, slot;
  if (!target.resolve(t, unit, slot)) return;
  const int vectors = int(head_dim * sizeof(T) / 16), n = heads * vectors;
  const int64_t in_row = int64_t(heads) * head_dim;
  for (int i = threadIdx.x; i < n; i += blockDim.x) {
    const int h = i / vectors, c = i % vectors;
    const uint4 kx = reinterpret_cast<const uint4*>(k_in + t * in_row + h * head_dim)[c];
    const uint4 vx = reinterpret_cast<const uint4*>(v_in + t * in_row + h * head_dim)[c];
    const int64_t at = unit * s.unit + slot * s.slot + h * s.head;
    reinterpret_cast<uint4*>(k_pool + at)[c] = kx;
    reinterpret_cast<uint4*>(v_pool + at)[c] = vx;
  }
}

// Its gather mirror: a block per position of the sequence, into [heads, n, head_dim].
template <class T>
__global__ void reference_gather(const T* __restrict__ k_pool, const T* __restrict__ v_pool, T* __restrict__ k_out,
                                 T* __restrict__ v_out, const int32_t* __restrict__ pages, int64_t page_size, int64_t row,
                                 PoolStrides s, int64_t count, int heads, int head_dim) {
  const int64_t p = blockIdx.x;
  const int64_t unit = pages ? pages[p / page_size] : row, slot = pages ? p % page_size : p;
  const int vectors = int(head_dim * sizeof(T) / 16), n = heads * vectors;
  for (int i = threadIdx.x; i < n; i += blockDim.x) {
    const int h = i / vectors, c = i % vectors;
    const int64_t at = unit * s.unit + slot * s.slot + h * s.head;
    const uint4 kx = reinterpret_cast<const uint4*>(k_pool + at)[c];
    const uint4 vx = reinterpret_cast<const uint4*>(v_pool + at)[c];
    const int64_t out = (int64_t(h) * count + p) * head_dim;
    reinterpret_cast<uint4*>(k_out + out)[c] = kx;
    reinterpret_cast<uint4*>(v_out + out)[c] = vx;
  }
}

// fp8 e4m3 storage with a per-tensor scale, as vLLM's fp8 cache: 8 bf16 in (16 bytes), 8 codes out
// through the hardware saturating convert.
__global__ void reference_append_fp8(uint8_t* __restrict__ k_pool, uint8_t* __restrict__ v_pool,
                                     const __nv_bfloat16* __restrict__ k_in, const __nv_bfloat16* __restrict__ v_in,
                                     Target target, PoolStrides s, int heads, int head_dim,
                                     const float* __restrict__ k_scale, const float* __restrict__ v_scale) {
  const int64_t t = blockIdx.x;
  int64_t unit, slot;
  if (!target.resolve(t, unit, slot)) return;
  const float k_inv = 1.0f / *k_scale, v_inv = 1.0f / *v_scale;
  const int vectors = head_dim / 8, n = heads * vectors;
  const int64_t in_row = int64_t(heads) * head_dim;
  for (int i = threadIdx.x; i < n; i += blockDim.x) {
    const int h = i / vectors, c = i % vectors;
    const uint4 kx = reinterpret_cast<const uint4*>(k_in + t * in_row + h * head_dim)[c];
    const uint4 vx = reinterpret_cast<const uint4*>(v_in + t * in_row + h * head_dim)[c];
    const __nv_bfloat16* kb = reinterpret_cast<const __nv_bfloat16*>(&kx);
    const __nv_bfloat16* vb = reinterpret_cast<const __nv_bfloat16*>(&vx);
    uint8_t kc[8], vc[8];
    for (int j = 0; j < 8; ++j) {
      kc[j] = __nv_cvt_float_to_fp8(__bfloat162float(kb[j]) * k_inv, __NV_SATFINITE, __NV_E4M3);
      vc[j] = __nv_cvt_float_to_fp8(__bfloat162float(vb[j]) * v_inv, __NV_SATFINITE, __NV_E4M3);
    }
    const int64_t at = unit * s.unit + slot * s.slot + h * s.head + c * 8;
    *reinterpret_cast<uint2*>(k_pool + at) = *reinterpret_cast<const uint2*>(kc);
    *reinterpret_cast<uint2*>(v_pool + at) = *reinterpret_cast<const uint2*>(vc);
  }
}

// ---- cases -----------------------------------------------------------------------------------------

struct Shape {
  std::string op;  // append_decode, append_prefill, gather
  int64_t n;
};

struct Preset {
  std::vector<Shape> float_shapes, quantized_shapes;
};

const std::map<std::string, Preset>& presets() {
  static const std::map<std::string, Preset> p = {
      {"full",
       {{{"append_decode", 64}, {"append_decode", 256}, {"append_prefill", 512}, {"append_prefill", 2048},
         {"append_prefill", 8192}, {"gather", 1024}, {"gather", 8192}, {"gather", 32768}},
        {{"append_decode", 256}, {"append_prefill", 8192}, {"gather", 8192}}}},
      // tools/gpu-check's: one decode, one prefill and one gather per variant, a few minutes in all.
      {"short",
       {{{"append_decode", 64}, {"append_prefill", 8192}, {"gather", 32768}},
        {{"append_decode", 256}, {"append_prefill", 8192}, {"gather", 8192}}}},
  };
  return p;
}

bool lazy(const VariantDescriptor& d) { return d.update == UpdateMode::lazy; }
int layers_per_op(const VariantDescriptor& d, const Shape& s) { return s.op == "gather" ? 1 : layers_per_append(d); }

// Device memory that frees itself.
struct DeviceBuffer {
  void* data = nullptr;
  int64_t bytes = 0;
  DeviceBuffer() = default;
  explicit DeviceBuffer(int64_t n) : bytes(n) { check(cudaMalloc(&data, size_t(std::max<int64_t>(n, 16))), "cudaMalloc"); }
  DeviceBuffer(DeviceBuffer&& o) noexcept : data(o.data), bytes(o.bytes) { o.data = nullptr; }
  DeviceBuffer& operator=(DeviceBuffer&& o) noexcept {
    std::swap(data, o.data);
    std::swap(bytes, o.bytes);
    return *this;
  }
  ~DeviceBuffer() {
    if (data) cudaFree(data);
  }
  template <class T> T* as() const { return static_cast<T*>(data); }
};

template <class T> DeviceBuffer upload(const std::vector<T>& host) {
  DeviceBuffer b(int64_t(host.size() * sizeof(T)));
  check(cudaMemcpy(b.data, host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice), "upload");
  return b;
}

std::vector<unsigned char> random_rows(int64_t bytes, uint32_t seed) {
  std::vector<unsigned char> out(static_cast<size_t>(bytes));
  std::mt19937 rng(seed);
  fill_small_values(out.data(), out.size(), rng);
  return out;
}

// One epoch's targets: where its tokens go (append), or which sequence it reads (gather).
struct Epoch {
  std::vector<int64_t> slots;
  std::vector<int32_t> rows, positions;
  int64_t row = 0;  // gather: the sequence (row, or its page list's index)
};

// A case's capacity and targets: `epochs` disjoint sets of targets, so that rotating through them
// (and through the layers) keeps the working set above L2.
struct Plan {
  CacheConfig config;
  std::vector<int32_t> pages;  // paged: every sequence's pages, pages_per_seq each
  int64_t pages_per_seq = 0;
  std::vector<Epoch> epochs;
  int64_t tokens = 0;  // appended per op
};

// Null when the variant cannot hold the shape (a contiguous model's max_seq_len, a ring's window).
std::unique_ptr<Plan> plan(const VariantDescriptor& d, const Shape& s, int epochs) {
  auto p = std::make_unique<Plan>();
  const bool decode = s.op == "append_decode", gather = s.op == "gather";
  const int64_t sequences = decode ? s.n : 1;
  const int64_t per_seq = decode ? epochs : gather ? s.n : s.n * epochs;
  if (d.addressing == Addressing::contiguous && per_seq > d.max_seq_len) return nullptr;
  if (d.addressing == Addressing::ring && per_seq > d.window) return nullptr;
  p->config.device = Device::cuda;
  p->config.rows = sequences;
  if (d.addressing == Addressing::contiguous) p->config.max_seq_len = per_seq;
  if (d.paged()) {
    p->pages_per_seq = (per_seq + d.page_size - 1) / d.page_size;
    p->config.pages = sequences * p->pages_per_seq;
    for (int64_t i = 0; i < p->config.pages; ++i) p->pages.push_back(int32_t(i));
    std::shuffle(p->pages.begin(), p->pages.end(), std::mt19937(1));  // as an allocator under churn
  }
  p->tokens = gather ? 0 : s.n;
  p->config.max_staged_tokens = std::max<int64_t>(s.n, sequences);
  auto slot_of = [&](int64_t seq, int64_t pos) {
    return int64_t(p->pages[size_t(seq * p->pages_per_seq + pos / d.page_size)]) * d.page_size + pos % d.page_size;
  };
  const int count = gather ? 1 : epochs;
  for (int e = 0; e < count; ++e) {
    Epoch ep;
    for (int64_t i = 0; i < s.n; ++i) {
      const int64_t seq = decode ? i : 0, pos = decode ? e : gather ? i : e * s.n + i;
      ep.rows.push_back(int32_t(seq));
      ep.positions.push_back(int32_t(pos));
      if (d.paged()) ep.slots.push_back(slot_of(seq, pos));
    }
    p->epochs.push_back(std::move(ep));
  }
  return p;
}

// The same targets on the device.
struct DeviceEpoch {
  DeviceBuffer slots, rows, positions;
  TokenTargets targets(const VariantDescriptor& d, int64_t n) const {
    if (d.paged()) return TokenTargets::paged(IndexView{slots.data, DType::i64, Device::cuda, n});
    return TokenTargets::row_positions(IndexView{rows.data, DType::i32, Device::cuda, n},
                                       IndexView{positions.data, DType::i32, Device::cuda, n});
  }
  Target target(const VariantDescriptor& d) const {
    return Target{d.paged() ? slots.as<const int64_t>() : nullptr, rows.as<const int32_t>(), positions.as<const int32_t>(),
                  d.page_size, d.addressing == Addressing::ring ? d.window : 0};
  }
};

DeviceEpoch to_device(const Epoch& e) {
  DeviceEpoch out;
  if (!e.slots.empty()) out.slots = upload(e.slots);
  out.rows = upload(e.rows);
  out.positions = upload(e.positions);
  return out;
}

// ---- timing ----------------------------------------------------------------------------------------

struct Timing {
  double eager_us = NAN, graph_us = NAN, host_us = NAN;
  std::string graph_error;
};

struct Timer {
  cudaStream_t stream;
  int iterations;
  bool cold;
  DeviceBuffer flush;  // twice L2: written before each cold iteration, untimed
  long long spin_cycles = 0;  // 30 us of SM clocks: the host's time to enqueue a call, with room

  // Times `iterations` calls of launch(i): events around the loop (warm), or around each call after an
  // untimed L2 flush (cold). Returns microseconds per call; `host_us`, where given, gets the host's
  // enqueue time per call (warm only: a cold run's flushes sit between the calls).
  template <class Launch> double time_calls(Launch launch, double* host_us) {
    cudaEvent_t start, stop;
    check(cudaEventCreate(&start), "event");
    check(cudaEventCreate(&stop), "event");
    float ms = 0;
    if (!cold) {
      check(cudaEventRecord(start, stream), "record");
      const auto host_start = std::chrono::steady_clock::now();
      for (int i = 0; i < iterations; ++i) launch(i);
      const double host = std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - host_start).count();
      if (host_us) *host_us = host / iterations;
      check(cudaEventRecord(stop, stream), "record");
      check(cudaEventSynchronize(stop), "sync");
      check(cudaEventElapsedTime(&ms, start, stop), "elapsed");
    } else {
      for (int i = 0; i < iterations; ++i) {
        check(cudaMemsetAsync(flush.data, i & 0xff, size_t(flush.bytes), stream), "flush");
        check(cudaEventRecord(start, stream), "record");
        launch(i);
        check(cudaEventRecord(stop, stream), "record");
        check(cudaEventSynchronize(stop), "sync");
        float one = 0;
        check(cudaEventElapsedTime(&one, start, stop), "elapsed");
        ms += one;
      }
    }
    cudaEventDestroy(start);
    cudaEventDestroy(stop);
    return 1000.0 * ms / iterations;
  }

  // Eager calls, after a warm-up.
  template <class Op> void eager(Op op, Timing& t) {
    for (int i = 0; i < 3; ++i) op(i);
    check(cudaStreamSynchronize(stream), "warm-up");
    t.eager_us = time_calls(op, &t.host_us);
  }

  // op(i) captured on the stream and instantiated; null, with `error` set, where the capture fails (an
  // op that synchronizes or allocates).
  template <class Op> cudaGraphExec_t capture(Op op, int i, std::string& error) {
    check(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal), "begin capture");
    try {
      op(i);
    } catch (const std::exception& e) {
      error = e.what();
    }
    cudaGraph_t graph = nullptr;
    const cudaError_t end = cudaStreamEndCapture(stream, &graph);
    if (error.empty() && end != cudaSuccess) error = cudaGetErrorString(end);
    cudaGetLastError();
    cudaGraphExec_t exec = nullptr;
    if (error.empty()) {
      const cudaError_t inst = cudaGraphInstantiate(&exec, graph, 0);
      if (inst != cudaSuccess) error = cudaGetErrorString(inst);
    }
    if (graph) cudaGraphDestroy(graph);
    return error.empty() ? exec : nullptr;
  }

  // Graphs of op(0) .. op(g - 1), each captured once, replayed in turn. A capture that fails is
  // reported, not fatal.
  template <class Op> void graph(Op op, int g, Timing& t) {
    std::vector<cudaGraphExec_t> execs;
    for (int i = 0; i < g && t.graph_error.empty(); ++i)
      if (cudaGraphExec_t exec = capture(op, i, t.graph_error)) execs.push_back(exec);
    if (t.graph_error.empty()) {
      auto replay = [&](int i) { check(cudaGraphLaunch(execs[size_t(i) % execs.size()], stream), "graph launch"); };
      for (int i = 0; i < 3; ++i) replay(i);
      t.graph_us = time_calls(replay, nullptr);
    }
    for (cudaGraphExec_t e : execs) cudaGraphExecDestroy(e);
  }

  // op(i) alone, as a graph, after prepare(i) has run eagerly and untimed (a lazy variant's staging,
  // before its commit). Each call is captured afresh, since prepare changes the state op reads, and is
  // launched behind a spin kernel, so that its events time the GPU's work and not the host's enqueue.
  template <class Prepare, class Op> void graph_alone(Prepare prepare, Op op, int calls, Timing& t) {
    std::vector<cudaGraphExec_t> execs;
    std::vector<cudaEvent_t> events(size_t(2 * calls));
    for (cudaEvent_t& e : events) check(cudaEventCreate(&e), "event");
    for (int i = 0; i < calls && t.graph_error.empty(); ++i) {
      prepare(i);
      const cudaGraphExec_t exec = capture(op, i, t.graph_error);
      if (!exec) break;
      execs.push_back(exec);
      spin_kernel<<<1, 1, 0, stream>>>(spin_cycles);
      check(cudaEventRecord(events[size_t(2 * i)], stream), "record");
      check(cudaGraphLaunch(exec, stream), "graph launch");
      check(cudaEventRecord(events[size_t(2 * i + 1)], stream), "record");
    }
    check(cudaStreamSynchronize(stream), "sync");
    if (t.graph_error.empty() && calls > 0) {
      double ms = 0;
      for (int i = 0; i < calls; ++i) {
        float one = 0;
        check(cudaEventElapsedTime(&one, events[size_t(2 * i)], events[size_t(2 * i + 1)]), "elapsed");
        ms += one;
      }
      t.graph_us = 1000.0 * ms / calls;
    }
    for (cudaGraphExec_t e : execs) cudaGraphExecDestroy(e);
    for (cudaEvent_t e : events) cudaEventDestroy(e);
  }
};

// ---- one case --------------------------------------------------------------------------------------

struct Record {
  std::string variant, op, check = "not run";
  int64_t n = 0, bytes = 0;
  Timing kvforge, untuned, reference, naive, twin, step, commit;
  double d2d_us = NAN;
};

// Inputs for `sets` epochs, and a gather's output, on the device.
struct Inputs {
  std::vector<DeviceBuffer> k, v;
  DeviceBuffer k_out, v_out;
};

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

// Times every implementation of one (variant, shape). `twin`: the bf16 twin of a quantized variant.
Record run_case(const VariantEntry& e, const VariantEntry* twin, const Shape& s, Timer& timer, DeviceBuffer& d2d_src,
                DeviceBuffer& d2d_dst, int64_t l2_bytes, bool baselines = true) {
  const VariantDescriptor& d = *e.descriptor;
  Record rec;
  rec.variant = d.name, rec.op = s.op, rec.n = s.n, rec.bytes = bytes_moved(d, s.op, s.n);
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
    }
  }
  cache->synchronize();
  // The same bytes, device to device.
  const int64_t half = rec.bytes / 2, span = std::max<int64_t>(half, d2d_src.bytes / half * half);
  if (half > 0 && half <= d2d_src.bytes) {
    Timing t;
    timer.eager([&](int i) {
      const int64_t at = (int64_t(i) * half) % span;
      check(cudaMemcpyAsync(d2d_dst.as<char>() + at, d2d_src.as<char>() + at, size_t(half), cudaMemcpyDeviceToDevice,
                            timer.stream), "d2d");
    }, t);
    rec.d2d_us = t.eager_us;
  }
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

// ---- output ----------------------------------------------------------------------------------------

std::string number(double x) {
  if (!std::isfinite(x)) return "null";
  char b[64];
  std::snprintf(b, sizeof b, "%.4f", x);
  return b;
}

std::string quoted(const std::string& s) {
  std::string out = "\"";
  for (char c : s) {
    if (c == '"' || c == '\\') out += '\\';
    if (c == '\n') out += "\\n";
    else if (static_cast<unsigned char>(c) >= 0x20) out += c;
  }
  return out + "\"";
}

std::string timing_json(const Timing& t) {
  return "{\"eager_us\": " + number(t.eager_us) + ", \"graph_us\": " + number(t.graph_us) + ", \"host_us\": " +
         number(t.host_us) + (t.graph_error.empty() ? "" : ", \"graph_error\": " + quoted(t.graph_error)) + "}";
}

struct DeviceInfo {
  std::string name;
  int sms = 0, sm_clock_mhz = 0, memory_clock_mhz = 0;
  int64_t l2_bytes = 0, memory_bytes = 0;
};

DeviceInfo device_info() {
  DeviceInfo info;
  int dev = 0;
  check(cudaGetDevice(&dev), "cudaGetDevice");
  cudaDeviceProp prop{};
  check(cudaGetDeviceProperties(&prop, dev), "cudaGetDeviceProperties");
  info.name = prop.name;
  info.sms = prop.multiProcessorCount;
  info.l2_bytes = prop.l2CacheSize;
  info.memory_bytes = int64_t(prop.totalGlobalMem);
  int khz = 0;
  if (cudaDeviceGetAttribute(&khz, cudaDevAttrClockRate, dev) == cudaSuccess) info.sm_clock_mhz = khz / 1000;
  if (cudaDeviceGetAttribute(&khz, cudaDevAttrMemoryClockRate, dev) == cudaSuccess) info.memory_clock_mhz = khz / 1000;
  return info;
}

void write_json(const std::string& path, const DeviceInfo& info, const std::string& preset, bool cold, const Timing& empty,
                const std::vector<Record>& records) {
  std::ofstream out(path);
  out << "{\n  \"kind\": \"kvforge_cuda_bench\",\n  \"preset\": " << quoted(preset) << ",\n  \"cold\": " << (cold ? "true" : "false")
      << ",\n  \"device\": {\"name\": " << quoted(info.name) << ", \"sms\": " << info.sms
      << ", \"sm_clock_mhz\": " << info.sm_clock_mhz << ", \"memory_clock_mhz\": " << info.memory_clock_mhz
      << ", \"l2_bytes\": " << info.l2_bytes << ", \"memory_bytes\": " << info.memory_bytes << "},\n  \"empty_kernel\": "
      << timing_json(empty) << ",\n  \"records\": [";
  for (size_t i = 0; i < records.size(); ++i) {
    const Record& r = records[i];
    out << (i ? ",\n" : "\n") << "    {\"variant\": " << quoted(r.variant) << ", \"op\": " << quoted(r.op) << ", \"n\": " << r.n
        << ", \"bytes\": " << r.bytes << ", \"check\": " << quoted(r.check) << ", \"d2d_us\": " << number(r.d2d_us)
        << ", \"kvforge\": " << timing_json(r.kvforge) << ", \"untuned\": " << timing_json(r.untuned)
        << ", \"step\": " << timing_json(r.step) << ", \"commit\": " << timing_json(r.commit)
        << ", \"reference\": " << timing_json(r.reference)
        << ", \"naive\": " << timing_json(r.naive) << ", \"twin\": " << timing_json(r.twin) << "}";
  }
  out << "\n  ]\n}\n";
}

// ---- tuning ----------------------------------------------------------------------------------------

// Replaces the `cuda:` section of a tuning file (keeping everything else), or starts the file.
// One launch shape --tune measures: Tuning's cuda fields.
struct LaunchShape {
  int block_threads, items_per_thread;
  bool operator<(const LaunchShape& o) const {
    return block_threads != o.block_threads ? block_threads < o.block_threads : items_per_thread < o.items_per_thread;
  }
};

void write_cuda_tuning(const std::string& path, const std::string& model, LaunchShape best, const std::string& why) {
  std::vector<std::string> kept;
  {
    std::ifstream in(path);
    bool in_cuda = false;
    for (std::string line; std::getline(in, line);) {
      if (line.rfind("cuda:", 0) == 0) {
        in_cuda = true;
        continue;
      }
      if (in_cuda && (line.empty() || line[0] == ' ' || line[0] == '#')) continue;
      in_cuda = false;
      kept.push_back(line);
    }
  }
  if (kept.empty()) kept.push_back("model: " + model);
  std::ofstream out(path);
  for (const std::string& line : kept) out << line << "\n";
  out << "cuda:\n  # " << why << "\n  block_threads: " << best.block_threads
      << "\n  items_per_thread: " << best.items_per_thread << "\n";
}

int tune(const std::string& model, const std::string& out_dir, Timer& timer) {
  std::vector<const VariantEntry*> variants;
  for (const VariantEntry& e : registry().variants()) {
    const VariantDescriptor& d = *e.descriptor;
    if (std::string(d.model) == model && !d.is_hybrid() && (d.storage == d.input || d.quantized())) variants.push_back(&e);
  }
  if (variants.empty()) {
    std::fprintf(stderr, "kvforge_cuda_bench: --tune=%s: no float or quantized variant of that model is registered\n", model.c_str());
    return 2;
  }
  const std::vector<Shape> shapes = {{"append_decode", 64}, {"append_prefill", 2048}, {"gather", 8192}};
  std::vector<LaunchShape> candidates;
  for (int threads : {64, 128, 256, 512, 1024})
    for (int items : {1, 2, 4, 8}) candidates.push_back({threads, items});
  std::map<LaunchShape, double> log_sum;
  int measured = 0;
  for (const VariantEntry* e : variants)
    for (const Shape& s : shapes) {
      const VariantDescriptor& d = *e->descriptor;
      const std::unique_ptr<Plan> p = plan(d, s, 1);
      if (!p) continue;
      CacheConfig config = p->config;
      config.stream = timer.stream;
      auto cache = e->create(config);
      if (d.quant == Quant::per_tensor)
        for (int l = 0; l < d.layers; ++l) cache->set_tensor_scale(l, 0.0625f, 0.125f);
      const int64_t row_bytes = int64_t(d.heads) * d.head_dim * dtype_size(d.input);
      const DeviceBuffer k = upload(random_rows(s.n * row_bytes, 1)), v = upload(random_rows(s.n * row_bytes, 2));
      const DeviceEpoch target = to_device(p->epochs[0]);
      const DeviceBuffer pages = d.paged() ? upload(p->pages) : DeviceBuffer(16);
      GatherRange range;
      range.end = s.n;
      if (d.paged()) range.pages = IndexView{pages.data, DType::i32, Device::cuda, p->pages_per_seq};
      auto op = [&](int i) {
        const int layer = i % d.layers;
        if (s.op == "gather")
          cache->gather(layer, range, TensorView::contiguous(k.data, d.input, Device::cuda, d.heads, s.n, d.head_dim),
                        TensorView::contiguous(v.data, d.input, Device::cuda, d.heads, s.n, d.head_dim));
        else
          cache->append(lazy(d) ? 0 : layer, TensorView::contiguous(k.data, d.input, Device::cuda, s.n, d.heads, d.head_dim),
                        TensorView::contiguous(v.data, d.input, Device::cuda, s.n, d.heads, d.head_dim), target.targets(d, s.n));
        cache->commit();
      };
      for (const LaunchShape& c : candidates) {
        Tuning t = d.tuning;
        t.cuda_block_threads = c.block_threads;
        t.cuda_items_per_thread = c.items_per_thread;
        cache->set_tuning(t);
        Timing timing;
        timer.eager(op, timing);
        log_sum[c] += std::log(timing.eager_us);
      }
      ++measured;
    }
  const LaunchShape fallback{Tuning{}.cuda_block_threads, Tuning{}.cuda_items_per_thread};
  LaunchShape best = fallback;
  for (const auto& [c, sum] : log_sum)
    if (sum < log_sum[best]) best = c;
  const double ratio = std::exp((log_sum[best] - log_sum[fallback]) / std::max(measured, 1));
  char why[256];
  std::snprintf(why, sizeof why,
                "written by kvforge_cuda_bench --tune=%s on %s: %zu candidates over %d (variant, shape) pairs; the "
                "winner's geometric-mean time is %.3f of the default's",
                model.c_str(), device_info().name.c_str(), candidates.size(), measured, ratio);
  const std::string path = out_dir + "/" + model + ".yaml";
  write_cuda_tuning(path, model, best, why);
  std::printf("%s\nwrote cuda.block_threads: %d, cuda.items_per_thread: %d to %s\n", why, best.block_threads,
              best.items_per_thread, path.c_str());
  return 0;
}

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
  for (const VariantEntry& e : registry().variants()) {
    const VariantDescriptor& d = *e.descriptor;
    // llama3-8b's layouts, float and quantized, as the CPU bench's short preset.
    if (std::string(d.model) != "llama3_8b" || d.is_hybrid() || !(d.storage == DType::bf16 || d.quantized())) continue;
    const VariantEntry* twin = nullptr;
    if (d.quantized()) twin = registry().find(variant_name(d.layout, d.model, d.input, d.input));
    for (const Shape& s : d.quantized() ? preset->second.quantized_shapes : preset->second.float_shapes) {
      const std::string key = s.op + "/" + d.name + "/" + std::to_string(s.n);
      if (!filter.empty() && key.find(filter) == std::string::npos) continue;
      const Record r = run_case(e, twin, s, timer, d2d_src, d2d_dst, info.l2_bytes);
      records.push_back(r);
      const double us = r.kvforge.eager_us;
      std::printf("| %s | %s | %lld | %.2f | %.2f | %.2f | %.2f | %.2f | %.0f | %.2f | %.2f | %.2f | %s |\n", r.variant.c_str(),
                  r.op.c_str(), (long long)r.n, us, r.kvforge.graph_us, r.kvforge.host_us, r.step.graph_us, r.commit.graph_us,
                  double(r.bytes) / us / 1e3, r.d2d_us / us, r.reference.eager_us / us, r.naive.eager_us / us, r.check.c_str());
      std::fflush(stdout);
    }
  }
  const std::string json = flag(argc, argv, "--json", "cuda_bench.json");
  write_json(json, info, preset_name, timer.cold, empty, records);
  std::printf("wrote %s\n", json.c_str());
  int failures = 0;
  for (const Record& r : records) failures += r.check != "ok" && r.check != "cannot hold the shape";
  if (failures) std::fprintf(stderr, "kvforge_cuda_bench: %d cases did not match the CPU backend\n", failures);
  return failures ? 1 : 0;
}
