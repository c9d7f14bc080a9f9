// The disk tier under faults and misuse: nothing wrong is ever served, and no failure leaves a page
// unaccounted for.
//   - A write that fails (EIO, ENOSPC, EFBIG from a store of the test's own; EFBIG from a real file
//     past RLIMIT_FSIZE) drops its block as a miss: every later add() still works, the values read
//     back are the ones written, and the invariants hold.
//   - A file of another variant, weights tag or hash seed is refused at construction, naming both,
//     and nothing in it changes; a record of another identity inside a file is a miss.
//   - reset_prefix_cache() clears the file for a later process too.
//   - One manager owns a file at a time.
//   - A promotion never evicts the prompt's own later device blocks: add() covers what
//     cached_prefix() said.
#include <signal.h>
#include <sys/resource.h>
#include <sys/wait.h>

#include <cerrno>
#include <cstring>
#include <fstream>
#include <algorithm>
#include <map>

#include "tiers_fixture.hpp"

namespace kvtest {
namespace {

// A store in memory whose writes fail with `error` once `fail_after` writes have gone through.
class FailingStore final : public BlockStore {
 public:
  FailingStore(int64_t records, int64_t packed, int error, int fail_after)
      : records_(records), packed_(packed), error_(error), left_(fail_after) {}
  int64_t capacity() const override { return records_; }
  void write(int64_t slot, const StoredBlock& b, const void* packed) override {
    if (left_-- <= 0) {
      held_.erase(slot);  // a failed write may have torn what was there
      throw BackendError(std::string("disk tier: writing a record failed: ") + std::strerror(error_));
    }
    const auto* p = static_cast<const unsigned char*>(packed);
    held_[slot] = {b, std::vector<unsigned char>(p, p + packed_)};
  }
  bool read(int64_t slot, uint64_t key, void* packed) override {
    const auto it = held_.find(slot);
    if (it == held_.end() || it->second.first.key != key) return false;
    std::memcpy(packed, it->second.second.data(), size_t(packed_));
    return true;
  }
  void scan(const std::function<void(int64_t, const StoredBlock&)>& f) override {
    for (const auto& [slot, entry] : held_) f(slot, entry.first);
  }
  void invalidate_all() override { held_.clear(); }
  int failures() const { return left_ < 0 ? -left_ : 0; }

