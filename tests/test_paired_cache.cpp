// PairedCache (paired_cache.hpp): a cache and a companion over the same pages, as DeepSeek-V3.2 keeps its
// indexer keys beside its MLA records. One SequenceManager over the pair: a fork's copy-on-write, an
// offload and a restore move both caches' pages together, so each sequence reads back what was written
// for it in both; caches that cannot share pages are refused, naming `companion`.
#include <gtest/gtest.h>

#include <functional>
#include <map>
#include <vector>

#include "support.hpp"

namespace kvtest {
namespace {

// A float MLA variant, and a float K/V variant of its page size to stand for the indexer's keys: the
// first such pair, whatever other specs are registered.
struct Pair {
  const VariantDescriptor* main = nullptr;
  const VariantDescriptor* companion = nullptr;
};

bool float_eager(const VariantDescriptor& d) {
  return !d.is_hybrid() && d.paged() && !d.lazy() && d.storage == DType::f32 && d.input == DType::f32;
}

Pair find_pair() {
  for (const auto& m : registry().variants())
    for (const auto& c : registry().variants()) {
      const VariantDescriptor &main = *m.descriptor, &companion = *c.descriptor;
      if (main.mla() && float_eager(main) && !companion.mla() && float_eager(companion) &&
          companion.page_size == main.page_size)
        return {&main, &companion};
    }
  return {};
}

// The value written for (cache, layer, seq, position, element): exact in fp32, distinct per sequence.
float value(int which, int layer, int64_t seq, int64_t pos, int64_t i) {
  return float(which * 100000 + layer * 10000 + seq * 1000 + pos * 10) + float(i % 10) / 16.0f;
}

class PairedTest : public testing::Test {
 protected:
  void SetUp() override {
    pair_ = find_pair();
    if (!pair_.main || !pair_.companion) GTEST_SKIP() << "no float MLA variant and K/V variant of one page size";
    // Room for the scenario's three sequences (a prompt of a page and 3 tokens, its fork, two pages more)
    // at any page size.
    const int64_t P = pair_.main->page_size;
    CacheConfig config;
    config.pages = 4 * ((P + 4 + P - 1) / P) + 2;
    paired_ = std::make_unique<PairedCache>(registry().create(pair_.main->name, config),
                                            registry().create(pair_.companion->name, config));
  }

  // Writes positions [begin, begin + slots.size()) of `seq` into both caches, every layer.
  void write(int64_t seq, int64_t begin, const std::vector<int64_t>& slots) {
    const int64_t n = int64_t(slots.size()), W = 2 * pair_.main->head_dim;
    const int64_t H = pair_.companion->heads, D = pair_.companion->head_dim;
    for (int layer = 0; layer < pair_.main->layers; ++layer) {
      std::vector<float> latent(size_t(n * W));
      for (int64_t t = 0; t < n; ++t)
        for (int64_t i = 0; i < W; ++i) latent[size_t(t * W + i)] = value(0, layer, seq, begin + t, i);
      paired_->append_latent(layer, {latent.data(), DType::f32, Device::cpu, {n, 1, W}, {W, W, 1}},
                             TokenTargets::paged(IndexView::of(slots.data(), n)));
    }
    for (int layer = 0; layer < pair_.companion->layers; ++layer) {
      std::vector<float> k(size_t(n * H * D)), v(k.size());
      for (int64_t i = 0; i < n * H * D; ++i) {
        k[size_t(i)] = value(1, layer, seq, begin + i / (H * D), i % (H * D));
        v[size_t(i)] = -k[size_t(i)];
      }
      paired_->companion().append(layer, {k.data(), DType::f32, Device::cpu, {n, H, D}, {H * D, D, 1}},
                                  {v.data(), DType::f32, Device::cpu, {n, H, D}, {H * D, D, 1}},
                                  TokenTargets::paged(IndexView::of(slots.data(), n)));
    }
  }

