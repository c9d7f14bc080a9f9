// The registry's other paths against the same driver: lazy variants against their eager twins, the
// generic runtime-strided path against the reference, a shape that was not generated, and the one
// grammar of names.
#include "variant_driver.hpp"

namespace kvtest {
namespace {

// Lazy variants against their eager twin (same model, dtypes, addressing and axes): the same traffic
// must leave byte-identical storage once committed.
class EveryLazyVariant : public testing::TestWithParam<Case> {};

TEST_P(EveryLazyVariant, EqualsEagerTwinAfterCommit) {
  const VariantDescriptor& d = *GetParam().entry->descriptor;
  KVTEST_REQUIRE_DEVICE(GetParam().device);
  const VariantEntry* twin = nullptr;
  for (const auto& e : registry().variants()) {
    const VariantDescriptor& o = *e.descriptor;
    if (o.update == UpdateMode::eager && std::string(o.model) == d.model && o.storage == d.storage &&
        o.input == d.input && o.quant == d.quant && o.scale == d.scale && o.scale_placement == d.scale_placement &&
        o.addressing == d.addressing && o.num_axes == d.num_axes &&
        std::equal(o.axes, o.axes + o.num_axes, d.axes) && o.page_size == d.page_size && o.window == d.window)
      twin = &e;
  }
  if (!twin) GTEST_SKIP() << "no eager variant with " << d.name << "'s model, dtypes and axes is registered";
  Driver lazy(*GetParam().entry, GetParam().device, 5), eager(*twin, GetParam().device, 5);
  for (int i = 0; i < 4; ++i) {
    lazy.step(i);
    eager.step(i);
  }
  ASSERT_EQ(lazy.cache_->memory().storage_bytes, eager.cache_->memory().storage_bytes);
  EXPECT_TRUE(held_bytes(*lazy.cache_) == held_bytes(*eager.cache_));
}

// The generic runtime-strided path, serving each generated variant's descriptor, meets the same
// reference: it is a real fallback, not only a benchmark baseline.
class EveryGenericTwin : public testing::TestWithParam<Case> {};

TEST_P(EveryGenericTwin, RandomTrafficMatchesReference) {
  const VariantDescriptor& d = *GetParam().entry->descriptor;
  twin_traffic_matches_reference(d, [&d](const CacheConfig& c) { return make_generic_cache(d, c); }, {1u, 2u}, "generic");
}

INSTANTIATE_TEST_SUITE_P(Registry, EveryGenericTwin, testing::ValuesIn(generic_cases()), case_name);

// A combination that was not generated, but whose layout and model are, is served by the generic path
// and says so through its descriptor.
TEST(GenericFallback, ServesAShapeThatWasNotGeneratedAndRefusesWhatItCannot) {
  ASSERT_EQ(registry().find("vllm_paged_nhd.qwen2_5_0_5b.fp32"), nullptr) << "the test needs a name that is not generated";
  auto query = [](const char* layout, const char* model, DType storage) {
    VariantQuery q;
    q.layout = layout;
    q.model = model;
    q.storage = storage;
    return q;
  };
  CacheConfig cfg;
  cfg.pages = 4;
  auto cache = registry().create(query("vllm_paged_nhd", "qwen2_5_0_5b", DType::f32), cfg);
  const VariantDescriptor& d = cache->descriptor();
  EXPECT_TRUE(d.generic);
  EXPECT_EQ(std::string(d.name), "vllm_paged_nhd.qwen2_5_0_5b.fp32");
  EXPECT_EQ(d.storage, DType::f32);
  const VariantDescriptor& qwen = *registry().at("vllm_paged_nhd.qwen2_5_0_5b.bf16").descriptor;
  EXPECT_EQ(d.layers, qwen.layers);
  EXPECT_EQ(d.heads * d.head_dim, qwen.heads * qwen.head_dim);
  EXPECT_EQ(d.bytes_per_token, 2 * qwen.bytes_per_token) << "fp32 stores twice bf16's bytes";
  // Each refusal names the query, input dtype included, and why the generic path could not serve it.
  auto refusal = [&](VariantQuery q) -> std::string {
    try {
      registry().create(q, cfg);
    } catch (const UnknownVariantError& e) {
      return e.what();
    }
    return "served";
  };
  auto has = [](const std::string& text, const char* part) { return text.find(part) != std::string::npos; };
  const std::string ring = refusal(query("jetstream_ring", "qwen2_5_0_5b", DType::bf16));
  EXPECT_TRUE(has(ring, "jetstream_ring.qwen2_5_0_5b.bf16") && has(ring, "a ring's window may follow the model")) << ring;
  const std::string lazy = refusal(query("jetstream_stacked_lazy", "qwen2_5_0_5b", DType::f32));
  EXPECT_TRUE(has(lazy, "lazy staging needs a generated variant")) << lazy;
  const std::string unknown = refusal(query("vllm_paged_nhd", "nosuchmodel", DType::bf16));
  EXPECT_TRUE(has(unknown, "no registered variant has model 'nosuchmodel'")) << unknown;
  VariantQuery quantized = query("vllm_paged_nhd", "qwen2_5_0_5b", DType::i8);
  quantized.input = DType::bf16;
  const std::string codes = refusal(quantized);
  EXPECT_TRUE(has(codes, "'vllm_paged_nhd.qwen2_5_0_5b.int8_in_bf16") && has(codes, "quantized storage")) << codes;
  EXPECT_THROW(registry().create("vllm_paged_nhd.qwen2_5_0_5b.fp32", cfg), UnknownVariantError)
      << "a name is looked up, never parsed: only registered names resolve";
}

// One spelling of names: the runtime forms every registered name exactly as codegen did.
TEST(Registry, NamesFollowOneGrammar) {
  for (const auto& e : registry().variants()) {
    const VariantDescriptor& d = *e.descriptor;
    EXPECT_EQ(variant_name(d.layout, d.model, d.storage_name(), d.input), d.name);
  }
}

std::vector<Case> lazy_cases() {
  std::vector<Case> out;
  for (const Case& c : all_cases())
    if (c.entry->descriptor->update == UpdateMode::lazy) out.push_back(c);
  return out;
}
INSTANTIATE_TEST_SUITE_P(Registry, EveryLazyVariant, testing::ValuesIn(lazy_cases()), case_name);

}  // namespace
}  // namespace kvtest
