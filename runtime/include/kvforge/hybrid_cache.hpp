// Hybrid caches: models whose layers follow different attention patterns (Gemma-2 and Mistral-style
// alternating sliding-window and global layers) keep one member cache per layer group, each stored by
// the layout the hybrid spec names for it, behind one Cache object, as DeepSpeed keeps a tuple of
// cache configs. A sliding-window group frees the pages that leave its window (through its
// sequence manager, hybrid.hpp), so its memory stays bounded by the window.
#pragma once

#include <cstddef>
#include <memory>
#include <vector>

#include "kvforge/cache.hpp"

namespace kvforge {

struct LayerGroupInfo {
  const char* name;
  int num_layers;
  const int* layers;   // the model's layer indices in this group, ascending within the group
  int sliding_window;  // 0: global attention
  const VariantDescriptor* member;
  std::unique_ptr<Cache> (*create)(const CacheConfig&);
};

// A layer group by name: its layer count comes from the array, so no two ints can trade places.
template <size_t N>
constexpr LayerGroupInfo layer_group(const char* name, const int (&layers)[N], int sliding_window,
                                     const VariantDescriptor* member,
                                     std::unique_ptr<Cache> (*create)(const CacheConfig&)) {
  LayerGroupInfo g{};
  g.name = name;
  g.num_layers = int(N);
  g.layers = layers;
  g.sliding_window = sliding_window;
  g.member = member;
  g.create = create;
  return g;
}

struct HybridDescriptor {
  int num_groups;
  const LayerGroupInfo* groups;
};

// The descriptor of a generated hybrid variant, from its traits (variant.hpp.j2): the model's shape and
// dtypes, and one member per layer group. A token costs what it costs in every group's member.
template <class T> constexpr VariantDescriptor describe_hybrid() {
  VariantDescriptor d = describe_common<T>();
  d.addressing = Addressing::paged;  // every member is paged: a group's window is kept by freeing pages
  d.update = UpdateMode::eager;
  d.hybrid = &T::hybrid;
  for (const LayerGroupInfo& g : T::groups) d.bytes_per_token += g.member->bytes_per_token;
  return d;
}

// Routes each layer to its group's member cache (with the layer renumbered within the group), and every
// other op by its row of cache_ops.hpp. Each member has `config.pages` pages of its own: page ids, and so
// targets and page lists, are per group.
class HybridCache final : public Cache {
 public:
  HybridCache(const VariantDescriptor& d, const CacheConfig& config);

  KVFORGE_CACHE_OPS(KVFORGE_CACHE_OP_OVERRIDE)

  int num_groups() const override { return int(members_.size()); }
  Cache& group(int g) override;
  int group_of(int layer) const override;
  int group_layer(int layer) const override;

 private:
  [[noreturn]] void per_group(const char* what) const;
  // Runs f(member, layer within the member) on the member cache holding `layer`.
  template <class F> decltype(auto) at_layer(int layer, F f) const {
    return f(*members_[size_t(group_of(layer))], group_layer(layer));
  }
  const VariantDescriptor& d_;
  std::vector<std::unique_ptr<Cache>> members_;
  std::vector<int> group_of_, index_in_group_;
};

template <class Traits> std::unique_ptr<Cache> make_hybrid_cache(const CacheConfig& config) {
  return std::make_unique<HybridCache>(descriptor_of<Traits>, config);
}

}  // namespace kvforge
