// Every registered variant, on every device kind, against the reference of reference.hpp: randomized
// ragged batches that mix prefill and decode with padding, over several seeds; then reorder or
// copy_blocks, reset_row and reset; what a token costs; and tunings that change no result.
#include "variant_driver.hpp"

namespace kvtest {
namespace {

class EveryVariant : public testing::TestWithParam<Case> {};

TEST_P(EveryVariant, RandomTrafficMatchesReference) {
  KVTEST_REQUIRE_DEVICE(GetParam().device);
  for (uint32_t seed : test_seeds({1u, 2u, 3u})) {
    SCOPED_TRACE("seed " + std::to_string(seed));
    Driver drv(*GetParam().entry, GetParam().device, seed);
    const int steps = drv.ref_.window && drv.d_.window <= 64 ? 12 : 6;
    for (int i = 0; i < steps; ++i) {
      drv.step(i);
      drv.verify("after step " + std::to_string(i));
      if (testing::Test::HasFailure()) return;
    }
    drv.verify_storage();
  }
}

TEST_P(EveryVariant, ReorderOrCopyBlocksThenResets) {
  KVTEST_REQUIRE_DEVICE(GetParam().device);
  Driver drv(*GetParam().entry, GetParam().device, 11);
  for (int i = 0; i < 3; ++i) drv.step(i);
  if (drv.d_.paged()) {
    drv.copy_blocks();
    drv.verify("after copy_blocks");
  } else {
    drv.reorder();
    drv.verify("after reorder");
    drv.reset_row(1);
    drv.verify("after reset_row");
    drv.step(3);
    drv.verify("after a step past reset_row");
  }
  drv.reset();
  drv.verify("after reset");
  drv.step(0);
  drv.verify("after a step past reset");
}

// What the listing says a token costs is what the pool holds per token of capacity.
TEST_P(EveryVariant, BytesPerTokenMatchesAllocation) {
  KVTEST_REQUIRE_DEVICE(GetParam().device);
  const VariantDescriptor& d = *GetParam().entry->descriptor;
  Driver drv(*GetParam().entry, GetParam().device, 1);
  const CacheConfig& c = drv.cache_->config();
  const int64_t tokens = d.paged() ? c.pages * d.page_size
                                   : c.rows * (d.addressing == Addressing::ring ? d.window : c.max_seq_len);
  const int64_t scales_per_token = d.quant == Quant::per_group        ? int64_t(d.heads) * (d.head_dim / d.quant_group)
                                   : d.quant == Quant::per_token_head ? d.heads
                                   : d.quant == Quant::per_token      ? 1
                                                                      : 0;
  // A per_tensor scale is a fixed cost per layer, not per token; so is a tensor-scaled layout's second
  // level, fp32 after its group scales, which are padded to a whole fp32.
  const int64_t group_scale_bytes = tokens * 2 * d.layers * scales_per_token * dtype_size(d.scale);
  const int64_t tensor_scales = d.quant == Quant::per_tensor ? int64_t(2) * d.layers * dtype_size(d.scale)
                                : d.tensor_scaled ? (-group_scale_bytes & 3) + int64_t(2) * d.layers * 4
                                                  : 0;
  EXPECT_EQ(drv.cache_->memory().storage_bytes, tokens * d.bytes_per_token + tensor_scales);
  // Stored elements of a head's row: half a record's bytes and its page-end scales where a token is coded
  // whole (part_record_reference.hpp's own sums), else its values' elements.
  const int64_t row = d.coded_records() ? (ref_place(*d.record_format).record_bytes + ref_place(*d.record_format).tail_bytes) / 2
                                        : d.head_dim / dtype_values(d.storage);
  EXPECT_EQ(d.bytes_per_token, int64_t(2) * d.layers * d.heads * row * dtype_size(d.storage) +
                                   int64_t(2) * d.layers * scales_per_token * dtype_size(d.scale));
  // Runtime overhead: lazy staging is exactly max_staged_tokens input tokens plus their targets per
  // layer; bookkeeping is a length per row and the status word, and on CUDA a row layout's reorder
  // scratch from creation (a captured reorder must not allocate): one layer of rows and their lengths.
  const MemoryReport m = drv.cache_->memory();
  const int64_t target_bytes = 8;  // an int64 slot, or an int32 row and an int32 position
  const int64_t staged = d.update == UpdateMode::lazy ? c.max_staged_tokens * d.layers : 0;
  EXPECT_EQ(m.staging_bytes, staged * (2 * d.heads * d.head_dim * dtype_size(d.input) + target_bytes));
  const int64_t reorder_scratch =
      !d.paged() && GetParam().device == Device::cuda ? tokens * d.bytes_per_token / d.layers + c.rows * 4 : 0;
  EXPECT_LE(m.bookkeeping_bytes, (d.paged() ? 0 : c.rows * 4) + 64 + reorder_scratch);
}

INSTANTIATE_TEST_SUITE_P(Registry, EveryVariant, testing::ValuesIn(all_cases()), case_name);

// Launch parameters change how work is split, never what is written: the same traffic under extreme
// tunings leaves byte-identical storage.
TEST_P(EveryVariant, TuningChangesNoResult) {
  KVTEST_REQUIRE_DEVICE(GetParam().device);
  const VariantDescriptor& d = *GetParam().entry->descriptor;
  if (d.bytes_per_token > 4096)
    GTEST_SKIP() << "checked on small variants only (at most 4 KiB a token), to keep the suite short";
  Driver plain(*GetParam().entry, GetParam().device, 9), tuned(*GetParam().entry, GetParam().device, 9);
  Tuning t;
  t.cpu_parallel_bytes = 0;  // every operation parallel, in chunks of one item
  t.cpu_chunk_items = 1;
  t.cuda_block_threads = 64;
  t.cuda_items_per_thread = 3;  // a grid a third of the items, each thread group taking 3 a grid apart
  tuned.cache_->set_tuning(t);
  EXPECT_EQ(tuned.cache_->tuning().cpu_chunk_items, 1);
  for (int i = 0; i < 4; ++i) {
    plain.step(i);
    tuned.step(i);
  }
  const int64_t bytes = plain.cache_->geometry().total_elems * dtype_size(d.storage);
  EXPECT_TRUE(plain.arena_.fetch(plain.cache_->storage(), bytes) == tuned.arena_.fetch(tuned.cache_->storage(), bytes));
  // A refused tuning names its field (OutOfRangeError derives from ArgumentError) and changes nothing.
  auto expect_refused = [&](Tuning bad, const char* field) {
    try {
      tuned.cache_->set_tuning(bad);
      ADD_FAILURE() << field << " was accepted";
    } catch (const ArgumentError& e) {
      EXPECT_EQ(e.argument(), field);
    }
    EXPECT_EQ(tuned.cache_->tuning().cuda_block_threads, 64);
    EXPECT_EQ(tuned.cache_->tuning().cuda_items_per_thread, 3);
  };
  Tuning bad = t;
  bad.cuda_block_threads = 100;  // not a whole number of warps
  expect_refused(bad, "tuning.cuda_block_threads");
  bad = t;
  bad.cuda_items_per_thread = 0;
  expect_refused(bad, "tuning.cuda_items_per_thread");
}

}  // namespace
}  // namespace kvtest
