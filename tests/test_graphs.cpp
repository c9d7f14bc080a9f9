// CUDA graphs, for every variant of the tiny model: an append, a whole decode step, a gather and (rows)
// a reorder are captured on a non-default stream, instantiated, and replayed after new inputs, targets,
// page lists and beams are written into the same device buffers; a twin cache makes the same calls
// eagerly, and the two must hold the same bytes. Built with KVFORGE_CUDA only; without a GPU every
// case skips and says why.
#include <cuda_runtime.h>

#include <algorithm>
#include <string>
#include <vector>

#include "support.hpp"

namespace {

using namespace kvforge;
using namespace kvtest;

void cuda_ok(cudaError_t e, const char* what) { ASSERT_EQ(e, cudaSuccess) << what << ": " << cudaGetErrorString(e); }

std::vector<const VariantEntry*> tiny_variants() {
  std::vector<const VariantEntry*> out;
  for (const auto& e : registry().variants())
    if (std::string(e.descriptor->model) == "tiny" && !e.descriptor->is_hybrid()) out.push_back(&e);
  return out;
}

std::string variant_case_name(const testing::TestParamInfo<const VariantEntry*>& info) {
  std::string name = std::string("cuda_") + info.param->descriptor->name;
  for (char& c : name)
    if (c == '.') c = '_';
  return name;
}

// A graph of whatever `record` queues on `stream`.
template <class Record> cudaGraphExec_t capture(cudaStream_t stream, Record record) {
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  EXPECT_EQ(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal), cudaSuccess);
  record();
  const cudaError_t end = cudaStreamEndCapture(stream, &graph);
  EXPECT_EQ(end, cudaSuccess) << "capture: " << cudaGetErrorString(end);
  if (end != cudaSuccess) return nullptr;
  EXPECT_EQ(cudaGraphInstantiate(&exec, graph, 0), cudaSuccess);
  cudaGraphDestroy(graph);
  return exec;
}

class Graphs : public testing::TestWithParam<const VariantEntry*> {
 protected:
  void SetUp() override {
    KVTEST_REQUIRE_DEVICE(Device::cuda);
    cuda_ok(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), "stream");
  }
  void TearDown() override {
    if (stream_) cudaStreamDestroy(stream_);
  }
  cudaStream_t stream_ = nullptr;
};

constexpr int64_t kRows = 3, kSteps = 4;

// Both caches, the device buffers the graphs read, and how each step fills them.
struct Twins {
  const VariantDescriptor& d;
  std::unique_ptr<Cache> graphed, eager;
  Buffer k, v, slots, rows, positions;
  int64_t pages_per_row = 0;

