// Prints one line per registered variant: its name and an FNV-1a digest of its pool's bytes (and its
// scales') after a fixed scenario of appends. tests/pool_digests.txt holds the lines this program printed
// when built at f1d6b61, before records became lists of parts in the spec; the pool_bytes test compares
// this build's lines with them, so that a change to how a variant stores its tokens cannot pass unseen.
//
// It uses only calls that were there at f1d6b61 (the registry, create, append, commit, memory, storage and
// scale_storage, num_groups and group), so the same file builds against that commit to record the table:
//   tests/pool_digest.cpp                   this program
//   tests/check_pool_digests.py             the comparison ctest runs (its header says how to re-record)
//
// The scenario: every layer of every group takes the same tokens, placed out of order (paged: slots
// scattered over every page; contiguous and ring: rows interleaved, a ring wrapping once), with values
// from a hash of (token, layer, head, dim) of both signs and many magnitudes, a token of zeros and part of
// another, and one NaN and one infinity in token 3.
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <exception>
#include <numeric>
#include <vector>

#include "kvforge/cache.hpp"
#include "kvforge/registry.hpp"

namespace {

using namespace kvforge;

uint64_t fnv1a(uint64_t h, const void* data, int64_t n) {
  const auto* p = static_cast<const uint8_t*>(data);
  for (int64_t i = 0; i < n; ++i) h = (h ^ p[i]) * 1099511628211ull;
  return h;
}

// A value of both signs over eight binades, from a hash of its coordinates.
float value_at(int64_t token, int layer, int head, int dim) {
  uint64_t h = 1469598103934665603ull;
  const int64_t c[4] = {token, layer, head, dim};
  h = fnv1a(h, c, sizeof c);
  const float mantissa = 1.0f + float(h & 0xffff) / 65536.0f;
  const int binade = int((h >> 16) % 8) - 4;
  const float sign = (h >> 24) & 1 ? -1.0f : 1.0f;
  if (token == 3 && head == 0 && dim == 1) return std::nanf("");
  if (token == 3 && head == 0 && dim == 2) return INFINITY;
  if (token == 5 && dim < 32) return 0.0f;  // zeros beside values in a group wider than 32
  if (token == 6) return 0.0f;                // a token of zeros: every group of it
  return sign * std::ldexp(mantissa, binade);
}

void store(DType t, float x, void* at) {
  if (t == DType::f32) {
    std::memcpy(at, &x, 4);
  } else if (t == DType::bf16) {
    const bf16 b = from_float<bf16>(x);
    std::memcpy(at, &b, 2);
  } else {
    const fp16 h = from_float<fp16>(x);
    std::memcpy(at, &h, 2);
  }
}

// Appends the scenario's tokens to every layer of `cache` (one group), then digests its memory.
uint64_t digest_group(Cache& cache, int first_layer) {
  const VariantDescriptor& d = cache.descriptor();
  const int64_t capacity = d.paged() ? cache.config().pages * d.page_size : cache.config().rows * 16;
  const int64_t tokens = capacity < 24 ? capacity : 24;
  std::vector<int64_t> slots(tokens);
  std::vector<int32_t> rows(tokens), positions(tokens);
  int64_t step = 7;  // prime to the capacity, so that the slots are a permutation's prefix
  while (std::gcd(step, capacity) != 1) step += 2;
  for (int64_t i = 0; i < tokens; ++i) {
    slots[i] = (i * step + 3) % capacity;
    rows[i] = int32_t(i % cache.config().rows);
    positions[i] = int32_t(i / cache.config().rows);
  }
  const TokenTargets targets = d.paged() ? TokenTargets::paged(IndexView::of(slots.data(), tokens))
                                         : TokenTargets::row_positions(IndexView::of(rows.data(), tokens),
                                                                       IndexView::of(positions.data(), tokens));
  const int64_t per_token = int64_t(d.heads) * d.head_dim;
  std::vector<uint8_t> k(size_t(tokens * per_token) * 4), v(k.size());
  const int bytes = dtype_size(d.input);
  for (int layer = 0; layer < d.layers; ++layer) {
    for (int64_t t = 0; t < tokens; ++t)
      for (int h = 0; h < d.heads; ++h)
        for (int x = 0; x < d.head_dim; ++x) {
          const int64_t at = (t * d.heads + h) * d.head_dim + x;
          store(d.input, value_at(t, first_layer + layer, h, x), k.data() + at * bytes);
          store(d.input, value_at(t, first_layer + layer, h, x + d.head_dim), v.data() + at * bytes);
        }
    cache.append(layer, TensorView::contiguous(k.data(), d.input, Device::cpu, tokens, d.heads, d.head_dim),
                 TensorView::contiguous(v.data(), d.input, Device::cpu, tokens, d.heads, d.head_dim), targets);
  }
  if (d.lazy()) cache.commit();
  cache.synchronize();
  const MemoryReport m = cache.memory();
  const int64_t separate_scales = d.scales_in_page() ? 0 : m.scale_bytes;
  uint64_t h = fnv1a(1469598103934665603ull, cache.storage(), m.storage_bytes - separate_scales);
  if (separate_scales > 0) h = fnv1a(h, cache.scale_storage(), separate_scales);
  return h;
}

}  // namespace

int main() {
  int failed = 0;
  for (const VariantEntry& e : registry().variants()) {
    const VariantDescriptor& d = *e.descriptor;
    CacheConfig config;
    config.rows = 3;
    config.max_seq_len = d.addressing == Addressing::contiguous ? 16 : 0;
    config.pages = d.paged() ? 3 : 0;
    config.max_staged_tokens = 32;  // a lazy layout stages the scenario's tokens of one layer
    try {
      std::unique_ptr<Cache> cache = e.create(config);
      uint64_t h = 1469598103934665603ull;
      int first_layer = 0;
      for (int g = 0; g < cache->num_groups(); ++g) {
        Cache& group = cache->num_groups() == 1 ? *cache : cache->group(g);
        const uint64_t member = digest_group(group, first_layer);
        h = fnv1a(h, &member, sizeof member);
        first_layer += group.descriptor().layers;
      }
      std::printf("%s %016llx\n", d.name, static_cast<unsigned long long>(h));
    } catch (const std::exception& err) {
      std::printf("%s error: %s\n", d.name, err.what());
      ++failed;
    }
  }
  return failed == 0 ? 0 : 1;
}
