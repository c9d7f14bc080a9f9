#include <iterator>

#include "kvforge/backend.hpp"
#include "kvforge/errors.hpp"

namespace kvforge {

Backend& backend(Device d) {
  if (size_t(d) >= std::size(kBackendAccessors)) throw BackendError("unknown device");
  return kBackendAccessors[size_t(d)]();
}

bool backend_available(Device d, std::string* why) {
  if (size_t(d) >= std::size(kBackendAvailability)) {
    if (why) *why = "unknown device";
    return false;
  }
  return kBackendAvailability[size_t(d)](why);
}

}  // namespace kvforge
