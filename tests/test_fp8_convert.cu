// The device's fp8 encoder (the hardware's saturating convert, quant.hpp) against the host's software
// codec, bit for bit, over every bf16 bit pattern as input (NaNs, infinities, subnormals, both signs),
// for both fp8 formats. Built with KVFORGE_CUDA only; without a GPU it skips and says why.
#include <cuda_runtime.h>

#include <vector>

#include "kvforge/quant.hpp"
#include "support.hpp"

namespace {

using namespace kvforge;

template <class Code> __global__ void encode_every_bf16(uint8_t* out) {
  const uint32_t bits = blockIdx.x * blockDim.x + threadIdx.x;
  if (bits >= 65536u) return;
  const float v = bits_float(bits << 16);
  const Code c = detail::Codec<Code>::encode(v);
  out[bits] = c.bits;
}

template <class Code> void check_every_bf16(const char* format) {
  uint8_t* device = nullptr;
  ASSERT_EQ(cudaMalloc(&device, 65536), cudaSuccess);
  encode_every_bf16<Code><<<256, 256>>>(device);
  std::vector<uint8_t> got(65536);
  ASSERT_EQ(cudaMemcpy(got.data(), device, got.size(), cudaMemcpyDeviceToHost), cudaSuccess);
  cudaFree(device);
  int mismatches = 0;
  for (uint32_t bits = 0; bits < 65536u; ++bits) {
    const uint8_t want = detail::Codec<Code>::encode(bits_float(bits << 16)).bits;
    if (got[bits] != want && ++mismatches <= 5)
      ADD_FAILURE() << format << ": bf16 0x" << std::hex << bits << " encodes to 0x" << int(got[bits])
                    << " on the device, 0x" << int(want) << " in software";
  }
  EXPECT_EQ(mismatches, 0) << format;
}

TEST(Fp8Convert, CudaHardwareConvertMatchesTheSoftwareCodecOnEveryBf16) {
  KVTEST_REQUIRE_DEVICE(Device::cuda);
  check_every_bf16<fp8_e4m3>("e4m3");
  check_every_bf16<fp8_e5m2>("e5m2");
}

}  // namespace
