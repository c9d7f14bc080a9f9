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

TEST(BlockAllocator, AGenerationAdvancesWheneverABlockMayComeToHoldAnotherOwnersTokens) {
  BlockAllocator a(3);
  auto gen = [&](int32_t b) { return a.generations()[b]; };
  const int64_t* address = a.generations();
  const auto first = a.allocate(1);
  const int32_t b = first[0];
  const int64_t owned = gen(b);
  EXPECT_EQ(owned, 1) << "an allocation is a new owner";
  a.retain(b);
  a.release({b});
  EXPECT_EQ(gen(b), owned) << "one owner of a shared block leaving changes neither its bytes nor its generation";
  a.release({b});
  EXPECT_EQ(gen(b), owned + 1) << "the last owner leaving frees it";
  const auto reused = a.allocate(1);
  ASSERT_EQ(reused[0], b) << "the most recently freed block is reused first";
  EXPECT_EQ(gen(b), owned + 2) << "a reuse is a new owner";
  EXPECT_THROW(a.release({b, b}), StateError);
  EXPECT_EQ(gen(b), owned + 2) << "a refused release changes no generation";
  EXPECT_EQ(gen(1 - std::min(b, 1)), 0) << "a block never handed out keeps its first generation";
  EXPECT_EQ(a.generations(), address) << "the counters stay where a registration saw them";
}

// Every paged variant small enough to drive thousands of operations through (tiny's and any user
// model of that size): the tests below hold for any page size, head count and head dim.
std::vector<const VariantEntry*> paged_tiny_variants() {
  std::vector<const VariantEntry*> out;
  for (const auto& e : registry().variants()) {
    const VariantDescriptor& d = *e.descriptor;
    if (d.paged() && !d.is_hybrid() && d.bytes_per_token <= 4096 && d.max_seq_len >= 64) out.push_back(&e);
  }
  return out;
}

