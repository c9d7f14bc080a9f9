#include <cstdlib>
#include <cstring>

#include "kvforge/backend.hpp"
#include "kvforge/errors.hpp"

namespace kvforge {

namespace {
class CpuBackend final : public Backend {
 public:
  Device device() const override { return Device::cpu; }
  void* allocate(int64_t bytes) override {
    const size_t rounded = (size_t(bytes) + 255) & ~size_t(255);
    void* p = std::aligned_alloc(256, rounded);
    if (!p) throw BackendError("cpu: cannot allocate " + std::to_string(bytes) + " bytes");
    std::memset(p, 0, rounded);
    return p;
  }
  void release(void* p) noexcept override { std::free(p); }
  void fill(void* dst, int byte, int64_t bytes, void*) override { std::memset(dst, byte, size_t(bytes)); }
  void copy(void* dst, const void* src, int64_t bytes, void*) override { std::memmove(dst, src, size_t(bytes)); }
  void to_host(void* host, const void* src, int64_t bytes, void*) override { std::memcpy(host, src, size_t(bytes)); }
  void from_host(void* dst, const void* host, int64_t bytes, void*) override { std::memcpy(dst, host, size_t(bytes)); }
  void synchronize(void*) override {}
  int64_t free_memory() override { return -1; }
  Backend& host() override { return *this; }
};
}  // namespace

Backend& cpu_backend() {
  static CpuBackend b;
  return b;
}

#if !KVFORGE_WITH_CUDA
bool cuda_available(std::string* why) {
  if (why) *why = "this build has no CUDA backend (configure with -DKVFORGE_CUDA=ON)";
  return false;
}
Backend& backend(Device d) {
  if (d == Device::cpu) return cpu_backend();
  std::string why;
  cuda_available(&why);
  throw BackendError(why);
}
#endif

}  // namespace kvforge
