// Every kind of bad argument is refused with a typed error naming it, and the cache is unchanged.
#include <algorithm>
#include <climits>
#include <optional>
#include <typeinfo>
#include <vector>

#include "kvforge/physical_wire.hpp"
#include "support.hpp"

namespace kvtest {
namespace {

// Every registered variant with the property a test needs and a footprint small enough to build a few
// times; tests run over all of them, so that no assumption rests on which one happens to come first.
// The fixture below holds for any page size >= 1, head count, head dim and window >= 1.
std::vector<const VariantEntry*> variants_with(Addressing a, UpdateMode u = UpdateMode::eager,
                                               std::optional<Quant> q = Quant::none, bool must_exist = true) {
  std::vector<const VariantEntry*> out;
  for (const auto& e : registry().variants()) {
    const VariantDescriptor& d = *e.descriptor;
    if (d.is_hybrid() || d.addressing != a || d.update != u || (q && d.quant != *q)) continue;
    if (d.bytes_per_token > (64 << 10) || d.window > 256) continue;  // small enough to create freely
    if (a == Addressing::contiguous && d.max_seq_len < 40) continue;   // the tests address up to 33
    out.push_back(&e);
  }
  if (out.empty() && must_exist) ADD_FAILURE() << "no small variant with addressing " << name_of(a) << " is registered";
  return out;
}

struct Fixture {
  explicit Fixture(const VariantEntry& e) : d(*e.descriptor) {
    CacheConfig cfg;
    cfg.rows = 2;
    cfg.max_seq_len = d.addressing == Addressing::contiguous ? 32 : 0;
    cfg.pages = 4;
    cfg.max_staged_tokens = 4;
    cache = e.create(cfg);
    es = dtype_size(d.input);
    k.assign(size_t(8 * d.heads * d.head_dim * es), 0x3c);
    v = k;
    // Put something in the cache so that "unchanged" is not trivially all zeros.
    std::vector<int32_t> rows{0, 1}, pos{0, 1};
    std::vector<int64_t> slots{0, std::min<int64_t>(5, 4 * int64_t(d.page_size) - 1)};
    append(0, 2, rows, pos, slots);
    cache->commit();
    snapshot = bytes();
  }
  std::vector<unsigned char> bytes() const { return held_bytes(*cache); }
  TensorView tokens(int64_t T, std::vector<unsigned char>& data, std::optional<DType> t = {}, int heads = -1) {
    return TensorView::contiguous(data.data(), t.value_or(d.input), Device::cpu, T,
                                  heads < 0 ? d.heads : heads, d.head_dim);
  }
  void append(int layer, int64_t T, std::vector<int32_t>& rows, std::vector<int32_t>& pos, std::vector<int64_t>& slots) {
    const TokenTargets t = d.paged() ? TokenTargets::paged(IndexView::of(slots.data(), T))
                                     : TokenTargets::row_positions(IndexView::of(rows.data(), T), IndexView::of(pos.data(), T));
    cache->append(layer, tokens(T, k), tokens(T, v), t);
  }
  void expect_unchanged() const { EXPECT_TRUE(bytes() == snapshot) << d.name << ": a refused call changed the cache"; }

