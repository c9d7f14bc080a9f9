// Test support: device buffers filled from host vectors, value generation, registry parameters.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "kvforge/kvforge.hpp"

namespace kvtest {

using namespace kvforge;

// How many seeds a randomized test runs: all of `full` by default; KVFORGE_TEST_SEEDS=N runs the first
// N, for the repeats of the kernel tests at the narrower CPU levels (tests/CMakeLists.txt), which check
// every variant's kernels of that level once while the widest level runs every seed.
inline std::vector<uint32_t> test_seeds(std::vector<uint32_t> full) {
  if (const char* n = std::getenv("KVFORGE_TEST_SEEDS")) {
    const size_t keep = size_t(std::strtoul(n, nullptr, 10));
    if (keep >= 1 && keep < full.size()) full.resize(keep);
  }
  return full;
}

// Every registered variant on every device kind; CUDA cases skip where CUDA cannot run.
struct Case {
  const VariantEntry* entry;
  Device device;
};

inline void PrintTo(const Case& c, std::ostream* os) {
  *os << c.entry->descriptor->name << " on " << name_of(c.device);
}

// Every variant with storage of its own; hybrid variants are tested through their members and the
// hybrid tests in test_memory.cpp.
inline std::vector<Case> all_cases() {
  std::vector<Case> out;
  for (Device d : {Device::cpu, Device::cuda})
    for (const auto& e : registry().variants())
      if (!e.descriptor->is_hybrid()) out.push_back({&e, d});
  return out;
}

inline std::string case_name(const testing::TestParamInfo<Case>& info) {
  std::string name = std::string(name_of(info.param.device)) + "_" + info.param.entry->descriptor->name;
  for (char& c : name)
    if (c == '.') c = '_';
  return name;
}

// Skips the current test, saying why, when `device` cannot run kernels here.
#define KVTEST_REQUIRE_DEVICE(device)                                      \
  do {                                                                     \
    std::string why_;                                                      \
    if ((device) == kvforge::Device::cuda && !kvforge::cuda_available(&why_)) \
      GTEST_SKIP() << "CUDA case skipped: " << why_;                       \
  } while (0)

// `count` distinct slots of a pool of `pool_slots`, in a random order: tokens scattered over its pages.
inline std::vector<int64_t> scattered_slots(int64_t pool_slots, int64_t count, std::mt19937& rng) {
  std::vector<int64_t> slots(static_cast<size_t>(pool_slots));
  std::iota(slots.begin(), slots.end(), 0);
  std::shuffle(slots.begin(), slots.end(), rng);
  slots.resize(static_cast<size_t>(count));
  return slots;
}

// Floats in this set are exact in fp32, fp16 and bf16: k/4 for k in [-128, 127].
inline float exact_value(uint64_t key) {
  key ^= key >> 33;
  key *= 0xff51afd7ed558ccdULL;
  key ^= key >> 33;
  key *= 0xc4ceb9fe1a85ec53ULL;
  key ^= key >> 33;
  return float(int(key % 256) - 128) / 4.0f;
}

// Encodes a float in a dtype, with an encoder written independently of kvforge's for exact values.
inline void store_as(DType t, float x, void* dst) {
  uint32_t u;
  std::memcpy(&u, &x, 4);
  if (t == DType::f32) {
    std::memcpy(dst, &x, 4);
  } else if (t == DType::bf16) {
    const uint16_t b = uint16_t(u >> 16);  // exact values have no bits below the top 16
    std::memcpy(dst, &b, 2);
  } else {
    // fp16 of an exact value: sign, exponent rebias, mantissa truncation (exact by construction).
    uint16_t h = 0;
    if (x != 0.0f) {
      int e;
      const float m = std::frexp(std::fabs(x), &e);  // |x| = m * 2^e, m in [0.5, 1)
      const int exp16 = e - 1 + 15;
      const uint16_t mant = uint16_t(std::lround((m * 2.0f - 1.0f) * 1024.0f));
      h = uint16_t((x < 0 ? 0x8000 : 0) | (exp16 << 10) | mant);
    }
    std::memcpy(dst, &h, 2);
  }
}

inline float load_as(DType t, const void* src) {
  if (t == DType::f32) {
    float f;
    std::memcpy(&f, src, 4);
    return f;
  }
  uint16_t h;
  std::memcpy(&h, src, 2);
  if (t == DType::bf16) {
    const uint32_t u = uint32_t(h) << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
  }
  const int exp = (h >> 10) & 0x1f, mant = h & 0x3ff;
  const float sign = (h & 0x8000) ? -1.0f : 1.0f;
  if (exp == 0) return sign * std::ldexp(float(mant), -24);
  if (exp == 31) return mant ? NAN : sign * INFINITY;
  return sign * std::ldexp(float(mant + 1024), exp - 25);
}

// Host staging that becomes device memory for the case's device.
class Arena {
 public:
  explicit Arena(Device d) : backend_(backend(d)), device_(d) {}
  template <class T> T* put(const std::vector<T>& host) {
    buffers_.emplace_back(backend_, int64_t(host.size() * sizeof(T)) + 16);
    backend_.from_host(buffers_.back().data(), host.data(), int64_t(host.size() * sizeof(T)), nullptr);
    return buffers_.back().as<T>();
  }
  void* zeros(int64_t bytes) {
    buffers_.emplace_back(backend_, bytes + 16);
    return buffers_.back().data();
  }
  // Zeros in the buffer kept as `slot`, grown where `bytes` is more than it holds: a check that reads
  // back again and again (Driver::verify) then faults its pages in once, not once a call (a ring of
  // mistral-7b's window took 4-7 s of page faults a case with a buffer a call).
  void* scratch_zeros(size_t slot, int64_t bytes) {
    if (scratch_.size() <= slot) scratch_.resize(slot + 1);
    if (scratch_[slot].bytes() < bytes + 16) scratch_[slot] = Buffer(backend_, bytes + 16);
    backend_.fill(scratch_[slot].data(), 0, bytes + 16, nullptr);
    return scratch_[slot].data();
  }
  template <class T> IndexView index(const std::vector<T>& host) {
    return IndexView{put(host), dtype_of<T>::value, device_, int64_t(host.size())};
  }
  std::vector<unsigned char> fetch(const void* src, int64_t bytes) {
    std::vector<unsigned char> out(static_cast<size_t>(bytes));
    backend_.to_host(out.data(), src, bytes, nullptr);
    return out;
  }
  Device device() const { return device_; }