 private:
  int64_t records_, packed_;
  int error_;
  int left_;
  std::map<int64_t, std::pair<StoredBlock, std::vector<unsigned char>>> held_;
};

// Every page is free or held by exactly what holds it: with no live sequence, all of the device pool
// is available again, and the host tier's too.
void expect_every_page_accounted(Tiers& t, int64_t pages, int32_t host) {
  t.manager->check_invariants();
  EXPECT_EQ(t.manager->available_blocks(), pages);
  EXPECT_EQ(t.manager->host_free(), host);
}

TEST(DiskFaults, AFailedWriteDropsItsBlockAsAMissAndEveryPageStaysAccountedFor) {
  for (const int error : {EIO, ENOSPC, EFBIG}) {
    SCOPED_TRACE(std::strerror(error));
    for (const int fail_after : {0, 3}) {
      std::shared_ptr<FailingStore> store;
      Tiers t("", 6, 4, 32, 64, false, [&](SequenceManagerOptions& o, const Cache& cache) {
        store = std::make_shared<FailingStore>(32, cache.packed_page_bytes(), error, fail_after);
        o.disk_store = store;
      });
      const auto prompts = fill(t);
      EXPECT_GT(store->failures(), 0);
      EXPECT_EQ(t.manager->stats().disk_write_failures, store->failures());
      EXPECT_NE(t.manager->last_disk_error().find(std::strerror(error)), std::string::npos) << t.manager->last_disk_error();
      expect_every_page_accounted(t, 6, 4);
      // Every prompt again, twice: those whose blocks reached the disk come back, the others are
      // recomputed; either way the values read back are the ones written.
      for (int round = 0; round < 2; ++round) t.serve_and_check_all(prompts);
      expect_every_page_accounted(t, 6, 4);
    }
  }
}

TEST(DiskFaults, AFileCutByTheFileSizeLimitStillServesRightAndKeepsItsPages) {
  // A real file under RLIMIT_FSIZE, in a child process (the limit is the process's): writes past the
  // header and one record fail with EFBIG.
  const std::string path = temp_file("fsize");
  const pid_t child = fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    signal(SIGXFSZ, SIG_IGN);
    Tiers t(path);
    const int64_t limit = file_store_record_offset(1, t.cache->packed_page_bytes(), t.P());
    const rlimit l{rlim_t(limit), rlim_t(limit)};
    if (setrlimit(RLIMIT_FSIZE, &l) != 0) _exit(3);
    const auto prompts = fill(t);
    t.serve_and_check_all(prompts);
    t.manager->check_invariants();
    const bool ok = !testing::Test::HasFailure() && t.manager->stats().disk_write_failures > 0 &&
                    t.manager->last_disk_error().find("too large") != std::string::npos &&
                    t.manager->available_blocks() == 6;
    _exit(ok ? 0 : 1);
  }
  int status = 0;
  waitpid(child, &status, 0);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << "status " << status;
  std::remove(path.c_str());
}

TEST(DiskFaults, AFileOfAnotherIdentityIsRefusedNamingBothAndLeftAsItIs) {
  const std::string path = temp_file("identity");
  {
    Tiers t(path, 6, 4, 32, 64, false, [](SequenceManagerOptions& o, const Cache&) { o.weights_tag = "step-1000"; });
    fill(t);
  }
  std::ifstream before_file(path, std::ios::binary);
  const std::string before((std::istreambuf_iterator<char>(before_file)), {});
  auto refused = [&](const std::function<void(SequenceManagerOptions&, const Cache&)>& adjust, const char* variant,
                     const char* names) {
    try {
      Tiers t(path, 6, 4, 32, 64, false, adjust, variant);
      ADD_FAILURE() << "a file of another identity was opened (" << names << ")";
    } catch (const ArgumentError& e) {
      EXPECT_EQ(e.argument(), "options.disk_path");
      EXPECT_NE(std::string(e.what()).find(names), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find("weights step-1000"), std::string::npos) << e.what();
    }
  };
  // Other weights; another variant whose pages pack to the same bytes (the same shape, other axes);
  // vLLM's hash under another seed.
  refused([](SequenceManagerOptions& o, const Cache&) { o.weights_tag = "step-2000"; }, kVariant, "weights step-2000");
  refused([](SequenceManagerOptions& o, const Cache&) { o.weights_tag = "step-1000"; }, "flashinfer_paged_hnd.tiny.fp32",
          "variant flashinfer_paged_hnd.tiny.fp32");
  refused([](SequenceManagerOptions& o, const Cache&) {
    o.weights_tag = "step-1000";
    o.block_hash = BlockHashScheme::vllm_sha256_cbor;
  }, kVariant, "block_hash vllm_sha256_cbor");
  std::ifstream after_file(path, std::ios::binary);
  EXPECT_TRUE(std::string((std::istreambuf_iterator<char>(after_file)), {}) == before) << "a refused open changed the file";
  // The same identity reuses it.
  Tiers same(path, 6, 4, 32, 64, false, [](SequenceManagerOptions& o, const Cache&) { o.weights_tag = "step-1000"; });
  EXPECT_FALSE(same.manager->disk_cached_block_hashes().empty());
  std::remove(path.c_str());
}

TEST(DiskFaults, ARecordOfAnotherIdentityInsideAFileIsAMiss) {
  // Another identity's records, copied byte for byte into this identity's file over its own: none
  // checks out (each names its identity), so nothing of them is served or even adopted.
  const std::string mine = temp_file("mine"), theirs = temp_file("theirs");
  {
    Tiers t(mine);
    fill(t);
  }
  {
    Tiers t(theirs, 6, 4, 32, 64, false, [](SequenceManagerOptions& o, const Cache&) { o.weights_tag = "other"; });
    fill(t);
  }
  std::ifstream in(theirs, std::ios::binary);
  std::string records((std::istreambuf_iterator<char>(in)), {});
  std::fstream out(mine, std::ios::in | std::ios::out | std::ios::binary);
  out.seekp(4096);  // past the file's header: every record
  out.write(records.data() + 4096, std::streamsize(records.size() - 4096));
  out.close();
  Tiers t(mine);
  EXPECT_TRUE(t.manager->disk_cached_block_hashes().empty());
  std::remove(mine.c_str());
  std::remove(theirs.c_str());
}

TEST(DiskFaults, ResetClearsTheFileForALaterProcess) {
  // Blocks on disk before reset_prefix_cache() never come back in a later manager on the file; blocks
  // written after it do.
  const std::string path = temp_file("reset");
  std::vector<std::vector<int32_t>> prompts;
  std::vector<uint64_t> cleared, written_after;
  {
    Tiers t(path);
    prompts = fill(t);
    cleared = t.manager->disk_cached_block_hashes();
    ASSERT_FALSE(cleared.empty());
    t.manager->reset_prefix_cache();
    for (int i = 0; i < 6; ++i) t.serve(200 + i, tier_prompt(500 + i, 2, t.P())), t.manager->free(200 + i);
    written_after = t.manager->disk_cached_block_hashes();
    ASSERT_FALSE(written_after.empty());
  }
  Tiers again(path);
  const std::vector<uint64_t> found = again.manager->disk_cached_block_hashes();
  for (const uint64_t key : cleared)
    EXPECT_EQ(std::count(found.begin(), found.end(), key), 0) << "block " << key << " came back though the reset cleared it";
  EXPECT_EQ(found, written_after);
  again.serve_and_check_all(prompts);  // recomputed, with the values written
  std::remove(path.c_str());
}

TEST(DiskFaults, OneManagerOwnsAFileAtATime) {
  const std::string path = temp_file("owner");
  auto first = std::make_unique<Tiers>(path);
  try {
    Tiers second(path);
    ADD_FAILURE() << "two managers opened one disk file";
  } catch (const StateError& e) {
    EXPECT_EQ(e.argument(), "options.disk_path");
    EXPECT_NE(std::string(e.what()).find(path), std::string::npos) << e.what();
  }
  first.reset();
  Tiers second(path);  // free again once the first is gone
  std::remove(path.c_str());
}

TEST(DiskFaults, APromotionNeverEvictsThePromptsOwnLaterDeviceBlocks) {
  // A prompt of three blocks whose first two live in the host tier and whose third is on the device,
  // in a pool with one free page: promoting the first two must evict a device block, and the prompt's
  // own third one is the least recently used.
  const std::string path = temp_file("promote");
  Tiers t(path, 4, 8, 32);
  const std::vector<int32_t> prompt = tier_prompt(7, 3, t.P());  // 3 blocks and a token: all 4 pages
  ASSERT_EQ(t.serve(1, prompt), 0);
  t.manager->free(1);
  // Two prompts of one block take pages, evicting the prompt's two oldest blocks to the host tier.
  for (int i = 0; i < 2; ++i) t.serve(10 + i, tier_prompt(20 + i, 1, t.P())), t.manager->free(10 + i);
  BlockChain chain;
  std::vector<uint64_t> keys;
  for (int b = 0; b < 3; ++b) keys.push_back((chain = t.manager->hasher().next(chain, 0, prompt.data() + b * t.P(), t.P())).key);
  auto holds = [](const std::vector<uint64_t>& hashes, uint64_t key) {
    return std::find(hashes.begin(), hashes.end(), key) != hashes.end();
  };
  ASSERT_TRUE(holds(t.manager->host_cached_block_hashes(), keys[0]) && holds(t.manager->host_cached_block_hashes(), keys[1]));
  ASSERT_TRUE(holds(t.manager->cached_block_hashes(), keys[2])) << "the scenario's third block left the device";
  const int64_t said = t.manager->cached_prefix(prompt);
  ASSERT_EQ(said, 3 * t.P());
  EXPECT_EQ(t.serve(2, prompt), said) << "add() covered less than cached_prefix() said";
  t.expect_contents(2, prompt);
  t.manager->free(2);
  t.manager->check_invariants();
  std::remove(path.c_str());
}

}  // namespace
}  // namespace kvtest
