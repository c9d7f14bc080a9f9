// Property tests of every variant's address function (make_geometry + Geometry::offset), over every
// coordinate of a small capacity: each element lands in bounds, no two coordinates share an element,
// and together they cover the whole pool.
#include <cctype>
#include <vector>

#include "part_record_reference.hpp"
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
  // A record format keeps its width: its rows are halves of a record of whole parts and groups.
  if (!d.coded_records()) small.head_dim = std::min(d.head_dim, 4);
  if (d.quant == Quant::per_group) small.quant_group = 2;  // two groups a row
  small.page_size = d.paged() ? std::min(d.page_size, 5) : 0;
  Capacity cap;
  cap.rows = d.paged() ? 0 : 3;
  cap.positions = d.paged() ? 0 : 7;
  cap.pages = d.paged() ? 4 : 0;
  const Geometry g = make_geometry(small, cap);
  const int64_t units = d.paged() ? cap.pages : cap.rows;
  const int64_t slots = d.paged() ? small.page_size : cap.positions;
  // 4-bit codes: two values an element; a record format: half its bytes (and page-end scales) a row.
  const int stored_dim = d.coded_records() ? (ref_place(*d.record_format).record_bytes + ref_place(*d.record_format).tail_bytes) / 2
                                           : small.head_dim / dtype_values(d.storage);
  const int64_t values = int64_t(small.layers) * 2 * units * slots * small.heads * stored_dim;
  // Dynamic scales: one per (layer, kv, unit, slot), times heads for per_token_head, and times groups
  // of a head's row for per_group.
  const bool grouped = d.quant == Quant::per_group;
  const int scale_heads = d.quant == Quant::per_token_head || grouped ? small.heads : d.quant == Quant::per_token ? 1 : 0;
  const int groups = grouped ? small.head_dim / small.quant_group : 1;
  const int64_t scales = int64_t(small.layers) * 2 * units * slots * scale_heads * groups;
  const int64_t ss = dtype_size(d.scale);
  ASSERT_EQ(g.total_elems, values + (d.scales_in_page() ? scales * ss : 0));
  ASSERT_EQ(g.scale_elems, d.quant == Quant::per_tensor ? 2 * small.layers : d.scales_in_page() ? 0 : scales);
  // Bytes of the pool and of the separate scale buffer, each claimed once.
  std::vector<bool> seen(size_t(g.total_elems), false), seen_scales(size_t(g.scale_elems), false);
  auto claim = [&](std::vector<bool>& space, int64_t at, int64_t n, const char* what) {
    ASSERT_GE(at, 0) << what;
    ASSERT_LE(at + n, int64_t(space.size())) << what;
    for (int64_t i = at; i < at + n; ++i) {
      ASSERT_FALSE(space[size_t(i)]) << d.name << ": two coordinates share " << what << " element " << i;
      space[size_t(i)] = true;
    }
  };
  for (int l = 0; l < small.layers; ++l)
    for (int kv = 0; kv < 2; ++kv) {
      if (d.quant == Quant::per_tensor)
        claim(seen_scales, l * g.scale_strides.layer + kv * g.scale_strides.kv, 1, "per-tensor scale");
      for (int64_t u = 0; u < units; ++u)
        for (int64_t s = 0; s < slots; ++s)
          for (int h = 0; h < small.heads; ++h) {
            for (int x = 0; x < stored_dim; ++x) claim(seen, g.offset(l, kv, u, s, h) + x, 1, "value");
            if (h >= scale_heads) continue;
            for (int group = 0; group < groups; ++group) {  // a head's groups adjacent, as LayerView says
              const int64_t scale = l * g.scale_strides.layer + kv * g.scale_strides.kv + u * g.scale_strides.row_or_page +
                                    s * g.scale_strides.seq_or_slot + h * g.scale_strides.head + group;
              if (d.scales_in_page()) {
                claim(seen, g.scale_offset_bytes + scale * ss, ss, "in-page scale");
              } else {
                claim(seen_scales, scale, 1, "scale");
              }
            }
          }
    }
  // Injective over a domain as large as the space means every element is reached.
  for (bool b : seen) ASSERT_TRUE(b);
  for (bool b : seen_scales) ASSERT_TRUE(b);
}

// A ring sends position p to cell p mod window, wrapping over several windows, and gather refuses
// positions that have left the window.
TEST(RingAddressing, WrapsOverSeveralWindowsAndRefusesExpiredPositions) {
  const VariantEntry* ring = nullptr;
  for (const auto& e : registry().variants())
    if (e.descriptor->addressing == Addressing::ring && e.descriptor->window <= 64 && !e.descriptor->quantized())
      ring = &e;
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

// Every variant's address function; a hybrid variant contributes its members, one per layer group.
std::vector<const VariantEntry*> entries() {
  static std::vector<VariantEntry> members;
  std::vector<const VariantEntry*> out;
  for (const auto& e : registry().variants())
    if (!e.descriptor->is_hybrid()) out.push_back(&e);
  for (const auto& e : registry().variants())
    if (e.descriptor->is_hybrid())
      for (int g = 0; g < e.descriptor->hybrid->num_groups; ++g)
        members.push_back({e.descriptor->hybrid->groups[g].member, e.descriptor->hybrid->groups[g].create});
  for (const auto& m : members) out.push_back(&m);
  return out;
}

INSTANTIATE_TEST_SUITE_P(Registry, EveryLayout, testing::ValuesIn(entries()),
                         [](const testing::TestParamInfo<const VariantEntry*>& i) {
                           std::string n = i.param->descriptor->name;
                           for (char& c : n)
                             if (!std::isalnum(static_cast<unsigned char>(c))) c = '_';
                           return n;
                         });

}  // namespace
}  // namespace kvtest
