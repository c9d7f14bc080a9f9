// StatePool (state_pool.hpp): each part of each slot holds what was written to it, through write and
// through its view, and nothing else moves; copy, zero, checkpoint and restore move whole slots; the
// memory is what the header states; bad arguments are refused naming them, before anything changes.
#include <gtest/gtest.h>

#include <cstring>
#include <numeric>
#include <vector>

#include "kvforge/kvforge.hpp"
#include "support.hpp"

namespace kvforge {
namespace {

// A gated-delta-net-like record in miniature: a conv window and a recurrent state.
std::vector<StatePart> record() {
  return {{"conv", {6, 3}, DType::bf16}, {"ssm", {2, 4, 4}, DType::f32}};
}

// The value of element i of (slot, layer, part): distinct everywhere, as float bytes or bf16 bits.
float value(int64_t slot, int layer, int part, int64_t i) { return float(slot * 1000 + layer * 100 + part * 50 + i); }

std::vector<char> bytes_of(const StatePool& pool, int64_t slot, int layer, int part) {
  const StatePart& p = pool.parts()[size_t(part)];
  const int64_t n = pool.part_bytes(part) / dtype_size(p.dtype);
  std::vector<char> out(size_t(pool.part_bytes(part)));
  for (int64_t i = 0; i < n; ++i) {
    if (p.dtype == DType::f32) {
      const float v = value(slot, layer, part, i);
      std::memcpy(out.data() + i * 4, &v, 4);
    } else {
      const uint16_t v = uint16_t(slot * 1000 + layer * 100 + part * 50 + i);  // any 16 bits: moved, not read
      std::memcpy(out.data() + i * 2, &v, 2);
    }
  }
  return out;
}

std::vector<char> read(const StatePool& pool, int64_t slot, int layer, int part) {
  std::vector<char> out(size_t(pool.part_bytes(part)));
  pool.read(slot, layer, part, out.data(), Device::cpu);
  return out;
}

StatePool filled(int64_t slots = 4, int64_t checkpoints = 2) {
  StatePool pool(record(), 3, StatePoolConfig{Device::cpu, slots, checkpoints});
  for (int64_t s = 0; s < slots; ++s)
    for (int layer = 0; layer < 3; ++layer)
      for (int part = 0; part < 2; ++part) pool.write(s, layer, part, bytes_of(pool, s, layer, part).data(), Device::cpu);
  return pool;
}

TEST(StatePool, EveryPartOfEverySlotHoldsWhatWasWritten) {
  StatePool pool = filled();
  for (int64_t s = 0; s < 4; ++s)
    for (int layer = 0; layer < 3; ++layer)
      for (int part = 0; part < 2; ++part) {
        EXPECT_EQ(read(pool, s, layer, part), bytes_of(pool, s, layer, part)) << s << " " << layer << " " << part;
        EXPECT_EQ(kvtest::state_view_bytes(pool, s, layer, part), bytes_of(pool, s, layer, part));
      }
}

TEST(StatePool, ViewsAreSlotsByShapeAndWritesThroughThemLand) {
  StatePool pool = filled();
  const StateView v = pool.view(2, 1);
  EXPECT_EQ(v.shape, (std::vector<int64_t>{4, 2, 4, 4}));
  EXPECT_EQ(v.strides[3], 1);
  EXPECT_EQ(v.strides[2], 4);
  EXPECT_EQ(v.strides[1], 16);
  EXPECT_EQ(v.strides[0] * 4, pool.slot_bytes());
  // A model updating slot 3's recurrent state in place, element [1][2][3].
  static_cast<float*>(v.data)[3 * v.strides[0] + 1 * 16 + 2 * 4 + 3] = -7.0f;
  std::vector<char> want = bytes_of(pool, 3, 2, 1);
  const float m7 = -7.0f;
  std::memcpy(want.data() + (16 + 8 + 3) * 4, &m7, 4);
  EXPECT_EQ(read(pool, 3, 2, 1), want);
  EXPECT_EQ(read(pool, 2, 2, 1), bytes_of(pool, 2, 2, 1));  // the neighbouring slot is untouched
}

TEST(StatePool, CopyZeroCheckpointAndRestoreMoveWholeSlots) {
  StatePool pool = filled();
  pool.copy_slot(1, 3);  // a fork: every layer and part
  pool.zero_slot(0);
  pool.checkpoint(2, 1);
  pool.write(2, 0, 0, bytes_of(pool, 0, 0, 0).data(), Device::cpu);  // slot 2 moves on
  pool.restore(1, 0);  // a prefix hit, restored into another slot
  for (int layer = 0; layer < 3; ++layer)
    for (int part = 0; part < 2; ++part) {
      EXPECT_EQ(read(pool, 3, layer, part), bytes_of(pool, 1, layer, part));
      EXPECT_EQ(read(pool, 1, layer, part), bytes_of(pool, 1, layer, part));
      EXPECT_EQ(read(pool, 0, layer, part), bytes_of(pool, 2, layer, part));  // the checkpoint, before the write
    }
  EXPECT_EQ(read(pool, 2, 0, 0), bytes_of(pool, 0, 0, 0));
  pool.zero_slot(3);
  for (int layer = 0; layer < 3; ++layer)
    for (int part = 0; part < 2; ++part) {
      const std::vector<char> got = read(pool, 3, layer, part);
      EXPECT_TRUE(std::all_of(got.begin(), got.end(), [](char c) { return c == 0; }));
    }
}

TEST(StatePool, MemoryIsPartsRoundedTo64BytesAndSlotsTo256) {
  StatePool pool(record(), 3, StatePoolConfig{Device::cpu, 5, 2});
  // conv: 6 x 3 bf16 = 36 bytes -> 64; ssm: 2 x 4 x 4 fp32 = 128. A layer's record 192; three layers 576
  // -> 768 a slot; 7 records (5 slots, 2 checkpoints).
  EXPECT_EQ(pool.part_bytes(0), 36);
  EXPECT_EQ(pool.part_bytes(1), 128);
  EXPECT_EQ(pool.record_bytes(), 192);
  EXPECT_EQ(pool.slot_bytes(), 768);
  EXPECT_EQ(pool.bytes(), 7 * 768);
  EXPECT_EQ(pool.padding_bytes(), 7 * (768 - 3 * (36 + 128)));
}

TEST(StatePool, RefusesBadArgumentsNamingThem) {
  const auto refused = [](auto make, const char* argument) {
    try {
      make();
      ADD_FAILURE() << "not refused: " << argument;
    } catch (const ArgumentError& e) {
      EXPECT_EQ(e.argument(), argument) << e.what();
    }
  };
  const StatePoolConfig two{Device::cpu, 2, 1};
  refused([&] { StatePool({}, 1, two); }, "parts");
  refused([&] { StatePool({{"Conv", {2}, DType::f32}}, 1, two); }, "parts[0].name");
  refused([&] { StatePool({{"a", {2}, DType::f32}, {"a", {3}, DType::f32}}, 1, two); }, "parts[1].name");
  refused([&] { StatePool({{"a", {}, DType::f32}}, 1, two); }, "parts[0].shape");
  refused([&] { StatePool({{"a", {1, 1, 1, 1, 1}, DType::f32}}, 1, two); }, "parts[0].shape");
  refused([&] { StatePool({{"a", {3, 0}, DType::f32}}, 1, two); }, "parts[0].shape");
  refused([&] { StatePool({{"a", {1 << 20, 1 << 20}, DType::f32}}, 1, two); }, "parts[0].shape");
  refused([&] { StatePool({{"a", {2}, DType::i8}}, 1, two); }, "parts[0].dtype");
  refused([&] { StatePool(std::vector<StatePart>(65, StatePart{"a", {1}, DType::f32}), 1, two); }, "parts");
  refused([&] { StatePool({{"a", {1 << 20}, DType::f32}}, 1024, StatePoolConfig{Device::cpu, 1 << 20, 0}); }, "slots");
  refused([&] { StatePool(record(), 0, two); }, "layers");
  refused([&] { StatePool(record(), 1, StatePoolConfig{Device::cpu, 0, 0}); }, "slots");
  refused([&] { StatePool(record(), 1, StatePoolConfig{Device::cpu, 1, -1}); }, "checkpoints");
  StatePool pool = filled();
  const std::vector<char> data = bytes_of(pool, 0, 0, 0);
  refused([&] { pool.write(4, 0, 0, data.data(), Device::cpu); }, "slot");
  refused([&] { pool.write(-1, 0, 0, data.data(), Device::cpu); }, "slot");
  refused([&] { pool.write(0, 3, 0, data.data(), Device::cpu); }, "layer");
  refused([&] { pool.write(0, 0, 2, data.data(), Device::cpu); }, "part");
  refused([&] { pool.copy_slot(0, 9); }, "dst");
  refused([&] { pool.copy_slot(9, 0); }, "src");
  refused([&] { pool.checkpoint(0, 2); }, "index");
  refused([&] { pool.restore(2, 0); }, "index");
  refused([&] { pool.part_index("ssm2"); }, "part");
  for (int64_t s = 0; s < 4; ++s)  // nothing moved
    for (int layer = 0; layer < 3; ++layer)
      for (int part = 0; part < 2; ++part) EXPECT_EQ(read(pool, s, layer, part), bytes_of(pool, s, layer, part));
}

// Every registered variant whose model spec names linear layers: its attention layers are the model's
// other layers, and its pool holds its record over the linear ones. Another variant keeps no state.
TEST(StatePool, AVariantsModelSpecNamesItsLinearLayersAndTheirRecord) {
  int seen = 0;
  for (const VariantEntry& e : registry().variants()) {
    const VariantDescriptor& d = *e.descriptor;
    if (!d.states) {
      if (!d.is_hybrid()) {
        EXPECT_THROW(StatePool(d, StatePoolConfig{Device::cpu, 1, 0}), UnsupportedError) << d.name;
      }
      continue;
    }
    ++seen;
    const StateRecord& r = *d.states;
    EXPECT_EQ(d.layers + r.num_linear, r.model_layers) << d.name;
    for (int i = 0; i < r.num_linear; ++i) {
      EXPECT_TRUE(r.linear_layers[i] >= 0 && r.linear_layers[i] < r.model_layers) << d.name;
      if (i) {
        EXPECT_LT(r.linear_layers[i - 1], r.linear_layers[i]) << d.name;
      }
    }
    const StatePool pool(d, StatePoolConfig{Device::cpu, 1, 0});
    EXPECT_EQ(pool.layers(), r.num_linear);
    ASSERT_EQ(int(pool.parts().size()), r.num_parts);
    int64_t bytes = 0;
    for (int p = 0; p < r.num_parts; ++p) {
      EXPECT_EQ(pool.parts()[size_t(p)].name, r.parts[p].name);
      int64_t n = dtype_size(r.parts[p].dtype);
      for (int k = 0; k < r.parts[p].rank; ++k) n *= r.parts[p].shape[k];
      EXPECT_EQ(pool.part_bytes(p), n);
      bytes += n;
    }
    EXPECT_GE(pool.slot_bytes(), bytes * r.num_linear);
  }
  EXPECT_GT(seen, 0) << "no registered variant's model names linear_layers";
}

TEST(StatePool, OnCudaTheSameCopies) {
  std::string why;
  if (!cuda_available(&why)) GTEST_SKIP() << "no CUDA here: " << why;
  StatePool pool(record(), 3, StatePoolConfig{Device::cuda, 4, 1});
  const std::vector<char> a = bytes_of(pool, 1, 2, 1);
  pool.write(1, 2, 1, a.data(), Device::cpu);  // from the host
  pool.copy_slot(1, 2);
  pool.checkpoint(2, 0);
  pool.zero_slot(1);
  pool.restore(0, 3);
  std::vector<char> got(a.size()), zero(a.size());
  pool.read(3, 2, 1, got.data(), Device::cpu);
  pool.read(1, 2, 1, zero.data(), Device::cpu);
  pool.synchronize();
  EXPECT_EQ(got, a);
  EXPECT_TRUE(std::all_of(zero.begin(), zero.end(), [](char c) { return c == 0; }));
}

}  // namespace
}  // namespace kvforge
