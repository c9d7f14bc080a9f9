// PyTorch's forms of the bench's jobs, timed on the same buffers as kvforge (the `peers` and `short`
// presets). The forms are what the anchor engines write with PyTorch ops:
//   index_put   vLLM's paged write, cache.view(-1, H, D)[slots] = k, as advanced indexing over
//               (row or page, position or slot), so it serves every layout;
//   index_copy  index_copy_: over the flattened slots of a paged layout whose pages are whole
//               [P, H, D] blocks (vLLM), or HF StaticCache's index_copy_(2, pos, k) on [B, H, S, D];
//   slice_copy  DeepSpeed's static cache: a slice of consecutive positions copied in with copy_;
//   gathers     a slice copy_ of a row, or index_select of a sequence's pages (then one copy_ into the
//               [H, T, D] output, as an attention call's input would be laid out).
// A quantized layout's forms also quantize (JetStream's per-token int8: amax, divide, round, clamp,
// cast; fp8 through torch's float8 cast) and write the dynamic scales, or dequantize on gather.
//
// Built with PyTorch's C++ API (ATen) when CMake finds the pip-installed torch: the peer runs in the
// same process, on the very pool and input buffers kvforge's benchmark uses, with no Python in the
// timed region, so the ratio compares the operations and nothing else. The same forms serve a CUDA
// cache (kvforge_cuda_bench --torch), on its device buffers, on torch's current stream. torch_peers_absent.cpp stands
// in where torch is not installed.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "kvforge/kvforge.hpp"

namespace kvforge_bench {

enum class TorchForm { index_put, index_copy, slice_copy, index_select };

const char* torch_form_name(TorchForm f);
// "2.15.0+cu132" where this bench was built with PyTorch; empty where it was not.
std::string torch_version();

// Where one step writes (rows and positions, or slots) or what it reads (a row's range).
struct Targets {
  std::vector<int32_t> rows, positions;
  std::vector<int64_t> slots;
  int64_t row = 0, begin = 0;  // gather
};

// Everything a peer touches, set up once; each step then only runs the op. Every pointer is on the
// cache's device but `pages` and the epochs' targets, which are host arrays.
struct PeerSetup {
  const kvforge::Cache* cache = nullptr;
  int device_index = 0;  // a CUDA cache's device
  bool gather = false;
  const void* k = nullptr;  // append input, [tokens, H, D]
  const void* v = nullptr;
  int64_t tokens = 0;
  const std::vector<Targets>* epochs = nullptr;
  void* k_out = nullptr;  // gather output slices, each [H, count, D]
  void* v_out = nullptr;
  int64_t out_slice_bytes = 0;
  int64_t out_slices = 1;
  int64_t count = 0;
  const int32_t* pages = nullptr;  // every row's pages, pages_per_row each
  int64_t pages_per_row = 0;
};

class TorchPeer;

// The forms that can serve this job on this layout (none where torch is absent, or, for a CUDA
// cache, where this torch has no CUDA: torch_missing says why).
std::vector<TorchForm> torch_forms(const PeerSetup& setup);
std::string torch_missing(kvforge::Device device);
// Null where the form cannot serve the job.
std::shared_ptr<TorchPeer> make_torch_peer(const PeerSetup& setup, TorchForm form);
void run_torch_peer(TorchPeer& peer, int layer, int64_t epoch, int64_t out_slice);

}  // namespace kvforge_bench
