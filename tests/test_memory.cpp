// The memory-management layer: the block allocator's contract, the batch metadata against arrays
// built here from page lists, memory planning, and the model-based randomized test of the sequence
// manager over every paged tiny variant (see sequence_model.hpp).
#include "sequence_model.hpp"

namespace kvtest {
namespace {

TEST(BlockAllocator, AllocatesAllOrNothingAndCountsReferences) {
  BlockAllocator a(4);
  EXPECT_EQ(a.free_count(), 4);
  const auto two = a.allocate(2);
  ASSERT_EQ(two.size(), 2u);
  EXPECT_NE(two[0], two[1]);
  EXPECT_THROW(a.allocate(3), CapacityError);
  EXPECT_EQ(a.free_count(), 2) << "a refused allocation takes nothing";
  a.retain(two[0]);
  EXPECT_EQ(a.ref_count(two[0]), 2);
  a.release({two[0]});
  EXPECT_EQ(a.free_count(), 2) << "a shared block stays in use until its last owner leaves";
  a.release({two[0], two[1]});
  EXPECT_EQ(a.free_count(), 4);
  try {
    a.release({two[1]});
    ADD_FAILURE() << "double free accepted";
  } catch (const StateError& e) {
    EXPECT_EQ(e.argument(), "blocks");
  }
  EXPECT_THROW(a.release({7}), OutOfRangeError);
  EXPECT_THROW(a.retain(two[0]), StateError) << "a free block cannot be shared";
  const auto again = a.allocate(1);
  EXPECT_THROW(a.release({again[0], again[0]}), StateError) << "released more often than owned";
  EXPECT_EQ(a.ref_count(again[0]), 1) << "a refused release changes no count";
}

std::vector<const VariantEntry*> paged_tiny_variants() {
  std::vector<const VariantEntry*> out;
  for (const auto& e : registry().variants())
    if (e.descriptor->paged() && std::string(e.descriptor->model) == "tiny") out.push_back(&e);
  return out;
}

TEST(SequenceManager, BatchMetadataMatchesThePageLists) {
  const VariantEntry* e = paged_tiny_variants().at(0);
  CacheConfig cfg;
  cfg.pages = 16;
  auto cache = e->create(cfg);
  SequenceManager m(*cache);
  const int P = e->descriptor->page_size;
  std::vector<int32_t> a(size_t(P + 3), 1), b(size_t(2 * P), 2);
  m.add(10, a);
  m.add(20, b);
  m.append(10, {5, 6});
  const BatchMetadata batch = m.step({20, 10});
  // Built here from the page lists and the contract: slot = page * P + offset.
  const std::vector<int32_t> pa = m.pages(10), pb = m.pages(20);
  std::vector<int64_t> slots;
  for (int64_t pos = 0; pos < 2 * P; ++pos) slots.push_back(int64_t(pb[size_t(pos / P)]) * P + pos % P);
  for (int64_t pos = 0; pos < P + 5; ++pos) slots.push_back(int64_t(pa[size_t(pos / P)]) * P + pos % P);
  EXPECT_EQ(batch.slots, slots);
  EXPECT_EQ(batch.query_start, (std::vector<int32_t>{0, 2 * P, 3 * P + 5}));
  EXPECT_EQ(batch.lengths, (std::vector<int32_t>{2 * P, P + 5}));
  EXPECT_EQ(batch.max_pages, 2);
  EXPECT_EQ(batch.page_table, (std::vector<int32_t>{pb[0], pb[1], pa[0], pa[1]}));
  EXPECT_EQ(batch.indptr, (std::vector<int32_t>{0, 2, 4}));
  EXPECT_EQ(batch.indices, (std::vector<int32_t>{pb[0], pb[1], pa[0], pa[1]}));
  EXPECT_EQ(batch.last_page_len, (std::vector<int32_t>{P, 5}));
  EXPECT_TRUE(m.step({10, 20}).slots.empty()) << "a second step hands out nothing twice";
  EXPECT_THROW(m.step({99}), StateError);
  EXPECT_THROW(m.offload(20), CapacityError) << "no host tier was configured";
  m.check_invariants();
}

TEST(SequenceManager, RefusesWhatItCannotDoAndChangesNothing) {
  const VariantEntry* e = paged_tiny_variants().at(0);
  const int P = e->descriptor->page_size;
  CacheConfig cfg;
  cfg.pages = 2;
  auto cache = e->create(cfg);
  SequenceManagerOptions o;
  o.host_blocks = 1;
  SequenceManager m(*cache, o);
  m.add(1, std::vector<int32_t>(size_t(P), 3));
  EXPECT_THROW(m.add(2, std::vector<int32_t>(size_t(2 * P), 4)), CapacityError);
  EXPECT_FALSE(m.contains(2));
  EXPECT_THROW(m.append(1, std::vector<int32_t>(size_t(2 * P), 4)), CapacityError);
  EXPECT_EQ(m.length(1), P);
  EXPECT_THROW(m.add(1, {1}), StateError);
  EXPECT_THROW(m.append(7, {1}), StateError);
  EXPECT_THROW(m.offload(1), StateError) << "pending tokens must be written first";
  m.step({1});
  m.offload(1);
  EXPECT_THROW(m.append(1, {1}), StateError) << "an offloaded sequence must be restored first";
  EXPECT_THROW(m.restore(2), StateError);
  m.restore(1);
  EXPECT_THROW(m.restore(1), StateError);
  m.check_invariants();
}

TEST(MemoryPlan, AllocateAndReserveBeforeAnythingIsAllocated) {
  const VariantDescriptor& d = *registry().at("vllm_paged_nhd.llama3_8b.bf16").descriptor;
  MemoryRequest r;
  r.pages = 1000;
  const MemoryPlan a = plan_memory(d, r);
  EXPECT_EQ(a.pages, 1000);
  EXPECT_EQ(a.page_bytes, d.bytes_per_token * d.page_size);
  EXPECT_EQ(a.tokens, 1000 * d.page_size);
  EXPECT_EQ(a.max_len_for_batch(8), 1000 / 8 * d.page_size);
  r.mode = PlanMode::reserve;
  r.budget_bytes = int64_t(4) << 30;
  r.reserve_bytes = int64_t(1) << 30;
  const MemoryPlan b = plan_memory(d, r);
  EXPECT_EQ(b.pages, (int64_t(3) << 30) / b.page_bytes);
  EXPECT_LE(b.pool_bytes, r.budget_bytes - r.reserve_bytes);
  r.budget_bytes = 0;
  try {
    plan_memory(d, r);
    ADD_FAILURE() << "a CPU reserve plan without a budget was accepted";
  } catch (const ArgumentError& e) {
    EXPECT_EQ(e.argument(), "budget_bytes");
  }
  r.budget_bytes = 1000;
  EXPECT_THROW(plan_memory(d, r), CapacityError);
  EXPECT_THROW(plan_memory(*registry().at("jetstream_stacked.tiny.bf16").descriptor, MemoryRequest{}), UnsupportedError);
}

class EveryPagedTinyVariant : public testing::TestWithParam<const VariantEntry*> {};

// Thousands of random operations under memory pressure, checked after every one.
TEST_P(EveryPagedTinyVariant, RandomOperationsMatchTheModel) {
  const VariantDescriptor& d = *GetParam()->descriptor;
  SequenceModel model(*GetParam(), 64 / d.page_size * 3 + 8, 24, true);
  RandomChoices choices(42);
  try {
    for (int i = 0; i < 3000; ++i) {
      model.random_op(choices);
      if (i % 250 == 249) model.verify();
    }
    model.verify();
  } catch (const ModelMismatch& e) {
    FAIL() << e.what();
  }
  const SequenceStats& s = model.manager().stats();
  RecordProperty("prefix_hits", std::to_string(s.prefix_hits));
  RecordProperty("evictions", std::to_string(s.evictions));
  EXPECT_GT(s.prefix_hits, 0);
  EXPECT_GT(s.evictions, 0);
  EXPECT_GT(s.copies_on_write, 0);
  EXPECT_GT(s.restored_pages, 0);
  EXPECT_GT(model.capacity_refusals, 0) << "the run never ran out of pages, so all-or-nothing went untested";
  EXPECT_GT(model.verified_sequences, 0);
}

// The same prompts give the same cache contents whether prefixes are reused or recomputed.
TEST_P(EveryPagedTinyVariant, PrefixReuseGivesIdenticalContents) {
  const VariantDescriptor& d = *GetParam()->descriptor;
  const int64_t pages = 60000 / d.page_size;
  SequenceModel reuse(*GetParam(), pages, 0, true), recompute(*GetParam(), pages, 0, false);
  RandomChoices a(7), b(7);
  for (int i = 0; i < 400; ++i) {
    // Only adds, appends and frees: with room to spare, both runs take the same path.
    for (SequenceModel* m : {&reuse, &recompute}) {
      Choices& c = m == &reuse ? static_cast<Choices&>(a) : b;
      const uint32_t op = c.below(10);
      if (op < 5) m->add(c);
      else if (op < 9 && !m->live_tokens().empty()) m->append(m->live_tokens().rbegin()->first, 1 + c.below(8), c);
      else m->step_all();
    }
  }
  reuse.verify();
  recompute.verify();
  EXPECT_GT(reuse.manager().stats().prefix_hits, 0);
  EXPECT_EQ(recompute.manager().stats().prefix_hits, 0);
  ASSERT_EQ(reuse.live_tokens(), recompute.live_tokens());
  const int es = dtype_size(d.input);
  for (const auto& [id, tokens] : reuse.live_tokens()) {
    const int64_t n = int64_t(tokens.size());
    for (int layer = 0; layer < d.layers; ++layer) {
      std::vector<unsigned char> out[2][2];
      SequenceModel* models[2] = {&reuse, &recompute};
      for (int r = 0; r < 2; ++r) {
        for (auto& o : out[r]) o.assign(size_t(d.heads * n * d.head_dim * es), 0);
        models[r]->cache_->gather(
            layer, models[r]->manager().range(id, 0, n),
            TensorView::contiguous(out[r][0].data(), d.input, Device::cpu, d.heads, n, d.head_dim),
            TensorView::contiguous(out[r][1].data(), d.input, Device::cpu, d.heads, n, d.head_dim));
      }
      EXPECT_TRUE(out[0][0] == out[1][0] && out[0][1] == out[1][1]) << "sequence " << id << " layer " << layer;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Registry, EveryPagedTinyVariant, testing::ValuesIn(paged_tiny_variants()),
                         [](const testing::TestParamInfo<const VariantEntry*>& info) {
                           std::string n = info.param->descriptor->name;
                           for (char& c : n)
                             if (c == '.') c = '_';
                           return n;
                         });

}  // namespace
}  // namespace kvtest