  Twins(const VariantEntry& e, cudaStream_t stream) : d(*e.descriptor) {
    CacheConfig c;
    c.device = Device::cuda;
    c.stream = stream;
    c.rows = kRows;
    if (d.paged()) {
      pages_per_row = (kSteps + d.page_size - 1) / d.page_size;
      c.pages = kRows * pages_per_row + 1;
    }
    c.max_staged_tokens = kRows;
    graphed = e.create(c);
    eager = e.create(c);
    if (d.takes_tensor_scale())
      for (Cache* cache : {graphed.get(), eager.get()})
        for (int l = 0; l < d.layers; ++l) cache->set_tensor_scale(l, 0.5f, 0.25f);
    Backend& b = backend(Device::cuda);
    const int64_t bytes = kRows * d.heads * d.head_dim * dtype_size(d.input);
    k = Buffer(b, bytes), v = Buffer(b, bytes);
    slots = Buffer(b, kRows * int64_t(sizeof(int64_t)));
    rows = Buffer(b, kRows * int64_t(sizeof(int32_t)));
    positions = Buffer(b, kRows * int64_t(sizeof(int32_t)));
  }
  TokenTargets targets() const {
    if (d.paged()) return TokenTargets::paged(IndexView{slots.data(), DType::i64, Device::cuda, kRows});
    return TokenTargets::row_positions(IndexView{rows.data(), DType::i32, Device::cuda, kRows},
                                       IndexView{positions.data(), DType::i32, Device::cuda, kRows});
  }
  TensorView input(const Buffer& b) const {
    return TensorView::contiguous(b.data(), d.input, Device::cuda, kRows, d.heads, d.head_dim);
  }
  // Step s: one new token per row, at position s (row r's page r * pages_per_row + s / P), with values
  // of their own; the buffers the graphs read are overwritten in place.
  void fill(int64_t s, int salt) {
    std::vector<unsigned char> kh(static_cast<size_t>(k.bytes())), vh(kh.size());
    const int es = dtype_size(d.input);
    for (int64_t i = 0; i < kRows * d.heads * d.head_dim; ++i) {
      store_as(d.input, exact_value(uint64_t(s * 1000003 + salt * 7919 + i)), &kh[size_t(i * es)]);
      store_as(d.input, exact_value(uint64_t(s * 1000003 + salt * 7919 + i) ^ 0x5555), &vh[size_t(i * es)]);
    }
    std::vector<int64_t> sl;
    std::vector<int32_t> rw, ps;
    for (int64_t r = 0; r < kRows; ++r) {
      rw.push_back(int32_t(r));
      ps.push_back(int32_t(s));
      if (d.paged()) sl.push_back((r * pages_per_row + s / d.page_size) * d.page_size + s % d.page_size);
    }
    Backend& b = backend(Device::cuda);
    void* stream = graphed->config().stream;
    b.from_host(k.data(), kh.data(), k.bytes(), stream);
    b.from_host(v.data(), vh.data(), v.bytes(), stream);
    b.from_host(rows.data(), rw.data(), rows.bytes(), stream);
    b.from_host(positions.data(), ps.data(), positions.bytes(), stream);
    if (d.paged()) b.from_host(slots.data(), sl.data(), slots.bytes(), stream);
  }
  void step(Cache& c, bool every_layer) {
    for (int l = 0; l < (every_layer ? d.layers : 1); ++l) c.append(l, input(k), input(v), targets());
    c.commit();
  }
};

// An append of one layer (step 0), then whole decode steps (steps 1 to 3), replayed with new inputs.
TEST_P(Graphs, CudaAppendAndDecodeStepReplayLikeEagerCalls) {
  Twins t(*GetParam(), stream_);
  const cudaGraphExec_t one = capture(stream_, [&] { t.step(*t.graphed, false); });
  const cudaGraphExec_t whole = capture(stream_, [&] { t.step(*t.graphed, true); });
  ASSERT_TRUE(one && whole);
  for (int64_t s = 0; s < kSteps; ++s) {
    t.fill(s, 0);
    cuda_ok(cudaGraphLaunch(s == 0 ? one : whole, stream_), "replay");
    t.step(*t.eager, s != 0);
  }
  t.graphed->synchronize();
  t.eager->synchronize();
  EXPECT_EQ(held_bytes(*t.graphed), held_bytes(*t.eager)) << "replayed graphs and eager calls hold different bytes";
  // And something was written: the steps' values are not all zero.
  const std::vector<unsigned char> held = held_bytes(*t.eager);
  EXPECT_NE(std::count(held.begin(), held.end(), 0), std::ptrdiff_t(held.size()));
  cudaGraphExecDestroy(one);
  cudaGraphExecDestroy(whole);
}

// A gather (every position written so far of row or sequence 1) captured once, replayed after the page
// list or row it reads is rewritten in place.
TEST_P(Graphs, CudaGatherReplaysLikeEagerCalls) {
  Twins t(*GetParam(), stream_);
  for (int64_t s = 0; s < kSteps; ++s) {
    t.fill(s, 1);
    t.step(*t.graphed, true);
    t.step(*t.eager, true);
  }
  const VariantDescriptor& d = t.d;
  Backend& b = backend(Device::cuda);
  const int64_t out_bytes = d.heads * kSteps * d.head_dim * dtype_size(d.input);
  Buffer ko(b, out_bytes), vo(b, out_bytes), ke(b, out_bytes), ve(b, out_bytes), pages(b, 4 * t.pages_per_row);
  GatherRange r;
  r.begin = 0, r.end = kSteps;
  if (d.addressing == Addressing::ring) r.begin = std::max<int64_t>(0, kSteps - d.window);
  const int64_t n = r.end - r.begin;
  if (d.paged()) r.pages = IndexView{pages.data(), DType::i32, Device::cuda, t.pages_per_row};
  auto out = [&](Buffer& o) { return TensorView::contiguous(o.data(), d.input, Device::cuda, d.heads, n, d.head_dim); };
  auto point_at = [&](int64_t row) {  // the page list (paged) or the row the gather reads
    std::vector<int32_t> list;
    for (int64_t i = 0; i < t.pages_per_row; ++i) list.push_back(int32_t(row * t.pages_per_row + i));
    if (d.paged()) b.from_host(pages.data(), list.data(), int64_t(list.size() * sizeof(int32_t)), stream_);
  };
  point_at(1);
  r.row = 1;
  const cudaGraphExec_t g = capture(stream_, [&] { t.graphed->gather(0, r, out(ko), out(vo)); });
  ASSERT_TRUE(g);
  for (int64_t row : {2, 0}) {
    point_at(row);  // a row is captured by value: there the replay reads row 1 again
    cuda_ok(cudaGraphLaunch(g, stream_), "replay");
    t.eager->gather(0, r, out(ke), out(ve));
    t.graphed->synchronize();
    t.eager->synchronize();
    Arena host(Device::cuda);
    EXPECT_EQ(host.fetch(ko.data(), out_bytes), host.fetch(ke.data(), out_bytes)) << "K, reading row " << row;
    EXPECT_EQ(host.fetch(vo.data(), out_bytes), host.fetch(ve.data(), out_bytes)) << "V, reading row " << row;
  }
  cudaGraphExecDestroy(g);
}

