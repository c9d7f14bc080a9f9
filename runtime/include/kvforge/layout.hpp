// A layout is data: an addressing mode plus an ordered list of axes. Strides follow from the order,
// as in CuTe. This header is the one place that turns a variant's axes into element strides.
#pragma once

#include <cstdint>
#include <string>

#include "kvforge/dtype.hpp"
#include "kvforge/quant.hpp"

namespace kvforge {

enum class Axis : uint8_t { layer, row, seq, page, slot, kv, head, dim };
constexpr int kNumAxes = 8;

enum class Addressing : uint8_t { contiguous, ring, paged };
enum class UpdateMode : uint8_t { eager, lazy };

constexpr const char* axis_name(Axis a) {
  constexpr const char* names[] = {"layer", "row", "seq", "page", "slot", "kv", "head", "dim"};
  return names[int(a)];
}
constexpr const char* addressing_name(Addressing a) {
  return a == Addressing::contiguous ? "contiguous" : a == Addressing::ring ? "ring" : "paged";
}

struct HybridDescriptor;  // hybrid.hpp: the layer groups of a hybrid variant

// Launch parameters. A variant bakes in its model's specs/tuning/<model>.yaml (written by
// kvforge_bench --kvf_tune) or these defaults; Cache::set_tuning changes them at run time, which is
// how the tuner measures candidates.
struct Tuning {
  int64_t cpu_parallel_bytes = 1 << 16;  // below this much data an operation runs on one thread
  int cpu_chunk_items = 0;               // OpenMP chunk in items; 0: one even chunk per thread
  int cuda_block_threads = 256;          // threads per CUDA block; items per block = this / lanes
};

// Everything the spec fixed about a variant. Generated as a constexpr per variant.
struct VariantDescriptor {
  const char* name;
  const char* layout;
  const char* model;
  DType storage;
  DType input;
  Addressing addressing;
  UpdateMode update;
  int layers;
  int heads;
  int head_dim;
  int page_size;    // paged only, else 0
  int window;       // ring only, else 0
  int max_seq_len;  // the model's
  int num_axes;
  Axis axes[kNumAxes];
  int64_t bytes_per_token;  // K and V of all layers for one token, scales included, as codegen computed it
  Quant quant = Quant::none;  // quantized storage only
  DType scale = DType::f32;
  ScalePlacement scale_placement = ScalePlacement::separate;
  const HybridDescriptor* hybrid = nullptr;  // hybrid variants: one member per layer group
  bool generic = false;                      // served by the generic runtime-strided path
  Tuning tuning = {};

  constexpr bool has_axis(Axis a) const {
    for (int i = 0; i < num_axes; ++i)
      if (axes[i] == a) return true;
    return false;
  }
  constexpr bool paged() const { return addressing == Addressing::paged; }
  constexpr bool stacked() const { return has_axis(Axis::layer); }
  constexpr bool kv_fused() const { return has_axis(Axis::kv); }
  constexpr bool quantized() const { return quant != Quant::none; }
  constexpr bool is_hybrid() const { return hybrid != nullptr; }
  constexpr bool scales_in_page() const { return quantized() && scale_placement == ScalePlacement::in_page; }
};

// Capacity chosen at construction: how many rows and positions, or how many pages.
struct Capacity {
  int64_t rows = 0;       // contiguous and ring
  int64_t positions = 0;  // contiguous: per row; ring: the window
  int64_t pages = 0;      // paged
};

// Strides in elements of the storage pool for the five coordinates a token row needs. For a layout
// without a `layer` or `kv` axis, the pool holds one tensor per layer (and per K/V) back to back, and
// the stride steps from one tensor to the next, so addressing is uniform.
struct Strides {
  int64_t layer = 0;
  int64_t kv = 0;
  int64_t row_or_page = 0;
  int64_t seq_or_slot = 0;
  int64_t head = 0;
};

// Scales of a quantized layout use the same five coordinates; the strides of coordinates a scale does
// not vary over are 0 (head for per_token; all but layer and kv for per_tensor).
struct Geometry {
  int64_t extent[kNumAxes] = {};  // 0 for axes the layout does not have
  int64_t axis_stride[kNumAxes] = {};
  Strides strides;
  int64_t tensor_elems = 0;  // elements of one physical tensor (with its in-page scales)
  int tensors = 0;           // physical tensors in the pool: (stacked ? 1 : layers) * (kv_fused ? 1 : 2)
  int64_t total_elems = 0;   // elements of the storage pool
  // Quantized layouts only. Scale strides are in scale elements from the scale base, which is the
  // separate scale buffer, or the pool plus `scale_offset_bytes` when scales live in each page.
  Strides scale_strides;
  int64_t scale_elems = 0;         // size of the separate scale buffer (0 for in-page scales)
  int64_t scale_offset_bytes = 0;  // in-page: where page 0's scales start in the pool
  int64_t page_block_bytes = 0;    // in-page: one page's codes and scales, the page stride in bytes

  KVF_HD int64_t offset(int layer, int kv, int64_t row_or_page, int64_t seq_or_slot, int head) const {
    return layer * strides.layer + kv * strides.kv + row_or_page * strides.row_or_page +
           seq_or_slot * strides.seq_or_slot + head * strides.head;
  }
};

Geometry make_geometry(const VariantDescriptor& d, const Capacity& c);

}  // namespace kvforge
