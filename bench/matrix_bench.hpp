// What kvforge_bench's matrix and its tuner (tuner.cpp) share: how the caches stand when an operation
// runs, a benchmark's shape and its prepared cache and inputs, and the one step that both time.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "kvforge/kvforge.hpp"
#include "torch_peers.hpp"

namespace kvforge_bench {

using kvforge::Cache;
using kvforge::VariantDescriptor;
using kvforge::VariantEntry;

// How the caches stand when an operation runs:
//   hot:  the same layer and targets every iteration, so pool and inputs stay in cache;
//   cold: the last-level cache is flushed before every iteration (outside the timed region);
//   big:  a pool of at least 1 GiB across all layers; every iteration moves to the next layer, and
//         after each pass over the layers to other rows, positions or pages, so neither the pool nor
//         a gather's output is in cache, as in an engine serving a large batch.
enum class Mode { hot, cold, big };
inline const char* mode_suffix(Mode m) { return m == Mode::cold ? "/cold" : m == Mode::big ? "/big" : ""; }

struct Shape {
  const char* op;   // append_decode, append_prefill, gather
  const char* key;  // batch, chunk, ctx
  int64_t n;
  Mode mode = Mode::hot;
};

struct Preset {
  std::vector<Shape> shapes;
  bool (*keeps)(const VariantDescriptor&);
  std::vector<Mode> modes = {Mode::hot};
  bool torch = false;  // also time PyTorch's forms of each job on the same buffers (torch_peers.hpp)
};

// One benchmark's cache and inputs. Only one is alive at a time: the next benchmark replaces it.
struct Prepared {
  std::unique_ptr<Cache> cache;
  std::vector<unsigned char> k, v, k_out, v_out;
  std::vector<int32_t> pages;  // every row's pages, pages_per_row each
  int64_t pages_per_row = 0;
  std::vector<Targets> epochs;  // hot and cold: one; big: a pass over the layers each
  int64_t out_slice_bytes = 0;  // a gather's output; big mode rotates through slices of k_out / v_out
  int64_t out_slices = 1;
  int64_t tokens = 0;
  int64_t iteration = 0;
  // A lazy variant's step, call by call: the seconds its appends (one a layer) and its commits took,
  // and how many of each ran (the counters append_us and commit_us: per call).
  double append_seconds = 0, commit_seconds = 0;
  int64_t appends = 0, commits = 0;
  std::map<TorchForm, std::shared_ptr<TorchPeer>> torch;  // PyTorch's forms on the same buffers

  PeerSetup peer_setup(const Shape& s) const {
    PeerSetup ps;
    ps.cache = cache.get();
    ps.gather = std::string(s.op) == "gather";
    ps.k = k.data();
    ps.v = v.data();
    ps.tokens = tokens;
    ps.epochs = &epochs;
    ps.k_out = const_cast<unsigned char*>(k_out.data());
    ps.v_out = const_cast<unsigned char*>(v_out.data());
    ps.out_slice_bytes = out_slice_bytes;
    ps.out_slices = out_slices;
    ps.count = s.n;
    ps.pages = pages.data();
    ps.pages_per_row = pages_per_row;
    return ps;
  }
};

// Which implementation serves the descriptor: the generated variant, the generic runtime-strided
// path, a naive engine's per-token memcpy scatter (appends only), or PyTorch.
// `untuned`: the generated variant with the default launch parameters, against its tuned ones.
enum class Impl { generated, generic, naive, untuned, torch };

// The cache and inputs of one benchmark of `e` (null where the shape does not apply to it).
std::unique_ptr<Prepared> prepare(const VariantEntry& e, const Shape& s, Impl impl);
// One step of the shape's operation (kvforge_bench.cpp says which).
void run_once(Prepared& p, const VariantDescriptor& d, const Shape& s, Impl impl, TorchPeer* peer = nullptr);

// Measures CPU launch-parameter candidates over a model's variants and shapes on this machine and
// writes the winner to <out>/<model>.yaml (tuner.cpp); the next build bakes it in.
int tune(const std::string& model, const std::string& out_dir);

}  // namespace kvforge_bench
