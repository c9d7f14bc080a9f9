// Host memory as a backend: the CPU backend and CUDA's pinned host tier differ only in how they
// allocate; every copy is a plain memcpy and nothing is queued. Private to runtime/src.
#pragma once

#include <cstring>

#include "kvforge/backend.hpp"

namespace kvforge {

namespace detail {
// A step's batch arrays built by the CPU's executor (backends/cpu/step_cpu.cpp).
void build_step_on_host(const StepBuildArgs& args);
}

class HostMemoryBackend : public Backend {
 public:
  Device device() const override { return Device::cpu; }
  void fill(void* dst, int byte, int64_t bytes, void*) override { std::memset(dst, byte, size_t(bytes)); }
  void copy(void* dst, const void* src, int64_t bytes, void*) override { std::memmove(dst, src, size_t(bytes)); }
  void to_host(void* host, const void* src, int64_t bytes, void*) override { std::memcpy(host, src, size_t(bytes)); }
  void from_host(void* dst, const void* host, int64_t bytes, void*) override { std::memcpy(dst, host, size_t(bytes)); }
  void synchronize(void*) override {}
  int64_t free_memory() override { return -1; }  // the host has no figure worth reserving from
  Backend& host() override { return *this; }
  // On the host a step's scan is a loop, which needs no scratch.
  int64_t step_scratch_bytes(int64_t) override { return 0; }
  void build_step(const detail::StepBuildArgs& args, void*, void*, int64_t) override { build_step_on_host(args); }
};

}  // namespace kvforge
