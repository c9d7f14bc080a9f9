// The generic path: the same TypedCache as every generated variant, over traits whose sizes are given
// at run time (CuTe's dynamic extents). Every check, message and kernel is shared; only the loop bounds
// and the row length are run-time values, so it serves any float eager layout that was not generated.
#include "kvforge/generic.hpp"

#include "caches/generic_path.hpp"

namespace kvforge {

namespace {

bool is_float(DType t) { return t == DType::f32 || t == DType::f16 || t == DType::bf16; }

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
  return generic_path::generic_cache_with<generic_path::CpuBaseTables>(d, config);
}

}  // namespace kvforge
