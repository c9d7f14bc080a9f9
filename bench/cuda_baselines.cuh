// The CUDA bench's baselines, written from scratch: an empty and a spinning kernel, a naive
// element-per-thread copy and vLLM's strategy of a block per token, for appends and gathers.
// Part of kvforge_cuda_bench (cuda_bench.cu includes it once, in this order).
#pragma once

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

}  // namespace
