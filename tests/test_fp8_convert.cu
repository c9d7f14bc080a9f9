// The device's encoders (the hardware's saturating converts, quant.hpp) against the host's software
// codecs, bit for bit, over every bf16 bit pattern as input (NaNs, infinities, subnormals, both signs),
// for both fp8 formats and int8 (int8 also at every half-integer of its range and either side of it);
// and the device's division by a scale (ScaleDivisor's product and correction) against the host's
// IEEE division. Built with KVFORGE_CUDA only; without a GPU it skips and says why.
#include "kvforge/backends/cuda/target.cuh"  // first: the codecs compile for the device

#include <cuda_runtime.h>

#include <cmath>
#include <cstring>
#include <vector>

#include "kvforge/detail/quant_codec.hpp"
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

// Every bf16 value, then each half-integer k + 0.5 of [-140.5, 140.5] and the floats either side of it.
std::vector<float> int8_probes() {
  std::vector<float> probes;
  for (uint32_t bits = 0; bits < 65536u; ++bits) probes.push_back(bits_float(bits << 16));
  for (int k = -141; k <= 140; ++k) {
    const float tie = float(k) + 0.5f;
    probes.insert(probes.end(), {tie, std::nextafter(tie, -INFINITY), std::nextafter(tie, INFINITY)});
  }
  return probes;
}

__global__ void encode_int8(const float* in, int8_t* out, int n) {
  const int i = int(blockIdx.x * blockDim.x + threadIdx.x);
  if (i < n) out[i] = detail::Codec<int8_t>::encode(in[i]);
}

__global__ void divide_every_bf16(float scale, float* out) {
  const uint32_t bits = blockIdx.x * blockDim.x + threadIdx.x;
  if (bits < 65536u) out[bits] = detail::ScaleDivisor(scale).divide(bits_float(bits << 16));
}

TEST(Fp8Convert, CudaInt8ConvertMatchesTheSoftwareCodec) {
  KVTEST_REQUIRE_DEVICE(Device::cuda);
  const std::vector<float> probes = int8_probes();
  const int n = int(probes.size());
  float* in = nullptr;
  int8_t* out = nullptr;
  ASSERT_EQ(cudaMalloc(&in, probes.size() * sizeof(float)), cudaSuccess);
  ASSERT_EQ(cudaMalloc(&out, probes.size()), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(in, probes.data(), probes.size() * sizeof(float), cudaMemcpyHostToDevice), cudaSuccess);
  encode_int8<<<(n + 255) / 256, 256>>>(in, out, n);
  std::vector<int8_t> got(probes.size());
  ASSERT_EQ(cudaMemcpy(got.data(), out, got.size(), cudaMemcpyDeviceToHost), cudaSuccess);
  cudaFree(in);
  cudaFree(out);
  int mismatches = 0;
  for (int i = 0; i < n; ++i) {
    const int8_t want = detail::Codec<int8_t>::encode(probes[size_t(i)]);
    if (got[size_t(i)] != want && ++mismatches <= 5)
      ADD_FAILURE() << "int8: " << probes[size_t(i)] << " encodes to " << int(got[size_t(i)]) << " on the device, "
                    << int(want) << " in software";
  }
  EXPECT_EQ(mismatches, 0);
}

TEST(Fp8Convert, CudaScaleDivisionMatchesIeeeDivisionOnEveryBf16) {
  KVTEST_REQUIRE_DEVICE(Device::cuda);
  float* out = nullptr;
  ASSERT_EQ(cudaMalloc(&out, 65536 * sizeof(float)), cudaSuccess);
  std::vector<float> got(65536);
  int mismatches = 0;
  // Dynamic scales of int8 and fp8 groups, the ends of the product's range, and one past each.
  for (float scale : {1.0f, 0.0078740157f, 0.0022321428f, 3.1e-5f, 0x1p-80f, 0x1.fffffep-81f, 0x1p125f, 1e-40f}) {
    divide_every_bf16<<<256, 256>>>(scale, out);
    ASSERT_EQ(cudaMemcpy(got.data(), out, got.size() * sizeof(float), cudaMemcpyDeviceToHost), cudaSuccess);
    for (uint32_t bits = 0; bits < 65536u; ++bits) {
      const float x = bits_float(bits << 16), want = x / scale, have = got[bits];
      // Bit for bit wherever a code could be nonzero; below, as small and of the same sign.
      const bool ok = std::fabs(want) < 0x1p-20f
                          ? std::fabs(have) < 0x1p-19f && std::signbit(have) == std::signbit(want)
                          : std::memcmp(&have, &want, sizeof have) == 0 || (std::isnan(have) && std::isnan(want));
      if (!ok && ++mismatches <= 5)
        ADD_FAILURE() << x << " / " << scale << " is " << have << " on the device, " << want << " on the host";
    }
  }
  cudaFree(out);
  EXPECT_EQ(mismatches, 0);
}

TEST(Fp8Convert, CudaHardwareConvertMatchesTheSoftwareCodecOnEveryBf16) {
  KVTEST_REQUIRE_DEVICE(Device::cuda);
  check_every_bf16<fp8_e4m3>("e4m3");
  check_every_bf16<fp8_e5m2>("e5m2");
}

}  // namespace
