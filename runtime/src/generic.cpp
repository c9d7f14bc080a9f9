// The generic path: the same TypedCache as every generated variant, over traits whose sizes are given
// at run time (CuTe's dynamic extents). Every check, message and kernel is shared; only the loop bounds
// and the row length are run-time values, so it serves any float eager layout that was not generated.
#include "kvforge/generic.hpp"

#include <memory>
#include <string>

#include "kvforge/cache_impl.hpp"
#include "kvforge/cpu_ops.hpp"

namespace kvforge {

namespace {

bool is_float(DType t) { return t == DType::f32 || t == DType::f16 || t == DType::bf16; }

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

template <class Store>
std::unique_ptr<Cache> with_input(std::shared_ptr<const OwnedDescriptor> d, const CacheConfig& c) {
  switch (d->d.input) {
    case DType::f32: return with_addressing<Store, float>(std::move(d), c);
    case DType::f16: return with_addressing<Store, fp16>(std::move(d), c);
    default: return with_addressing<Store, bf16>(std::move(d), c);
  }
}

}  // namespace

std::string generic_unsupported_reason(const VariantDescriptor& d, const CacheConfig& config) {
  if (d.is_hybrid()) return "hybrid layouts are served through their generated members";
  if (d.quantized() || !is_float(d.storage)) return "quantized storage needs a generated variant";
  if (!is_float(d.input)) return "the input dtype must be fp32, fp16 or bf16";
  if (d.update == UpdateMode::lazy) return "lazy staging needs a generated variant";
  if (config.device != Device::cpu) return "the generic path runs on the CPU only";
  return "";
}

std::unique_ptr<Cache> make_generic_cache(const VariantDescriptor& d, const CacheConfig& config) {
  const std::string why = generic_unsupported_reason(d, config);
  if (!why.empty()) throw UnsupportedError(std::string(d.name) + ": no generic path: " + why);
  auto owned = std::make_shared<const OwnedDescriptor>(d);
  switch (d.storage) {
    case DType::f32: return with_input<float>(std::move(owned), config);
    case DType::f16: return with_input<fp16>(std::move(owned), config);
    default: return with_input<bf16>(std::move(owned), config);
  }
}

}  // namespace kvforge
