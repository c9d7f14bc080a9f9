// FlashMLA's fp8 records as a cache's storage (`flashmla_fp8`): every such variant, on each device,
// stores each appended latent as the record that an encoder written here from FlashMLA's description
// makes of it (flashmla_reference.hpp), byte for byte, at the place of FlashMLA's [pages, page_size, 1,
// record] tensor where the layout is that tensor; and gathers it back as that encoder's reading of it.
// The registry tests (test_variants, test_memory) hold the same records to the same encoder through
// every other operation.
#include <gtest/gtest.h>

#include <cstring>
#include <numeric>
#include <random>
#include <vector>

#include "flashmla_reference.hpp"
#include "support.hpp"

namespace kvtest {
namespace {

std::vector<Case> flashmla_cases() {
  std::vector<Case> out;
  for (const Case& c : all_cases())
    if (c.entry->descriptor->coded_records() && std::string(c.entry->descriptor->record_format->name) == "flashmla_fp8")
      out.push_back(c);
  return out;
}

class FlashMla : public testing::TestWithParam<Case> {};

TEST_P(FlashMla, RecordsAreByteExactWhereFlashMlasTensorPutsThemAndReadBack) {
  const Case c = GetParam();
  KVTEST_REQUIRE_DEVICE(c.device);
  const VariantDescriptor& d = *c.entry->descriptor;
  const int L = d.mla_kv_lora_rank, R = d.mla_rope_dim;
  const int64_t width = L + R, record = ref_record_bytes(L, R), P = d.page_size;
  const int64_t tokens = 2 * P + 3, pages = tokens / P + 2, es = dtype_size(d.input);
  CacheConfig config;
  config.device = c.device, config.pages = pages;
  auto cache = registry().create(d.name, config);
  Arena arena(c.device);
  std::mt19937 rng(11);
  const std::vector<int64_t> slots = scattered_slots(pages * P, tokens, rng);
  // Tokens of very different magnitudes (powers of two apart, so every value stays exact in the input
  // dtype), an all-zero token, and tiles of one token at different scales.
  std::vector<std::vector<float>> latents(size_t(tokens), std::vector<float>(static_cast<size_t>(width)));
  std::vector<unsigned char> input(size_t(tokens * width * es));
  for (int64_t t = 0; t < tokens; ++t)
    for (int64_t i = 0; i < width; ++i) {
      const float spread = t == 1 ? 0.0f : std::ldexp(1.0f, int(t % 5) * 4 - 10 + int(i / 128));
      const float x = exact_value(uint64_t(t * width + i) + 5) * spread;
      latents[size_t(t)][size_t(i)] = x;
      store_as(d.input, x, &input[size_t((t * width + i) * es)]);
    }
  const int layer = d.layers - 1;
  cache->append_latent(layer, TensorView{arena.put(input), d.input, c.device, {tokens, 1, width}, {width, width, 1}},
                       TokenTargets::paged(arena.index(slots)));

  std::vector<int32_t> table(static_cast<size_t>(pages));
  std::iota(table.begin(), table.end(), 0);
  const int64_t positions = pages * P;
  void* out = arena.zeros(positions * width * es);
  cache->gather_latent(layer, GatherRange{0, arena.index(table), 0, positions},
                       TensorView{out, d.input, c.device, {1, positions, width}, {positions * width, width, 1}});
  const std::vector<unsigned char> got = arena.fetch(out, positions * width * es);
  const std::vector<unsigned char> pool = held_bytes(*cache);
  const Axis flashmla_tensor[] = {Axis::page, Axis::slot, Axis::kv, Axis::head, Axis::dim};
  const bool is_flashmla_tensor = d.num_axes == 5 && std::equal(flashmla_tensor, flashmla_tensor + 5, d.axes);
  for (int64_t t = 0; t < tokens; ++t) {
    const RefRecord want = ref_flashmla_record(latents[size_t(t)], L, R, d.input);
    const int64_t s = slots[size_t(t)];
    if (is_flashmla_tensor) {  // no layer axis: one [pages, P, 1, record] tensor per layer, back to back
      const int64_t at = layer * pages * P * record + s * record;
      ASSERT_EQ(0, std::memcmp(&pool[size_t(at)], want.bytes.data(), size_t(record)))
          << "token " << t << " at slot " << s << " is not FlashMLA's record where its tensor holds it";
    }
    for (int64_t i = 0; i < width; ++i)
      ASSERT_EQ(load_as(d.input, &got[size_t((s * width + i) * es)]), want.gathered[size_t(i)])
          << "token " << t << " value " << i;
  }
  if (is_flashmla_tensor) {  // the record view is FlashMLA's tensor: this layer's memory, record bytes wide
    const std::optional<RecordView> view = record_view(*cache, layer);
    ASSERT_TRUE(view.has_value());
    EXPECT_EQ(view->first_width + view->second_width, record);
    EXPECT_EQ(view->strides.seq_or_slot, record);
  }
}

INSTANTIATE_TEST_SUITE_P(Registry, FlashMla, testing::ValuesIn(flashmla_cases()), case_name);
GTEST_ALLOW_UNINSTANTIATED_PARAMETERIZED_TEST(FlashMla);

}  // namespace
}  // namespace kvtest
