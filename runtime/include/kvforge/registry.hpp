// The registry is the only place the runtime learns which variants exist. Its contents are generated
// (generated/registry.cpp); this header is the lookup over them.
#pragma once

#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "kvforge/cache.hpp"

namespace kvforge {

struct VariantEntry {
  const VariantDescriptor* descriptor;
  std::unique_ptr<Cache> (*create)(const CacheConfig&);
};

// Select variants by typed fields; an empty field matches everything.
struct VariantQuery {
  std::string layout;
  std::string model;
  std::optional<DType> storage;
  std::optional<DType> input;
};

class Registry {
 public:
  explicit Registry(std::vector<VariantEntry> entries);
  const std::vector<VariantEntry>& variants() const { return entries_; }
  const VariantEntry* find(std::string_view name) const;
  // Throws UnknownVariantError naming the nearest registered names.
  const VariantEntry& at(std::string_view name) const;
  std::vector<const VariantEntry*> select(const VariantQuery& q) const;
  // A registered variant; or, for a float eager layout x model x dtype that was not generated but whose
  // layout and model are known from other variants, the generic path (it says so on stderr).
  std::unique_ptr<Cache> create(std::string_view name, const CacheConfig& config) const;
  // The descriptor a name would have, built from registered variants of its layout and its model.
  std::optional<VariantDescriptor> synthesize(std::string_view name) const;
  // Exactly one variant must match the query; otherwise UnknownVariantError lists the candidates.
  std::unique_ptr<Cache> create(const VariantQuery& q, const CacheConfig& config) const;
  std::vector<std::string> nearest(std::string_view name, size_t count = 3) const;

 private:
  std::vector<VariantEntry> entries_;
};

// The registry of this build's generated variants (defined in the generated registry.cpp).
const Registry& registry();

}  // namespace kvforge
