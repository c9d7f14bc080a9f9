// MLA variants (a model spec's `mla`): Cache::append_latent and gather_latent move each token's latent
// record whole. Every registered MLA variant with float storage, on each device: records come back as
// written, and where the layout is vLLM's MLA tensor ([page, slot, kv, head, dim]: per layer [pages,
// page_size, R + P]) each record sits in the pool where that formula, written here, puts it. The K/V
// path of the same variants is checked against the reference with every other variant (test_variants).
#include <gtest/gtest.h>

#include <cstring>
#include <optional>
#include <numeric>
#include <random>
#include <vector>

#include "support.hpp"

namespace kvtest {
namespace {

std::vector<Case> mla_cases() {
  std::vector<Case> out;
  for (const Case& c : all_cases())
    if (c.entry->descriptor->mla() && c.entry->descriptor->plain_values()) out.push_back(c);
  return out;
}

class Mla : public testing::TestWithParam<Case> {};

bool vllm_record_tensor(const VariantDescriptor& d) {
  const Axis want[] = {Axis::page, Axis::slot, Axis::kv, Axis::head, Axis::dim};
  return d.num_axes == 5 && std::equal(want, want + 5, d.axes);
}

TEST_P(Mla, RecordsComeBackWholeAndLieWhereVllmsTensorPutsThem) {
  const Case c = GetParam();
  KVTEST_REQUIRE_DEVICE(c.device);
  const VariantDescriptor& d = *c.entry->descriptor;
  // A record of odd width is stored with one zero after it: a token takes `stored` values.
  const int64_t width = d.mla_kv_lora_rank + d.mla_rope_dim, stored = width + width % 2;
  ASSERT_EQ(stored, 2 * d.head_dim);
  ASSERT_EQ(d.heads, 1);
  // Two pages and part of a third, scattered over a pool with room to spare, for any page size.
  const int64_t P = d.page_size, tokens = 2 * P + 3, pages = tokens / P + 2;
  const int64_t es = dtype_size(d.input);
  CacheConfig config;
  config.device = c.device, config.pages = pages;
  auto cache = registry().create(d.name, config);
  Arena arena(c.device);
  std::mt19937 rng(7);
  const std::vector<int64_t> slots = scattered_slots(pages * P, tokens, rng);
  const int layer = d.layers - 1;
  std::vector<unsigned char> records(size_t(tokens * width * es));
  for (int64_t i = 0; i < tokens * width; ++i) store_as(d.input, exact_value(uint64_t(i) + 99), &records[size_t(i * es)]);
  const TensorView latent{arena.put(records), d.input, c.device, {tokens, 1, width}, {width, width, 1}};
  cache->append_latent(layer, latent, TokenTargets::paged(arena.index(slots)));

  // Back through a page table that names the pool's pages in order: position s is slot s.
  std::vector<int32_t> table(static_cast<size_t>(pages));
  std::iota(table.begin(), table.end(), 0);
  const int64_t positions = pages * P;
  void* out = arena.zeros(positions * width * es);
  cache->gather_latent(layer, GatherRange{0, arena.index(table), 0, positions},
                       TensorView{out, d.input, c.device, {1, positions, width}, {positions * width, width, 1}});
  const std::vector<unsigned char> got = arena.fetch(out, positions * width * es);
  const std::vector<unsigned char> pool = held_bytes(*cache);
  const int64_t layer_elems = pages * P * stored;  // no layer axis: one tensor per layer, back to back
  for (int64_t t = 0; t < tokens; ++t) {
    const int64_t s = slots[size_t(t)];
    ASSERT_EQ(0, std::memcmp(&got[size_t(s * width * es)], &records[size_t(t * width * es)], size_t(width * es)))
        << "token " << t << " at slot " << s;
    if (vllm_record_tensor(d)) {
      const int64_t at = (layer * layer_elems + (s / P) * P * stored + (s % P) * stored) * es;
      ASSERT_EQ(0, std::memcmp(&pool[size_t(at)], &records[size_t(t * width * es)], size_t(width * es)))
          << "token " << t << " is not where vLLM's [blocks, block_size, " << stored << "] tensor holds it";
      for (int64_t i = width; i < stored; ++i)
        ASSERT_EQ(load_as(d.input, &pool[size_t(at + i * es)]), 0.0) << "token " << t << "'s pad";
    }
  }
}

TEST_P(Mla, RefusesARecordOfAnotherShapeOrDtypeNamingIt) {
  const Case c = GetParam();
  KVTEST_REQUIRE_DEVICE(c.device);
  const VariantDescriptor& d = *c.entry->descriptor;
  CacheConfig config;
  config.device = c.device, config.pages = 1;
  auto cache = registry().create(d.name, config);
  Arena arena(c.device);
  const int64_t width = 2 * d.head_dim;
  void* data = arena.zeros(4 * (width + 2) * 4);
  const TokenTargets targets = TokenTargets::paged(arena.index(std::vector<int64_t>{0, 1}));
  const std::vector<unsigned char> before = held_bytes(*cache);
  auto refused = [&](const TensorView& latent, const char* what) {
    try {
      cache->append_latent(0, latent, targets);
      ADD_FAILURE() << what << ": accepted";
    } catch (const ArgumentError& e) {
      EXPECT_EQ(e.argument(), "latent") << what << ": " << e.what();
    }
  };
  refused({data, d.input, c.device, {2, 1, width + 2}, {width + 2, width + 2, 1}}, "a wider record");
  refused({data, d.input, c.device, {2, 2, width}, {2 * width, width, 1}}, "two heads");
  refused({data, d.input == DType::f32 ? DType::f16 : DType::f32, c.device, {2, 1, width}, {width, width, 1}},
          "another dtype");
  EXPECT_EQ(held_bytes(*cache), before) << "a refused record changed the pool";
}

INSTANTIATE_TEST_SUITE_P(Registry, Mla, testing::ValuesIn(mla_cases()), case_name);

TEST(MlaRefusal, AKvVariantHasNoLatentRecord) {
  for (const auto& e : registry().variants()) {
    const VariantDescriptor& d = *e.descriptor;
    if (d.mla() || d.is_hybrid() || !d.paged()) continue;
    CacheConfig config;
    config.pages = 1;
    auto cache = registry().create(d.name, config);
    std::vector<float> data(size_t(2 * d.head_dim));
    const TensorView latent{data.data(), d.input, Device::cpu, {1, 1, 2 * d.head_dim}, {2 * d.head_dim, 2 * d.head_dim, 1}};
    const int64_t slot = 0;
    EXPECT_THROW(cache->append_latent(0, latent, TokenTargets::paged(IndexView::of(&slot, 1))), UnsupportedError);
    return;  // one K/V variant says it; every one shares the check
  }
  GTEST_SKIP() << "no paged K/V variant is registered";
}

// Two variants of one model each hold a StateRecord of their own: equal when their facts are.
bool same_record(const StateRecord* a, const StateRecord* b) {
  if (!a || !b) return a == b;
  if (a->model_layers != b->model_layers || a->num_linear != b->num_linear || a->num_parts != b->num_parts) return false;
  if (!std::equal(a->linear_layers, a->linear_layers + a->num_linear, b->linear_layers)) return false;
  for (int i = 0; i < a->num_parts; ++i) {
    const StatePartSpec &x = a->parts[i], &y = b->parts[i];
    if (std::strcmp(x.name, y.name) != 0 || x.rank != y.rank || x.dtype != y.dtype || !std::equal(x.shape, x.shape + x.rank, y.shape))
      return false;
  }
  return true;
}

// A combination no variant was generated for takes its layout from one registered variant and its model
// from another (Registry::synthesize, the generic path): every model fact must be the model's, never the
// layout's variant's. Each registered model against a layout of another model's variant.
TEST(Synthesized, EveryModelFactIsTheModelsAndAnMlaRecordRoundTrips) {
  auto same = [](const char* a, const char* b) { return (a == nullptr) == (b == nullptr) && (!a || std::strcmp(a, b) == 0); };
  int checked = 0, records = 0;
  for (const auto& m : registry().variants()) {
    const VariantDescriptor& model = *m.descriptor;
    if (model.is_hybrid()) continue;
    for (const auto& l : registry().variants()) {
      const VariantDescriptor& layout = *l.descriptor;
      if (layout.is_hybrid() || !layout.paged() || layout.lazy() || std::strcmp(layout.model, model.model) == 0) continue;
      const VariantQuery q{layout.layout, model.model, DType::f16, DType::f16, ""};
      if (!registry().select(q).empty()) continue;
      const std::optional<VariantDescriptor> d = registry().synthesize(q);
      ASSERT_TRUE(d) << layout.layout << " x " << model.model;
      EXPECT_EQ(d->tensor_parallel, model.tensor_parallel) << model.model;
      EXPECT_EQ(d->model_heads, model.model_heads) << model.model;
      EXPECT_TRUE(same(d->shard_of, model.shard_of)) << model.model;
      EXPECT_TRUE(same_record(d->states, model.states)) << model.model;
      EXPECT_EQ(d->mla_kv_lora_rank, model.mla_kv_lora_rank) << model.model;
      EXPECT_EQ(d->mla_rope_dim, model.mla_rope_dim) << model.model;
      ++checked;
      if (model.mla() && model.max_seq_len <= 4096 && records == 0) {  // a small MLA model's records, generic path
        CacheConfig config;
        config.pages = 2;
        auto cache = registry().create(q, config);
        ASSERT_TRUE(cache->descriptor().generic);
        const int64_t width = model.mla_kv_lora_rank + model.mla_rope_dim, tokens = 3;
        std::vector<uint16_t> in(size_t(tokens * width)), out(in.size());
        for (size_t i = 0; i < in.size(); ++i) store_as(DType::f16, exact_value(i), &in[i]);
        const std::vector<int64_t> slots{2, 0, 1};
        cache->append_latent(0, {in.data(), DType::f16, Device::cpu, {tokens, 1, width}, {width, width, 1}},
                             TokenTargets::paged(IndexView::of(slots.data(), tokens)));
        const std::vector<int32_t> pages{0, 1};
        cache->gather_latent(0, GatherRange{0, IndexView::of(pages.data(), 2), 0, tokens},
                             {out.data(), DType::f16, Device::cpu, {1, tokens, width}, {tokens * width, width, 1}});
        for (int64_t t = 0; t < tokens; ++t)
          ASSERT_EQ(0, std::memcmp(&out[size_t(slots[size_t(t)] * width)], &in[size_t(t * width)], size_t(width * 2)))
              << "token " << t << " at slot " << slots[size_t(t)];
        ++records;
      }
      break;  // one layout a model
    }
  }
  EXPECT_GT(checked, 0);
  if (records == 0) GTEST_SKIP() << "no small MLA model registered, so no record went through the generic path";
}

}  // namespace
}  // namespace kvtest
