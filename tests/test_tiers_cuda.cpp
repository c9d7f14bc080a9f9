// Host-tier blocks promoted ahead on a CUDA cache (SequenceManagerOptions::promote_ahead): the copies go
// on the manager's own stream, and the cache's stream waits for a sequence's own pages by an event. Each
// prompt's K/V, written on the device, demoted to pinned host pages by eviction and promoted back, reads
// back through gather as the values written (a function of token, position, layer, head and dim), whether
// its step came at once or after another's, and after pages freed under pending copies were reused.
// Built with KVFORGE_CUDA only; without a GPU every case skips and says why.
#include <cuda_runtime.h>

#include <string>
#include <vector>

#include "support.hpp"
#include "tier_values.hpp"

namespace kvtest {
namespace {

// The paged, unquantized fp32 variants of the tiny model: their values come back exactly.
std::vector<const VariantEntry*> float_paged_variants() {
  std::vector<const VariantEntry*> out;
  for (const auto& e : registry().variants()) {
    const VariantDescriptor& d = *e.descriptor;
    if (std::string(d.model) == "tiny" && d.paged() && !d.is_hybrid() && d.storage == DType::f32 && d.input == DType::f32 &&
        d.update == UpdateMode::eager)
      out.push_back(&e);
  }
  return out;
}

template <class T> void to_device(Buffer& b, const std::vector<T>& host) {
  const int64_t bytes = int64_t(host.size() * sizeof(T));
  if (b.bytes() < bytes) b = Buffer(backend(Device::cuda), bytes);
  ASSERT_EQ(cudaMemcpy(b.data(), host.data(), size_t(bytes), cudaMemcpyHostToDevice), cudaSuccess);
}

struct CudaTiersCase {
  const VariantDescriptor& d;
  std::unique_ptr<Cache> cache;
  std::unique_ptr<SequenceManager> manager;
  Buffer k, v, slots, out_k, out_v;

  CudaTiersCase(const VariantEntry& e, cudaStream_t s) : d(*e.descriptor) {
    CacheConfig c;
    c.device = Device::cuda;
    c.stream = s;
    c.pages = 8;
    cache = e.create(c);
    SequenceManagerOptions o;
    o.host_blocks = 16;
    o.promote_ahead = true;
    manager = std::make_unique<SequenceManager>(*cache, o);
  }
  int P() const { return d.page_size; }

  // Steps `id` alone and writes its tokens from `cached` on, from device memory.
  void write(int64_t id, const std::vector<int32_t>& prompt, int64_t cached) {
    const BatchMetadata b = manager->step({id});
    const int64_t T = int64_t(b.slots.size());
    std::vector<float> hk, hv;
    to_device(slots, b.slots);
    for (int layer = 0; layer < d.layers; ++layer) {
      tier_inputs(d, prompt, cached, T, layer, hk, hv);
      to_device(k, hk);
      to_device(v, hv);
      cache->append(layer, TensorView::contiguous(k.data(), d.input, Device::cuda, T, d.heads, d.head_dim),
                    TensorView::contiguous(v.data(), d.input, Device::cuda, T, d.heads, d.head_dim),
                    TokenTargets::paged(IndexView{slots.data(), DType::i64, Device::cuda, T}));
      cache->synchronize();  // the inputs' buffers are refilled for the next layer
    }
  }
  int64_t serve(int64_t id, const std::vector<int32_t>& prompt) {
    const int64_t cached = manager->add(id, prompt);
    write(id, prompt, cached);
    return cached;
  }
  void expect_contents(int64_t id, const std::vector<int32_t>& prompt) {
    const int64_t n = int64_t(prompt.size()), values = d.heads * n * d.head_dim;
    std::vector<float> hk(static_cast<size_t>(values)), hv(hk.size());
    if (out_k.bytes() < values * 4) out_k = Buffer(backend(Device::cuda), values * 4), out_v = Buffer(backend(Device::cuda), values * 4);
    for (int layer = 0; layer < d.layers; ++layer) {
      cache->gather(layer, manager->range(id, 0, n), TensorView::contiguous(out_k.data(), d.input, Device::cuda, d.heads, n, d.head_dim),
                    TensorView::contiguous(out_v.data(), d.input, Device::cuda, d.heads, n, d.head_dim));
      cache->synchronize();
      ASSERT_EQ(cudaMemcpy(hk.data(), out_k.data(), size_t(values * 4), cudaMemcpyDeviceToHost), cudaSuccess);
      ASSERT_EQ(cudaMemcpy(hv.data(), out_v.data(), size_t(values * 4), cudaMemcpyDeviceToHost), cudaSuccess);
      expect_tier_layer(d, prompt, layer, hk, hv);
    }
  }
};

TEST(CudaTiers, PromotionAheadOnItsOwnStreamReadsBackWhatWasWritten) {
  KVTEST_REQUIRE_DEVICE(Device::cuda);
  const auto variants = float_paged_variants();
  ASSERT_FALSE(variants.empty()) << "no paged fp32 variant of the tiny model is built";
  cudaStream_t stream = nullptr;
  ASSERT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
  for (const VariantEntry* e : variants) {
    CudaTiersCase t(*e, stream);
    std::vector<std::vector<int32_t>> prompts;
    for (int i = 0; i < 8; ++i) {  // two blocks each through 8 pages: most end on the host tier
      prompts.push_back(tier_prompt(i + 1, 2, t.P()));
      t.serve(i, prompts.back());
      t.manager->free(i);
    }
    ASSERT_EQ(t.manager->cached_prefix(prompts[0]), 2 * t.P()) << e->descriptor->name;
    EXPECT_EQ(t.manager->add(100, prompts[0]), 2 * t.P());
    EXPECT_EQ(t.manager->add(101, prompts[1]), 2 * t.P());
    EXPECT_EQ(t.manager->stats().promoted_ahead, 4) << e->descriptor->name << ": the host-tier blocks were not copied ahead";
    t.manager->check_invariants();
    t.write(101, prompts[1], 2 * t.P());  // the second one steps first
    t.write(100, prompts[0], 2 * t.P());
    t.expect_contents(100, prompts[0]);
    t.expect_contents(101, prompts[1]);
    t.manager->free(100);
    t.manager->free(101);
    // One comes back and is freed before any step: its pages go to the prompts after it under the
    // pending copy, and it comes back again with its values.
    t.manager->add(102, prompts[2]);
    t.manager->free(102);
    for (int i = 3; i < 6; ++i) {
      const int64_t id = 200 + i;
      t.serve(id, prompts[size_t(i)]);
      t.expect_contents(id, prompts[size_t(i)]);
      t.manager->free(id);
    }
    t.manager->check_invariants();
    t.serve(300, prompts[2]);
    t.expect_contents(300, prompts[2]);
    t.manager->free(300);
    t.manager->reset_prefix_cache();  // waits on the host for every copy
    t.manager->check_invariants();
  }
  cudaStreamDestroy(stream);
}

}  // namespace
}  // namespace kvtest
