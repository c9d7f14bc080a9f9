// A state pool of its own in each order of its axes (StateAxes, a layout's `state_axes`): every part of
// every slot lies where a walk over the axes in that order puts it, and every operation moves the same
// state as in the slot-major pool, which test_state_pool.cpp holds to what was written.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <map>
#include <tuple>
#include <vector>

#include "kvforge/kvforge.hpp"
#include "support.hpp"

namespace kvforge {
namespace {

constexpr int kLayers = 3;
constexpr int64_t kSlots = 4, kCheckpoints = 2;

// Parts of sizes that are not whole 64-byte units (conv: 36 bytes, ssm: 128), so padding shows.
std::vector<StatePart> record() { return {{"conv", {6, 3}, DType::bf16}, {"ssm", {2, 4, 4}, DType::f32}}; }

std::vector<StateAxes> every_order() {
  StateAxes a = kSlotMajor;
  std::sort(a.begin(), a.end());
  std::vector<StateAxes> out;
  do out.push_back(a);
  while (std::next_permutation(a.begin(), a.end()));
  return out;
}

std::string order_name(const StateAxes& a) {
  return std::string(name_of(a[0])) + "," + name_of(a[1]) + "," + name_of(a[2]);
}

// docs/memory.md's rule, as nested loops in the pool's order: each (slot, layer, part) takes its part's
// bytes rounded up to 64 at a cursor; where slot is the outermost axis, each slot then rounds the cursor
// up to 256. Slots run over the checkpoints too (slot index slots + i).
std::map<std::tuple<int64_t, int, int>, int64_t> walked(const StateAxes& axes, const std::vector<int64_t>& part_bytes) {
  std::map<std::tuple<int64_t, int, int>, int64_t> at;
  int64_t cursor = 0;
  const int64_t extent[3] = {kSlots + kCheckpoints, kLayers, int64_t(part_bytes.size())};
  auto index = [&](StateAxis a) { return int(a); };
  int64_t i[3];
  for (i[0] = 0; i[0] < extent[index(axes[0])]; ++i[0]) {
    for (i[1] = 0; i[1] < extent[index(axes[1])]; ++i[1])
      for (i[2] = 0; i[2] < extent[index(axes[2])]; ++i[2]) {
        int64_t c[3];  // by StateAxis: slot, layer, part
        for (int k = 0; k < 3; ++k) c[index(axes[k])] = i[k];
        at[{c[0], int(c[1]), int(c[2])}] = cursor;
        cursor += (part_bytes[size_t(c[2])] + 63) / 64 * 64;
      }
    if (axes[0] == StateAxis::slot) cursor = (cursor + 255) / 256 * 256;
  }
  return at;
}

TEST(StateAxes, EachOrderPlacesEveryPartWhereAWalkOverItsAxesDoes) {
  for (const StateAxes& axes : every_order()) {
    StatePool pool(record(), kLayers, StatePoolConfig{Device::cpu, kSlots, kCheckpoints}, axes);
    ASSERT_EQ(pool.axes(), axes);
    const auto at = walked(axes, {pool.part_bytes(0), pool.part_bytes(1)});
    for (const auto& [key, offset] : at) {
      const auto [slot, layer, part] = key;
      EXPECT_EQ(pool.offset(slot, layer, part), offset) << order_name(axes) << " " << slot << " " << layer << " " << part;
      EXPECT_LE(offset + pool.part_bytes(part), pool.bytes()) << order_name(axes);
      if (slot >= kSlots) continue;  // a view spans the slots, not the checkpoints
      const StateView v = pool.view(layer, part);
      const int64_t es = dtype_size(v.dtype);
      EXPECT_EQ(static_cast<char*>(v.data) + slot * v.strides[0] * es, static_cast<char*>(pool.data()) + offset)
          << order_name(axes) << " " << slot << " " << layer << " " << part;
    }
    // Whatever the order, a slot costs what slot_bytes() says (memory plans count that).
    EXPECT_EQ(pool.bytes(), pool.slot_bytes() * (kSlots + kCheckpoints)) << order_name(axes);
  }
  // The engines' forms by hand: vLLM's tensor a layer [slots, record], SGLang's tensor a part
  // [layers, slots, *shape]. conv takes 64 bytes, ssm 128, a record 192.
  const int64_t records = kSlots + kCheckpoints;
  StatePool vllm(record(), kLayers, StatePoolConfig{Device::cpu, kSlots, kCheckpoints},
                 {StateAxis::layer, StateAxis::slot, StateAxis::part});
  EXPECT_EQ(vllm.offset(3, 2, 1), 2 * records * 192 + 3 * 192 + 64);
  EXPECT_EQ(vllm.view(2, 1).strides[0], 192 / 4);
  StatePool sglang(record(), kLayers, StatePoolConfig{Device::cpu, kSlots, kCheckpoints},
                   {StateAxis::part, StateAxis::layer, StateAxis::slot});
  EXPECT_EQ(sglang.offset(3, 2, 1), kLayers * records * 64 + 2 * records * 128 + 3 * 128);
  EXPECT_EQ(sglang.view(2, 0).strides[0], 64 / 2);
}

// Bytes that differ wherever (slot, layer, part) does.
std::vector<char> pattern(const StatePool& pool, int64_t slot, int layer, int part) {
  std::vector<char> out(size_t(pool.part_bytes(part)));
  for (size_t i = 0; i < out.size(); ++i) out[i] = char(slot * 37 + layer * 11 + part * 5 + int64_t(i) * 3 + 1);
  return out;
}

std::vector<char> read(const StatePool& pool, int64_t slot, int layer, int part) {
  std::vector<char> out(size_t(pool.part_bytes(part)));
  pool.read(slot, layer, part, out.data(), Device::cpu);
  return out;
}

// The same writes and operations on a pool of each order and on a slot-major one leave the same state
// in every slot, the same host image of each, and nothing outside the parts written.
TEST(StateAxes, EveryOperationMovesTheSameStateAsTheSlotMajorPool) {
  for (const StateAxes& axes : every_order()) {
    StatePool pool(record(), kLayers, StatePoolConfig{Device::cpu, kSlots, kCheckpoints}, axes);
    StatePool ref(record(), kLayers, StatePoolConfig{Device::cpu, kSlots, kCheckpoints});
    for (StatePool* p : {&pool, &ref})
      for (int64_t s = 0; s < kSlots; ++s)
        for (int l = 0; l < kLayers; ++l)
          for (int part = 0; part < 2; ++part) p->write(s, l, part, pattern(*p, s, l, part).data(), Device::cpu);
    for (StatePool* p : {&pool, &ref}) {
      p->copy_slot(1, 2);
      p->checkpoint(0, 1);
      p->zero_slot(0);
      p->restore(1, 3);
      p->checkpoint(2, 0);
    }
    auto same_everywhere = [&](const char* after) {
      for (int64_t s = 0; s < kSlots; ++s) {
        for (int l = 0; l < kLayers; ++l)
          for (int part = 0; part < 2; ++part)
            EXPECT_EQ(read(pool, s, l, part), read(ref, s, l, part))
                << order_name(axes) << " after " << after << ": " << s << " " << l << " " << part;
        std::vector<unsigned char> a(size_t(pool.slot_bytes()), 0xee), b(a.size(), 0xdd);
        pool.read_slot(s, a.data());
        ref.read_slot(s, b.data());
        EXPECT_EQ(a, b) << order_name(axes) << " after " << after << ": image of slot " << s;
      }
    };
    same_everywhere("copy, checkpoint, zero and restore");
    // An image moves between orders: the slot-major pool's slot 3 into this pool's slot 0.
    std::vector<unsigned char> image(size_t(ref.slot_bytes()));
    ref.read_slot(3, image.data());
    pool.write_slot(0, image.data());
    ref.write_slot(0, image.data());
    same_everywhere("write_slot");
    // Nothing lies outside the parts: every byte the walk gives no part is still zero.
    std::vector<char> used(size_t(pool.bytes()), 0);
    for (int64_t s = 0; s < kSlots + kCheckpoints; ++s)
      for (int l = 0; l < kLayers; ++l)
        for (int part = 0; part < 2; ++part)
          std::fill_n(used.begin() + pool.offset(s, l, part), pool.part_bytes(part), 1);
    const auto* raw = static_cast<const char*>(pool.data());
    int64_t stray = 0;
    for (size_t i = 0; i < used.size(); ++i) stray += !used[i] && raw[i] != 0;
    EXPECT_EQ(stray, 0) << order_name(axes);
  }
}

TEST(StateAxes, AnOrderMustNameEachAxisOnce) {
  try {
    StatePool(record(), 1, StatePoolConfig{Device::cpu, 1, 0}, {StateAxis::slot, StateAxis::slot, StateAxis::part});
    ADD_FAILURE() << "not refused";
  } catch (const ArgumentError& e) {
    EXPECT_EQ(e.argument(), "axes") << e.what();
    EXPECT_NE(std::string(e.what()).find("[slot, slot, part] does not name 'slot' once"), std::string::npos) << e.what();
  }
}

// A variant's pool of its own takes its layout's order. Picked by property: every variant with a state
// record, and at least one whose layout names an order other than slot-major.
TEST(StateAxes, AVariantsPoolTakesItsLayoutsOrder) {
  int reordered = 0;
  for (const VariantEntry& e : registry().variants()) {
    const VariantDescriptor& d = *e.descriptor;
    if (!d.states) continue;
    const StatePool pool(d, StatePoolConfig{Device::cpu, 1, 1});
    EXPECT_EQ(pool.axes(), d.state_axes) << d.name;
    if (d.state_axes[0] == StateAxis::layer && d.state_axes[1] == StateAxis::slot) {
      ++reordered;
      // vLLM's: layer 1's slots lie after every slot (and checkpoint) of layer 0.
      EXPECT_EQ(pool.offset(0, 1, 0), 2 * pool.record_bytes()) << d.name;
    }
  }
  if (!reordered) GTEST_SKIP() << "no registered variant's layout keeps states [layer, slot, part] (vllm_paged_nhd does)";
}

}  // namespace
}  // namespace kvforge
