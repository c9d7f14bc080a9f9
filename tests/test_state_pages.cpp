// StatePool in a paged cache's own pages (state_pool.hpp): one pool and one free list for K/V and states.
// The reference for where a page's K/V lies is the cache's own append and gather over logical
// coordinates: a state written into page s must leave every other page's K/V as it was, K/V written into
// other pages must leave the state as it was, and the state reads back (by read and through its view)
// as written. StateSlots over such a pool takes its slots and checkpoints from the SequenceManager.
#include "support.hpp"

namespace kvtest {
namespace {

std::unique_ptr<Cache> make(const std::string& name, int64_t pages) {
  CacheConfig cfg;
  cfg.pages = pages;
  return registry().at(name).create(cfg);
}

float kv_value(int layer, int kv, int64_t slot, int head, int d, int round) {
  return exact_value((uint64_t(round) << 48) ^ (uint64_t(layer) << 40) ^ (uint64_t(kv) << 36) ^ (uint64_t(slot) << 12) ^
                     (uint64_t(head) << 8) ^ uint64_t(d));
}

// Appends K/V of `round` into every slot of `pages` of a float cache.
void fill_pages(Cache& c, const std::vector<int32_t>& pages, int round) {
  const VariantDescriptor& d = c.descriptor();
  const int H = d.heads, D = d.head_dim, P = d.page_size, es = dtype_size(d.input);
  std::vector<int64_t> slots;
  for (int32_t p : pages)
    for (int s = 0; s < P; ++s) slots.push_back(int64_t(p) * P + s);
  Arena arena(Device::cpu);
  for (int layer = 0; layer < d.layers; ++layer) {
    std::vector<unsigned char> k(slots.size() * H * D * es), v(k.size());
    for (size_t t = 0; t < slots.size(); ++t)
      for (int h = 0; h < H; ++h)
        for (int x = 0; x < D; ++x) {
          store_as(d.input, kv_value(layer, 0, slots[t], h, x, round), k.data() + ((t * H + h) * D + x) * es);
          store_as(d.input, kv_value(layer, 1, slots[t], h, x, round), v.data() + ((t * H + h) * D + x) * es);
        }
    const int64_t T = int64_t(slots.size());
    c.append(layer, TensorView::contiguous(arena.put(k), d.input, Device::cpu, T, H, D),
             TensorView::contiguous(arena.put(v), d.input, Device::cpu, T, H, D), TokenTargets::paged(arena.index(slots)));
  }
  c.commit();
}

// Whether page `page` of every layer gathers back round `round`'s K/V.
bool page_holds(Cache& c, int32_t page, int round) {
  const VariantDescriptor& d = c.descriptor();
  const int H = d.heads, D = d.head_dim, P = d.page_size, es = dtype_size(d.input);
  Arena arena(Device::cpu);
  for (int layer = 0; layer < d.layers; ++layer) {
    std::vector<unsigned char> k(size_t(H) * P * D * es), v(k.size());
    c.gather(layer, GatherRange{0, arena.index(std::vector<int32_t>{page}), 0, P},
             TensorView::contiguous(k.data(), d.input, Device::cpu, H, P, D),
             TensorView::contiguous(v.data(), d.input, Device::cpu, H, P, D));
    for (int h = 0; h < H; ++h)
      for (int s = 0; s < P; ++s)
        for (int x = 0; x < D; ++x) {
          const size_t at = ((size_t(h) * P + s) * D + x) * es;
          const int64_t slot = int64_t(page) * P + s;
          if (load_as(d.input, k.data() + at) != kv_value(layer, 0, slot, h, x, round) ||
              load_as(d.input, v.data() + at) != kv_value(layer, 1, slot, h, x, round))
            return false;
        }
  }
  return true;
}

std::vector<StatePart> record() { return {{"conv", {6, 3}, DType::bf16}, {"ssm", {2, 4, 4}, DType::f32}}; }

// Distinct bytes for (slot, layer, part), as the part's elements.
std::vector<unsigned char> state_bytes(const StatePool& pool, int64_t slot, int layer, int part) {
  const StatePart& p = pool.parts()[size_t(part)];
  const int64_t es = dtype_size(p.dtype), n = pool.part_bytes(part) / es;
  std::vector<unsigned char> out(size_t(pool.part_bytes(part)));
  for (int64_t i = 0; i < n; ++i) store_as(p.dtype, exact_value(uint64_t(slot) * 7919 + layer * 131 + part * 17 + i), out.data() + i * es);
  return out;
}

std::vector<unsigned char> read_part(const StatePool& pool, int64_t slot, int layer, int part) {
  std::vector<unsigned char> out(size_t(pool.part_bytes(part)));
  pool.read(slot, layer, part, out.data(), Device::cpu);
  return out;
}

std::vector<char> as_chars(const std::vector<unsigned char>& b) { return std::vector<char>(b.begin(), b.end()); }

void write_state(StatePool& pool, int64_t slot, int64_t as) {
  for (int layer = 0; layer < pool.layers(); ++layer)
    for (int part = 0; part < int(pool.parts().size()); ++part)
      pool.write(slot, layer, part, state_bytes(pool, as, layer, part).data(), Device::cpu);
}

bool holds_state(const StatePool& pool, int64_t slot, int64_t as) {
  for (int layer = 0; layer < pool.layers(); ++layer)
    for (int part = 0; part < int(pool.parts().size()); ++part)
      if (read_part(pool, slot, layer, part) != state_bytes(pool, as, layer, part) ||
          state_view_bytes(pool, slot, layer, part) != as_chars(state_bytes(pool, as, layer, part)))
        return false;
  return true;
}

// vllm_paged_nhd keeps each layer's K and V blocks of a page apart (runs of one layer's K or V), and
// paged_state_pages keeps a page whole (one run): both kinds of placement.
class StatePages : public testing::TestWithParam<std::string> {};

TEST_P(StatePages, StatesAndKvShareThePagesWithoutTouchingEachOther) {
  auto cache = make(GetParam(), 8);
  std::vector<int32_t> all(8);
  std::iota(all.begin(), all.end(), 0);
  fill_pages(*cache, all, 1);
  StatePool pool(record(), 3, *cache, 0);
  EXPECT_EQ(pool.config().slots, 8);
  EXPECT_EQ(pool.bytes(), 0);
  EXPECT_EQ(pool.data(), nullptr);
  EXPECT_EQ(pool.page_bytes(), cache->memory().storage_bytes / 8);
  EXPECT_EQ(pool.page_padding_bytes(), pool.page_bytes() - 3 * (36 + 128));
  write_state(pool, 3, 3);
  write_state(pool, 5, 5);
  for (int32_t p : all) EXPECT_EQ(page_holds(*cache, p, 1), p != 3 && p != 5) << "page " << p;
  fill_pages(*cache, {0, 1, 2, 4, 6, 7}, 2);  // K/V around the states
  EXPECT_TRUE(holds_state(pool, 3, 3));
  EXPECT_TRUE(holds_state(pool, 5, 5));
  // Whole-state moves: fork, checkpoint (a page too), restore, zero, and the host image.
  pool.copy_slot(3, 6);
  EXPECT_TRUE(holds_state(pool, 6, 3));
  pool.checkpoint(5, 7);
  pool.zero_slot(5);
  const std::vector<unsigned char> zero(size_t(pool.part_bytes(1)), 0);
  EXPECT_EQ(read_part(pool, 5, 2, 1), zero);
  pool.restore(7, 5);
  EXPECT_TRUE(holds_state(pool, 5, 5));
  // The host image (offload, transfers) is a pool of its own's slot, byte for byte, both ways.
  StatePool own(record(), 3, StatePoolConfig{Device::cpu, 2, 0});
  write_state(own, 1, 3);
  std::vector<unsigned char> image(size_t(own.slot_bytes())), back(image.size(), 0xee);
  own.read_slot(1, image.data());
  ASSERT_EQ(pool.slot_bytes(), own.slot_bytes());
  pool.read_slot(3, back.data());
  EXPECT_EQ(back, image);
  write_state(own, 1, 9);
  own.read_slot(1, image.data());
  pool.write_slot(2, image.data());
  EXPECT_TRUE(holds_state(pool, 2, 9));
  EXPECT_TRUE(page_holds(*cache, 0, 2) && page_holds(*cache, 1, 2) && page_holds(*cache, 4, 2)) << "a state move spilled";
  EXPECT_THROW(pool.checkpoint(5, 8), OutOfRangeError);
  EXPECT_THROW(pool.copy_slot(-1, 2), OutOfRangeError);
}

INSTANTIATE_TEST_SUITE_P(Layouts, StatePages, testing::Values("vllm_paged_nhd.tiny.fp32", "paged_state_pages.tiny_gdn.fp32"),
                         [](const testing::TestParamInfo<std::string>& i) { return i.param.substr(0, i.param.find('.')); });

// Every paged variant this build registered, whatever its layout, storage and scales: a state that a
// page holds, written into one page, leaves every other page's K/V (codes and scales, as gather reads
// them back) as it was, and reads back as written. A page too small is refused before anything moves.
TEST(StatePagesEveryLayout, AStateInOnePageLeavesTheOtherPagesAsTheyWere) {
  int checked = 0;
  for (const VariantEntry& e : registry().variants()) {
    const VariantDescriptor& d = *e.descriptor;
    if (!d.paged() || d.is_hybrid() || d.layers * int64_t(d.heads) * d.head_dim * d.page_size > (int64_t(1) << 22)) continue;
    auto cache = make(d.name, 4);
    std::vector<int32_t> all{0, 1, 2, 3};
    fill_pages(*cache, all, 3);
    auto snapshot = [&](int32_t page) {
      const int H = d.heads, D = d.head_dim, P = d.page_size, es = dtype_size(d.input);
      std::vector<unsigned char> out;
      Arena arena(Device::cpu);
      for (int layer = 0; layer < d.layers; ++layer) {
        std::vector<unsigned char> k(size_t(H) * P * D * es), v(k.size());
        cache->gather(layer, GatherRange{0, arena.index(std::vector<int32_t>{page}), 0, P},
                      TensorView::contiguous(k.data(), d.input, Device::cpu, H, P, D),
                      TensorView::contiguous(v.data(), d.input, Device::cpu, H, P, D));
        out.insert(out.end(), k.begin(), k.end());
        out.insert(out.end(), v.begin(), v.end());
      }
      return out;
    };
    std::vector<std::vector<unsigned char>> before;
    for (int32_t p : all) before.push_back(snapshot(p));
    std::unique_ptr<StatePool> pool;
    try {
      pool = std::make_unique<StatePool>(std::vector<StatePart>{{"conv", {3, 2}, DType::bf16}, {"ssm", {4, 2}, DType::f32}}, 2, *cache);
    } catch (const ShapeError& x) {
      EXPECT_EQ(x.argument(), "cache") << d.name;
      for (int32_t p : all) EXPECT_EQ(snapshot(p), before[size_t(p)]) << d.name << ": a refused pool moved page " << p;
      continue;
    }
    write_state(*pool, 2, 7);
    EXPECT_TRUE(holds_state(*pool, 2, 7)) << d.name;
    for (int32_t p : {0, 1, 3}) EXPECT_EQ(snapshot(p), before[size_t(p)]) << d.name << ": page " << p << " moved";
    ++checked;
  }
  EXPECT_GT(checked, 0);
}

// A page of a layout that keeps it whole (page first, then every other axis: one run) holds the state
// with only its own alignment to spare: the parts one after another, each on 64 bytes, the smallest
// last. So the smallest page is those bytes over a token's, rounded up to the layout's page size. Float
// storage whose token is whole 64-byte lines, so that every page stride keeps parts on 64 bytes.
TEST(StatePagesFit, APageMajorLayoutNeedsTheStatesBytesOverATokensAndNoMore) {
  int checked = 0;
  for (const VariantEntry& e : registry().variants()) {
    const VariantDescriptor& d = *e.descriptor;
    if (!d.states || !d.paged() || d.is_hybrid() || d.quantized() || d.bytes_per_token % 64 != 0) continue;
    const Axis* axes_end = d.axes + d.num_axes;
    if (d.axes[0] != Axis::page || std::find(d.axes, axes_end, Axis::layer) == axes_end ||
        std::find(d.axes, axes_end, Axis::kv) == axes_end)
      continue;
    std::vector<int64_t> sizes;
    for (int layer = 0; layer < d.states->num_linear; ++layer)
      for (const StatePart& p : state_parts(d)) {
        int64_t n = dtype_size(p.dtype);
        for (int64_t x : p.shape) n *= x;
        sizes.push_back(n);
      }
    std::sort(sizes.rbegin(), sizes.rend());
    int64_t state = 0;
    for (int64_t n : sizes) state = (state + 63) / 64 * 64 + n;
    const int64_t tokens = (state + d.bytes_per_token - 1) / d.bytes_per_token;
    EXPECT_EQ(state_page_size(d), (tokens + d.page_size - 1) / d.page_size * d.page_size) << d.name;
    ++checked;
  }
  if (checked == 0) GTEST_SKIP() << "no page-major float variant of a hybrid model is registered";
  // Qwen3-Next-80B by hand: 36 x (8192 x 4 x 2 + 32 x 128 x 128 x 4) bytes of state over 24,576 a token.
  if (const VariantEntry* q = registry().find("paged_state_pages.qwen3_next_80b.bf16")) {
    EXPECT_EQ(state_page_size(*q->descriptor), 3168);
  }
}

// A layout whose page keeps its rows apart ([kv, slot, page, head, dim]: a run is one token's heads)
// never holds a part larger than a row, at any page size, and the search for one ends.
TEST(StatePagesFit, ALayoutWhoseRowsLieApartHoldsNoStateAndTheSearchEnds) {
  int checked = 0;
  for (const VariantEntry& e : registry().variants()) {
    const VariantDescriptor& d = *e.descriptor;
    if (!d.states || !d.paged() || d.is_hybrid() || d.layers > 4) continue;
    int64_t largest = 0;  // a run is a row of one token's heads: a part larger than that fits nowhere
    for (const StatePart& p : state_parts(d)) {
      int64_t n = dtype_size(p.dtype);
      for (int64_t x : p.shape) n *= x;
      largest = std::max(largest, n);
    }
    if (largest <= int64_t(d.heads) * d.stored_dim() * dtype_size(d.storage)) continue;
    VariantDescriptor apart = d;
    const Axis axes[] = {Axis::kv, Axis::slot, Axis::page, Axis::head, Axis::dim};
    apart.num_axes = 5;
    std::copy(std::begin(axes), std::end(axes), apart.axes);
    EXPECT_EQ(state_page_size(apart), 0) << d.name;
    ++checked;
  }
  EXPECT_GT(checked, 0);
}

TEST(StatePagesFit, APageTooSmallIsRefusedNamingThePageThatWouldDo) {
  const VariantDescriptor* small = nullptr;  // a hybrid model's paged variant whose page is too small
  for (const VariantEntry& e : registry().variants())
    if (e.descriptor->states && e.descriptor->paged() && !e.descriptor->is_hybrid() && e.descriptor->layers <= 4 &&
        state_page_size(*e.descriptor) > e.descriptor->page_size)
      small = e.descriptor;
  if (!small) GTEST_SKIP() << "no paged variant of a hybrid model whose page is too small for its state is registered";
  const VariantDescriptor& d = *small;
  const int64_t enough = state_page_size(d);
  auto cache = make(d.name, 4);
  try {
    StatePool pool(*cache);
    ADD_FAILURE() << "a state larger than a page was placed";
  } catch (const ShapeError& e) {
    EXPECT_EQ(e.argument(), "cache");
    EXPECT_NE(std::string(e.what()).find("a page of " + std::to_string(enough) + " tokens"), std::string::npos) << e.what();
  }
  CacheConfig cfg;
  cfg.rows = 2;
  for (const VariantEntry& e : registry().variants())
    if (!e.descriptor->paged() && !e.descriptor->is_hybrid()) {
      auto rows = e.create(cfg);
      EXPECT_THROW(StatePool(record(), 1, *rows), UnsupportedError) << e.descriptor->name;
      break;
    }
}

TEST(StatePagesManager, TakenPagesComeFromTheFreeListAndGoBackAndNothingElse) {
  auto cache = make("vllm_paged_nhd.tiny.fp32", 6);
  SequenceManager m(*cache);
  m.add(0, std::vector<int32_t>(40, 7));  // 3 pages
  m.step({0});
  m.free(0);  // 2 full blocks stay cached, evictable
  EXPECT_EQ(m.available_blocks(), 6);
  EXPECT_THROW(m.take_pages(7), CapacityError);
  EXPECT_THROW(m.take_pages(-1), OutOfRangeError);
  const std::vector<int32_t> taken = m.take_pages(5);  // takes the free pages, then evicts a cached one
  EXPECT_EQ(m.taken_pages(), 5);
  EXPECT_EQ(m.available_blocks(), 1);
  EXPECT_EQ(m.stats().evictions, 1);
  m.check_invariants();
  EXPECT_THROW(m.give_pages({taken[0], taken[0]}), StateError);
  EXPECT_THROW(m.give_pages({taken[0], 99}), StateError);
  EXPECT_EQ(m.taken_pages(), 5) << "a refused give_pages changed something";
  EXPECT_THROW(m.add(1, std::vector<int32_t>(40, 9)), CapacityError);  // K/V competes for the same pages
  m.give_pages(taken);
  EXPECT_EQ(m.available_blocks(), 6);
  m.add(1, std::vector<int32_t>(40, 9));
  m.check_invariants();
}

// StateSlots over a pool in the manager's cache's pages: a sequence's state takes one page beside its
// K/V pages, a fork one more, a checkpoint one (up to the pool's cap); free and the destructor give
// them all back.
TEST(StatePagesManager, StateSlotsTakeSlotsAndCheckpointsFromTheManagersPages) {
  auto cache = make("paged_state_pages.tiny_gdn.fp32", 8);
  SequenceManager m(*cache);
  StatePool pool(*cache, 1);
  {
    StateSlots slots(m, pool, 1);
    const int32_t P = m.block_size();
    std::vector<int32_t> prompt(size_t(P) + 5, 3);
    slots.add(0, prompt);  // 2 K/V pages and a state page
    EXPECT_EQ(m.available_blocks(), 5);
    EXPECT_EQ(slots.free_slots(), 5);
    const int64_t s0 = slots.slot(0);
    EXPECT_EQ(std::count(m.pages(0).begin(), m.pages(0).end(), int32_t(s0)), 0) << "the state's page is also K/V's";
    write_state(pool, s0, 11);
    m.step({0});
    slots.fork(0, 1);  // shares the K/V pages, copies the state into a page of its own
    EXPECT_EQ(m.available_blocks(), 4);
    EXPECT_TRUE(holds_state(pool, slots.slot(1), 11));
    slots.free(1);
    EXPECT_EQ(m.available_blocks(), 5);
    m.append(0, std::vector<int32_t>(size_t(P) - 5, 4));  // fills page 2 of 0: a boundary at 2 * P
    m.step({0});
    EXPECT_TRUE(slots.checkpoint(0));
    EXPECT_EQ(slots.checkpoints_held(), 1);
    EXPECT_EQ(m.taken_pages(), 2);  // the state and the checkpoint
    m.check_invariants();
    // A prompt sharing both blocks starts from the checkpoint, in a page of its own.
    std::vector<int32_t> again = m.tokens(0);
    again.push_back(8);
    EXPECT_EQ(slots.add(2, again), 2 * P);
    EXPECT_TRUE(holds_state(pool, slots.slot(2), 11));
    // Pages run short: a refused add changes nothing.
    const int32_t before = m.available_blocks();
    EXPECT_THROW(slots.add(3, std::vector<int32_t>(size_t(P) * 8, 1)), CapacityError);
    EXPECT_EQ(m.available_blocks(), before);
    EXPECT_FALSE(m.contains(3));
    m.check_invariants();
  }
  EXPECT_EQ(m.taken_pages(), 0) << "StateSlots' destructor kept pages";
  auto other = make("paged_state_pages.tiny_gdn.fp32", 2);
  SequenceManager other_manager(*other);
  EXPECT_THROW(StateSlots(other_manager, pool, 1), ArgumentError);
}

// Checkpoints in the cache's pages give way to K/V: an allocation that finds no free or cached page
// takes checkpoint pages, least recently used first, and the ones left still restore their states.
TEST(StatePagesManager, AnAllocationShortOfPagesTakesTheOldestCheckpoints) {
  auto cache = make("paged_state_pages.tiny_gdn.fp32", 6);
  SequenceManager m(*cache);
  StatePool pool(*cache, 6);
  StateSlots slots(m, pool, 1);
  EXPECT_THROW(StateSlots(m, pool, 1), ArgumentError);  // one StateSlots a manager
  const int32_t P = m.block_size();
  std::vector<int32_t> prompt(size_t(3 * P));
  std::iota(prompt.begin(), prompt.end(), 1);
  slots.add(0, std::vector<int32_t>(prompt.begin(), prompt.begin() + P));  // a state page and a K/V page
  for (int chunk = 1; chunk <= 2; ++chunk) {
    write_state(pool, slots.slot(0), 100 + chunk);
    m.step({0});
    EXPECT_TRUE(slots.checkpoint(0));  // at P (state 101), at 2P (state 102)
    m.append(0, std::vector<int32_t>(prompt.begin() + chunk * P, prompt.begin() + (chunk + 1) * P));
  }
  m.step({0});
  slots.free(0);  // 3 K/V pages stay cached, 2 checkpoints held, 1 page free
  EXPECT_EQ(m.available_blocks(), 6);
  // 5 K/V pages and a state page: the free page, the 3 cached ones, then both checkpoints.
  std::vector<int32_t> other(size_t(5 * P), 7);
  EXPECT_EQ(slots.add(1, other), 0);
  EXPECT_EQ(slots.stats().reclaimed, 2);
  EXPECT_EQ(slots.checkpoints_held(), 0);
  m.check_invariants();
  slots.free(1);
  // Again, with the K/V of the checkpointed prefix held by a live sequence: the older checkpoint goes
  // first, and the newer one still restores its state.
  m.reset_prefix_cache();
  slots.add(2, std::vector<int32_t>(prompt.begin(), prompt.begin() + P));
  write_state(pool, slots.slot(2), 201);
  m.step({2});
  slots.checkpoint(2);
  m.append(2, std::vector<int32_t>(prompt.begin() + P, prompt.begin() + 2 * P));
  write_state(pool, slots.slot(2), 202);
  m.step({2});
  slots.checkpoint(2);  // 2 K/V pages and a state page held, 2 checkpoints, 1 page free
  slots.add(3, std::vector<int32_t>(size_t(P), 9));  // a K/V page and a state page: the free one, the older checkpoint
  EXPECT_EQ(slots.stats().reclaimed, 3);
  EXPECT_EQ(slots.checkpoints_held(), 1);
  slots.free(3);
  std::vector<int32_t> again(prompt.begin(), prompt.begin() + 2 * P + 1);
  EXPECT_EQ(slots.add(4, again), 2 * P);
  EXPECT_TRUE(holds_state(pool, slots.slot(4), 202));
  m.check_invariants();
}

}  // namespace
}  // namespace kvtest
