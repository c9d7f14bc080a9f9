// Retention priorities and KV events of the sequence manager's prefix cache: what survives a flood of
// the device pool and of every tier, when a priority's time runs out, what reset_prefix_cache refuses,
// and the events of each step against what the test itself knows it stored and evicted. Block hashes:
// SHA-256 against FIPS 180-2's published examples, and vLLM's construction against hashes recorded from
// vLLM v0.17.0's own code.
#include <unistd.h>

#include <cstdio>

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

// The same with tiers below 8 device pages: an 8-page host tier and a 16-record disk tier, and a flood
// of priority-0 blocks twice what all three hold. Every victim of each tier is a priority-0 block, so
// the system prompt never leaves the device.
TEST(Retention, ASystemPromptAtPriority100OutlivesAFloodThatFillsEveryTierTwice) {
  SequenceManagerOptions o;
  o.host_blocks = 8;
  o.disk_path = testing::TempDir() + "/kvforge_flood_" + std::to_string(getpid());
  std::remove(o.disk_path.c_str());
  o.disk_blocks = 16;
  Pool pool(8, o);
  const std::vector<int32_t> system = pool.cache_prompt(0, 2, 1, {{0, 2 * pool.P, 100, 0}});
  for (int r = 0; r < 22; ++r) pool.cache_prompt(1 + r, 3, 2 + r, {{0, 3 * pool.P + 1, 0, 0}});  // 66 blocks
  const SequenceStats st = pool.manager->stats();
  EXPECT_GE(st.demoted_blocks, 2 * 8) << "the flood did not fill the host tier twice";
  EXPECT_GE(st.disk_writes, 2 * 16) << "the flood did not fill the disk tier twice";
  EXPECT_EQ(pool.manager->cached_prefix(system), 2 * pool.P) << "the system prompt's blocks were evicted";
  pool.manager->add(100, system);  // served from the device: nothing comes back from a lower tier
  EXPECT_EQ(pool.manager->stats().promoted_blocks, st.promoted_blocks) << "the system prompt left the device";
  pool.manager->check_invariants();
  std::remove(o.disk_path.c_str());
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

std::string hex(const Sha256Digest& d) {
  std::string out;
  for (uint8_t b : d) out += "0123456789abcdef"[b >> 4], out += "0123456789abcdef"[b & 15];
  return out;
}

TEST(BlockHash, Sha256GivesFips180sExamples) {
  auto of = [](const std::string& s) { return hex(sha256(reinterpret_cast<const uint8_t*>(s.data()), s.size())); };
  EXPECT_EQ(of(""), "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855");
  EXPECT_EQ(of("abc"), "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
  // 56 bytes: the padding takes a second block.
  EXPECT_EQ(of("abcdbcdecdefdefgefghfghighijhijkijkljklmklmnlmnomnopnopq"),
            "248d6a61d20638b8e5c026930c3e6039a33ce45964ff2167f6ecedd419db06c1");
  EXPECT_EQ(of(std::string(1000000, 'a')), "cdc76e5c9914fb9281a1c7e284d73e67f1809a48a497200e046d39ccc7112cd0");
}

// Hashes recorded from vLLM v0.17.0's own code for PYTHONHASHSEED=0, sha256_cbor and 16-token blocks
// (loxilb-inference-gateway's kv_hash_vectors.json): its NONE_HASH, and two chained blocks' integer
// block hashes, as its KV events carry them.
TEST(BlockHash, VllmSchemeKeysBlocksAsVllmDoes) {
  SequenceManagerOptions o;
  o.block_hash = BlockHashScheme::vllm_sha256_cbor;
  o.hash_seed = "0";
  Pool pool(8, o);
  ASSERT_EQ(pool.P, 16);
  EXPECT_EQ(hex(pool.manager->hasher().none_hash()), "4e1195df020de59e0d65a33a4279f1183e7ae4e5d980e309f8b55adff2e61c3e");
  std::vector<int32_t> prompt;
  for (int i = 1; i <= 32; ++i) prompt.push_back(101 * i);
  prompt.push_back(1);
  pool.manager->add(0, prompt);
  pool.manager->step({0});
  const std::vector<KvEvent> events = pool.manager->take_kv_events();
  ASSERT_EQ(events.size(), 1u);
  EXPECT_EQ(events[0].block_hashes, (std::vector<uint64_t>{7876691182959014722ULL, 8769878286166771163ULL}));
  // A second prompt sharing the first block finds it by the same key.
  std::vector<int32_t> other(prompt.begin(), prompt.begin() + 16);
  other.insert(other.end(), {5, 6, 7});
  EXPECT_EQ(pool.manager->cached_prefix(other), 16);
  // The default seed is vLLM's default, and the kvforge scheme keys the same blocks otherwise.
  EXPECT_NE(BlockHasher(BlockHashScheme::vllm_sha256_cbor).none_hash(), pool.manager->hasher().none_hash());
  EXPECT_NE(BlockHasher().next({}, 0, prompt.data(), 16).key, 7876691182959014722ULL);
  SequenceManagerOptions bad;
  bad.block_hash = BlockHashScheme(7);
  EXPECT_THROW(Pool(4, bad), OutOfRangeError);
}

}  // namespace
}  // namespace kvtest
