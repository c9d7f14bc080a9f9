// What a transfer between tensor-parallel groups carries of a state slot (state_shards.hpp), in one
// process: every sender rank packs each of its pieces from its own pool, every receiver rank unpacks the
// pieces addressed to it, and each receiver's state is then its share of the model's, checked by plain
// loops over the model's coordinates. Parts split on axes 0, 1 and 2, and one whole on every rank, over
// degrees 1, 2 and 4 each way; and the refusals.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "kvforge/kvforge.hpp"
#include "kvforge/state_shards.hpp"

namespace kvforge {
namespace {


constexpr int kLayers = 2, kHeads = 4;

// The model's record: a conv window split on its channels (axis 0), a state split on its second axis,
// one split on its last, and a norm that every rank holds whole. Extents divide by 4.
struct ModelPart {
  const char* name;
  std::vector<int64_t> shape;
  int axis;
};
const ModelPart kModel[] = {{"conv", {8, 3}, 0}, {"ssm", {2, 8, 3}, 1}, {"last", {3, 4}, 1}, {"norm", {5}, StatePartSpec::kWhole}};

// A rank's descriptor at degree tp: its parts' shapes are its share.
struct Shard {
  std::vector<StatePartSpec> specs;
  StateRecord record{};
  VariantDescriptor d{};
  int linear[kLayers] = {0, 1};
  explicit Shard(int tp, int model_heads = kHeads) {
    for (const ModelPart& m : kModel) {
      StatePartSpec s{m.name, int(m.shape.size()), {0, 0, 0, 0}, DType::f32, m.axis};
      for (size_t a = 0; a < m.shape.size(); ++a) s.shape[a] = m.shape[a] / (int(a) == m.axis ? tp : 1);
      specs.push_back(s);
    }
    record = StateRecord{kLayers + 1, kLayers, linear, int(specs.size()), specs.data()};
    d.name = "test";
    d.model_heads = model_heads;
    d.tensor_parallel = tp;
    d.states = &record;
  }
  std::vector<StatePart> parts() const {
    std::vector<StatePart> out;
    for (const StatePartSpec& s : specs) out.push_back({s.name, std::vector<int64_t>(s.shape, s.shape + s.rank), s.dtype});
    return out;
  }
};

// The model's value at (layer, part, index along each axis), distinct everywhere.
float model_value(int layer, int part, const std::vector<int64_t>& at) {
  float v = float(layer * 1000 + part * 100);
  for (int64_t i : at) v = v * 7 + float(i);
  return v;
}

// Rank `rank`'s share, as its host image (StatePool::read_slot's layout).
std::vector<unsigned char> share(const StatePool& pool, int rank) {
  std::vector<unsigned char> image(size_t(pool.slot_bytes()), 0);
  for (int layer = 0; layer < kLayers; ++layer)
    for (int part = 0; part < int(std::size(kModel)); ++part) {
      const ModelPart& m = kModel[part];
      const std::vector<int64_t>& shape = pool.parts()[size_t(part)].shape;
      int64_t n = 1;
      for (int64_t e : shape) n *= e;
      for (int64_t flat = 0; flat < n; ++flat) {
        std::vector<int64_t> at(shape.size());
        for (int64_t a = int64_t(shape.size()) - 1, rest = flat; a >= 0; --a) at[size_t(a)] = rest % shape[size_t(a)], rest /= shape[size_t(a)];
        if (m.axis >= 0) at[size_t(m.axis)] += rank * shape[size_t(m.axis)];  // the rank's share begins there
        const float v = model_value(layer, part, at);
        std::memcpy(&image[size_t(pool.image_offset(layer, part) + flat * 4)], &v, 4);
      }
    }
  return image;
}

TEST(StateShards, EveryReceiverAssemblesItsShareOfTheModelsState) {
  for (int S : {1, 2, 4})
    for (int R : {1, 2, 4}) {
      const Shard sender(S), receiver(R);
      std::vector<StatePool> senders, receivers;
      for (int s = 0; s < S; ++s) senders.emplace_back(sender.parts(), kLayers, StatePoolConfig{Device::cpu, 1, 0});
      for (int r = 0; r < R; ++r) receivers.emplace_back(receiver.parts(), kLayers, StatePoolConfig{Device::cpu, 1, 0});
      std::vector<std::vector<unsigned char>> got(size_t(R), std::vector<unsigned char>(size_t(receivers[0].slot_bytes()), 0xee));
      int messages = 0;
      const StateShards out(sender.parts(), kLayers, sender.d, S, S, R, "state");
      const StateShards in(receiver.parts(), kLayers, receiver.d, R, S, R, "states");
      ASSERT_EQ(out.model_record_hash(), in.model_record_hash()) << S << " -> " << R;
      for (int s = 0; s < S; ++s)
        for (int r = 0; r < R; ++r) {
          const auto rows = out.rows(s, r);
          ASSERT_EQ(StateShards::bytes(rows), StateShards::bytes(in.rows(s, r))) << S << " -> " << R;
          if (rows.empty()) continue;
          std::vector<unsigned char> message(size_t(StateShards::bytes(rows)));
          StateShards::pack(rows, senders[size_t(s)], share(senders[size_t(s)], s).data(), message.data());
          StateShards::unpack(in.rows(s, r), receivers[size_t(r)], message.data(), got[size_t(r)].data());
          ++messages;
        }
      for (int r = 0; r < R; ++r) {
        const std::vector<unsigned char> want = share(receivers[size_t(r)], r);
        for (int layer = 0; layer < kLayers; ++layer)
          for (int part = 0; part < int(std::size(kModel)); ++part) {
            const int64_t at = receivers[size_t(r)].image_offset(layer, part), n = receivers[size_t(r)].part_bytes(part);
            EXPECT_TRUE(std::equal(want.begin() + at, want.begin() + at + n, got[size_t(r)].begin() + at))
                << S << " -> " << R << ": receiver " << r << " layer " << layer << " part " << kModel[part].name;
          }
      }
      // Every pair whose shares of the split parts meet exchanges one message (4 heads split alike).
      EXPECT_EQ(messages, int(shard_pieces(kHeads, S, R).size())) << S << " -> " << R;
    }
}

// Two pieces of heads between one pair of ranks carry the pair's rows once, in the first.
TEST(StateShards, APairsRowsGoWithItsFirstPieceOnly) {
  const Shard one(1);
  const StateShards shards(one.parts(), kLayers, one.d, 1, 1, 1, "state");
  const auto rows = shards.piece_rows({ShardPiece{0, 0, {0, 1}}, ShardPiece{0, 0, {2, 2}}});
  ASSERT_EQ(rows.size(), 2u);
  EXPECT_EQ(StateShards::bytes(rows[0]), StateShards::bytes(shards.rows(0, 0)));
  EXPECT_TRUE(rows[1].empty());
}

void expect_refused(const std::function<void()>& make, const std::string& words) {
  try {
    make();
    ADD_FAILURE() << "not refused: " << words;
  } catch (const ArgumentError& e) {
    EXPECT_EQ(e.argument(), "state");
    EXPECT_NE(std::string(e.what()).find(words), std::string::npos) << e.what();
  }
}

TEST(StateShards, RefusesWhatCannotGoAsTheSpecSplitsIt) {
  const Shard two(2);
  // A record other than the variant's: its split is unknown.
  std::vector<StatePart> other = two.parts();
  other[1].name = "other";
  expect_refused([&] { StateShards(other, kLayers, two.d, 2, 2, 1, "state"); }, "only from and into a pool of the variant's own record");
  // Between groups of one rank, any record goes whole.
  const Shard one(1);
  EXPECT_NO_THROW(StateShards(other, kLayers, one.d, 1, 1, 1, "state"));
  // A part given per degree, between two degrees; between two of one degree, rank to rank.
  Shard per_degree(2);
  per_degree.specs[0].shard_axis = StatePartSpec::kShapesPerDegree;
  expect_refused([&] { StateShards(two.parts(), kLayers, per_degree.d, 2, 2, 1, "state"); }, "part 'conv' has a shape of its own");
  EXPECT_NO_THROW(StateShards(two.parts(), kLayers, per_degree.d, 2, 2, 2, "state").require_paired_with_heads("state"));
  // Two KV heads over four senders: receiver 0 takes its heads from one of two replicas, but its state
  // from both, so a transfer that goes with the heads cannot carry it (a one-sided pull can).
  const Shard four(4, 2);
  const StateShards quarter(four.parts(), kLayers, four.d, 4, 4, 2, "state");
  expect_refused([&] { quarter.require_paired_with_heads("state"); }, "none of its K/V heads");
}

}  // namespace
}  // namespace kvforge
