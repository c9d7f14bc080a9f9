// A build without the CUDA backend (KVFORGE_CUDA=OFF): CMake compiles this file instead of
// backend_cuda.cu, so that asking for CUDA says why it cannot be had.
#include <string>

#include "kvforge/backend.hpp"
#include "kvforge/errors.hpp"

namespace kvforge {

bool cuda_available(std::string* why) {
  if (why) *why = "this build has no CUDA backend (configure with -DKVFORGE_CUDA=ON)";
  return false;
}

Backend& cuda_backend() {
  std::string why;
  cuda_available(&why);
  throw BackendError(why);
}

}  // namespace kvforge
