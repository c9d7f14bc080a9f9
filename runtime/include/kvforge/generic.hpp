// The generic path: serves any eager float layout from its descriptor alone,
// with every dimension and stride a run-time value. It is the baseline the benchmark measures
// generated variants against, and the registry's fallback for a layout x model x dtype that was not
// generated (descriptor().generic says so). It is TypedCache over runtime-sized traits, so it shares
// every check, message and kernel with generated variants. CPU only; quantized, lazy and hybrid
// layouts need codegen.
#pragma once

#include <memory>
#include <string>

#include "kvforge/cache.hpp"

namespace kvforge {

// Why `d` cannot be served by the generic path; empty when it can.
std::string generic_unsupported_reason(const VariantDescriptor& d, const CacheConfig& config);

// Copies `d` (names included) into the cache, so the descriptor may be a temporary.
std::unique_ptr<Cache> make_generic_cache(const VariantDescriptor& d, const CacheConfig& config);

}  // namespace kvforge
