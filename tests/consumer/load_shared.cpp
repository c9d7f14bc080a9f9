// A C++ program that links no variant: it loads the consumer's variants from a shared library
// (kvforge_generate() into a SHARED target) with kvforge::load_variants, then writes one token through
// every layer and reads it back; then builds a variant on demand (kvforge::variant) and does the same.
// Exits 1 on any mismatch.
#include <cstdio>
#include <string>
#include <vector>

#include "kvforge/kvforge.hpp"

// Writes one token through every layer of `name` and reads it back; false on any mismatch.
bool round_trip(const kvforge::Registry& registry, const std::string& name) {
  using namespace kvforge;
  CacheConfig config;
  config.pages = 2;
  auto cache = registry.create(name, config);
  const VariantDescriptor& d = cache->descriptor();
  const int64_t H = d.heads, D = d.head_dim;
  std::vector<float> k(size_t(H * D)), v(k.size()), k_out(k.size()), v_out(k.size());
  for (size_t i = 0; i < k.size(); ++i) k[i] = float(i % 37) / 4.0f, v[i] = -k[i];
  const int64_t slot = d.page_size + 2;  // page 1, offset 2
  const int32_t page = 1;
  for (int layer = 0; layer < d.layers; ++layer) {
    cache->append(layer, TensorView::contiguous(k.data(), d.input, Device::cpu, 1, H, D),
                  TensorView::contiguous(v.data(), d.input, Device::cpu, 1, H, D),
                  TokenTargets::paged(IndexView::of(&slot, 1)));
    cache->gather(layer, GatherRange{0, IndexView::of(&page, 1), 2, 3},
                  TensorView::contiguous(k_out.data(), d.input, Device::cpu, H, 1, D),
                  TensorView::contiguous(v_out.data(), d.input, Device::cpu, H, 1, D));
    if (k_out != k || v_out != v) {
      std::printf("load_shared: %s: layer %d reads back other values\n", name.c_str(), layer);
      return false;
    }
  }
  return true;
}

int main(int argc, char** argv) {
  using namespace kvforge;
  if (argc != 2) {
    std::fprintf(stderr, "usage: load_shared <path of the shared variant library>\n");
    return 2;
  }
  try {
    const Registry& loaded = load_variants(argv[1], "consumer_shared::registry");
    if (&load_variants(argv[1], "consumer_shared::registry") != &loaded) throw StateError("path", "loaded twice");
    if (!round_trip(loaded, "consumer_paged.odd_model.fp32")) return 1;
    try {
      load_variants(argv[1], "no_such::registry");
      std::printf("load_shared: a registry the library does not define was found\n");
      return 1;
    } catch (const ArgumentError& e) {
      if (e.argument() != "registry_function") throw;
    }
    std::printf("load_shared: %zu variants loaded from a shared library, round trip ok\n", loaded.variants().size());
    // On demand: a default layout of another name over a default model, built through the spec compiler
    // and headers that kvforge::runtime names (this tree's, or the installed package's).
    OnDemandRequest request("jetstream_paged", "tiny", "fp32");
    request.name = "consumer_on_demand";
    const OnDemandVariant built = variant(request);
    if (!round_trip(*built.registry, built.name)) return 1;
    std::printf("load_shared: %s built on demand, round trip ok\n", built.name.c_str());
  } catch (const std::exception& e) {
    std::fprintf(stderr, "load_shared: %s\n", e.what());
    return 1;
  }
  return 0;
}