// Contiguous and ring layouts: a reorder (its scratch allocated up front) captured once, replayed with
// new beams written into the same buffer.
TEST_P(Graphs, CudaReorderReplaysLikeEagerCalls) {
  if (GetParam()->descriptor->paged()) GTEST_SKIP() << "paged layouts fork by copy_blocks, not reorder";
  Twins t(*GetParam(), stream_);
  for (int64_t s = 0; s < 2; ++s) {
    t.fill(s, 2);
    t.step(*t.graphed, true);
    t.step(*t.eager, true);
  }
  Backend& b = backend(Device::cuda);
  Buffer beam(b, kRows * int64_t(sizeof(int32_t)));
  const IndexView view{beam.data(), DType::i32, Device::cuda, kRows};
  const cudaGraphExec_t g = capture(stream_, [&] { t.graphed->reorder(view); });
  ASSERT_TRUE(g);
  for (const std::vector<int32_t>& order : {std::vector<int32_t>{2, 2, 0}, std::vector<int32_t>{1, 0, 1}}) {
    b.from_host(beam.data(), order.data(), beam.bytes(), stream_);
    cuda_ok(cudaGraphLaunch(g, stream_), "replay");
    t.eager->reorder(view);
  }
  t.graphed->synchronize();
  t.eager->synchronize();
  EXPECT_EQ(held_bytes(*t.graphed), held_bytes(*t.eager));
  cudaGraphExecDestroy(g);
}

INSTANTIATE_TEST_SUITE_P(Tiny, Graphs, testing::ValuesIn(tiny_variants()), variant_case_name);

