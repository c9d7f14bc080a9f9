// The prefix cache's tiers below the device: blocks that eviction moves to the host tier and on to the
// disk tier come back on a prefix hit with the K/V that was written (read back through gather and
// compared with the values the test wrote); a restart serves the disk tier's records; a record with
// flipped bytes, a file cut short and a writer killed mid-record all end as misses, never wrong data;
// host-tier blocks copied ahead on the manager's thread read back right whatever comes between.
#include <fcntl.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <fstream>
#include <thread>

#include "tiers_fixture.hpp"

namespace kvtest {
namespace {

TEST(Tiers, BlocksComeBackFromHostAndDiskWithTheirContents) {
  const std::string path = temp_file("tiers");
  Tiers t(path);
  const auto prompts = fill(t);
  EXPECT_GT(t.manager->stats().disk_writes, 0);
  EXPECT_FALSE(t.manager->disk_cached_block_hashes().empty());
  // The oldest prompt now lives on disk only: it comes back whole, with its values.
  EXPECT_EQ(t.manager->cached_prefix(prompts[0]), 2 * t.P());
  EXPECT_EQ(t.serve(100, prompts[0]), 2 * t.P());
  EXPECT_GT(t.manager->stats().disk_reads, 0);
  t.expect_contents(100, prompts[0]);
  t.manager->free(100);
  // A recent one comes from the host tier (and the device, where a block of it still is).
  const int64_t reads = t.manager->stats().disk_reads, promoted = t.manager->stats().promoted_blocks;
  EXPECT_EQ(t.serve(101, prompts[8]), 2 * t.P());
  t.expect_contents(101, prompts[8]);
  EXPECT_GT(t.manager->stats().promoted_blocks, promoted);
  EXPECT_EQ(t.manager->stats().disk_reads, reads) << "a host-tier hit read the disk";
  t.manager->check_invariants();
  std::remove(path.c_str());
}

TEST(Tiers, ARestartServesTheDiskTiersRecords) {
  const std::string path = temp_file("restart");
  std::vector<std::vector<int32_t>> prompts;
  std::vector<uint64_t> on_disk;
  {
    Tiers t(path);
    prompts = fill(t);
    on_disk = t.manager->disk_cached_block_hashes();
  }
  Tiers again(path);
  EXPECT_EQ(again.manager->disk_cached_block_hashes(), on_disk);
  const std::vector<KvEvent> events = again.manager->take_kv_events();
  ASSERT_FALSE(events.empty()) << "a restart announces what it reuses";
  EXPECT_EQ(events[0].medium, "DISK");
  EXPECT_EQ(again.serve(0, prompts[0]), 2 * again.P());
  again.expect_contents(0, prompts[0]);
  std::remove(path.c_str());
}

// Flips one byte in every record's packed bytes on disk (records start after the file's header block:
// block_store.hpp's file_store_record_offset).
void corrupt_records(const std::string& path, int64_t records, const Tiers& t) {
  std::fstream f(path, std::ios::in | std::ios::out | std::ios::binary);
  for (int64_t r = 0; r < records; ++r) {
    const int64_t at = file_store_record_offset(r, t.cache->packed_page_bytes(), t.P()) + 200;
    f.seekg(at);
    char c = 0;
    f.read(&c, 1);
    c = char(c ^ 0x10);
    f.seekp(at);
    f.write(&c, 1);
  }
}

TEST(Tiers, FlippedBytesAndACutFileReadAsMissesNeverAsWrongData) {
  const std::string path = temp_file("faults");
  std::vector<std::vector<int32_t>> prompts;
  int64_t cut_at = 0;
  {
    Tiers t(path);
    prompts = fill(t);
    cut_at = file_store_record_offset(2, t.cache->packed_page_bytes(), t.P()) +
             file_store_record_bytes(t.cache->packed_page_bytes(), t.P()) / 2;  // in the third record
    // Changed while it runs: the next read of such a record is a miss, and the block is recomputed.
    corrupt_records(path, 32, t);
    EXPECT_EQ(t.serve(100, prompts[0]), 0);
    EXPECT_GT(t.manager->stats().disk_misses, 0);
    t.expect_contents(100, prompts[0]);
    t.manager->check_invariants();
  }
  // A restart reuses only the records written intact after the damage: every prompt reads back right.
  Tiers restarted(path);
  restarted.serve_and_check_all(prompts);
  // Cut short: the records past the cut are gone, those before it stay.
  std::remove(path.c_str());
  {
    Tiers t(path);
    fill(t);
    EXPECT_GE(t.manager->disk_cached_block_hashes().size(), 4u);
  }
  ASSERT_EQ(truncate(path.c_str(), cut_at), 0);
  Tiers cut(path);
  EXPECT_LE(cut.manager->disk_cached_block_hashes().size(), 2u);
  cut.serve_and_check_all(prompts);
  std::remove(path.c_str());
}

// prefetch() reads a prompt's disk blocks on the manager's thread; the add() that promotes them takes
// those bytes (read_ahead_hits) and serves the values written. A record damaged before its read ahead
// is still a miss, the value recomputed; the read-ahead limit holds; reset drops what was read ahead.
TEST(Tiers, PrefetchReadsDiskBlocksAheadAndAddTakesThem) {
  const std::string path = temp_file("prefetch");
  Tiers t(path);
  const auto prompts = fill(t);
  ASSERT_EQ(t.manager->cached_prefix(prompts[0]), 2 * t.P());
  EXPECT_EQ(t.manager->prefetch(prompts[0]), 2) << "the oldest prompt's two blocks are on disk only";
  EXPECT_EQ(t.manager->prefetch(prompts[0]), 0) << "a block already read ahead is not read again";
  const SequenceStats before = t.manager->stats();
  EXPECT_EQ(t.serve(100, prompts[0]), 2 * t.P());
  EXPECT_EQ(t.manager->stats().read_ahead_hits - before.read_ahead_hits, 2);
  EXPECT_EQ(t.manager->stats().disk_reads - before.disk_reads, 2);
  t.expect_contents(100, prompts[0]);
  t.manager->free(100);
  // A prompt with nothing below the device reads nothing.
  EXPECT_EQ(t.manager->prefetch(prompts[0]), 0);
  // Damaged on disk before it is read ahead: a miss, as without read-ahead, and the values are right.
  corrupt_records(path, 32, t);
  ASSERT_EQ(t.manager->cached_prefix(prompts[1]), 2 * t.P());
  EXPECT_EQ(t.manager->prefetch(prompts[1]), 2);
  const int64_t hits = t.manager->stats().read_ahead_hits;
  EXPECT_EQ(t.serve(101, prompts[1]), 0);
  EXPECT_GT(t.manager->stats().disk_misses, 0);
  EXPECT_EQ(t.manager->stats().read_ahead_hits, hits);
  t.expect_contents(101, prompts[1]);
  t.manager->free(101);
  t.manager->check_invariants();
  std::remove(path.c_str());
  // At most read_ahead_blocks held ahead: a read that is done and never taken (its request went away)
  // makes room for the next; reset_prefix_cache() forgets them.
  Tiers one(path, 6, 4, 32, 1);
  const auto again = fill(one);
  EXPECT_EQ(one.manager->prefetch(again[0]), 1);
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(20);
  int64_t queued = 0;
  while (queued == 0 && std::chrono::steady_clock::now() < deadline) {
    queued = one.manager->prefetch(again[1]);  // 0 while again[0]'s first block is still being read
    if (queued == 0) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  EXPECT_EQ(queued, 1) << "a finished, untaken read did not make room";
  EXPECT_EQ(one.serve(103, again[1]), 2 * one.P());
  one.expect_contents(103, again[1]);
  EXPECT_EQ(one.manager->stats().read_ahead_hits, 1);
  one.manager->free(103);
  one.manager->reset_prefix_cache();
  EXPECT_EQ(one.manager->prefetch(again[1]), 0) << "nothing is cached after the reset";
  EXPECT_EQ(one.serve(102, again[0]), 0);
  one.expect_contents(102, again[0]);
  EXPECT_EQ(one.manager->stats().read_ahead_hits, 1);
  std::remove(path.c_str());
}

// promote_ahead: host-tier blocks come back on the manager's thread. Each sequence reads back the values
// written, whether its step came at once, after another sequence's step, or never (freed first, its
// pages then taken by other prompts); the invariants hold between operations.
TEST(Tiers, PromotionAheadCopiesBeforeAnyoneReadsThePages) {
  Tiers t("", 8, 16, 0, 64, true);  // no disk tier: every hit below the device is a host-tier block
  std::vector<std::vector<int32_t>> prompts;
  for (int i = 0; i < 8; ++i) {  // two blocks each through 8 pages: most end on the host tier
    prompts.push_back(tier_prompt(i + 1, 2, t.P()));
    t.serve(i, prompts.back());
    t.manager->free(i);
  }
  ASSERT_EQ(t.manager->cached_prefix(prompts[0]), 2 * t.P());
  // Two prompts come back at once; the second one's step comes first, then both read back.
  EXPECT_EQ(t.manager->add(100, prompts[0]), 2 * t.P());
  EXPECT_EQ(t.manager->add(101, prompts[1]), 2 * t.P());
  EXPECT_EQ(t.manager->stats().promoted_ahead, 4) << "the host-tier blocks were not copied ahead";
  t.manager->check_invariants();
  t.write(101, prompts[1], 2 * t.P());
  t.write(100, prompts[0], 2 * t.P());
  t.expect_contents(100, prompts[0]);
  t.expect_contents(101, prompts[1]);
  t.manager->free(100);
  t.manager->free(101);
  // One comes back and is freed before any step: its pages go to the prompts after it, and it comes
  // back again with its values.
  ASSERT_EQ(t.manager->cached_prefix(prompts[2]), 2 * t.P());
  const int64_t ahead = t.manager->stats().promoted_ahead;
  t.manager->add(102, prompts[2]);
  EXPECT_GT(t.manager->stats().promoted_ahead, ahead);
  t.manager->free(102);
  t.manager->check_invariants();
  for (int i = 3; i < 8; ++i) {
    t.serve(200 + i, prompts[size_t(i)]);
    t.expect_contents(200 + i, prompts[size_t(i)]);
    t.manager->free(200 + i);
    t.manager->check_invariants();
  }
  t.serve(300, prompts[2]);
  t.expect_contents(300, prompts[2]);
  t.manager->free(300);
  t.manager->reset_prefix_cache();
  t.manager->check_invariants();
}

TEST(Tiers, AWriterKilledMidRecordLeavesOnlyIntactRecords) {
  const std::string path = temp_file("killed");
  const int64_t packed = 64 * 1024, records = 8;
  const int32_t tokens = 16;
  auto payload = [&](uint64_t key, std::vector<unsigned char>& out) {
    out.resize(size_t(packed));
    for (int64_t i = 0; i < packed; ++i) out[size_t(i)] = (unsigned char)((key * 2654435761u + uint64_t(i)) >> 3);
  };
  const pid_t child = fork();
  ASSERT_GE(child, 0);
  if (child == 0) {  // writes records over and over until it is killed
    auto store = open_file_store(path, records, packed, tokens, "a writer killed mid-record");
    std::vector<unsigned char> bytes;
    for (uint64_t key = 1;; ++key) {
      StoredBlock b{key, 0, 0, 35, std::vector<int32_t>(size_t(tokens), int32_t(key))};
      payload(key, bytes);
      store->write(int64_t(key % uint64_t(records)), b, bytes.data());
    }
  }
  usleep(200 * 1000);
  kill(child, SIGKILL);
  int status = 0;
  waitpid(child, &status, 0);
  auto store = open_file_store(path, records, packed, tokens, "a writer killed mid-record");
  int found = 0;
  std::vector<unsigned char> want, got(static_cast<size_t>(packed));
  store->scan([&](int64_t slot, const StoredBlock& b) {
    ++found;
    EXPECT_EQ(int64_t(b.key % uint64_t(records)), slot);
    EXPECT_EQ(b.tokens, std::vector<int32_t>(size_t(tokens), int32_t(b.key)));
    ASSERT_TRUE(store->read(slot, b.key, got.data()));
    payload(b.key, want);
    EXPECT_EQ(got, want) << "record " << slot << " passed its checksum with wrong bytes";
  });
  EXPECT_GT(found, 0) << "the writer left no record at all";
  std::remove(path.c_str());
}

TEST(Tiers, BadOptionsAreRefusedByName) {
  CacheConfig cfg;
  cfg.pages = 4;
  auto cache = registry().at(kVariant).create(cfg);
  auto refused = [&](SequenceManagerOptions o, const std::string& argument) {
    try {
      SequenceManager m(*cache, o);
      ADD_FAILURE() << "accepted; wanted a refusal naming " << argument;
    } catch (const ArgumentError& e) {
      EXPECT_EQ(e.argument(), argument);
    }
  };
  SequenceManagerOptions o;
  o.host_blocks = 2;
  o.disk_blocks = 4;
  refused(o, "options.disk_path");
  o.disk_path = "/nonexistent/dir/kv.blocks";
  EXPECT_THROW(SequenceManager(*cache, o), BackendError);
  o.host_blocks = 0;
  o.disk_path = temp_file("nohost");
  refused(o, "options.disk_blocks");
  o.host_blocks = 2;
  o.disk_blocks = -1;
  refused(o, "options.disk_blocks");
  o.disk_blocks = 4;
  o.read_ahead_blocks = -1;
  refused(o, "options.read_ahead_blocks");
}

}  // namespace
}  // namespace kvtest
