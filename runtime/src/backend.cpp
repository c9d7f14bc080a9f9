#include "host_backend.hpp"
#include "kvforge/errors.hpp"

namespace kvforge {

Backend& backend(Device d) {
  switch (d) {
    case Device::cpu: return cpu_backend();
    case Device::cuda: return cuda_backend();
  }
  throw BackendError("unknown device");
}

}  // namespace kvforge
