#include <iterator>

#include "kvforge/backend.hpp"
#include "kvforge/errors.hpp"

namespace kvforge {

Backend& backend(Device d) {
  if (size_t(d) >= std::size(kBackendAccessors)) throw BackendError("unknown device");
  return kBackendAccessors[size_t(d)]();
}

}  // namespace kvforge