TEST(SequenceManager, PagesFreedAndReusedForAnotherRequestChangeGeneration) {
  // A stale page table names pages whose generations have changed: what kvforge.nixl's pulls check.
  for (bool prefix_caching : {false, true}) {
    const VariantEntry* e = paged_tiny_variants().at(0);
    CacheConfig cfg;
    cfg.pages = 4;
    auto cache = e->create(cfg);
    SequenceManagerOptions o;
    o.prefix_caching = prefix_caching;
    SequenceManager m(*cache, o);
    const int P = e->descriptor->page_size;
    const int64_t* gen = m.allocator().generations();
    m.add(1, std::vector<int32_t>(size_t(2 * P), 7));
    m.step({1});  // its K/V written: a fork may share them
    const std::vector<int32_t> a = m.pages(1);
    std::vector<int64_t> published;
    for (int32_t p : a) published.push_back(gen[p]);
    m.fork(1, 2);
    m.free(2);
    for (size_t i = 0; i < a.size(); ++i) EXPECT_EQ(gen[a[i]], published[i]) << "a fork and its free share A's bytes";
    m.free(1);
    // Another request takes every page: A's pages are evicted from the prefix cache if they sat there.
    m.add(3, std::vector<int32_t>(size_t(4 * P), 9));
    for (size_t i = 0; i < a.size(); ++i)
      EXPECT_GT(gen[a[i]], published[i]) << "page " << a[i] << " holds request 3 now (prefix caching "
                                         << prefix_caching << ")";
    m.check_invariants();
  }
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
  m.add(3, {5});
  try {  // the host step, like the device step, refuses a batch that names a sequence twice
    m.step({1, 3, 1});
    ADD_FAILURE() << "a batch listing sequence 1 twice was stepped";
  } catch (const ArgumentError& err) {
    EXPECT_EQ(err.argument(), "seqs");
  }
  m.free(3);
  m.step({1});
  m.offload(1);
  EXPECT_THROW(m.append(1, {1}), StateError) << "an offloaded sequence must be restored first";
  EXPECT_THROW(m.restore(2), StateError);
  m.restore(1);
  EXPECT_THROW(m.restore(1), StateError);
  m.check_invariants();
  auto with = [](auto set) {
    SequenceManagerOptions o;
    set(o);
    return o;
  };
  for (const auto& [field, options] :
       {std::pair{"options.host_blocks", with([](SequenceManagerOptions& o) { o.host_blocks = -1; })},
        std::pair{"options.window", with([](SequenceManagerOptions& o) { o.window = -2; })}}) {
    try {
      SequenceManager refused(*cache, options);
      ADD_FAILURE() << field << " < 0 was taken";
    } catch (const OutOfRangeError& err) {
      EXPECT_EQ(err.argument(), field);
    }
  }
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

// A gather range must lie within the sequence: [begin, end) with 0 <= begin <= end <= length.
TEST(SequenceManager, RangesOutsideTheSequenceAreRefused) {
  const VariantEntry* e = paged_tiny_variants().at(0);
  CacheConfig cfg;
  cfg.pages = 8;
  auto cache = e->create(cfg);
  SequenceManager m(*cache);
  m.add(1, {1, 2, 3});
  auto argument_of = [&](int64_t begin, int64_t end) -> std::string {
    try {
      m.range(1, begin, end);
    } catch (const OutOfRangeError& err) {
      return err.argument();
    }
    return "";
  };
  EXPECT_EQ(argument_of(-1, 2), "begin");
  EXPECT_EQ(argument_of(4, 4), "begin");
  EXPECT_EQ(argument_of(2, 1), "end");
  EXPECT_EQ(argument_of(0, 4), "end");
  EXPECT_EQ(argument_of(0, 3), "");
  EXPECT_EQ(argument_of(3, 3), "");
}

class EveryPagedTinyVariant : public testing::TestWithParam<const VariantEntry*> {};

// `ops` random operations, each checked; every live sequence gathered every 250 and at the end.
void run_model(SequenceModel& model, uint64_t seed, int ops) {
  RandomChoices choices(seed);
  try {
    for (int i = 0; i < ops; ++i) {
      model.random_op(choices);
      if (i % 250 == 249) model.verify();
    }
    model.verify();
  } catch (const ModelMismatch& e) {
    FAIL() << e.what();
  }
}

// Thousands of random operations under memory pressure, checked after every one.
TEST_P(EveryPagedTinyVariant, RandomOperationsMatchTheModel) {
  const VariantDescriptor& d = *GetParam()->descriptor;
  SequenceModel model(*GetParam(), 64 / d.page_size * 3 + 8, 24, true);
  ASSERT_NO_FATAL_FAILURE(run_model(model, 42, 3000));
  const SequenceStats& s = model.manager().stats();
  RecordProperty("prefix_hits", std::to_string(s.prefix_hits));
  RecordProperty("evictions", std::to_string(s.evictions));
  EXPECT_GT(s.prefix_hits, 0);
  EXPECT_GT(s.evictions, 0);
  if (d.page_size > 1) {
    EXPECT_GT(s.copies_on_write, 0);
  } else {  // a fork shares only full pages, and one-token pages are always full: nothing to copy
    RecordProperty("copies_on_write", "not applicable: page_size 1");
    EXPECT_EQ(s.copies_on_write, 0);
  }
  EXPECT_GT(s.restored_pages, 0);
  EXPECT_GT(s.demoted_blocks, 0) << "no evicted block reached the host tier";
  // Whether an evicted block is asked for again depends on the shape (a user's spec of 2-token pages
  // keeps every shared prompt on the device): recorded here, and required by Tiers.* and
  // test_kv_events.py, whose traces return to evicted prefixes.
  RecordProperty("promoted_blocks", std::to_string(s.promoted_blocks));
  RecordProperty("disk_reads", std::to_string(s.disk_reads));
  EXPECT_GT(model.capacity_refusals, 0) << "the run never ran out of pages, so all-or-nothing went untested";
  EXPECT_GT(model.verified_sequences, 0);
}

// The same, with a sliding window: pages that leave it are freed as sequences grow.
TEST_P(EveryPagedTinyVariant, RandomOperationsWithASlidingWindowMatchTheModel) {
  const VariantDescriptor& d = *GetParam()->descriptor;
  SequenceModel model(*GetParam(), 64 / d.page_size * 3 + 8, 24, true, d.page_size + 5);
  ASSERT_NO_FATAL_FAILURE(run_model(model, 43, 1500));
  EXPECT_GT(model.verified_sequences, 0);
}

// The same, with host-tier promotions copied on the manager's thread (promote_ahead): whatever comes
// between an add() and its step, every sequence the model verifies reads back what was written.
TEST_P(EveryPagedTinyVariant, RandomOperationsWithPromotionAheadMatchTheModel) {
  const VariantDescriptor& d = *GetParam()->descriptor;
  SequenceModel model(*GetParam(), 64 / d.page_size * 3 + 8, 24, true, 0, true);
  ASSERT_NO_FATAL_FAILURE(run_model(model, 44, 1500));
  EXPECT_GT(model.verified_sequences, 0);
  RecordProperty("promoted_ahead", std::to_string(model.manager().stats().promoted_ahead));
}

// The same prompts give the same cache contents whether prefixes are reused or recomputed.
TEST_P(EveryPagedTinyVariant, PrefixReuseGivesIdenticalContents) {
  const VariantDescriptor& d = *GetParam()->descriptor;
  const int64_t pages = 60000 / d.page_size;
  SequenceModel reuse(*GetParam(), pages, 0, true), recompute(*GetParam(), pages, 0, false);
  RandomChoices a(7), b(7);
  for (int i = 0; i < 400; ++i) {
    // Only adds, appends and steps: with room to spare, both runs take the same path. The run
    // without reuse holds the most pages, so both stop growing before it could run short (an add
    // takes at most 6 pages, an append of 8 tokens at most 9), whatever the page size.
    const bool room = recompute.manager().available_blocks() >= 16;
    for (SequenceModel* m : {&reuse, &recompute}) {
      Choices& c = m == &reuse ? static_cast<Choices&>(a) : b;
      const uint32_t op = c.below(10);
      if (op < 5 && room) m->add(c);
      else if (op < 9 && room && !m->live_tokens().empty()) m->append(m->live_tokens().rbegin()->first, 1 + c.below(8), c);
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

// A hybrid cache routes each layer to its group's member, and its local group frees pages that
// leave the sliding window while the global group keeps everything; both read back as written.
TEST(Hybrid, RoutesLayersToGroupsAndFreesPagesThatLeaveTheWindow) {
  const VariantEntry* entry = nullptr;
  for (const auto& e : registry().variants())
    if (e.descriptor->is_hybrid() && std::string(e.descriptor->model) == "tiny_hybrid") entry = &e;
  if (!entry) GTEST_SKIP() << "no hybrid variant for tiny_hybrid is registered";
  const VariantDescriptor& d = *entry->descriptor;
  CacheConfig cfg;
  cfg.pages = 24;
  auto cache = entry->create(cfg);
  ASSERT_EQ(cache->num_groups(), d.hybrid->num_groups);
  HybridSequenceManager m(*cache);
  int local = -1;
  for (int g = 0; g < d.hybrid->num_groups; ++g)
    if (d.hybrid->groups[g].sliding_window) local = g;
  ASSERT_GE(local, 0);
  const int window = d.hybrid->groups[local].sliding_window;
  for (int layer = 0; layer < d.layers; ++layer) {
    const LayerGroupInfo& g = d.hybrid->groups[cache->group_of(layer)];
    EXPECT_EQ(g.layers[cache->group_layer(layer)], layer) << "layer " << layer << " routes to the wrong member layer";
  }
  // K/V of (layer, position) from the tokens up to it and the layer, so misrouting shows.
  auto value = [&](const std::vector<int32_t>& tokens, int64_t pos, int layer, int kv, int i) {
    uint64_t h = uint64_t(layer) * 1000003u + uint64_t(kv);
    for (int64_t p = 0; p <= pos; ++p) h = h * 31 + uint64_t(tokens[size_t(p)]);
    return exact_value(h * 4096 + uint64_t(i));
  };
  const int es = dtype_size(d.input);
  const int64_t row = int64_t(d.heads) * d.head_dim;
  auto step = [&](const std::vector<int64_t>& ids) {
    const std::vector<BatchMetadata> batches = m.step(ids);
    for (int layer = 0; layer < d.layers; ++layer) {
      const BatchMetadata& b = batches[size_t(cache->group_of(layer))];
      const int64_t T = int64_t(b.slots.size());
      std::vector<unsigned char> k(size_t(T * row * es)), v(k.size());
      for (size_t s = 0; s < ids.size(); ++s)
        for (int32_t t = b.query_start[s]; t < b.query_start[s + 1]; ++t) {
          const int64_t pos = b.lengths[s] - (b.query_start[s + 1] - t);
          for (int64_t i = 0; i < row; ++i) {
            store_as(d.input, value(m.group(0).tokens(ids[s]), pos, layer, 0, int(i)), k.data() + (t * row + i) * es);
            store_as(d.input, value(m.group(0).tokens(ids[s]), pos, layer, 1, int(i)), v.data() + (t * row + i) * es);
          }
        }
      cache->append(layer, TensorView::contiguous(k.data(), d.input, Device::cpu, T, d.heads, d.head_dim),
                    TensorView::contiguous(v.data(), d.input, Device::cpu, T, d.heads, d.head_dim),
                    TokenTargets::paged(IndexView::of(b.slots.data(), T)));
    }
  };
  std::vector<int32_t> system(70, 5);  // more than one page of the global group's 64
  std::vector<int32_t> a = system, b = system;
  a.push_back(1);
  b.push_back(2);
  EXPECT_EQ(m.add(1, a), 0);
  step({1});
  const int64_t shared = m.add(2, b);
  EXPECT_GT(shared, 0) << "the second prompt reuses the first one's prefix";
  step({2});
  for (int t = 0; t < 60; ++t) {
    m.append(1, {int32_t(t)});
    m.append(2, {int32_t(t + 100)});
    step({1, 2});
  }
  for (int64_t id : {1, 2}) {
    const std::vector<int32_t>& tokens = m.group(0).tokens(id);
    const int64_t n = int64_t(tokens.size());
    const int P = d.hybrid->groups[local].member->page_size;
    // The local group holds only the pages that overlap the window.
    int64_t held = 0;
    for (int32_t p : m.group(local).pages(id)) held += p >= 0;
    EXPECT_LE(held, (window + P - 1) / P + 1) << "sequence " << id;
    for (int layer = 0; layer < d.layers; ++layer) {
      const bool windowed = cache->group_of(layer) == local;
      const int64_t begin = windowed ? n - window : 0;
      if (windowed) {
        EXPECT_THROW(m.range(layer, id, 0, n), OutOfRangeError) << "positions left the window";
      }
      const int64_t count = n - begin;
      std::vector<unsigned char> ko(size_t(row * count * es)), vo(ko.size());
      cache->gather(layer, m.range(layer, id, begin, n),
                    TensorView::contiguous(ko.data(), d.input, Device::cpu, d.heads, count, d.head_dim),
                    TensorView::contiguous(vo.data(), d.input, Device::cpu, d.heads, count, d.head_dim));
      for (int h = 0; h < d.heads; ++h)
        for (int64_t j = 0; j < count; ++j)
          for (int x = 0; x < d.head_dim; ++x) {
            const int64_t at = ((h * count + j) * d.head_dim + x) * es;
            const int i = h * d.head_dim + x;
            ASSERT_EQ(load_as(d.input, ko.data() + at), value(tokens, begin + j, layer, 0, i))
                << "sequence " << id << " layer " << layer << " position " << begin + j;
            ASSERT_EQ(load_as(d.input, vo.data() + at), value(tokens, begin + j, layer, 1, i));
          }
    }
  }
  for (int g = 0; g < m.num_groups(); ++g) m.group(g).check_invariants();
  EXPECT_THROW(cache->copy_blocks(IndexView{}), UnsupportedError) << "page ids are per group";
  const MemoryReport r = cache->memory();
  EXPECT_EQ(r.storage_bytes, cache->group(0).memory().storage_bytes + cache->group(1).memory().storage_bytes);
}

// A steady decode step built on the device uploads nothing but the page-table entries new pages
// took; its arrays match the host-built ones of the same step (the model test holds them equal
// under random traffic too).
TEST(DeviceStep, SteadyDecodeUploadsOnlyNewPages) {
  const VariantEntry* e = nullptr;
  for (const auto& v : registry().variants())
    if (v.descriptor->paged() && !v.descriptor->is_hybrid() && std::string(v.descriptor->model) == "tiny") e = &v;
  ASSERT_NE(e, nullptr) << "no paged variant of the tiny model";
  const int32_t P = e->descriptor->page_size;
  CacheConfig cfg;
  cfg.pages = 64 * 4;
  auto cache = e->create(cfg);
  SequenceManager m(*cache);
  std::vector<int64_t> ids;
  for (int64_t id = 0; id < 64; ++id) {
    m.add(id, std::vector<int32_t>(size_t(P / 2 + id % P), int32_t(id)));
    ids.push_back(id);
  }
  BatchMetadata host;
  m.step_on_device(ids, false, &host);  // the prefill: every row goes up
  for (int step = 0; step < 2 * P; ++step) {
    int64_t new_pages = 0;
    for (int64_t id : ids) {
      new_pages += m.length(id) % P == 0;  // the token about to come starts a page
      m.append(id, {int32_t(step)});
    }
    const DeviceStep& d = m.step_on_device(ids, false, &host);
    // The first decode step changes every sequence's new-token count (from its prompt's to 1): the
    // batch goes up once. From then on only the new pages do.
    const int64_t batch_bytes = step == 0 ? 2 * 64 * int64_t(sizeof(int32_t)) : 0;
    EXPECT_EQ(d.uploaded_bytes, batch_bytes + new_pages * int64_t(sizeof(detail::TableWrite))) << "step " << step;
    ASSERT_EQ(d.slots.size, 64);
    for (size_t i = 0; i < ids.size(); ++i) {
      const int64_t pos = m.length(ids[i]) - 1;
      const int64_t want = int64_t(m.pages(ids[i])[size_t(pos / P)]) * P + pos % P;  // plain page arithmetic
      EXPECT_EQ(static_cast<const int64_t*>(d.slots.data)[i], want);
      EXPECT_EQ(static_cast<const int32_t*>(d.seq_lens.data)[i], pos + 1);
    }
  }
  // A sequence listed twice is refused before anything changes: its new token is still to be handed out.
  m.append(0, {9});
  EXPECT_THROW(m.step_on_device({0, 1, 0}), ArgumentError);
  const DeviceStep& d = m.step_on_device({0}, false, &host);
  EXPECT_EQ(d.slots.size, 1);
  EXPECT_EQ(host.slots, std::vector<int64_t>{static_cast<const int64_t*>(d.slots.data)[0]});
}

}  // namespace
}  // namespace kvtest
