#include "kvforge/cache.hpp"

namespace kvforge {

// The defaults for every cache that is not hybrid: one group, itself.
Cache& Cache::group(int g) {
  if (g != 0) throw OutOfRangeError("group", g, 0, 1);
  return *this;
}
int Cache::group_of(int layer) const {
  if (layer < 0 || layer >= descriptor().layers) throw OutOfRangeError("layer", layer, 0, descriptor().layers);
  return 0;
}
int Cache::group_layer(int layer) const { return group_of(layer), layer; }

}  // namespace kvforge
