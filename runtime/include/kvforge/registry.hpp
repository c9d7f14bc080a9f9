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

// Select variants by typed fields; an empty field matches everything. layout and model are spec names
// (the `name` of a file in specs/layouts and specs/models); storage and input are DTypes.
struct VariantQuery {
  std::string layout;
  std::string model;
  std::optional<DType> storage;  // DType::record: a record format's variants, `record` naming which
  std::optional<DType> input;
  std::string record;  // a record format's name (flashmla_fp8, ...): its variants only
};

class Registry {
 public:
  explicit Registry(std::vector<VariantEntry> entries);
  const std::vector<VariantEntry>& variants() const { return entries_; }
  // The registered variant named `name` (layout.model.dtype, see variant_name), or null.
  const VariantEntry* find(std::string_view name) const;
  // Throws UnknownVariantError naming the nearest registered names.
  const VariantEntry& at(std::string_view name) const;
  // Every registered variant the query matches, in registration order (sorted by name).
  std::vector<const VariantEntry*> select(const VariantQuery& q) const;
  // The registered variant of that name; UnknownVariantError naming the nearest otherwise.
  std::unique_ptr<Cache> create(std::string_view name, const CacheConfig& config) const;
  // Exactly one registered variant must match the query. Where none does, but the query names a
  // layout, a model and a float storage dtype that other registered variants know, the generic
  // runtime-strided path (CPU) serves it and the cache's descriptor().generic is true; eager, non-ring
  // layouts only. Otherwise UnknownVariantError lists the candidates, and says why the generic path
  // could not serve it.
  std::unique_ptr<Cache> create(const VariantQuery& q, const CacheConfig& config) const;
  // The descriptor such a query would get, built from registered variants of its layout and its model;
  // where none can be, `why` says what is missing.
  std::optional<VariantDescriptor> synthesize(const VariantQuery& q) const;
  std::optional<VariantDescriptor> synthesize(const VariantQuery& q, std::string& why) const;
  // The `count` registered names closest to `name` by edit distance, for error messages.
  std::vector<std::string> nearest(std::string_view name, size_t count = 3) const;

 private:
  std::vector<VariantEntry> entries_;
};

// The one spelling of a variant's name, layout.model.dtype, the dtype being `storage` or
// `storage_in_input` (codegen's plan.variant_name; a test holds the two equal for every variant).
// `storage` is a dtype's name or a record format's (VariantDescriptor::storage_name).
std::string variant_name(std::string_view layout, std::string_view model, std::string_view storage, DType input);
std::string variant_name(std::string_view layout, std::string_view model, DType storage, DType input);

// The registry of this build's generated variants (defined in the generated registry.cpp).
const Registry& registry();

}  // namespace kvforge