  // Both caches hold, for positions [0, n) of `seq`, the values written for `owner_of(pos)`.
  void expect_held(SequenceManager& m, int64_t seq, int64_t n, const std::function<int64_t(int64_t)>& owner_of) {
    const int64_t W = 2 * pair_.main->head_dim, H = pair_.companion->heads, D = pair_.companion->head_dim;
    for (int layer = 0; layer < pair_.main->layers; ++layer) {
      std::vector<float> out(size_t(n * W));
      paired_->gather_latent(layer, m.range(seq, 0, n), {out.data(), DType::f32, Device::cpu, {1, n, W}, {n * W, W, 1}});
      for (int64_t t = 0; t < n; ++t)
        for (int64_t i = 0; i < W; ++i)
          ASSERT_EQ(out[size_t(t * W + i)], value(0, layer, owner_of(t), t, i)) << "main, seq " << seq << " pos " << t;
    }
    for (int layer = 0; layer < pair_.companion->layers; ++layer) {
      std::vector<float> k(size_t(H * n * D)), v(k.size());
      paired_->companion().gather(layer, m.range(seq, 0, n), {k.data(), DType::f32, Device::cpu, {H, n, D}, {n * D, D, 1}},
                                  {v.data(), DType::f32, Device::cpu, {H, n, D}, {n * D, D, 1}});
      for (int64_t h = 0; h < H; ++h)
        for (int64_t t = 0; t < n; ++t)
          for (int64_t i = 0; i < D; ++i) {
            const float want = value(1, layer, owner_of(t), t, h * D + i);
            ASSERT_EQ(k[size_t((h * n + t) * D + i)], want) << "companion K, seq " << seq << " pos " << t;
            ASSERT_EQ(v[size_t((h * n + t) * D + i)], -want) << "companion V, seq " << seq << " pos " << t;
          }
    }
  }

  Pair pair_;
  std::unique_ptr<PairedCache> paired_;
};

TEST_F(PairedTest, AForksCopyOnWriteAndAnOffloadMoveBothCachesPages) {
  SequenceManagerOptions options;
  options.host_blocks = 4;
  SequenceManager m(*paired_, options);
  const int64_t P = pair_.main->page_size, prompt = P + 3;  // a full page and a partial one
  m.add(1, std::vector<int32_t>(size_t(prompt), 7));
  write(1, 0, m.step({1}).slots);
  m.fork(1, 2);
  m.append(2, {9});  // into the shared partial page: copied first, in both caches
  write(2, prompt, m.step({2}).slots);
  expect_held(m, 1, prompt, [](int64_t) { return 1; });
  expect_held(m, 2, prompt + 1, [&](int64_t pos) { return pos < prompt ? 1 : 2; });

  m.offload(2);
  m.add(3, std::vector<int32_t>(size_t(2 * P), 5));  // takes pages the child gave up
  write(3, 0, m.step({3}).slots);
  m.restore(2);  // into whatever pages are free now
  expect_held(m, 2, prompt + 1, [&](int64_t pos) { return pos < prompt ? 1 : 2; });
  expect_held(m, 3, 2 * P, [](int64_t) { return 3; });
  EXPECT_EQ(paired_->packed_page_bytes(),
            paired_->main().packed_page_bytes() + paired_->companion().packed_page_bytes());
  const MemoryReport r = paired_->memory();
  EXPECT_EQ(r.storage_bytes, paired_->main().memory().storage_bytes + paired_->companion().memory().storage_bytes);
}

TEST_F(PairedTest, CachesThatCannotSharePagesAreRefusedNamingTheCompanion) {
  CacheConfig config, more;
  config.pages = paired_->config().pages, more.pages = config.pages + 1;
  try {
    PairedCache(registry().create(pair_.main->name, config), registry().create(pair_.companion->name, more));
    FAIL() << "a companion of another page count was accepted";
  } catch (const ArgumentError& e) {
    EXPECT_EQ(e.argument(), "companion") << e.what();
  }
}

}  // namespace
}  // namespace kvtest
