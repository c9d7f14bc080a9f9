// The CUDA write's item body (ops.hpp) on host lanes: a float token's K and V are loaded into its
// lanes before its target is read (token_vectors.hpp), then stored where the target says. The lanes
// of each item run one after another here, each with its own lane number, as a block's threads do;
// nothing in a float write reduces across lanes, so the order does not matter. The pool is checked
// against plain loops over (layer, K or V, page, slot, head, dim), on shapes no default model has.
#include <gtest/gtest.h>

#include <cstring>
#include <random>
#include <vector>

#include "kvforge/backends/cpu/exec_cpu.hpp"
#include "kvforge/detail/upkeep_ops.hpp"

namespace kvtest {
namespace {

using namespace kvforge;
using detail::Fixed;

// Pool memory aligned as a device allocation is (16 bytes is all a vector access needs).
struct alignas(16) Vec16Storage {
  unsigned char bytes[16];
};

// The CPU executor's copies, with CUDA's item shape: every item runs each of its Lanes lanes, and a
// write holds its token's inputs in its lanes before it reads the target.
struct HostLanesExec : detail::CpuExec<2> {
  static constexpr int kTileItems = 1;
  static constexpr bool kHoldsTokens = true;
  template <int Lanes, class Body>
  void for_each_item(int64_t items, Fixed<Lanes>, int64_t, Body body, const detail::IndexChecks& checks = {}) const {
    detail::check_indices_on_host(checks);
    for (int64_t i = 0; i < items; ++i)
      for (int lane = 0; lane < Lanes; ++lane) body(i, lane, Lanes);
  }
};

// A paged float layout of any shape, [layer, kv, page, head, slot, dim] (ops.hpp reads these members).
template <class T, int H, int D, int P> struct PagedTraits {
  using storage_t = T;
  using input_t = T;
  using scale_t = float;
  static constexpr int heads = H, head_dim = D, page_size = P, window = 0;
  static constexpr Addressing addressing = Addressing::paged;
  static constexpr Axis axes[] = {Axis::layer, Axis::kv, Axis::page, Axis::head, Axis::slot, Axis::dim};
  static constexpr Quant quant = Quant::none;
};

// The strides of a PagedTraits pool of `pages` pages, [layer, kv, page, head, slot, dim].
template <class Traits> Strides pool_strides(int pages) {
  Strides s;
  s.seq_or_slot = Traits::head_dim;
  s.head = int64_t(Traits::page_size) * Traits::head_dim;
  s.row_or_page = Traits::heads * s.head;
  s.kv = pages * s.row_or_page;
  s.layer = 2 * s.kv;
  return s;
}

// Appends `tokens` tokens with random values to layer `layer` of a 2-layer pool of `pages` pages,
// through the CUDA item body, with a shuffled slot per token (every third token padding), from inputs
// whose heads are `head_gap` elements apart beyond D (0: dense; odd: rows not 16-byte aligned).
template <class Traits> void check_write(int pages, int tokens, int layer, int head_gap, uint32_t seed) {
  using T = typename Traits::storage_t;
  constexpr int H = Traits::heads, D = Traits::head_dim, P = Traits::page_size, L = 2;
  using Ops = detail::WriteOps<Traits, HostLanesExec>;
  SCOPED_TRACE(::testing::Message() << "H=" << H << " D=" << D << " P=" << P << " " << sizeof(T) << "-byte elements, "
                                    << tokens << " tokens, head gap " << head_gap << ", "
                                    << (Ops::template WrittenToken<false>::kHolds ? "held in lanes" : "copied after the target"));
  std::mt19937 rng(seed);
  const int64_t head_stride = D + head_gap, token_stride = H * head_stride;
  auto random_tokens = [&] {
    // One spare element in front, so that an odd gap also shifts the first row off 16 bytes.
    std::vector<T> x(size_t(tokens * token_stride + 1));
    for (T& e : x) {
      const uint32_t bits = rng();
      std::memcpy(&e, &bits, sizeof e);
    }
    return x;
  };
  const std::vector<T> k_in = random_tokens(), v_in = random_tokens();
  const int64_t offset = head_gap % 2;  // odd gaps start one element in
  std::vector<int64_t> slots(size_t(pages) * P);
  for (size_t s = 0; s < slots.size(); ++s) slots[s] = int64_t(s);
  std::shuffle(slots.begin(), slots.end(), rng);
  slots.resize(size_t(tokens));
  for (int t = 2; t < tokens; t += 3) slots[size_t(t)] = -1;

  const Strides s = pool_strides<Traits>(pages);
  // A 16-byte-aligned pool, one sentinel byte pattern throughout.
  std::vector<Vec16Storage> storage(size_t(L * s.layer * int64_t(sizeof(T)) / 16 + 1));
  std::memset(storage.data(), 0xa5, storage.size() * sizeof(Vec16Storage));
  T* pool = reinterpret_cast<T*>(storage.data());
  std::vector<unsigned char> want(reinterpret_cast<unsigned char*>(pool),
                                  reinterpret_cast<unsigned char*>(pool) + L * s.layer * int64_t(sizeof(T)));
  for (int t = 0; t < tokens; ++t) {
    if (slots[size_t(t)] < 0) continue;
    const int64_t page = slots[size_t(t)] / P, slot = slots[size_t(t)] % P;
    for (int kv = 0; kv < 2; ++kv)
      for (int h = 0; h < H; ++h)
        for (int d = 0; d < D; ++d) {
          const T& from = (kv ? v_in : k_in)[size_t(offset + t * token_stride + h * head_stride + d)];
          const int64_t at = ((((int64_t(layer) * 2 + kv) * pages + page) * H + h) * P + slot) * D + d;
          std::memcpy(want.data() + at * int64_t(sizeof(T)), &from, sizeof(T));
        }
  }
  detail::DeviceStatus status{};
  detail::WriteArgs<T, T> a{pool,
                            s,
                            detail::ScaleRef{nullptr, Strides{}},
                            {k_in.data() + offset, token_stride, head_stride},
                            {v_in.data() + offset, token_stride, head_stride},
                            0,
                            nullptr,
                            nullptr,
                            slots.data(),
                            0,
                            tokens,
                            layer,
                            1,
                            nullptr,
                            &status};
  Ops::write(HostLanesExec{{int64_t(1) << 40, 0, false}}, a);
  const unsigned char* got = reinterpret_cast<const unsigned char*>(pool);
  for (size_t b = 0; b < want.size(); ++b)
    ASSERT_EQ(got[b], want[b]) << "pool byte " << b << " (element " << b / sizeof(T) << ")";
}

// A lazy append's staging through the same body: tokens into dense [T, H, D] staging, slots beside.
template <class Traits> void check_stage(int tokens, int head_gap, uint32_t seed) {
  using T = typename Traits::input_t;
  constexpr int H = Traits::heads, D = Traits::head_dim;
  SCOPED_TRACE(::testing::Message() << "staging H=" << H << " D=" << D << ", head gap " << head_gap);
  std::mt19937 rng(seed);
  const int64_t head_stride = D + head_gap, token_stride = H * head_stride, offset = head_gap % 2;
  std::vector<T> k_in(size_t(tokens * token_stride + 1)), v_in(k_in.size());
  for (std::vector<T>* x : {&k_in, &v_in})
    for (T& e : *x) {
      const uint32_t bits = rng();
      std::memcpy(&e, &bits, sizeof e);
    }
  std::vector<int64_t> slots(static_cast<size_t>(tokens));
  for (int64_t& slot : slots) slot = int64_t(rng() % 1000) - 1;
  std::vector<Vec16Storage> k_stage(size_t(tokens * H * D * int64_t(sizeof(T)) / 16 + 1)), v_stage(k_stage.size());
  std::vector<int64_t> staged_slots(static_cast<size_t>(tokens), -7);
  detail::DeviceStatus status{};
  detail::StageArgs<T> a{{k_in.data() + offset, token_stride, head_stride},
                         {v_in.data() + offset, token_stride, head_stride},
                         reinterpret_cast<T*>(k_stage.data()),
                         reinterpret_cast<T*>(v_stage.data()),
                         tokens,
                         &status};
  a.targets.slots = slots.data();
  a.targets.slots_stage = staged_slots.data();
  detail::WriteOps<Traits, HostLanesExec>::stage(HostLanesExec{{int64_t(1) << 40, 0, false}}, a);
  for (int t = 0; t < tokens; ++t) {
    ASSERT_EQ(staged_slots[size_t(t)], slots[size_t(t)]) << "token " << t;
    for (int h = 0; h < H; ++h)
      for (int d = 0; d < D; ++d)
        for (int kv = 0; kv < 2; ++kv) {
          const T& from = (kv ? v_in : k_in)[size_t(offset + t * token_stride + h * head_stride + d)];
          const T* staged = reinterpret_cast<const T*>((kv ? v_stage : k_stage).data()) + (int64_t(t) * H + h) * D + d;
          ASSERT_EQ(0, std::memcmp(staged, &from, sizeof(T))) << (kv ? "V" : "K") << " token " << t << " head " << h << " element " << d;
        }
  }
}

// A gather through the same lanes: positions [begin, begin + count) of a sequence whose pages are
// shuffled, out of layer `layer` of a 2-layer pool of random bytes, into [T, H, D] outputs whose heads
// are `head_gap` elements apart beyond D. Every output byte is checked, the gaps' sentinels too.
template <class Traits> void check_gather(int pages, int64_t begin, int64_t count, int layer, int head_gap, uint32_t seed) {
  using T = typename Traits::storage_t;
  constexpr int H = Traits::heads, D = Traits::head_dim, P = Traits::page_size, L = 2;
  SCOPED_TRACE(::testing::Message() << "gather H=" << H << " D=" << D << " P=" << P << ", positions " << begin << " + "
                                    << count << ", head gap " << head_gap);
  std::mt19937 rng(seed);
  const Strides s = pool_strides<Traits>(pages);
  std::vector<Vec16Storage> storage(size_t(L * s.layer * int64_t(sizeof(T)) / 16 + 1));
  for (Vec16Storage& v : storage)
    for (unsigned char& b : v.bytes) b = static_cast<unsigned char>(rng());
  const T* pool = reinterpret_cast<const T*>(storage.data());
  std::vector<int32_t> page_table(static_cast<size_t>(pages));
  for (int p = 0; p < pages; ++p) page_table[size_t(p)] = p;
  std::shuffle(page_table.begin(), page_table.end(), rng);

  const int64_t head_stride = D + head_gap, token_stride = H * head_stride, offset = head_gap % 2;
  const size_t out_elems = size_t(count * token_stride + 1);
  std::vector<unsigned char> want[2];
  std::vector<Vec16Storage> got[2];
  for (int kv = 0; kv < 2; ++kv) {
    got[kv].assign(out_elems * sizeof(T) / 16 + 1, Vec16Storage{});
    std::memset(got[kv].data(), 0x5a, got[kv].size() * sizeof(Vec16Storage));
    const unsigned char* bytes = reinterpret_cast<const unsigned char*>(got[kv].data());
    want[kv].assign(bytes, bytes + got[kv].size() * sizeof(Vec16Storage));
    for (int64_t j = 0; j < count; ++j) {
      const int64_t pos = begin + j, page = page_table[size_t(pos / P)], slot = pos % P;
      for (int h = 0; h < H; ++h)
        for (int d = 0; d < D; ++d) {
          const int64_t from = ((((int64_t(layer) * 2 + kv) * pages + page) * H + h) * P + slot) * D + d;
          const int64_t to = offset + j * token_stride + h * head_stride + d;
          std::memcpy(want[kv].data() + to * int64_t(sizeof(T)), pool + from, sizeof(T));
        }
    }
  }
  detail::DeviceStatus status{};
  T* k_out = reinterpret_cast<T*>(got[0].data()) + offset;
  T* v_out = reinterpret_cast<T*>(got[1].data()) + offset;
  detail::GatherArgs<T, T> a{pool, s, detail::ScaleRef{nullptr, Strides{}}, {k_out, token_stride, head_stride},
                             {v_out, token_stride, head_stride}, layer, 0, page_table.data(), begin, count, &status};
  detail::GatherOps<Traits, HostLanesExec>::gather(HostLanesExec{{int64_t(1) << 40, 0, false}}, a);
  for (int kv = 0; kv < 2; ++kv) {
    const unsigned char* bytes = reinterpret_cast<const unsigned char*>(got[kv].data());
    for (size_t b = 0; b < want[kv].size(); ++b)
      ASSERT_EQ(bytes[b], want[kv][b]) << (kv ? "V" : "K") << " output byte " << b << " (element " << b / sizeof(T) << ")";
  }
}

// A status word already set (an earlier operation's failed check) stops the write before it stores.
template <class Traits> void check_halted_write() {
  using T = typename Traits::storage_t;
  constexpr int H = Traits::heads, D = Traits::head_dim, P = Traits::page_size;
  std::vector<T> in(size_t(H) * D);
  std::vector<Vec16Storage> storage(size_t(2 * 2 * H * P * D * int64_t(sizeof(T)) / 16 + 1));
  std::memset(storage.data(), 0xa5, storage.size() * sizeof(Vec16Storage));
  const std::vector<Vec16Storage> before = storage;
  const int64_t slot = 0;
  const Strides s = pool_strides<Traits>(1);
  detail::DeviceStatus status{};
  status.code = detail::kCheckSlots;
  detail::WriteArgs<T, T> a{reinterpret_cast<T*>(storage.data()), s, detail::ScaleRef{nullptr, Strides{}},
                            {in.data(), int64_t(H) * D, D}, {in.data(), int64_t(H) * D, D}, 0, nullptr, nullptr, &slot, 0,
                            1, 0, 1, nullptr, &status};
  detail::WriteOps<Traits, HostLanesExec>::write(HostLanesExec{{int64_t(1) << 40, 0, false}}, a);
  EXPECT_EQ(0, std::memcmp(storage.data(), before.data(), storage.size() * sizeof(Vec16Storage)))
      << "a write stored after the status word had recorded a failure";
}

TEST(CudaWriteOnHostLanes, HeldTokensLandWhereTheReferenceSays) {
  static_assert(detail::Ops<PagedTraits<bf16, 8, 128, 16>, HostLanesExec>::WrittenToken<false>::kHolds);
  // One vector a lane (llama3-8b's K and V: 128 lanes).
  check_write<PagedTraits<bf16, 8, 128, 16>>(8, 40, 1, 0, 1);
  // Two vectors a lane: 32 heads of 128 take 512 vectors over 256 lanes.
  check_write<PagedTraits<bf16, 32, 128, 4>>(16, 37, 0, 0, 2);
  // Heads of 40 floats (10 vectors), 3 heads, 7-slot pages; inputs with heads 8 floats apart.
  check_write<PagedTraits<float, 3, 40, 7>>(9, 50, 1, 8, 3);
  // Rows not 16-byte aligned in the input: the body copies after reading the target instead.
  check_write<PagedTraits<fp16, 5, 64, 16>>(6, 33, 0, 1, 4);
  // The first row aligned, the others 4 bytes off: the call takes the body with the element path, which
  // tests each token's rows (the body without it would trap on its first misaligned vector).
  check_write<PagedTraits<bf16, 8, 128, 16>>(8, 40, 1, 2, 6);
  // Too many vectors to hold (8 a lane): copied after the target.
  static_assert(!detail::Ops<PagedTraits<fp16, 64, 256, 2>, HostLanesExec>::WrittenToken<false>::kHolds);
  check_write<PagedTraits<fp16, 64, 256, 2>>(8, 9, 1, 0, 5);
}

TEST(CudaWriteOnHostLanes, StagedTokensLandWhereTheReferenceSays) {
  static_assert(detail::Ops<PagedTraits<bf16, 8, 128, 16>, HostLanesExec>::StagedToken<false>::kHolds);
  check_stage<PagedTraits<bf16, 8, 128, 16>>(21, 0, 11);
  check_stage<PagedTraits<float, 3, 40, 7>>(13, 8, 12);
  check_stage<PagedTraits<fp16, 5, 64, 16>>(10, 1, 13);  // inputs off 16 bytes: copied at the store
  check_stage<PagedTraits<bf16, 8, 128, 16>>(9, 2, 14);   // heads 4 bytes off, the first row aligned
}

TEST(CudaWriteOnHostLanes, GatheredTokensMatchThePool) {
  static_assert(detail::Ops<PagedTraits<bf16, 8, 128, 16>, HostLanesExec>::GatheredToken<true>::kHolds);
  check_gather<PagedTraits<bf16, 8, 128, 16>>(6, 5, 70, 1, 0, 21);       // every row whole vectors
  check_gather<PagedTraits<bf16, 32, 128, 4>>(12, 0, 45, 0, 0, 22);      // two vectors a lane
  check_gather<PagedTraits<float, 3, 40, 7>>(9, 3, 50, 1, 8, 23);        // heads 8 floats apart: still whole
  check_gather<PagedTraits<bf16, 8, 128, 16>>(6, 2, 60, 0, 2, 24);       // heads 4 bytes off: element path
  check_gather<PagedTraits<fp16, 5, 64, 16>>(5, 1, 33, 1, 1, 25);        // outputs off 16 bytes
  check_gather<PagedTraits<fp16, 64, 256, 2>>(8, 1, 9, 0, 0, 26);        // too many vectors to hold
}

TEST(CudaWriteOnHostLanes, SetStatusWordWritesNothing) {
  check_halted_write<PagedTraits<bf16, 8, 128, 16>>();
  check_halted_write<PagedTraits<fp16, 64, 256, 2>>();
}

// The executor contract (executor.hpp) that make_op_table asserts: both executors meet it, and its
// detectors see what a would-be executor lacks, so the static_assert names that member.
struct TilesWithoutTileFor {
  static constexpr int kTileItems = 4;
};
static_assert(detail::check_executor<detail::CpuExec<2>>());
static_assert(!detail::contract::for_each_item<TilesWithoutTileFor>::value);
static_assert(!detail::contract::tiles<TilesWithoutTileFor>::value);
static_assert(!detail::contract::constants<TilesWithoutTileFor>::value);

}  // namespace
}  // namespace kvtest
