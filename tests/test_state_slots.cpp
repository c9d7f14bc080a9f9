// StateSlots (state_slots.hpp): prefix reuse for hybrid models. A fake linear layer keeps, per sequence,
// a state that is a function of every token so far (the test computes it from the tokens alone); a
// sequence started from a cached prefix must find exactly the state of the tokens it was told are
// covered, and computing the rest from there must give the state of the whole prompt.
#include "support.hpp"

namespace kvtest {
namespace {

// The fake layer's state after `tokens`: count, sum, position-weighted sum mod 4093, last token. Exact
// in fp32 (every value below 2^24).
std::vector<float> state_of(const std::vector<int32_t>& tokens, size_t n) {
  int64_t sum = 0, weighted = 0;
  for (size_t i = 0; i < n; ++i) {
    sum += tokens[i];
    weighted = (weighted + int64_t(i + 1) * tokens[i]) % 4093;
  }
  return {float(n), float(sum), float(weighted), n ? float(tokens[n - 1]) : 0.0f};
}

std::vector<float> held(const StatePool& pool, const StateSlots& slots, int64_t seq) {
  std::vector<float> out(4);
  pool.read(slots.slot(seq), 0, 0, out.data(), Device::cpu);
  return out;
}

struct Engine {
  std::unique_ptr<Cache> cache;
  std::unique_ptr<SequenceManager> manager;
  std::unique_ptr<StatePool> pool;
  std::unique_ptr<StateSlots> slots;
  int P = 0;
  // in_pages: the states lie in the cache's own pages (state_slots is then unused: pages are the slots).
  Engine(int64_t state_slots, int64_t checkpoints, int32_t every = 2, int64_t pages = 64, int32_t host_blocks = 0,
         bool in_pages = false) {
    // A paged float variant of the tiny model, chosen by property.
    const VariantEntry* entry = nullptr;
    for (const VariantEntry& e : registry().variants())
      if (e.descriptor->paged() && !e.descriptor->is_hybrid() && !e.descriptor->quantized() && e.descriptor->page_size == 16 &&
          std::string(e.descriptor->model) == "tiny")
        entry = &e;
    CacheConfig cfg;
    cfg.pages = pages;
    cache = entry->create(cfg);
    P = entry->descriptor->page_size;
    SequenceManagerOptions o;
    o.host_blocks = host_blocks;
    manager = std::make_unique<SequenceManager>(*cache, o);
    const std::vector<StatePart> record{{"h", {4}, DType::f32}};
    pool = in_pages ? std::make_unique<StatePool>(record, 1, *cache, checkpoints)
                    : std::make_unique<StatePool>(record, 1, StatePoolConfig{Device::cpu, state_slots, checkpoints});
    slots = std::make_unique<StateSlots>(*manager, *pool, every);
  }
  // One forward of seq's pending tokens: the fake layer advances the state to all its tokens.
  void forward(int64_t seq) {
    manager->step({seq});
    const std::vector<int32_t>& t = manager->tokens(seq);
    pool->write(slots->slot(seq), 0, 0, state_of(t, t.size()).data(), Device::cpu);
    slots->checkpoint(seq);
  }
  // Prefill in chunks that end on checkpoint boundaries, as an engine aligns them; then free.
  void prefill_aligned(int64_t seq, const std::vector<int32_t>& prompt) {
    const int64_t first = std::min<int64_t>(int64_t(prompt.size()), int64_t(slots->every()) * P);
    slots->add(seq, std::vector<int32_t>(prompt.begin(), prompt.begin() + first));
    forward(seq);
    while (manager->length(seq) < int64_t(prompt.size())) {
      const int64_t from = manager->length(seq), to = std::min<int64_t>(int64_t(prompt.size()), slots->next_boundary(seq));
      manager->append(seq, std::vector<int32_t>(prompt.begin() + from, prompt.begin() + to));
      forward(seq);
    }
  }
};

std::vector<int32_t> tokens(int n, int seed) {
  std::vector<int32_t> t;
  for (int i = 0; i < n; ++i) t.push_back(int32_t((seed * 7919 + i * 31) % 997));
  return t;
}

// Each flow with a StatePool of its own, and with the states in the cache's pages (StatePool over the
// cache, its slots and checkpoints taken from the manager).
class StateSlotsEitherPool : public testing::TestWithParam<bool> {};
INSTANTIATE_TEST_SUITE_P(Pools, StateSlotsEitherPool, testing::Values(false, true),
                         [](const testing::TestParamInfo<bool>& i) { return i.param ? "InPages" : "OwnPool"; });

TEST_P(StateSlotsEitherPool, APrefixHitRestoresTheLongestCheckpointedBoundaryAndComputingOnGivesThePromptsState) {
  Engine e(4, 8, 2, 64, 0, GetParam());
  const std::vector<int32_t> first = tokens(100, 1);
  e.prefill_aligned(0, first);
  EXPECT_EQ(e.slots->stats().checkpoints, 3);  // at 32, 64 and 96 (every 2 blocks of 16)
  EXPECT_EQ(held(*e.pool, *e.slots, 0), state_of(first, 100));
  e.slots->free(0);
  // The first 90 tokens again, then others: blocks 0..4 (80 tokens) are cached, and 64 is the longest
  // boundary with a kept state.
  std::vector<int32_t> second(first.begin(), first.begin() + 90);
  for (int32_t t : tokens(30, 2)) second.push_back(t);
  EXPECT_EQ(e.manager->cached_prefix(second), 80);
  EXPECT_EQ(e.slots->add(1, second), 64);
  EXPECT_EQ(held(*e.pool, *e.slots, 1), state_of(second, 64));
  EXPECT_EQ(e.slots->stats().restores, 1);
  EXPECT_EQ(e.slots->stats().capped_tokens, 16);
  e.forward(1);
  EXPECT_EQ(held(*e.pool, *e.slots, 1), state_of(second, second.size()));
  e.manager->check_invariants();
}

TEST_P(StateSlotsEitherPool, WithoutCheckpointsNothingIsSharedAndTheSlotStartsAtZero) {
  Engine e(4, 0, 2, 64, 0, GetParam());
  const std::vector<int32_t> first = tokens(100, 1);
  e.prefill_aligned(0, first);
  e.slots->free(0);
  EXPECT_EQ(e.slots->add(1, first), 0);
  EXPECT_EQ(held(*e.pool, *e.slots, 1), std::vector<float>(4, 0.0f));
  EXPECT_EQ(e.slots->stats().capped_tokens, 96);  // what attention alone would have shared
}

TEST_P(StateSlotsEitherPool, DecodingThroughABoundaryCheckpointsThereAndAForkCopiesTheState) {
  Engine e(4, 8, 2, 64, 0, GetParam());
  std::vector<int32_t> t = tokens(20, 3);
  e.slots->add(0, t);
  e.forward(0);
  for (int i = 0; i < 20; ++i) {  // one token a step, through position 32
    e.manager->append(0, {int32_t(500 + i)});
    t.push_back(int32_t(500 + i));
    e.forward(0);
  }
  EXPECT_EQ(e.slots->stats().checkpoints, 1);
  e.slots->fork(0, 1);
  EXPECT_EQ(held(*e.pool, *e.slots, 1), state_of(t, t.size()));
  e.manager->append(1, {7});
  e.forward(1);
  EXPECT_EQ(held(*e.pool, *e.slots, 0), state_of(t, t.size())) << "the parent's state moved with the child's";
  e.slots->free(0);
  e.slots->free(1);
  // A prompt that shares the decoded sequence's first 40 tokens starts from its boundary at 32.
  std::vector<int32_t> again(t.begin(), t.begin() + 40);
  EXPECT_EQ(e.slots->add(2, again), 32);
  EXPECT_EQ(held(*e.pool, *e.slots, 2), state_of(t, 32));
}

TEST_P(StateSlotsEitherPool, TheLeastRecentlyUsedCheckpointMakesRoom) {
  Engine e(4, 2, 2, 64, 0, GetParam());
  const std::vector<int32_t> first = tokens(100, 4);
  e.prefill_aligned(0, first);  // 32, 64, then 96 replaces 32
  EXPECT_EQ(e.slots->stats().replaced, 1);
  EXPECT_EQ(e.slots->checkpoints_held(), 2);
  e.slots->free(0);
  EXPECT_EQ(e.slots->add(1, std::vector<int32_t>(first.begin(), first.begin() + 50)), 0);
  EXPECT_EQ(e.slots->add(2, std::vector<int32_t>(first.begin(), first.begin() + 70)), 64);
}

TEST(StateSlots, OffloadFreesTheSlotAndRestoreBringsTheStateBackIntoAnother) {
  Engine e(1, 2, 2, 64, 16);  // one state slot, a host tier of 16 pages
  const std::vector<int32_t> a = tokens(40, 7), b = tokens(20, 8);
  e.slots->add(0, a);
  e.forward(0);
  e.slots->offload(0);
  EXPECT_TRUE(e.manager->offloaded(0));
  EXPECT_THROW(e.slots->slot(0), StateError);
  e.slots->add(1, b);  // the only slot, now another sequence's
  e.forward(1);
  EXPECT_THROW(e.slots->restore(0), CapacityError);
  EXPECT_TRUE(e.manager->offloaded(0)) << "a refused restore changed the sequence";
  e.slots->free(1);
  e.slots->restore(0);
  EXPECT_EQ(held(*e.pool, *e.slots, 0), state_of(a, a.size()));
  e.manager->append(0, {9});
  e.forward(0);
  std::vector<int32_t> more = a;
  more.push_back(9);
  EXPECT_EQ(held(*e.pool, *e.slots, 0), state_of(more, more.size()));
  e.manager->check_invariants();
}

TEST(StateSlots, RefusalsNameTheArgumentAndChangeNothing) {
  Engine e(1, 2);
  e.slots->add(0, tokens(10, 5));
  try {
    e.slots->add(1, tokens(10, 6));
    ADD_FAILURE() << "a second sequence got the only slot";
  } catch (const CapacityError& c) {
    EXPECT_EQ(c.argument(), "states");
  }
  EXPECT_FALSE(e.manager->contains(1));
  EXPECT_THROW(e.slots->fork(0, 1), CapacityError);
  EXPECT_FALSE(e.manager->contains(1));
  EXPECT_THROW(e.slots->free(7), StateError);
  EXPECT_THROW(e.slots->add(0, tokens(3, 1)), StateError);
  EXPECT_THROW(StateSlots(*e.manager, *e.pool, 0), OutOfRangeError);
  e.slots->free(0);
  EXPECT_EQ(e.slots->add(1, tokens(10, 6)), 0);  // the slot came back
  e.manager->check_invariants();
}

// A sequence whose pages came another way (a transfer's receiver adds them through the manager) gets a
// zeroed slot of its own, and free() gives back both.
TEST(StateSlots, AttachGivesAManagedSequenceAZeroedSlot) {
  Engine e(2, 0);
  e.slots->add(0, tokens(10, 5));
  e.forward(0);
  e.slots->add(5, tokens(12, 9));  // leaves its state in the other slot when freed
  e.forward(5);
  e.slots->free(5);
  e.manager->add(1, tokens(20, 7));
  EXPECT_THROW(e.slots->attach(0), StateError);  // holds one already
  EXPECT_THROW(e.slots->attach(2), StateError);  // the manager does not hold it
  EXPECT_EQ(e.slots->free_slots(), 1);
  const int64_t slot = e.slots->attach(1);
  EXPECT_EQ(slot, e.slots->slot(1));
  EXPECT_NE(e.slots->slot(1), e.slots->slot(0));
  EXPECT_EQ(held(*e.pool, *e.slots, 1), std::vector<float>(4, 0.0f));
  EXPECT_EQ(held(*e.pool, *e.slots, 0), state_of(tokens(10, 5), 10));  // the other sequence's state stays
  e.manager->add(2, tokens(30, 3));
  EXPECT_THROW(e.slots->attach(2), CapacityError);
  e.slots->free(1);
  EXPECT_FALSE(e.manager->contains(1));
  EXPECT_EQ(e.slots->free_slots(), 1);
  e.manager->check_invariants();
}

TEST(StateSlots, PlanMemoryTakesTheStatesBeforeThePages) {
  const VariantDescriptor& d = *registry().at("vllm_paged_nhd.tiny.fp32").descriptor;
  const StatePool pool({{"conv", {64, 4}, DType::bf16}, {"ssm", {4, 16, 16}, DType::f32}}, 3,
                       StatePoolConfig{Device::cpu, 4, 6});
  MemoryRequest r;
  r.mode = PlanMode::reserve;
  r.budget_bytes = int64_t(1) << 20;
  r.state_slot_bytes = pool.slot_bytes(), r.state_slots = 4, r.state_checkpoints = 6;
  const MemoryPlan p = plan_memory(d, r);
  EXPECT_EQ(p.state_bytes, pool.bytes());
  // One page: K and V of every layer for page_size tokens, fp32 (the tiny model: 2 layers, 2 heads of 16).
  const int64_t page = 2 * 2 * 2 * 16 * 4 * int64_t(d.page_size);
  EXPECT_EQ(p.page_bytes, page);
  EXPECT_EQ(p.pages, ((int64_t(1) << 20) - pool.bytes()) / page);
  r.budget_bytes = pool.bytes();  // the states alone fill it
  EXPECT_THROW(plan_memory(d, r), CapacityError);
  r.state_checkpoints = -1;
  try {
    plan_memory(d, r);
    ADD_FAILURE() << "a negative checkpoint count was planned";
  } catch (const OutOfRangeError& e) {
    EXPECT_EQ(e.argument(), "state_checkpoints");
  }
}

}  // namespace
}  // namespace kvtest
