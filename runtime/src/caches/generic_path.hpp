// The generic path's pieces shared by its files (runtime/src/generic*.cpp): the runtime-sized traits and
// the dispatch over input dtype and addressing, instantiated once per storage dtype in a file of its
// own, so that the 27 TypedCaches compile in parallel rather than in one file.
#pragma once

#include <memory>
#include <string>

#include "kvforge/detail/cache_impl.hpp"
#include "kvforge/backends/cpu/cpu_ops.hpp"

namespace kvforge::generic_path {

// The descriptor with its strings owned here, so that a synthesized one can outlive its source.
struct OwnedDescriptor {
  explicit OwnedDescriptor(const VariantDescriptor& d) : name(d.name), layout(d.layout), model(d.model), d(d) {
    this->d.name = name.c_str();
    this->d.layout = layout.c_str();
    this->d.model = model.c_str();
    this->d.generic = true;
  }
  std::string name, layout, model;
  VariantDescriptor d;
};

// Where a runtime-sized cache's kernels come from: the op tables of a backend's executor for the given
// traits, one per Device. The generic path's are the CPU's, built for the base x86-64 level (it is the
// fallback); an executor built elsewhere (the tests' serial one, tests/serial_exec.hpp) brings its own
// the same way, and every check and body above it stays the same.
struct CpuBaseTables {
  template <class T> static detail::OpTables<T> of() {
    static const detail::OpTable<T> cpu = detail::cpu_kernels<T, kCpuBaseLevel>();
    detail::OpTables<T> tables{};
    tables[size_t(Device::cpu)] = &cpu;
    return tables;
  }
};

template <class Store, class In, Addressing A, class Tables = CpuBaseTables> struct RuntimeTraits {
  static constexpr bool runtime_extents = true;  // sizes come from the descriptor (ops.hpp: Extents)
  using storage_t = Store;
  using input_t = In;
  using scale_t = float;
  static constexpr Quant quant = Quant::none;
  static constexpr Addressing addressing = A;
  static constexpr UpdateMode update = UpdateMode::eager;

  std::shared_ptr<const OwnedDescriptor> owned;
  const VariantDescriptor& descriptor() const { return owned->d; }

  static detail::OpTables<RuntimeTraits> op_tables() { return Tables::template of<RuntimeTraits>(); }
};

template <class Store, class In, class Tables = CpuBaseTables>
std::unique_ptr<Cache> with_addressing(std::shared_ptr<const OwnedDescriptor> d, const CacheConfig& c) {
  switch (d->d.addressing) {
    case Addressing::contiguous: {
      using T = RuntimeTraits<Store, In, Addressing::contiguous, Tables>;
      return std::make_unique<TypedCache<T>>(c, T{std::move(d)});
    }
    case Addressing::ring: {
      using T = RuntimeTraits<Store, In, Addressing::ring, Tables>;
      return std::make_unique<TypedCache<T>>(c, T{std::move(d)});
    }
    default: {
      using T = RuntimeTraits<Store, In, Addressing::paged, Tables>;
      return std::make_unique<TypedCache<T>>(c, T{std::move(d)});
    }
  }
}

// A generic cache of storage `Store`, for any float input and addressing. Instantiated in a file per
// storage dtype (generic_f32.cpp, ...): 9 TypedCaches each, which compile side by side.
template <class Store, class Tables = CpuBaseTables>
std::unique_ptr<Cache> generic_cache_of(std::shared_ptr<const OwnedDescriptor> d, const CacheConfig& c) {
  switch (d->d.input) {
    case DType::f32: return with_addressing<Store, float, Tables>(std::move(d), c);
    case DType::f16: return with_addressing<Store, fp16, Tables>(std::move(d), c);
    default: return with_addressing<Store, bf16, Tables>(std::move(d), c);
  }
}

// A generic cache of `d`'s storage dtype, its kernels from Tables. `d` must be one the generic path
// serves (generic_unsupported_reason).
template <class Tables> std::unique_ptr<Cache> generic_cache_with(const VariantDescriptor& d, const CacheConfig& c) {
  auto owned = std::make_shared<const OwnedDescriptor>(d);
  switch (d.storage) {
    case DType::f32: return generic_cache_of<float, Tables>(std::move(owned), c);
    case DType::f16: return generic_cache_of<fp16, Tables>(std::move(owned), c);
    default: return generic_cache_of<bf16, Tables>(std::move(owned), c);
  }
}

extern template std::unique_ptr<Cache> generic_cache_of<float>(std::shared_ptr<const OwnedDescriptor>, const CacheConfig&);
extern template std::unique_ptr<Cache> generic_cache_of<fp16>(std::shared_ptr<const OwnedDescriptor>, const CacheConfig&);
extern template std::unique_ptr<Cache> generic_cache_of<bf16>(std::shared_ptr<const OwnedDescriptor>, const CacheConfig&);

}  // namespace kvforge::generic_path
