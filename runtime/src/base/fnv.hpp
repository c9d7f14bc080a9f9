// FNV-1a, for the hashes two sides of a transfer compare (a request's tokens, a state record). Internal
// to the runtime.
#pragma once

#include <cstdint>

namespace kvforge {

inline constexpr uint64_t kFnvBasis = 1469598103934665603ull;

// Mixes the low `bytes` bytes of x into h, least significant first.
inline void fnv_mix(uint64_t& h, uint64_t x, int bytes = 8) {
  for (int i = 0; i < bytes; ++i) h = (h ^ ((x >> (8 * i)) & 0xffu)) * 1099511628211ull;
}

}  // namespace kvforge
