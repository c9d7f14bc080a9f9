// kvforge::variant(): a variant of a model that no spec in specs/ names, built on demand from C++ through
// the same spec compiler and disk cache as Python's kvforge.variant(), then checked against vLLM's
// published NHD layout: per layer one tensor [2, pages, page_size, heads, head_dim], K before V.
#include <gtest/gtest.h>

#include <cstdlib>
#include <fstream>
#include <string>
#include <vector>

#include "kvforge/kvforge.hpp"

namespace {

using namespace kvforge;

// A scratch folder for the disk cache and the spec files, so that every run builds once.
struct Scratch {
  std::string path;
  Scratch() {
    const char* tmp = std::getenv("TMPDIR");
    path = std::string(tmp && *tmp ? tmp : "/tmp") + "/kvforge-on-demand-test-XXXXXX";
    if (mkdtemp(path.data()) == nullptr) throw std::runtime_error("mkdtemp failed");
    setenv("KVFORGE_CACHE_DIR", (path + "/cache").c_str(), 1);
  }
  ~Scratch() { std::system(("rm -rf '" + path + "'").c_str()); }
  std::string write(const std::string& name, const std::string& text) const {
    std::ofstream(path + "/" + name) << text;
    return path + "/" + name;
  }
};

const Scratch& scratch() {
  static const Scratch s;
  return s;
}

TEST(OnDemand, BuildsAModelNoSpecNamesAndStoresItInVllmsNhdLayout) {
  const std::string model = scratch().write("odd_heads.yaml", "name: odd_heads\nlayers: 2\nkv_heads: 3\n"
                                                              "head_dim: 40\nmax_seq_len: 64\n");
  const OnDemandVariant v = variant({"vllm_paged_nhd", model, "bf16", "fp32"});
  EXPECT_EQ(v.name, "vllm_paged_nhd.odd_heads.bf16_in_fp32");
  const VariantDescriptor& d = v.descriptor();
  ASSERT_EQ(d.layers, 2);
  ASSERT_EQ(d.heads, 3);
  ASSERT_EQ(d.head_dim, 40);
  ASSERT_EQ(d.page_size, 16);
  CacheConfig config;
  config.pages = 3;
  auto cache = v.create(config);

  // Tokens 0..T-1 of one sequence on pages 2 then 0; values exact in bf16.
  const int64_t T = 20, H = d.heads, D = d.head_dim, P = d.page_size;
  const int32_t pages[] = {2, 0};
  std::vector<int64_t> slots(T);
  for (int64_t t = 0; t < T; ++t) slots[t] = pages[t / P] * P + t % P;
  auto value = [&](int layer, int kv, int64_t t, int64_t h, int64_t e) {
    return float((layer * 7 + kv * 3 + t * 5 + h * 11 + e) % 61) * 0.25f - 7.0f;
  };
  for (int layer = 0; layer < d.layers; ++layer) {
    std::vector<float> k(size_t(T * H * D)), v_in(k.size());
    for (int64_t t = 0; t < T; ++t)
      for (int64_t h = 0; h < H; ++h)
        for (int64_t e = 0; e < D; ++e)
          k[(t * H + h) * D + e] = value(layer, 0, t, h, e), v_in[(t * H + h) * D + e] = value(layer, 1, t, h, e);
    cache->append(layer, TensorView::contiguous(k.data(), DType::f32, Device::cpu, T, H, D),
                  TensorView::contiguous(v_in.data(), DType::f32, Device::cpu, T, H, D),
                  TokenTargets::paged(IndexView::of(slots.data(), T)));
  }
  cache->commit();
  for (int layer = 0; layer < d.layers; ++layer) {
    const LayerView view = cache->view(layer);
    const auto* base = static_cast<const uint16_t*>(view.k);
    ASSERT_EQ(static_cast<const uint16_t*>(view.v), base + config.pages * P * H * D) << "V follows K in the layer";
    for (int kv = 0; kv < 2; ++kv)
      for (int64_t t = 0; t < T; ++t)
        for (int64_t h = 0; h < H; ++h)
          for (int64_t e = 0; e < D; ++e) {
            const int64_t at = kv * config.pages * P * H * D + ((pages[t / P] * P + t % P) * H + h) * D + e;
            uint32_t bits = uint32_t(base[at]) << 16;
            float stored;
            std::memcpy(&stored, &bits, 4);
            ASSERT_EQ(stored, value(layer, kv, t, h, e)) << "layer " << layer << " kv " << kv << " token " << t;
          }
  }
  // A second request finds the loaded library: no build, the same registry.
  EXPECT_EQ(variant({"vllm_paged_nhd", model, "bf16", "fp32"}).registry, v.registry);
}

TEST(OnDemand, RefusalsNameWhatIsWrong) {
  const std::string bad = scratch().write("bad.yaml", "name: bad\nlayers: 1\nkv_heads: 1\nhead_dim: 0\n"
                                                      "max_seq_len: 8\n");
  try {
    variant({"vllm_paged_nhd", bad, "fp32"});
    FAIL() << "a model of head_dim 0 was built";
  } catch (const SpecError& e) {
    ASSERT_FALSE(e.errors().empty());
    EXPECT_NE(e.errors()[0].find("bad.yaml:4: head_dim"), std::string::npos) << e.what();
  }
  try {
    variant({"no_such_layout", "tiny", "fp32"});
    FAIL();
  } catch (const ArgumentError& e) {
    EXPECT_EQ(e.argument(), "layout");
    EXPECT_NE(std::string(e.what()).find("vllm_paged_nhd"), std::string::npos) << "lists the defaults: " << e.what();
  }
  try {
    variant({"vllm_paged_nhd", "tiny", "fp7"});
    FAIL();
  } catch (const ArgumentError& e) {
    EXPECT_EQ(e.argument(), "dtype");
  }
  try {
    variant({"hybrid_paged", "tiny", "fp32"});
    FAIL() << "a hybrid layout was built over a model without its layer groups";
  } catch (const SpecError& e) {
    EXPECT_NE(std::string(e.what()).find("layer_groups"), std::string::npos) << e.what();
  }
  try {
    variant({"vllm_paged_nhd", "", "fp32"});
    FAIL();
  } catch (const ArgumentError& e) {
    EXPECT_EQ(e.argument(), "model");
  }
  OnDemandTools no_compiler = OnDemandTools::of_this_build();
  no_compiler.compiler = "/nonexistent/c++";
  OnDemandRequest request("vllm_paged_nhd", "tiny", "fp16");
  request.name = "nocompiler";
  try {
    variant(request, no_compiler);
    FAIL();
  } catch (const BackendError& e) {
    EXPECT_NE(std::string(e.what()).find("compiler: /nonexistent/c++ was not found"), std::string::npos) << e.what();
  }
  OnDemandTools no_python = OnDemandTools::of_this_build();
  no_python.python = "/nonexistent/python3";
  EXPECT_THROW(variant({"vllm_paged_nhd", "tiny", "fp16"}, no_python), BackendError);
}

}  // namespace
