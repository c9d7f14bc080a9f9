// The generic path's pieces shared by its files (runtime/src/generic*.cpp): the runtime-sized traits and
// the dispatch over input dtype and addressing, instantiated once per storage dtype in a file of its
// own, so that the 27 TypedCaches compile in parallel rather than in one file.
#pragma once

#include <memory>
#include <string>

#include "kvforge/cache_impl.hpp"
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

template <class Store, class In, Addressing A> struct RuntimeTraits {
  static constexpr bool runtime_extents = true;  // sizes come from the descriptor (ops.hpp: Extents)
  using storage_t = Store;
  using input_t = In;
  using scale_t = float;
  static constexpr Quant quant = Quant::none;
  static constexpr Addressing addressing = A;
  static constexpr UpdateMode update = UpdateMode::eager;

  std::shared_ptr<const OwnedDescriptor> owned;
  const VariantDescriptor& descriptor() const { return owned->d; }

  // The CPU's table only, built for the base x86-64 level: the generic path is the fallback.
  static detail::OpTables<RuntimeTraits> op_tables() {
    static const detail::OpTable<RuntimeTraits> cpu = detail::cpu_kernels<RuntimeTraits, kCpuBaseLevel>();
    return {&cpu, nullptr};
  }
};

template <class Store, class In>
std::unique_ptr<Cache> with_addressing(std::shared_ptr<const OwnedDescriptor> d, const CacheConfig& c) {
  switch (d->d.addressing) {
    case Addressing::contiguous: {
      using T = RuntimeTraits<Store, In, Addressing::contiguous>;
      return std::make_unique<TypedCache<T>>(c, T{std::move(d)});
    }
    case Addressing::ring: {
      using T = RuntimeTraits<Store, In, Addressing::ring>;
      return std::make_unique<TypedCache<T>>(c, T{std::move(d)});
    }
    default: {
      using T = RuntimeTraits<Store, In, Addressing::paged>;
      return std::make_unique<TypedCache<T>>(c, T{std::move(d)});
    }
  }
}

// A generic cache of storage `Store`, for any float input and addressing. Instantiated in a file per
// storage dtype (generic_f32.cpp, ...): 9 TypedCaches each, which compile side by side.
template <class Store>
std::unique_ptr<Cache> generic_cache_of(std::shared_ptr<const OwnedDescriptor> d, const CacheConfig& c) {
  switch (d->d.input) {
    case DType::f32: return with_addressing<Store, float>(std::move(d), c);
    case DType::f16: return with_addressing<Store, fp16>(std::move(d), c);
    default: return with_addressing<Store, bf16>(std::move(d), c);
  }
}

extern template std::unique_ptr<Cache> generic_cache_of<float>(std::shared_ptr<const OwnedDescriptor>, const CacheConfig&);
extern template std::unique_ptr<Cache> generic_cache_of<fp16>(std::shared_ptr<const OwnedDescriptor>, const CacheConfig&);
extern template std::unique_ptr<Cache> generic_cache_of<bf16>(std::shared_ptr<const OwnedDescriptor>, const CacheConfig&);

}  // namespace kvforge::generic_path
