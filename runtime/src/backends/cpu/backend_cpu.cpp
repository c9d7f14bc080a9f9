#include <cstdlib>
#include <cstring>
#include <string>

#include "base/host_backend.hpp"
#include "kvforge/errors.hpp"

namespace kvforge {

namespace {
constexpr size_t kAlignment = 256;  // the alignment Backend::allocate promises

class CpuBackend final : public HostMemoryBackend {
 public:
  void* allocate(int64_t bytes) override {
    const size_t rounded = (size_t(bytes) + kAlignment - 1) & ~(kAlignment - 1);
    void* p = std::aligned_alloc(kAlignment, rounded);
    if (!p) throw BackendError("cpu: cannot allocate " + std::to_string(bytes) + " bytes");
    std::memset(p, 0, rounded);
    return p;
  }
  void release(void* p) noexcept override { std::free(p); }
};
}  // namespace

bool cpu_available(std::string*) { return true; }

Backend& cpu_backend() {
  static CpuBackend b;
  return b;
}

}  // namespace kvforge