// A ring gather checks its range against the row's length on the device (so that it can be captured):
// a range that left the window is refused at synchronize(), naming the range.
// A bad target refuses the whole append on the device, whether its checks ran inside the append's one
// launch (a decode step's tokens, up to 256: 8, and 200, whose rows and positions are 400 entries) or in
// a launch of their own (more than 256, every index array in it): synchronize() names the argument and
// the element, and the cache holds the same bytes and
// lengths as before. A good append queued behind the refused one writes nothing either (the status
// word halts it), and a row layout's bad position (its second index array) is caught as its bad row is.
TEST(DeviceChecks, CudaBadTargetWritesNothingInOneLaunchOrSeveral) {
  KVTEST_REQUIRE_DEVICE(Device::cuda);
  int checked = 0;
  for (const VariantEntry* e : tiny_variants()) {
    const VariantDescriptor& d = *e->descriptor;
    if (d.update != UpdateMode::eager) continue;
    const std::vector<std::string> bad_arrays =
        d.paged() ? std::vector<std::string>{"targets.slots"} : std::vector<std::string>{"targets.rows", "targets.positions"};
    for (const std::string& bad : bad_arrays)
      for (int64_t tokens : {int64_t(8), int64_t(200), int64_t(300)}) {
        SCOPED_TRACE(std::string(d.name) + ", " + std::to_string(tokens) + " tokens, bad " + bad);
        CacheConfig c;
        c.device = Device::cuda;
        c.rows = 2;
        c.pages = (tokens + d.page_size - 1) / std::max(d.page_size, 1) + 1;
        auto cache = e->create(c);
        if (d.takes_tensor_scale())
          for (int l = 0; l < d.layers; ++l) cache->set_tensor_scale(l, 0.5f, 0.25f);
        const std::vector<unsigned char> before = held_bytes(*cache);
        Arena a(Device::cuda);
        std::vector<unsigned char> values(static_cast<size_t>(tokens * d.heads * d.head_dim * dtype_size(d.input)), 0x3c);
        const TensorView k = TensorView::contiguous(a.put(values), d.input, Device::cuda, tokens, d.heads, d.head_dim);
        const TensorView v = TensorView::contiguous(a.put(values), d.input, Device::cuda, tokens, d.heads, d.head_dim);
        std::vector<int64_t> slots;
        std::vector<int32_t> rows, positions;
        for (int64_t t = 0; t < tokens; ++t) {
          slots.push_back(t);
          rows.push_back(0);
          positions.push_back(int32_t(t % std::max<int64_t>(1, std::min<int64_t>(d.max_seq_len, 64))));
        }
        const TokenTargets good = d.paged() ? TokenTargets::paged(a.index(slots))
                                            : TokenTargets::row_positions(a.index(rows), a.index(positions));
        // The last token's target is out of range: one past the pool's slots, one past the rows, or a
        // negative position other than the padding mark.
        if (bad == "targets.slots") slots.back() = c.pages * d.page_size;
        if (bad == "targets.rows") rows.back() = int32_t(c.rows);
        if (bad == "targets.positions") positions.back() = -2;
        const TokenTargets targets = d.paged() ? TokenTargets::paged(a.index(slots))
                                               : TokenTargets::row_positions(a.index(rows), a.index(positions));
        cache->append(0, k, v, targets);
        cache->append(0, k, v, good);
        try {
          cache->synchronize();
          ADD_FAILURE() << "a bad target was not refused";
        } catch (const OutOfRangeError& err) {
          EXPECT_EQ(err.argument(), bad) << err.what();
          EXPECT_EQ(err.index(), tokens - 1) << err.what();
        }
        EXPECT_TRUE(held_bytes(*cache) == before) << "a refused append, or one queued after it, wrote into the cache";
        if (!d.paged()) {
          EXPECT_EQ(cache->row_length(0), 0);
        }
        ++checked;
      }
  }
  EXPECT_GT(checked, 0);
}

TEST(GraphsRing, CudaRingGatherChecksItsRangeOnTheDevice) {
  KVTEST_REQUIRE_DEVICE(Device::cuda);
  const VariantEntry* ring = nullptr;
  for (const VariantEntry* e : tiny_variants())
    if (e->descriptor->addressing == Addressing::ring && e->descriptor->update == UpdateMode::eager) ring = e;
  if (!ring) GTEST_SKIP() << "no eager ring variant of the tiny model is registered";
  const VariantDescriptor& d = *ring->descriptor;
  CacheConfig c;
  c.device = Device::cuda;
  c.rows = 1;
  auto cache = ring->create(c);
  Arena a(Device::cuda);
  const int W = d.window;
  std::vector<unsigned char> zeros(size_t(d.heads * d.head_dim * dtype_size(d.input)));
  const std::vector<int32_t> rows{0}, positions{3 * W};
  cache->append(0, TensorView::contiguous(a.put(zeros), d.input, Device::cuda, 1, d.heads, d.head_dim),
                TensorView::contiguous(a.put(zeros), d.input, Device::cuda, 1, d.heads, d.head_dim),
                TokenTargets::row_positions(a.index(rows), a.index(positions)));
  void* out = a.zeros(int64_t(d.heads) * (W + 1) * d.head_dim * dtype_size(d.input));
  GatherRange g;
  g.row = 0, g.begin = 2 * W, g.end = 3 * W + 1;  // the oldest readable is 2W + 1
  cache->gather(0, g, TensorView::contiguous(out, d.input, Device::cuda, d.heads, W + 1, d.head_dim),
                TensorView::contiguous(out, d.input, Device::cuda, d.heads, W + 1, d.head_dim));
  try {
    cache->synchronize();
    ADD_FAILURE() << "a range that left the window was not refused";
  } catch (const OutOfRangeError& e) {
    EXPECT_EQ(e.argument(), "range");
  }
}

}  // namespace
