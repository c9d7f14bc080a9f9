// The block-scaled codecs and FlashMLA's record (block_quant.hpp, part_record.hpp) compiled for the
// device give the host's bytes, for groups at every scale edge test_block_quant.cpp uses and random
// ones; the record coded on a warp, as the CUDA write codes it, gives the host's one-lane bytes. Built
// with KVFORGE_CUDA only; without a GPU it skips and says why.
#include "kvforge/backends/cuda/exec_cuda.cuh"  // first: the codecs compile for the device

#include <cuda_runtime.h>

#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "record_traits.hpp"
#include "support.hpp"

namespace {

using namespace kvforge;

// Bytes per group out: MXFP4 16 + 1, NVFP4 8 + 1, int4 16 + 4, FlashMLA 656 (per 576 inputs).
constexpr int kOut = 17 + 9 + 20;

__global__ void encode_groups(const float* in, uint8_t* out, int groups) {
  const int g = int(blockIdx.x * blockDim.x + threadIdx.x);
  if (g >= groups) return;
  const float* x = in + g * 32;
  uint8_t* o = out + g * kOut;
  o[16] = detail::quantize_mxfp4<32>(x, o);
  o[25] = detail::quantize_nvfp4(x, 0.37f, o + 17);
  const float s = detail::quantize_int4<32, float>(x, o + 26);
  memcpy(o + 42, &s, 4);
}

using DeepSeekV3Record = detail::PartRecord<kvtest::FlashMlaTraits<512, 64>>;

// A record a warp (one block of 32 threads): a run of 8 lanes a group of the latent, its amax one
// shuffle reduction over them, and the RoPE values a lane at a time.
__global__ void encode_records(const float* in, uint8_t* out, int records) {
  const int r = int(blockIdx.x);
  const float* latent = in + r * DeepSeekV3Record::kValues;
  uint8_t* record = out + r * DeepSeekV3Record::kBytes;
  if (r < records)  // the whole warp, or none of it
    DeepSeekV3Record::encode<detail::CudaExec, 32>(latent, latent + DeepSeekV3Record::D, record,
                                                   record + DeepSeekV3Record::kSplit, nullptr, int(threadIdx.x));
}

// kernel over `items` items, `threads` threads to a block of `per_block` items.
std::vector<uint8_t> run(void (*kernel)(const float*, uint8_t*, int), const std::vector<float>& in, int items, int out_bytes,
                         int threads = 128, int per_block = 128) {
  float* din = nullptr;
  uint8_t* dout = nullptr;
  std::vector<uint8_t> out(size_t(items) * size_t(out_bytes));
  EXPECT_EQ(cudaMalloc(&din, in.size() * 4), cudaSuccess);
  EXPECT_EQ(cudaMalloc(&dout, out.size()), cudaSuccess);
  cudaMemcpy(din, in.data(), in.size() * 4, cudaMemcpyHostToDevice);
  cudaMemset(dout, 0, out.size());
  kernel<<<(items + per_block - 1) / per_block, threads>>>(din, dout, items);
  EXPECT_EQ(cudaMemcpy(out.data(), dout, out.size(), cudaMemcpyDeviceToHost), cudaSuccess);
  cudaFree(din), cudaFree(dout);
  return out;
}

TEST(BlockQuantDevice, CudaCodecsAndTheFlashMlaRecordGiveTheHostsBytes) {
  KVTEST_REQUIRE_DEVICE(Device::cuda);
  std::mt19937 rng(3);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  const int groups = 512;
  std::vector<float> in(size_t(groups) * 32);
  for (int g = 0; g < groups; ++g)
    for (int i = 0; i < 32; ++i)
      in[size_t(g * 32 + i)] = normal(rng) * std::ldexp(1.0f, g % 64 - 32) * (g % 97 == 0 ? 0.0f : 1.0f);
  in[5] = INFINITY, in[40] = NAN;
  const std::vector<uint8_t> got = run(encode_groups, in, groups, kOut);
  for (int g = 0; g < groups; ++g) {
    uint8_t want[kOut] = {};
    const float* x = in.data() + g * 32;
    want[16] = detail::quantize_mxfp4<32>(x, want);
    want[25] = detail::quantize_nvfp4(x, 0.37f, want + 17);
    const float s = detail::quantize_int4<32, float>(x, want + 26);
    std::memcpy(want + 42, &s, 4);
    ASSERT_EQ(0, std::memcmp(got.data() + g * kOut, want, kOut)) << "group " << g;
  }
  const int records = 64;
  std::vector<float> latent(size_t(records) * 576);
  for (size_t i = 0; i < latent.size(); ++i) latent[i] = normal(rng) * std::ldexp(1.0f, int(i / 576) % 16 - 8);
  const std::vector<uint8_t> bytes = run(encode_records, latent, records, DeepSeekV3Record::kBytes, 32, 1);
  for (int r = 0; r < records; ++r) {
    uint8_t want[DeepSeekV3Record::kBytes];
    DeepSeekV3Record::encode_whole(latent.data() + r * 576, latent.data() + r * 576 + DeepSeekV3Record::D, want,
                                   want + DeepSeekV3Record::kSplit, nullptr);
    ASSERT_EQ(0, std::memcmp(bytes.data() + r * DeepSeekV3Record::kBytes, want, DeepSeekV3Record::kBytes)) << r;
  }
}

}  // namespace