  const VariantDescriptor& d;
  std::unique_ptr<Cache> cache;
  int es;
  std::vector<unsigned char> k, v, snapshot;
};

template <class E, class F> void expect_error(F f, const std::string& argument) {
  try {
    f();
    ADD_FAILURE() << "expected an error naming " << argument;
  } catch (const E& e) {
    if constexpr (std::is_base_of_v<ArgumentError, E>) {
      EXPECT_EQ(e.argument(), argument) << e.what();
    }
  }
}

// Targets of the other addressing, or none: the error names the array left out as missing (not its
// dtype or size) and, where the call gave the other kind, says what that kind addresses.
template <class F> void expect_missing_targets(F f, const std::string& argument, const std::string& hint) {
  try {
    f();
    ADD_FAILURE() << "expected " << argument << " to be reported missing";
  } catch (const ArgumentError& e) {
    EXPECT_EQ(typeid(e), typeid(ArgumentError)) << e.what();
    EXPECT_EQ(e.argument(), argument) << e.what();
    EXPECT_NE(std::string(e.what()).find(argument + ": missing"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find(hint), std::string::npos) << e.what();
  }
}

// The caller's bound on kvforge's CPU threads: refused below 0 by name, in force at once, and lifted by 0.
TEST(Errors, CpuThreadBoundIsCheckedAndTakesEffect) {
  const int own = cpu_threads();
  try {
    set_cpu_threads(-1);
    FAIL() << "a negative thread bound was taken";
  } catch (const OutOfRangeError& e) {
    EXPECT_EQ(e.argument(), "threads");
  }
  EXPECT_EQ(cpu_threads(), own);
  set_cpu_threads(1);
  EXPECT_EQ(cpu_threads(), 1);
  set_cpu_threads(own + 7);  // more than OpenMP has: OpenMP's count
  EXPECT_EQ(cpu_threads(), own);
  set_cpu_threads(0);
  EXPECT_EQ(cpu_threads(), own);
}

TEST(Errors, UnknownVariantNamesTheNearest) {
  try {
    registry().create("vllm_paged_nhd.tiny.bf17", CacheConfig{});
    FAIL();
  } catch (const UnknownVariantError& e) {
    ASSERT_FALSE(e.nearest().empty());
    EXPECT_EQ(e.nearest()[0], "vllm_paged_nhd.tiny.bf16");
    EXPECT_NE(std::string(e.what()).find("vllm_paged_nhd.tiny.bf16"), std::string::npos);
  }
}

TEST(Errors, ContiguousAppendRefusesBadArgumentsBeforeWriting) {
  for (const VariantEntry* e : variants_with(Addressing::contiguous)) {
  SCOPED_TRACE(e->descriptor->name);
  Fixture f(*e);
  std::vector<int32_t> rows{0, 1, 1}, pos{2, 3, 32};  // the last position is past max_seq_len=32
  std::vector<int64_t> none;
  expect_error<OutOfRangeError>([&] { f.append(0, 3, rows, pos, none); }, "targets.positions");
  f.expect_unchanged();
  rows = {0, 2, -1};  // row 2 of 2
  pos = {2, 3, 4};
  expect_error<OutOfRangeError>([&] { f.append(0, 3, rows, pos, none); }, "targets.rows");
  rows = {0, -2, 1};  // only -1 is padding
  expect_error<OutOfRangeError>([&] { f.append(0, 3, rows, pos, none); }, "targets.rows");
  rows = {0, 1, 1};
  expect_error<OutOfRangeError>([&] { f.append(f.d.layers, 3, rows, pos, none); }, "layer");
  expect_error<OutOfRangeError>([&] { f.append(-1, 3, rows, pos, none); }, "layer");
  f.expect_unchanged();
  const TokenTargets t = TokenTargets::row_positions(IndexView::of(rows.data(), 3), IndexView::of(pos.data(), 3));
  const DType wrong = f.d.input == DType::f32 ? DType::bf16 : DType::f32;
  std::vector<unsigned char> big(size_t(8 * 8 * f.d.head_dim * 4));
  expect_error<DtypeError>([&] { f.cache->append(0, f.tokens(3, big, wrong), f.tokens(3, f.v), t); }, "k");
  expect_error<ShapeError>([&] { f.cache->append(0, f.tokens(3, f.k), f.tokens(3, big, std::nullopt, f.d.heads + 1), t); }, "v");
  expect_error<ShapeError>([&] { f.cache->append(0, f.tokens(2, f.k), f.tokens(2, f.v), t); }, "targets.rows");
  TensorView on_gpu = f.tokens(3, f.k);
  on_gpu.device = Device::cuda;
  expect_error<DeviceError>([&] { f.cache->append(0, on_gpu, f.tokens(3, f.v), t); }, "k");
  std::vector<int64_t> as64{0, 1, 1};
  const TokenTargets wrong_type =
      TokenTargets::row_positions(IndexView{as64.data(), DType::i64, Device::cpu, 3}, IndexView::of(pos.data(), 3));
  expect_error<DtypeError>([&] { f.cache->append(0, f.tokens(3, f.k), f.tokens(3, f.v), wrong_type); }, "targets.rows");
  // Slots, as a paged layout takes them: the error names the rows left out, not the slots' dtype.
  std::vector<int64_t> slots{0, 1, 2};
  expect_missing_targets([&] { f.cache->append(0, f.tokens(3, f.k), f.tokens(3, f.v), TokenTargets::paged(IndexView::of(slots.data(), 3))); },
                         "targets.rows", "slots address paged layouts");
  expect_missing_targets([&] { f.cache->append(0, f.tokens(3, f.k), f.tokens(3, f.v), TokenTargets::row_positions(IndexView::of(rows.data(), 3), {})); },
                         "targets.positions", "");
  f.expect_unchanged();
  }
}

TEST(Errors, ContiguousGatherReorderAndResetRefuseBadArguments) {
  for (const VariantEntry* e : variants_with(Addressing::contiguous)) {
  SCOPED_TRACE(e->descriptor->name);
  Fixture f(*e);
  std::vector<unsigned char> out(size_t(f.d.heads * 40 * f.d.head_dim * f.es));
  GatherRange g;
  g.row = 0;
  g.begin = 0;
  g.end = 33;
  const auto out_view = [&](int64_t n) { return TensorView::contiguous(out.data(), f.d.input, Device::cpu, f.d.heads, n, f.d.head_dim); };
  expect_error<OutOfRangeError>([&] { f.cache->gather(0, g, out_view(33), out_view(33)); }, "range.end");
  g.end = 4;
  expect_error<ShapeError>([&] { f.cache->gather(0, g, out_view(5), out_view(4)); }, "k_out");
  g.row = 2;
  expect_error<OutOfRangeError>([&] { f.cache->gather(0, g, out_view(4), out_view(4)); }, "row");
  g.row = 0;
  g.begin = 5;
  expect_error<OutOfRangeError>([&] { f.cache->gather(0, g, out_view(4), out_view(4)); }, "range.end");
  g.begin = 34;  // past max_seq_len=32: no end would do, so the begin is named
  g.end = 35;
  expect_error<OutOfRangeError>([&] { f.cache->gather(0, g, out_view(1), out_view(1)); }, "range.begin");
  std::vector<int32_t> beam{1, 2};
  expect_error<OutOfRangeError>([&] { f.cache->reorder(IndexView::of(beam.data(), 2)); }, "beam");
  expect_error<ShapeError>([&] { f.cache->reorder(IndexView::of(beam.data(), 1)); }, "beam");
  expect_error<OutOfRangeError>([&] { f.cache->reset_row(2); }, "row");
  std::vector<int32_t> pairs{0, 1};
  EXPECT_THROW(f.cache->copy_blocks(IndexView::of(pairs.data(), 2)), UnsupportedError);
  f.expect_unchanged();
  }
}

TEST(Errors, RingPositionsStopWhereTheRowLengthStillFits) {
  for (const VariantEntry* e : variants_with(Addressing::ring, UpdateMode::eager, std::nullopt)) {
  SCOPED_TRACE(e->descriptor->name);
  Fixture f(*e);
  std::vector<int32_t> rows{0}, pos{INT32_MAX};
  std::vector<int64_t> none;
  expect_error<OutOfRangeError>([&] { f.append(0, 1, rows, pos, none); }, "targets.positions");
  f.expect_unchanged();
  pos = {INT32_MAX - 1};  // the highest position whose length, position + 1, an int32 holds
  f.append(0, 1, rows, pos, none);
  EXPECT_EQ(f.cache->row_length(0), int64_t(INT32_MAX));
  std::vector<unsigned char> out(size_t(f.d.heads * f.d.head_dim * f.es), 0);
  GatherRange g;
  g.begin = INT32_MAX - 1;
  g.end = INT32_MAX;
  const TensorView one = TensorView::contiguous(out.data(), f.d.input, Device::cpu, f.d.heads, 1, f.d.head_dim);
  f.cache->gather(0, g, one, one);
  if (f.d.quant == Quant::none) {  // the fixture's tokens are one repeated byte, 0x3c
    EXPECT_TRUE(std::all_of(out.begin(), out.end(), [](unsigned char b) { return b == 0x3c; }));
  }
  }
}

TEST(Errors, RingGatherRefusesPositionsThatLeftTheWindow) {
  for (const VariantEntry* e : variants_with(Addressing::ring, UpdateMode::eager, std::nullopt)) {
  SCOPED_TRACE(e->descriptor->name);
  Fixture f(*e);
  const int W = f.d.window;
  std::vector<int32_t> rows{0}, pos{3 * W};
  std::vector<int64_t> none;
  f.append(0, 1, rows, pos, none);
  f.snapshot = f.bytes();
  std::vector<unsigned char> out(size_t(f.d.heads * (W + 1) * f.d.head_dim * f.es));
  const auto out_view = [&](int64_t n) { return TensorView::contiguous(out.data(), f.d.input, Device::cpu, f.d.heads, n, f.d.head_dim); };
  GatherRange g;
  g.row = 0;
  g.begin = 3 * W - W;  // oldest readable is 3W + 1 - W
  g.end = 3 * W + 1;
  expect_error<OutOfRangeError>([&] { f.cache->gather(0, g, out_view(W + 1), out_view(W + 1)); }, "range.begin");
  g.begin = 3 * W;
  g.end = 3 * W + 2;  // one past what was written
  expect_error<OutOfRangeError>([&] { f.cache->gather(0, g, out_view(2), out_view(2)); }, "range.end");
  g.begin = 3 * W + 2;  // wholly past what was written
  g.end = 3 * W + 3;
  expect_error<OutOfRangeError>([&] { f.cache->gather(0, g, out_view(1), out_view(1)); }, "range.begin");
  f.expect_unchanged();
  }
}

TEST(Errors, PagedRefusesBadSlotsPagesAndPairs) {
  for (const VariantEntry* e : variants_with(Addressing::paged, UpdateMode::eager, std::nullopt)) {
  SCOPED_TRACE(e->descriptor->name);
  Fixture f(*e);
  const int64_t slots_total = 4 * f.d.page_size;
  std::vector<int32_t> none;
  std::vector<int64_t> slots{1, 2, slots_total};
  expect_error<OutOfRangeError>([&] { f.append(0, 3, none, none, slots); }, "targets.slots");
  // Rows and positions, as a row layout takes them: the error says slots are missing.
  std::vector<int32_t> rows{0, 0, 0}, positions{0, 1, 2};
  expect_missing_targets([&] { f.cache->append(0, f.tokens(3, f.k), f.tokens(3, f.v),
                                               TokenTargets::row_positions(IndexView::of(rows.data(), 3), IndexView::of(positions.data(), 3))); },
                         "targets.slots", "rows and positions address contiguous and ring layouts");
  f.expect_unchanged();
  std::vector<int32_t> pages{0, 4};
  std::vector<unsigned char> out(size_t(f.d.heads * 2 * f.d.page_size * f.d.head_dim * f.es));
  GatherRange g;
  g.pages = IndexView::of(pages.data(), 2);
  g.begin = 0;
  g.end = f.d.page_size + 1;
  const auto out_view = [&](int64_t n) { return TensorView::contiguous(out.data(), f.d.input, Device::cpu, f.d.heads, n, f.d.head_dim); };
  expect_error<OutOfRangeError>([&] { f.cache->gather(0, g, out_view(g.end), out_view(g.end)); }, "range.pages");
  g.pages = IndexView::of(pages.data(), 1);
  expect_error<ShapeError>([&] { f.cache->gather(0, g, out_view(g.end), out_view(g.end)); }, "range.pages");
  std::vector<int32_t> pairs{0, 1, 2, 1};
  expect_error<ArgumentError>([&] { f.cache->copy_blocks(IndexView::of(pairs.data(), 4)); }, "pairs");
  pairs = {0, 1, 1, 2};
  expect_error<ArgumentError>([&] { f.cache->copy_blocks(IndexView::of(pairs.data(), 4)); }, "pairs");
  pairs = {0, 9};
  expect_error<OutOfRangeError>([&] { f.cache->copy_blocks(IndexView::of(pairs.data(), 2)); }, "pairs");
  expect_error<ShapeError>([&] { f.cache->copy_blocks(IndexView::of(pairs.data(), 1)); }, "pairs");
  std::vector<int32_t> beam{0, 1};
  EXPECT_THROW(f.cache->reorder(IndexView::of(beam.data(), 2)), UnsupportedError);
  EXPECT_THROW(f.cache->reset_row(0), UnsupportedError);
  f.expect_unchanged();
  }
}

TEST(Errors, LazyStagingOverflowIsRefusedBeforeStaging) {
  for (const VariantEntry* e : variants_with(Addressing::contiguous, UpdateMode::lazy, std::nullopt)) {
  SCOPED_TRACE(e->descriptor->name);
  Fixture f(*e);
  std::vector<int32_t> rows{0, 0, 0}, pos{4, 5, 6};
  std::vector<int64_t> none;
  f.append(0, 3, rows, pos, none);  // 3 of 4 staged
  expect_error<OutOfRangeError>([&] { f.append(0, 3, rows, pos, none); }, "k.shape[0]");
  f.cache->commit();  // only the first three land
  std::vector<unsigned char> out(size_t(f.d.heads * 8 * f.d.head_dim * f.es));
  GatherRange g;
  g.row = 0;
  g.begin = 4;
  g.end = 8;
  f.cache->gather(0, g, TensorView::contiguous(out.data(), f.d.input, Device::cpu, f.d.heads, 4, f.d.head_dim),
                  TensorView::contiguous(out.data(), f.d.input, Device::cpu, f.d.heads, 4, f.d.head_dim));
  EXPECT_EQ(f.cache->row_length(0), 7);
  }
}

TEST(Errors, BadConfigurationsAreRefused) {
  const VariantEntry& contiguous = *variants_with(Addressing::contiguous).at(0);
  CacheConfig c;
  c.rows = 0;
  expect_error<OutOfRangeError>([&] { contiguous.create(c); }, "config.rows");
  c.rows = 1;
  c.max_seq_len = contiguous.descriptor->max_seq_len + 1;
  expect_error<OutOfRangeError>([&] { contiguous.create(c); }, "config.max_seq_len");
  CacheConfig p;
  expect_error<OutOfRangeError>([&] { variants_with(Addressing::paged).at(0)->create(p); }, "config.pages");
  const VariantEntry& ring = *variants_with(Addressing::ring, UpdateMode::eager, std::nullopt).at(0);
  CacheConfig r;
  r.max_seq_len = ring.descriptor->window + 1;
  expect_error<OutOfRangeError>([&] { ring.create(r); }, "config.max_seq_len");
  CacheConfig g;
  g.device = Device::cuda;
  std::string why;
  if (!cuda_available(&why)) {
    expect_error<DeviceError>([&] { contiguous.create(g); }, "config.device");
  }
}

// A negative extent is a shape error, not an empty call.
TEST(Errors, NegativeShapesAreRefused) {
  for (const VariantEntry* e : variants_with(Addressing::paged, UpdateMode::eager, std::nullopt)) {
    SCOPED_TRACE(e->descriptor->name);
    Fixture f(*e);
    std::vector<int64_t> slots{0};
    TensorView k = f.tokens(1, f.k), v = f.tokens(1, f.v);
    k.shape[0] = v.shape[0] = -1;
    expect_error<ShapeError>([&] { f.cache->append(0, k, v, TokenTargets::paged(IndexView::of(slots.data(), 1))); }, "k");
    f.expect_unchanged();
  }
}

// A capacity no machine could hold is refused by name before anything is allocated, never wrapped
// into a small pool by an overflowing size.
TEST(Errors, AbsurdCapacitiesAreRefusedBeforeAllocating) {
  int tested = 0;
  for (const auto& e : registry().variants()) {
    const VariantDescriptor& d = *e.descriptor;
    if (d.is_hybrid()) continue;
    // The pool holds rows x positions (or pages x page_size) tokens of bytes_per_token each.
    const int64_t tokens_per_unit = d.paged() ? d.page_size : d.addressing == Addressing::ring ? d.window : d.max_seq_len;
    const int64_t units = d.paged() ? INT32_MAX / d.page_size : INT32_MAX;
    if (double(units) * double(tokens_per_unit) * double(d.bytes_per_token) < 0x1p50) continue;  // could fit
    SCOPED_TRACE(d.name);
    CacheConfig c;
    c.rows = units;
    c.pages = units;
    try {
      e.create(c);
      ADD_FAILURE() << "an absurd capacity was accepted";
    } catch (const OutOfRangeError& err) {
      EXPECT_EQ(err.argument(), d.paged() ? "config.pages" : "config.rows") << err.what();
      EXPECT_NE(std::string(err.what()).find("2^48 bytes"), std::string::npos) << err.what();
    }
    ++tested;
  }
  EXPECT_GT(tested, 0) << "no registered variant is large enough to overflow; nothing was tested";
}

// Quantized variants refuse bad appends before touching codes or scales, and per-tensor scales are
// checked before they reach the device.
TEST(Errors, QuantizedAppendAndScalesRefuseBadArguments) {
  for (Quant q : {Quant::per_token, Quant::per_token_head, Quant::per_tensor})
    for (Addressing a : {Addressing::contiguous, Addressing::ring, Addressing::paged})
      for (const VariantEntry* entry : variants_with(a, UpdateMode::eager, q, false)) {
    SCOPED_TRACE(entry->descriptor->name);
    Fixture f(*entry);
    std::vector<int32_t> rows{0, 0}, pos{0, -5};  // only -1 is padding, whatever the addressing
    std::vector<int64_t> slots{0, -5};
    expect_error<OutOfRangeError>([&] { f.append(0, 2, rows, pos, slots); },
                                  f.d.paged() ? "targets.slots" : "targets.positions");
    f.expect_unchanged();
    if (f.d.takes_tensor_scale()) {
      expect_error<ArgumentError>([&] { f.cache->set_tensor_scale(0, 0.0f, 1.0f); }, "k_scale");
      expect_error<ArgumentError>([&] { f.cache->set_tensor_scale(0, 1.0f, NAN); }, "v_scale");
      expect_error<OutOfRangeError>([&] { f.cache->set_tensor_scale(f.d.layers, 1.0f, 1.0f); }, "layer");
    } else {
      EXPECT_THROW(f.cache->set_tensor_scale(0, 1.0f, 1.0f), UnsupportedError);
    }
    f.expect_unchanged();
  }
}

// The message names the argument, the element and the range in words a user reads at once.
TEST(Errors, RangeMessagesReadNaturally) {
  auto message = [](auto f) {
    try {
      f();
    } catch (const OutOfRangeError& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  for (const VariantEntry* e : variants_with(Addressing::paged, UpdateMode::eager, std::nullopt)) {
    Fixture f(*e);
    const int64_t total = 4 * int64_t(f.d.page_size);
    std::vector<int32_t> none;
    std::vector<int64_t> slots{0, -1, total};
    EXPECT_EQ(message([&] { f.append(0, 3, none, none, slots); }),
              "targets.slots[2] = " + std::to_string(total) + " is outside [0, " + std::to_string(total) +
                  "); -1 marks padding");
  }
  for (const VariantEntry* e : variants_with(Addressing::ring, UpdateMode::eager, std::nullopt)) {
    Fixture f(*e);
    std::vector<int32_t> rows{0}, pos{-7};
    std::vector<int64_t> none;
    EXPECT_EQ(message([&] { f.append(0, 1, rows, pos, none); }),
              "targets.positions[0] = -7 is outside [0, 2147483647); -1 marks padding");
  }
  EXPECT_EQ(message([] { throw OutOfRangeError("options.window", -2, 0, LLONG_MAX, -1, "0: no window"); }),
            "options.window = -2 is below 0 (allowed: >= 0); 0: no window");
  EXPECT_EQ(message([] { throw OutOfRangeError("layer", 5, 0, 2); }), "layer = 5 is outside [0, 2)");
  EXPECT_EQ(message([] { throw OutOfRangeError("config.max_seq_len", 5, 0, 1, -1, "pass 0"); }),
            "config.max_seq_len = 5 is not 0 (allowed: 0); pass 0");
}

// A ring holds each row's last `window` positions. An append of a position that has already left the
// window is dropped, as the JetStream seed's ring overwrites without a check would otherwise corrupt a
// newer cell: nothing is written, the row keeps its length, and no error is raised. (The length is
// shared by every layer, so layer 1 appending the same prefill as layer 0 must not be refused.)
TEST(Errors, RingDropsPositionsThatLeftTheWindow) {
  for (const VariantEntry* e : variants_with(Addressing::ring, UpdateMode::eager, std::nullopt)) {
    SCOPED_TRACE(e->descriptor->name);
    Fixture f(*e);
    const int W = f.d.window;
    std::vector<int32_t> rows{0}, pos{2 * W + 3};
    std::vector<int64_t> none;
    f.append(0, 1, rows, pos, none);
    f.snapshot = f.bytes();
    const int64_t length = f.cache->row_length(0);
    ASSERT_EQ(length, 2 * W + 4);
    for (int32_t expired : {W + 3, 0}) {  // both at or below length - W - 1
      pos = {expired};
      f.append(0, 1, rows, pos, none);
      f.expect_unchanged();
      EXPECT_EQ(f.cache->row_length(0), length);
    }
  }
}

// Two positions of one row that share a ring cell in the same append (p and p + window): the later
// position is what the cell holds, whichever order the append lists them in, and the row's length
// counts it. (A short append finds the row's new length inside its items, a longer one in a pass
// of its own; both must agree.)
TEST(Errors, RingAppendKeepsTheLaterOfTwoPositionsSharingACell) {
  for (const VariantEntry* e : variants_with(Addressing::ring, UpdateMode::eager))
    for (bool later_first : {false, true}) {
      SCOPED_TRACE(std::string(e->descriptor->name) + (later_first ? ", later position listed first" : ""));
      Fixture f(*e);
      const int W = f.d.window;
      const size_t token_bytes = size_t(f.d.heads) * f.d.head_dim * f.es;
      std::fill(f.k.begin(), f.k.begin() + token_bytes, 0x3c);
      std::fill(f.k.begin() + token_bytes, f.k.begin() + 2 * token_bytes, 0x40);
      f.v = f.k;
      std::vector<int32_t> rows{1, 1}, pos{3, 3 + W};
      if (later_first) std::swap(pos[0], pos[1]);
      std::vector<int64_t> none;
      f.append(0, 2, rows, pos, none);
      EXPECT_EQ(f.cache->row_length(1), 4 + W);
      std::vector<unsigned char> k_out(token_bytes), v_out(token_bytes);
      GatherRange g;
      g.row = 1, g.begin = 3 + W, g.end = 4 + W;
      f.cache->gather(0, g, TensorView::contiguous(k_out.data(), f.d.input, Device::cpu, f.d.heads, 1, f.d.head_dim),
                      TensorView::contiguous(v_out.data(), f.d.input, Device::cpu, f.d.heads, 1, f.d.head_dim));
      const size_t later = later_first ? 0 : 1;  // the token that carried position 3 + W
      EXPECT_TRUE(std::equal(k_out.begin(), k_out.end(), f.k.begin() + later * token_bytes));
      EXPECT_TRUE(std::equal(v_out.begin(), v_out.end(), f.v.begin() + later * token_bytes));
    }
}

// A hybrid cache's groups each have their own pages and page size, so it has no one physical placement:
// the range check refuses it (it divided by its page size of 0) and points at a group.
TEST(Errors, PhysicalRangeOfAHybridCacheIsRefused) {
  int hybrids = 0;
  for (const auto& e : registry().variants()) {
    if (!e.descriptor->is_hybrid()) continue;
    SCOPED_TRACE(e.descriptor->name);
    ++hybrids;
    CacheConfig cfg;
    cfg.pages = 4;
    const auto cache = e.create(cfg);
    GatherRange range;
    range.end = 1;
    try {
      check_physical_range(*cache, range, 1);
      ADD_FAILURE() << "a hybrid cache's physical range was accepted";
    } catch (const UnsupportedError& err) {
      EXPECT_NE(std::string(err.what()).find("cache.group(g)"), std::string::npos) << err.what();
    }
  }
  if (hybrids == 0) GTEST_SKIP() << "no hybrid variant is registered";
}

}  // namespace
}  // namespace kvtest
