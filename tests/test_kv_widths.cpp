// K and V of different widths (a model spec's `v_head_dim`): Cache::append_record and gather_record move
// each head's K (k_head_dim values) then V (v_head_dim) as one record. Every registered variant of such a
// model with float storage, on each device, paged or contiguous: K and V come back value for value at
// their logical coordinates (token, head, index), written and read here by plain loops; and where the
// layout keeps a head's halves adjacent ([page, slot, head, kv, dim]) each head's K then V sits in the
// pool where that formula, written here, puts it: per layer [pages, page_size, heads, k + v], which is
// also where record_view says it is.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <numeric>
#include <optional>
#include <random>
#include <vector>

#include "support.hpp"

namespace kvtest {
namespace {

// Variants that store K and V of other widths as values (a record format's bytes are the record tests').
std::vector<Case> width_cases() {
  std::vector<Case> out;
  for (const Case& c : all_cases()) {
    const VariantDescriptor& d = *c.entry->descriptor;
    if (d.split_widths() && !d.quantized() && !d.lazy() && !d.coded_records()) out.push_back(c);
  }
  return out;
}

class KvWidths : public testing::TestWithParam<Case> {};

bool head_records_whole(const VariantDescriptor& d) {
  const Axis want[] = {Axis::page, Axis::slot, Axis::head, Axis::kv, Axis::dim};
  return d.num_axes == 5 && std::equal(want, want + 5, d.axes);
}

TEST_P(KvWidths, KAndVComeBackAtTheirCoordinatesAndLieWholeInAHeadsRecord) {
  const Case c = GetParam();
  KVTEST_REQUIRE_DEVICE(c.device);
  const VariantDescriptor& d = *c.entry->descriptor;
  // A record of odd width is stored with one zero after it: a head takes `stored` values.
  const int64_t K = d.k_head_dim, V = d.v_head_dim, H = d.heads, width = K + V, stored = width + width % 2;
  ASSERT_NE(K, V);
  ASSERT_EQ(stored, 2 * d.head_dim);
  const int64_t es = dtype_size(d.input);
  const int layer = d.layers - 1;
  CacheConfig config;
  config.device = c.device;
  int64_t tokens = 0, positions = 0;
  std::vector<int64_t> slots;  // paged: token t's slot; contiguous: position t of row 1
  std::mt19937 rng(11);
  if (d.paged()) {
    const int64_t P = d.page_size, pages = 3;
    tokens = 2 * P + 3 <= pages * P ? 2 * P + 3 : pages * P;
    config.pages = pages;
    slots = scattered_slots(pages * P, tokens, rng);
    positions = pages * P;
  } else {
    config.rows = 2;
    tokens = positions = std::min<int64_t>(d.max_seq_len, 19);
  }
  auto cache = registry().create(d.name, config);
  Arena arena(c.device);
  // value(t, h, i): i < K is K's value i of head h, else V's value i - K.
  auto value = [&](int64_t t, int64_t h, int64_t i) { return exact_value(uint64_t((t * H + h) * width + i) + 5); };
  std::vector<unsigned char> records(size_t(tokens * H * width * es));
  for (int64_t t = 0; t < tokens; ++t)
    for (int64_t h = 0; h < H; ++h)
      for (int64_t i = 0; i < width; ++i) store_as(d.input, value(t, h, i), &records[size_t(((t * H + h) * width + i) * es)]);
  const TensorView record{arena.put(records), d.input, c.device, {tokens, H, width}, {H * width, width, 1}};
  std::vector<int32_t> rows(static_cast<size_t>(tokens), 1), at(static_cast<size_t>(tokens));
  std::iota(at.begin(), at.end(), 0);
  cache->append_record(layer, record, d.paged() ? TokenTargets::paged(arena.index(slots))
                                                : TokenTargets::row_positions(arena.index(rows), arena.index(at)));

  std::vector<int32_t> table(size_t(config.pages));
  std::iota(table.begin(), table.end(), 0);  // position s is slot s
  void* out = arena.zeros(H * positions * width * es);
  const GatherRange range = d.paged() ? GatherRange{0, arena.index(table), 0, positions} : GatherRange{1, {}, 0, positions};
  cache->gather_record(layer, range, TensorView{out, d.input, c.device, {H, positions, width}, {positions * width, width, 1}});
  const std::vector<unsigned char> got = arena.fetch(out, H * positions * width * es);
  const std::vector<unsigned char> pool = held_bytes(*cache);
  for (int64_t t = 0; t < tokens; ++t) {
    const int64_t p = d.paged() ? slots[size_t(t)] : t;
    for (int64_t h = 0; h < H; ++h) {
      for (int64_t i = 0; i < width; ++i)
        ASSERT_EQ(load_as(d.input, &got[size_t(((h * positions + p) * width + i) * es)]), value(t, h, i))
            << (i < K ? "K" : "V") << " value " << (i < K ? i : i - K) << " of head " << h << ", token " << t;
      if (head_records_whole(d)) {
        const int64_t layer_elems = config.pages * d.page_size * H * stored;  // one tensor per layer, back to back
        const int64_t offset = (layer * layer_elems + (p * H + h) * stored) * es;
        ASSERT_EQ(0, std::memcmp(&pool[size_t(offset)], &records[size_t((t * H + h) * width * es)], size_t(width * es)))
            << "head " << h << " of token " << t << " is not where [pages, page_size, heads, k + v] holds it";
        for (int64_t i = width; i < stored; ++i)
          ASSERT_EQ(load_as(d.input, &pool[size_t(offset + i * es)]), 0.0) << "head " << h << " of token " << t << "'s pad";
      }
    }
  }
  // Where that formula holds, record_view names its memory: the layer's tensor, K then V a head; where
  // the layout puts K's and V's halves apart, there is no record to view.
  const std::optional<RecordView> r = record_view(*cache, layer);
  ASSERT_EQ(r.has_value(), head_records_whole(d));
  if (r) {
    const int64_t layer_elems = config.pages * d.page_size * H * stored;
    EXPECT_EQ(r->record, static_cast<const char*>(cache->storage()) + layer * layer_elems * es);
    EXPECT_EQ(r->second, static_cast<const char*>(r->record) + K * es);
    EXPECT_EQ(r->strides.row_or_page, d.page_size * H * stored);
    EXPECT_EQ(r->strides.seq_or_slot, H * stored);
    EXPECT_EQ(r->strides.head, stored);
    EXPECT_EQ((std::vector<int64_t>{r->rows_or_pages, r->seq_or_slots, r->heads, r->first_width, r->second_width}),
              (std::vector<int64_t>{config.pages, d.page_size, H, K, V}));
  }
}

TEST_P(KvWidths, RefusesARecordOfAnotherWidthNamingIt) {
  const Case c = GetParam();
  KVTEST_REQUIRE_DEVICE(c.device);
  const VariantDescriptor& d = *c.entry->descriptor;
  CacheConfig config;
  config.device = c.device;
  if (d.paged()) config.pages = 1; else config.rows = 1;
  auto cache = registry().create(d.name, config);
  Arena arena(c.device);
  const int64_t width = 2 * d.head_dim, H = d.heads;
  void* data = arena.zeros(2 * H * (width + d.k_head_dim) * 4);
  const TokenTargets targets = d.paged() ? TokenTargets::paged(arena.index(std::vector<int64_t>{0, 1}))
                                         : TokenTargets::row_positions(arena.index(std::vector<int32_t>{0, 0}),
                                                                       arena.index(std::vector<int32_t>{0, 1}));
  const std::vector<unsigned char> before = held_bytes(*cache);
  // K and V of the model's K width each (the symmetric shape a caller might assume), unless that is a
  // width the record takes (K 12, V 11 is stored as 24).
  const int64_t wrong = 2 * d.k_head_dim == 2 * d.head_dim ? 2 * d.k_head_dim + 2 : 2 * d.k_head_dim;
  try {
    cache->append_record(0, {data, d.input, c.device, {2, H, wrong}, {H * wrong, wrong, 1}}, targets);
    ADD_FAILURE() << "a record of " << wrong << " values was accepted";
  } catch (const ShapeError& e) {
    EXPECT_EQ(e.argument(), "record") << e.what();
    EXPECT_NE(std::string(e.what()).find(std::to_string(d.k_head_dim) + " + " + std::to_string(d.v_head_dim)),
              std::string::npos) << e.what();
  }
  EXPECT_THROW(cache->append_latent(0, {data, d.input, c.device, {2, 1, width}, {width, width, 1}}, targets),
               UnsupportedError);
  EXPECT_EQ(held_bytes(*cache), before) << "a refused record changed the pool";
}

INSTANTIATE_TEST_SUITE_P(Registry, KvWidths, testing::ValuesIn(width_cases()), case_name);
GTEST_ALLOW_UNINSTANTIATED_PARAMETERIZED_TEST(KvWidths);

}  // namespace
}  // namespace kvtest