 private:
  Backend& backend_;
  Device device_;
  std::vector<Buffer> buffers_;
  std::vector<Buffer> scratch_;
};

// What a cache holds, on the host: its pool (with any in-page scales), then any scale buffer beside it.
inline std::vector<unsigned char> held_bytes(const Cache& c) {
  const MemoryReport m = c.memory();
  const int64_t beside = c.scale_storage() ? m.scale_bytes : 0;
  std::vector<unsigned char> out(static_cast<size_t>(m.storage_bytes));
  Backend& b = backend(c.config().device);
  b.to_host(out.data(), c.storage(), m.storage_bytes - beside, c.config().stream);
  if (beside) b.to_host(out.data() + (m.storage_bytes - beside), c.scale_storage(), beside, c.config().stream);
  return out;
}

// The bytes of one part of one slot of a StatePool as its view addresses them: [slots, *shape] by the
// view's strides (the pool's own read() is the other way to the same bytes).
inline std::vector<char> state_view_bytes(const StatePool& pool, int64_t slot, int layer, int part) {
  const StateView v = pool.view(layer, part);
  const int64_t es = dtype_size(v.dtype), n = pool.part_bytes(part) / es;
  std::vector<char> out(static_cast<size_t>(pool.part_bytes(part)));
  for (int64_t i = 0; i < n; ++i) {
    int64_t at = slot * v.strides[0], rest = i;
    for (size_t d = v.shape.size() - 1; d >= 1; --d) {
      at += (rest % v.shape[d]) * v.strides[d];
      rest /= v.shape[d];
    }
    std::memcpy(out.data() + i * es, static_cast<const char*>(v.data) + at * es, static_cast<size_t>(es));
  }
  return out;
}

}  // namespace kvtest
