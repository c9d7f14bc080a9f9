// A downstream program: creates each of its own variants through its registry, appends tokens to random
// slots and gathers them back, against plain values kept by (layer, position, head, dim). Exits 1 on any
// mismatch.
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <vector>

#include "consumer_registry.hpp"  // declares consumer::consumer::registry(), the REGISTRY_FUNCTION
#include "kvforge/kvforge.hpp"

float through_int(float c);  // float_semantics.cpp

// argv[1]: how many variants of f32 or bf16 input to expect (default 2, the specs' own).
int main(int argc, char** argv) {
  using namespace kvforge;
  const int expected = argc > 1 ? std::atoi(argv[1]) : 2;
  for (const VariantEntry& e : consumer::registry().variants()) std::printf("registered: %s\n", e.descriptor->name);
  volatile float minus_half = -0.5f;
  if (std::signbit(through_int(minus_half))) {
    std::printf("float(int(-0.5f)) gave -0.0: kvforge's build options reached the consumer's own code\n");
    return 1;
  }
  int checked = 0;
  for (const VariantEntry& e : consumer::registry().variants()) {
    const VariantDescriptor& d = *e.descriptor;
    if (d.input != DType::f32 && d.input != DType::bf16) continue;
    const int64_t T = 12, H = d.heads, D = d.head_dim, pages = 4;
    CacheConfig config;
    config.pages = pages;
    auto cache = consumer::registry().create(d.name, config);
    // Positions 0..T-1 of one sequence over pages {2, 0, 3}.
    const std::vector<int32_t> page_list{2, 0, 3};
    std::vector<int64_t> slots(T);
    for (int64_t p = 0; p < T; ++p) slots[p] = page_list[p / d.page_size] * d.page_size + p % d.page_size;
    std::mt19937 rng(7);
    std::uniform_int_distribution<int> small(-64, 64);  // exact in bf16 and fp32
    auto value = [&] { return float(small(rng)) / 8.0f; };
    const int width = dtype_size(d.input);
    auto store = [&](float f, void* out) {
      if (width == 4) std::memcpy(out, &f, 4);
      else { uint32_t u; std::memcpy(&u, &f, 4); uint16_t b = uint16_t(u >> 16); std::memcpy(out, &b, 2); }
    };
    auto load = [&](const void* in) {
      if (width == 4) { float f; std::memcpy(&f, in, 4); return f; }
      uint16_t b; std::memcpy(&b, in, 2); uint32_t u = uint32_t(b) << 16; float f; std::memcpy(&f, &u, 4); return f;
    };
    std::vector<float> reference(size_t(d.layers) * 2 * T * H * D);
    auto ref = [&](int layer, int kv, int64_t t, int64_t h, int64_t x) -> float& {
      return reference[(((size_t(layer) * 2 + kv) * T + t) * H + h) * D + x];
    };
    std::vector<char> k(T * H * D * width), v(k.size());
    for (int layer = 0; layer < d.layers; ++layer) {
      for (int64_t t = 0; t < T; ++t)
        for (int64_t h = 0; h < H; ++h)
          for (int64_t x = 0; x < D; ++x) {
            const size_t at = size_t((t * H + h) * D + x) * width;
            store(ref(layer, 0, t, h, x) = value(), &k[at]);
            store(ref(layer, 1, t, h, x) = value(), &v[at]);
          }
      cache->append(layer, TensorView::contiguous(k.data(), d.input, Device::cpu, T, H, D),
                    TensorView::contiguous(v.data(), d.input, Device::cpu, T, H, D),
                    TokenTargets::paged(IndexView::of(slots.data(), T)));
    }
    std::vector<char> k_out(k.size()), v_out(k.size());
    for (int layer = 0; layer < d.layers; ++layer) {
      GatherRange range{0, IndexView::of(page_list.data(), int64_t(page_list.size())), 0, T};
      cache->gather(layer, range, TensorView::contiguous(k_out.data(), d.input, Device::cpu, H, T, D),
                    TensorView::contiguous(v_out.data(), d.input, Device::cpu, H, T, D));
      for (int64_t h = 0; h < H; ++h)
        for (int64_t t = 0; t < T; ++t)
          for (int64_t x = 0; x < D; ++x) {
            const size_t at = size_t((h * T + t) * D + x) * width;
            if (load(&k_out[at]) != ref(layer, 0, t, h, x) || load(&v_out[at]) != ref(layer, 1, t, h, x)) {
              std::printf("%s: layer %d position %lld head %lld dim %lld differs\n", d.name, layer, (long long)t,
                          (long long)h, (long long)x);
              return 1;
            }
          }
    }
    std::printf("%s: %lld B/token, round trip ok\n", d.name, (long long)d.bytes_per_token);
    ++checked;
  }
  if (checked != expected) {
    std::printf("expected %d variants of f32 or bf16 input, checked %d\n", expected, checked);
    return 1;
  }
  return 0;
}
