// Retention priorities and KV events of the sequence manager's prefix cache: what survives a flood,
// when a priority's time runs out, what reset_prefix_cache refuses, and the events of each step
// against what the test itself knows it stored and evicted.
#include "support.hpp"

namespace kvtest {
namespace {

double fake_seconds = 0;
double fake_clock() { return fake_seconds; }

// A paged float variant of the tiny model with `pages` pages, and its manager.
struct Pool {
  std::unique_ptr<Cache> cache;
  std::unique_ptr<SequenceManager> manager;
  int P = 0;
  Pool(int64_t pages, SequenceManagerOptions o = {}) {
    const VariantEntry& e = registry().at("vllm_paged_nhd.tiny.fp32");
    CacheConfig cfg;
    cfg.pages = pages;
    cache = e.create(cfg);
    P = e.descriptor->page_size;
    o.kv_events = true;
    manager = std::make_unique<SequenceManager>(*cache, o);
  }
  // A prompt of `blocks` full blocks plus one token, distinct per `seed`; written and freed, so its
  // full blocks stay cached with nobody holding them.
  std::vector<int32_t> cache_prompt(int64_t id, int blocks, int seed, std::vector<RetentionRange> retention = {}) {
    std::vector<int32_t> t;
    for (int i = 0; i < blocks * P + 1; ++i) t.push_back(seed * 100000 + i);
    manager->add(id, t);
    if (!retention.empty()) manager->set_retention(id, retention);
    manager->step({id});
    manager->free(id);
    return t;
  }
};

TEST(Retention, ASystemPromptAtPriority100OutlivesAFloodThatFillsThePoolTwice) {
  Pool pool(16);
  const std::vector<int32_t> system = pool.cache_prompt(0, 2, 1, {{0, 2 * pool.P, 100, 0}});
  // Priority-0 requests of three blocks each, 2 x 16 pages of them.
  for (int r = 0; r < 11; ++r) pool.cache_prompt(1 + r, 3, 2 + r, {{0, 3 * pool.P + 1, 0, 0}});
  EXPECT_GT(pool.manager->stats().evictions, 16);
  EXPECT_EQ(pool.manager->cached_prefix(system), 2 * pool.P) << "the system prompt's blocks were evicted";
  pool.manager->check_invariants();
}

TEST(Retention, WithinAPriorityTheLeastRecentlyReleasedGoesFirst) {
  Pool pool(4);
  const auto a = pool.cache_prompt(0, 1, 1), b = pool.cache_prompt(1, 1, 2), c = pool.cache_prompt(2, 1, 3);
  // Three cached, one free: a request of two pages evicts one block, the oldest at the default priority.
  pool.manager->add(3, std::vector<int32_t>(size_t(2 * pool.P), 7));
  EXPECT_EQ(pool.manager->cached_prefix(a), 0);
  EXPECT_EQ(pool.manager->cached_prefix(b), pool.P);
  EXPECT_EQ(pool.manager->cached_prefix(c), pool.P);
}

TEST(Retention, APriorityWhoseTimeRunsOutDropsToTheDefault) {
  SequenceManagerOptions o;
  o.clock = fake_clock;
  fake_seconds = 100;
  Pool pool(4, o);
  const auto kept = pool.cache_prompt(0, 1, 1, {{0, pool.P, 90, 10}});  // 90 until t = 110
  const auto first = pool.cache_prompt(1, 1, 2, {{0, pool.P, 60, 0}});   // 60 for good
  const auto second = pool.cache_prompt(2, 1, 3, {{0, pool.P, 60, 0}});
  fake_seconds = 105;  // still 90: of the 60s, the one released first goes
  pool.manager->add(3, std::vector<int32_t>(size_t(2 * pool.P), 7));
  EXPECT_EQ(pool.manager->cached_prefix(kept), pool.P);
  EXPECT_EQ(pool.manager->cached_prefix(first), 0);
  fake_seconds = 111;  // 35 now, below the other 60: it goes next
  pool.manager->add(4, std::vector<int32_t>(size_t(pool.P), 8));
  EXPECT_EQ(pool.manager->cached_prefix(kept), 0);
  EXPECT_EQ(pool.manager->cached_prefix(second), pool.P);
}

TEST(Retention, BadRangesAreRefusedByNameAndChangeNothing) {
  Pool pool(4);
  pool.manager->add(0, std::vector<int32_t>(size_t(pool.P + 1), 3));
  auto refused = [&](std::vector<RetentionRange> r, const std::string& argument) {
    try {
      pool.manager->set_retention(0, r);
      ADD_FAILURE() << "accepted; wanted a refusal naming " << argument;
    } catch (const ArgumentError& e) {
      EXPECT_EQ(e.argument(), argument);
    }
  };
  refused({{0, 4, 35, 0}, {5, 2, 35, 0}}, "ranges[1]");
  refused({{-1, 4, 35, 0}}, "ranges[0]");
  refused({{0, 4, 101, 0}}, "ranges[0].priority");
  refused({{0, 4, 50, -1}}, "ranges[0].seconds");
  refused({{0, 4, 50, std::numeric_limits<double>::infinity()}}, "ranges[0].seconds");
  EXPECT_THROW(pool.manager->set_retention(9, {}), StateError);
  SequenceManagerOptions bad;
  bad.default_priority = 101;
  EXPECT_THROW(Pool(4, bad), OutOfRangeError);
}

TEST(KvEvents, EachStepReportsWhatItStoredAndEachEvictionWhatItRemoved) {
  Pool pool(4);
  const auto first = pool.cache_prompt(0, 2, 1);
  std::vector<KvEvent> events = pool.manager->take_kv_events();
  ASSERT_EQ(events.size(), 1u);
  EXPECT_EQ(events[0].kind, KvEvent::Kind::block_stored);
  EXPECT_EQ(events[0].block_hashes.size(), 2u);
  EXPECT_FALSE(events[0].parent_block_hash.has_value()) << "a prompt's first block has no parent";
  EXPECT_EQ(events[0].token_ids, std::vector<int32_t>(first.begin(), first.begin() + 2 * pool.P));
  EXPECT_EQ(events[0].block_size, pool.P);
  EXPECT_EQ(events[0].medium, "CPU");
  // Sharing the first block and adding one of its own stores one block, whose parent is the first.
  std::vector<int32_t> branch(first.begin(), first.begin() + pool.P);
  for (int i = 0; i < pool.P + 1; ++i) branch.push_back(9);
  pool.manager->add(1, branch);
  pool.manager->step({1});
  events = pool.manager->take_kv_events();
  ASSERT_EQ(events.size(), 1u);
  EXPECT_EQ(events[0].parent_block_hash, pool.manager->prefix_cache().key_of(pool.manager->pages(1)[0]));
  pool.manager->free(1);
  // Four pages, three cached: a request of three pages evicts two, in one BlockRemoved.
  pool.manager->add(2, std::vector<int32_t>(size_t(3 * pool.P), 5));
  events = pool.manager->take_kv_events();
  ASSERT_EQ(events.size(), 1u);
  EXPECT_EQ(events[0].kind, KvEvent::Kind::block_removed);
  EXPECT_EQ(events[0].block_hashes.size(), 2u);
  pool.manager->step({2});  // its three full blocks join the cache, held by it
  ASSERT_EQ(pool.manager->take_kv_events().size(), 1u);
  EXPECT_THROW(pool.manager->reset_prefix_cache(), StateError) << "a live sequence holds a cached block";
  pool.manager->free(2);
  pool.manager->reset_prefix_cache();
  events = pool.manager->take_kv_events();
  ASSERT_EQ(events.size(), 1u);
  EXPECT_EQ(events[0].kind, KvEvent::Kind::all_blocks_cleared);
  EXPECT_TRUE(pool.manager->cached_block_hashes().empty());
  pool.manager->check_invariants();
}

}  // namespace
}  // namespace kvtest
