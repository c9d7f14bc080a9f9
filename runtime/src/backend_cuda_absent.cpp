// A build without the CUDA backend (KVFORGE_CUDA=OFF): CMake compiles this file instead of
// backend_cuda.cu, so that asking for CUDA says why it cannot be had.
#include <string>

#include "host_backend.hpp"
#include "kvforge/errors.hpp"
#include "step_cuda.hpp"

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

namespace detail {

int64_t step_scan_temp_bytes_cuda(int64_t) {
  cuda_backend();  // throws: this build has no CUDA backend
  return 0;
}
void build_step_cuda(const StepBuildArgs&, void*, void*, int64_t) { cuda_backend(); }

}  // namespace detail
}  // namespace kvforge
