// DeepSeek-V3.2's fp8 index keys (`indexer_fp8`, vllm_indexer.yaml's record format), held to an encoder written
// from vLLM's indexer_k_quant_and_cache (indexer_reference.hpp):
//   - the codec's one-lane form gives its bytes for keys at every scale edge (ref_index_edge_keys), and
//     its one-lane and lane-split decodes read them back as the encoder's values (test_quant_lanes.cpp
//     codes them on a warp's emulated lanes);
//   - every indexer_fp8 variant, on each device, puts each appended key's codes and scale where vLLM's
//     formula puts them in its page, and leaves every other byte of the pool as it was;
//   - beside FlashMLA's fp8 records in pages of 64 (DeepSeek-V3.2 as vLLM serves it), one page table
//     names both: a PairedCache's pages pack, unpack and copy the two caches' bytes together.
// The registry tests (test_variants, test_sequences) hold the same keys through every other operation.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "indexer_reference.hpp"
#include "record_traits.hpp"
#include "kvforge/paired_cache.hpp"
#include "support.hpp"

namespace kvtest {
namespace {

TEST(IndexerRecord, EveryFormGivesVllmsBytesAtEachScaleEdgeAndReadsThemBack) {
  using Key = kvforge::detail::PartRecord<IndexKeyTraits<256>>;
  for (const std::vector<float>& x : ref_index_edge_keys()) {
    const RefRecord want = ref_index_key(x, DType::f32);
    const float *k = x.data(), *v = x.data() + Key::D;
    std::vector<uint8_t> codes(256, 0xee), scales(8, 0xee);
    Key::encode_whole(k, v, codes.data(), codes.data() + Key::kSplit, scales.data());
    const std::vector<uint8_t> want_codes(want.bytes.begin(), want.bytes.begin() + 256);
    const std::vector<uint8_t> want_scales(want.bytes.begin() + 256, want.bytes.end());
    ASSERT_EQ(codes, want_codes) << "amax " << x[0];
    ASSERT_EQ(scales, want_scales) << "amax " << x[0];
    std::vector<float> whole(256, -1.0f), lanes(256, -1.0f);
    Key::decode_whole(codes.data(), codes.data() + Key::kSplit, scales.data(), whole.data(), whole.data() + Key::D);
    for (int lane = 0; lane < 32; ++lane)
      Key::decode(codes.data(), codes.data() + Key::kSplit, scales.data(), lanes.data(), lanes.data() + Key::D, lane, 32);
    ASSERT_EQ(whole, want.gathered);
    ASSERT_EQ(lanes, want.gathered);
  }
  // The floor: an all-zero key's scale is 2^-22, the smallest power of two >= 1e-4 / 448.
  const RefRecord zero = ref_index_key(std::vector<float>(128, 0.0f), DType::f32);
  float s;
  std::memcpy(&s, zero.bytes.data() + 128, 4);
  EXPECT_EQ(s, std::ldexp(1.0f, -22));
}

std::vector<Case> indexer_cases() {
  std::vector<Case> out;
  for (const Case& c : all_cases())
    if (c.entry->descriptor->page_end_scales()) out.push_back(c);
  return out;
}

class IndexerPages : public testing::TestWithParam<Case> {};

TEST_P(IndexerPages, KeysLieWhereVllmsFormulaPutsThemAndNothingElseIsWritten) {
  const Case c = GetParam();
  KVTEST_REQUIRE_DEVICE(c.device);
  const VariantDescriptor& d = *c.entry->descriptor;
  // Part of a second page, scattered over a pool with room to spare, for any page size.
  const int64_t W = 2 * d.head_dim, P = d.page_size, key_bytes = W + W / 32, tokens = P + 5, pages = tokens / P + 2;
  CacheConfig config;
  config.device = c.device, config.pages = pages;
  auto cache = registry().create(d.name, config);
  Arena arena(c.device);
  std::mt19937 rng(17);
  const std::vector<int64_t> slots = scattered_slots(pages * P, tokens, rng);
  std::vector<std::vector<float>> keys(static_cast<size_t>(tokens), std::vector<float>(static_cast<size_t>(W)));
  const int64_t es = dtype_size(d.input);
  std::vector<unsigned char> k(size_t(tokens * W / 2 * es)), v(k.size());
  for (int64_t t = 0; t < tokens; ++t)
    for (int64_t i = 0; i < W; ++i) {
      const float x = exact_value(uint64_t(t * W + i) + 3) * std::ldexp(1.0f, int(t % 7) * 3 - 9);
      keys[size_t(t)][size_t(i)] = x;
      store_as(d.input, x, &(i < W / 2 ? k : v)[size_t((t * W / 2 + i % (W / 2)) * es)]);
    }
  const int layer = d.layers - 1;
  cache->append(layer, {arena.put(k), d.input, c.device, {tokens, 1, W / 2}, {W / 2, W / 2, 1}},
                {arena.put(v), d.input, c.device, {tokens, 1, W / 2}, {W / 2, W / 2, 1}},
                TokenTargets::paged(arena.index(slots)));
  cache->synchronize();
  // No layer axis: each layer is a tensor [pages, P * key_bytes] of its own, back to back.
  const std::vector<unsigned char> pool = held_bytes(*cache);
  ASSERT_EQ(int64_t(pool.size()), d.layers * pages * P * key_bytes);
  std::vector<bool> written(pool.size(), false);
  for (int64_t t = 0; t < tokens; ++t) {
    const RefRecord want = ref_index_key(keys[size_t(t)], d.input);
    const int64_t page = slots[size_t(t)] / P, slot = slots[size_t(t)] % P;
    for (int64_t j = 0; j < key_bytes; ++j) {
      const int64_t at = (layer * pages + page) * P * key_bytes + ref_index_key_byte(P, W, slot, j);
      ASSERT_EQ(pool[size_t(at)], want.bytes[size_t(j)]) << "token " << t << " byte " << j;
      written[size_t(at)] = true;
    }
  }
  for (size_t i = 0; i < pool.size(); ++i) {
    if (!written[i]) {
      ASSERT_EQ(pool[i], 0) << "byte " << i << " of no key was written";
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Registry, IndexerPages, testing::ValuesIn(indexer_cases()), case_name);

// DeepSeek-V3.2 as vLLM serves it: FlashMLA's fp8 records and the fp8 index keys in pages of 64 that one
// page table names. A page of the pair packs as the record page, then the key page; unpacked elsewhere
// and copied, both caches' bytes move.
TEST(IndexerPages, PairWithFlashMlasPagesAndMoveWithThem) {
  const VariantDescriptor *main = nullptr, *keys = nullptr;
  for (const auto& e : registry().variants()) {
    const VariantDescriptor& d = *e.descriptor;
    const std::string format = d.coded_records() ? d.record_format->name : "";
    if (format == "flashmla_fp8" && d.page_size == 64 && (!main || d.layers < main->layers)) main = &d;
    if (format == "indexer_fp8" && d.page_size == 64 && (!keys || d.layers < keys->layers)) keys = &d;
  }
  if (!main || !keys) GTEST_SKIP() << "this build has no FlashMLA record variant or index key variant of pages of 64";
  CacheConfig config;
  config.pages = 4;
  PairedCache pair(registry().create(main->name, config), registry().create(keys->name, config));
  const int64_t W = 2 * keys->head_dim, R = 2 * main->head_dim;
  std::vector<float> latent(static_cast<size_t>(R)), key(static_cast<size_t>(W));
  for (int64_t i = 0; i < R; ++i) latent[size_t(i)] = exact_value(uint64_t(i) + 40);
  for (int64_t i = 0; i < W; ++i) key[size_t(i)] = exact_value(uint64_t(i) + 90);
  std::vector<unsigned char> lin(size_t(R) * dtype_size(main->input)), kin(size_t(W) * dtype_size(keys->input));
  for (int64_t i = 0; i < R; ++i) store_as(main->input, latent[size_t(i)], &lin[size_t(i * dtype_size(main->input))]);
  for (int64_t i = 0; i < W; ++i) store_as(keys->input, key[size_t(i)], &kin[size_t(i * dtype_size(keys->input))]);
  const int64_t slot = 64 + 5;  // page 1
  pair.main().append_latent(0, {lin.data(), main->input, Device::cpu, {1, 1, R}, {R, R, 1}},
                            TokenTargets::paged(IndexView::of(&slot, 1)));
  const int64_t ke = dtype_size(keys->input);
  pair.companion().append(0, {kin.data(), keys->input, Device::cpu, {1, 1, W / 2}, {W, W / 2, 1}},
                          {kin.data() + W / 2 * ke, keys->input, Device::cpu, {1, 1, W / 2}, {W, W / 2, 1}},
                          TokenTargets::paged(IndexView::of(&slot, 1)));
  // Page 1 packed, unpacked into page 3; then page 3 copied to page 0.
  std::vector<unsigned char> packed(size_t(pair.packed_page_bytes()));
  const int32_t one = 1, three = 3;
  pair.pack_pages(IndexView::of(&one, 1), packed.data());
  pair.unpack_pages(packed.data(), IndexView::of(&three, 1));
  const int32_t pairs[2] = {3, 0};
  pair.copy_blocks(IndexView::of(pairs, 2));
  const RefRecord want = ref_index_key(key, keys->input);
  for (int64_t page : {1, 3, 0}) {
    std::vector<unsigned char> out(size_t(W * ke));
    const int32_t table = int32_t(page);
    pair.companion().gather(0, GatherRange{0, IndexView::of(&table, 1), 5, 6},
                            {out.data(), keys->input, Device::cpu, {1, 1, W / 2}, {W / 2, W / 2, 1}},
                            {out.data() + W / 2 * ke, keys->input, Device::cpu, {1, 1, W / 2}, {W / 2, W / 2, 1}});
    for (int64_t i = 0; i < W; ++i)
      ASSERT_EQ(load_as(keys->input, &out[size_t(i * ke)]), want.gathered[size_t(i)]) << "page " << page << " value " << i;
    std::vector<unsigned char> record(size_t(R) * dtype_size(main->input));
    pair.main().gather_latent(0, GatherRange{0, IndexView::of(&table, 1), 5, 6},
                              {record.data(), main->input, Device::cpu, {1, 1, R}, {R, R, 1}});
    const RefRecord mla = ref_flashmla_record(latent, main->mla_kv_lora_rank, main->mla_rope_dim, main->input);
    for (int64_t i = 0; i < R; ++i)
      ASSERT_EQ(load_as(main->input, &record[size_t(i * dtype_size(main->input))]), mla.gathered[size_t(i)])
          << "page " << page << " latent value " << i;
  }
}

}  // namespace
}  // namespace kvtest
