#include "kvforge/hybrid_cache.hpp"

#include <algorithm>
#include <string>
#include <type_traits>

namespace kvforge {

HybridCache::HybridCache(const VariantDescriptor& d, const CacheConfig& config) : d_(d) {
  group_of_.assign(size_t(d.layers), -1);
  index_in_group_.assign(size_t(d.layers), -1);
  for (int g = 0; g < d.hybrid->num_groups; ++g) {
    const LayerGroupInfo& info = d.hybrid->groups[g];
    for (int i = 0; i < info.num_layers; ++i) {
      group_of_[size_t(info.layers[i])] = g;
      index_in_group_[size_t(info.layers[i])] = i;
    }
    members_.push_back(info.create(config));
  }
}

Cache& HybridCache::group(int g) {
  if (g < 0 || g >= num_groups()) throw OutOfRangeError("group", g, 0, num_groups());
  return *members_[size_t(g)];
}
int HybridCache::group_of(int layer) const {
  if (layer < 0 || layer >= d_.layers) throw OutOfRangeError("layer", layer, 0, d_.layers);
  return group_of_[size_t(layer)];
}
int HybridCache::group_layer(int layer) const {
  group_of(layer);
  return index_in_group_[size_t(layer)];
}

void HybridCache::per_group(const char* what) const {
  throw UnsupportedError(std::string(d_.name) + ": " + what +
                         " works on page ids, and a hybrid cache's pages are per layer group; call it on group(g)");
}

// The ops of cache_ops.hpp, each by its route; the `own` rows follow.
namespace {
template <class... A> void ignore(const A&...) {}
}  // namespace
#define HYBRID_ROUTE(route, python, result, name, params, args, qualifier) \
  HYBRID_##route(result, name, params, args, qualifier)
#define HYBRID_layer(result, name, params, args, qualifier)                                   \
  result HybridCache::name params qualifier {                                                 \
    return at_layer(layer, [&](Cache& member, int layer) -> result { return member.name args; }); \
  }
#define HYBRID_whole(result, name, params, args, qualifier) \
  result HybridCache::name params qualifier {               \
    static_assert(std::is_void_v<result>);                  \
    for (auto& m : members_) m->name args;                  \
  }
#define HYBRID_first(result, name, params, args, qualifier) \
  result HybridCache::name params qualifier { return members_[0]->name args; }
#define HYBRID_pages(result, name, params, args, qualifier) \
  result HybridCache::name params qualifier {               \
    ignore args;                                            \
    per_group(#name);                                       \
  }
#define HYBRID_packed HYBRID_pages
#define HYBRID_own(result, name, params, args, qualifier)
#define HYBRID_derived(result, name, params, args, qualifier)
#define HYBRID_groups(result, name, params, args, qualifier)
KVFORGE_CACHE_OPS(HYBRID_ROUTE)

const VariantDescriptor& HybridCache::descriptor() const { return d_; }

MemoryReport HybridCache::memory() const {
  MemoryReport r;
  for (const auto& m : members_) r += m->memory();
  return r;
}

}  // namespace kvforge
