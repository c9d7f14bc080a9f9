// Property tests of every variant's address function (make_geometry + Geometry::offset), over every
// coordinate of a small capacity: each element lands in bounds, no two coordinates share an element,
// and together they cover the whole pool.
#include <vector>

#include "support.hpp"

namespace kvtest {
namespace {

class EveryLayout : public testing::TestWithParam<const VariantEntry*> {};

TEST_P(EveryLayout, AddressesAreInBoundsAndInjective) {
  const VariantDescriptor& d = *GetParam()->descriptor;
  // Keep the walk small while still exercising every axis with an extent above one.
  VariantDescriptor small = d;
  small.layers = std::min(d.layers, 3);
  small.heads = std::min(d.heads, 3);
  small.head_dim = std::min(d.head_dim, 4);
  small.page_size = d.paged() ? std::min(d.page_size, 5) : 0;
  Capacity cap;
  cap.rows = d.paged() ? 0 : 3;
  cap.positions = d.paged() ? 0 : 7;
  cap.pages = d.paged() ? 4 : 0;
  const Geometry g = make_geometry(small, cap);
  const int64_t units = d.paged() ? cap.pages : cap.rows;
  const int64_t slots = d.paged() ? small.page_size : cap.positions;
  ASSERT_EQ(g.total_elems, int64_t(small.layers) * 2 * units * slots * small.heads * small.head_dim);
  std::vector<bool> seen(size_t(g.total_elems), false);
  for (int l = 0; l < small.layers; ++l)
    for (int kv = 0; kv < 2; ++kv)
      for (int64_t u = 0; u < units; ++u)
        for (int64_t s = 0; s < slots; ++s)
          for (int h = 0; h < small.heads; ++h)
            for (int x = 0; x < small.head_dim; ++x) {
              const int64_t off = g.offset(l, kv, u, s, h) + x;
              ASSERT_GE(off, 0);
              ASSERT_LT(off, g.total_elems);
              ASSERT_FALSE(seen[size_t(off)]) << d.name << ": two coordinates share element " << off;
              seen[size_t(off)] = true;
            }
  // Injective over a domain as large as the pool means every element is reached.
  for (bool b : seen) ASSERT_TRUE(b);
}

// A ring sends position p to cell p mod window, wrapping over several windows, and gather refuses
// positions that have left the window.
TEST(RingAddressing, WrapsOverSeveralWindowsAndRefusesExpiredPositions) {
  const VariantEntry* ring = nullptr;
  for (const auto& e : registry().variants())
    if (e.descriptor->addressing == Addressing::ring && e.descriptor->window <= 64) ring = &e;
  if (!ring) GTEST_SKIP() << "no ring variant with a window of at most 64 is registered";
  const VariantDescriptor& d = *ring->descriptor;
  CacheConfig cfg;
  cfg.rows = 1;
  auto cache = ring->create(cfg);
  const int H = d.heads, D = d.head_dim, es = dtype_size(d.input);
  const int W = d.window;
  for (int p = 0; p < 4 * W + 3; ++p) {
    std::vector<unsigned char> k(size_t(H) * D * es), v(k.size());
    for (int h = 0; h < H; ++h)
      for (int x = 0; x < D; ++x) {
        store_as(d.input, exact_value(uint64_t(p) * 1000 + h * 100 + x), k.data() + (h * D + x) * es);
        store_as(d.input, -exact_value(uint64_t(p) * 1000 + h * 100 + x), v.data() + (h * D + x) * es);
      }
    std::vector<int32_t> row{0}, pos{p};
    cache->append(0, TensorView::contiguous(k.data(), d.input, Device::cpu, 1, H, D),
                  TensorView::contiguous(v.data(), d.input, Device::cpu, 1, H, D),
                  TokenTargets::row_positions(IndexView::of(row.data(), 1), IndexView::of(pos.data(), 1)));
    // The whole window reads back, oldest first.
    const int64_t len = p + 1, begin = std::max<int64_t>(0, len - W), n = len - begin;
    std::vector<unsigned char> ko(size_t(H * n * D * es)), vo(ko.size());
    GatherRange g;
    g.row = 0;
    g.begin = begin;
    g.end = len;
    cache->gather(0, g, TensorView::contiguous(ko.data(), d.input, Device::cpu, H, n, D),
                  TensorView::contiguous(vo.data(), d.input, Device::cpu, H, n, D));
    for (int h = 0; h < H; ++h)
      for (int64_t j = 0; j < n; ++j)
        ASSERT_EQ(load_as(d.input, ko.data() + ((h * n + j) * D) * es), exact_value(uint64_t(begin + j) * 1000 + h * 100))
            << "position " << begin + j << " after writing " << p;
    if (begin > 0) {
      g.begin = begin - 1;
      EXPECT_THROW(cache->gather(0, g, TensorView::contiguous(ko.data(), d.input, Device::cpu, H, n + 1, D),
                                 TensorView::contiguous(vo.data(), d.input, Device::cpu, H, n + 1, D)),
                   OutOfRangeError);
    }
  }
}

std::vector<const VariantEntry*> entries() {
  std::vector<const VariantEntry*> out;
  for (const auto& e : registry().variants()) out.push_back(&e);
  return out;
}

INSTANTIATE_TEST_SUITE_P(Registry, EveryLayout, testing::ValuesIn(entries()),
                         [](const testing::TestParamInfo<const VariantEntry*>& i) {
                           std::string n = i.param->descriptor->name;
                           for (char& c : n)
                             if (c == '.') c = '_';
                           return n;
                         });

}  // namespace
}  // namespace kvtest
