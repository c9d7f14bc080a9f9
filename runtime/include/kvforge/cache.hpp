// The type-erased cache interface every variant implements. See docs/contract.md.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "kvforge/errors.hpp"
#include "kvforge/geometry.hpp"
#include "kvforge/tensor.hpp"

namespace kvforge {

// Capacity and placement, chosen at creation; every field is checked then (OutOfRangeError naming it).
struct CacheConfig {
  Device device = Device::cpu;    // cuda needs a CUDA build and a device (else DeviceError)
  int64_t rows = 1;               // contiguous and ring: sequence rows (the batch capacity), 1..2^31-1
  int64_t max_seq_len = 0;        // contiguous: positions per row, 0..the model's; 0 means the model's
  int64_t pages = 0;              // paged: pages in the pool, 1..(2^31-1) / page_size
  int64_t max_staged_tokens = 0;  // lazy: tokens one layer may stage between commits, 0..2^31-1; 0 means
                                  // `rows` (contiguous, ring) or min(pages * page_size, 4096) (paged)
  void* stream = nullptr;         // CUDA: the cudaStream_t every operation is queued on (capturable)
};

// Where each appended token goes, as device arrays of one entry per token; -1 marks padding.
// Contiguous and ring layouts take (row, position) pairs as int32; paged layouts take int64 slots,
// slot = page * page_size + offset in page.
struct TokenTargets {
  IndexView rows;
  IndexView positions;
  IndexView slots;

  static TokenTargets row_positions(IndexView rows, IndexView positions) { return {rows, positions, {}}; }
  static TokenTargets paged(IndexView slots) { return {{}, {}, slots}; }
};

// Positions [begin, end) of one sequence. Contiguous and ring layouts name the row; paged layouts
// give the sequence's page list (int32, on the cache's device).
struct GatherRange {
  int64_t row = 0;
  IndexView pages;
  int64_t begin = 0;
  int64_t end = 0;
};

// What an attention kernel needs to read one layer in place. For quantized storage, value =
// code * scale, with the scale of a (row or page, seq or slot, head) at k_scales + scale_strides (in
// scale elements; a zero stride means the scale is shared along that coordinate), plus, for per_group,
// d / (head_dim / scale_groups) for element d of the head's row.
struct LayerView {
  const void* k = nullptr;
  const void* v = nullptr;
  DType dtype = DType::f32;
  Quant quant = Quant::none;
  const void* k_scales = nullptr;
  const void* v_scales = nullptr;
  DType scale_dtype = DType::f32;
  Strides scale_strides;
  int scale_groups = 1;  // per_group: scales of a head's row, adjacent (group g of head h at h * head + g)
  const float* tensor_scales = nullptr;  // tensor-scaled: this layer's second-level scales, [2] (K, V) fp32
  Device device = Device::cpu;
  Strides strides;  // element strides: row_or_page, seq_or_slot, head (dim is contiguous)
  int64_t rows_or_pages = 0;
  int64_t seq_or_slots = 0;  // positions per row (window for ring) or page_size
  int heads = 0;
  int head_dim = 0;
};

// Memory the cache holds, split into the KV storage itself and the runtime's own overhead.
struct MemoryReport {
  int64_t storage_bytes = 0;      // codes or values, and their scales
  int64_t scale_bytes = 0;        // the part of storage_bytes that is scales
  int64_t staging_bytes = 0;   // lazy staging of appended tokens and their targets
  int64_t bookkeeping_bytes = 0;  // row lengths, error flag, reorder scratch once used
  int64_t overhead_bytes() const { return staging_bytes + bookkeeping_bytes; }
};

// Every variant implements this interface (TypedCache<Traits> in cache_impl.hpp; the generic path and
// hybrid caches too). Notation below: H = descriptor().heads, D = descriptor().head_dim,
// L = descriptor().layers, P = descriptor().page_size; "on the cache's device" means memory of
// config().device. Tensors may have any token and head stride; the last axis must be contiguous
// (stride 1). Every argument is checked before anything is written, and a refused call raises a typed
// error (errors.hpp) naming the argument: the cache is then unchanged. On CUDA, index arrays are
// checked on the device and a failure raises at synchronize() (docs/contract.md).
// An MLA record's two halves as the K and V views a cache takes: the last axis of `latent` (R + P
// wide, contiguous) split in two, the other axes as they are. ShapeError naming `arg` where the record
// is not the variant's; UnsupportedError where the variant is not an MLA one.
struct LatentHalves {
  TensorView k, v;
};
LatentHalves latent_halves(const VariantDescriptor& d, const TensorView& latent, const char* arg);

class Cache {
 public:
  virtual ~Cache() = default;

  virtual const VariantDescriptor& descriptor() const = 0;
  virtual const CacheConfig& config() const = 0;
  virtual const Geometry& geometry() const = 0;

  // Writes T new tokens of one layer.
  //   layer:   [0, L)
  //   k, v:    [T, H, D], the input dtype (descriptor().input), on the cache's device; T >= 0
  //   targets: one entry per token, on the cache's device, -1 = padding (skipped):
  //            contiguous and ring: rows int32 [T] in [0, config().rows), positions int32 [T] in
  //            [0, max_seq_len) (contiguous) or >= 0 (ring: cell = position mod window; a position below
  //            row_length - window is dropped); paged: slots int64 [T] in [0, pages * P),
  //            slot = page * P + offset in page.
  // Lazy variants stage the tokens (at most max_staged_tokens per layer between commits).
  virtual void append(int layer, const TensorView& k, const TensorView& v, const TokenTargets& targets) = 0;
  // Lazy variants: writes every layer's staged tokens in one launch. Eager variants: nothing to do.
  virtual void commit() = 0;
  // Reads positions [range.begin, range.end) of one sequence of one layer, dequantized.
  //   layer:        [0, L)
  //   range:        begin >= 0, end >= begin; contiguous: range.row in [0, rows), end <= max_seq_len;
  //                 ring: end <= row_length(row) and begin >= row_length(row) - window; paged:
  //                 range.pages int32 [>= ceil(end / P)] on the cache's device, the sequence's page list
  //                 (only the entries the range touches must be valid pages)
  //   k_out, v_out: [H, end - begin, D], the input dtype, on the cache's device
  virtual void gather(int layer, const GatherRange& range, const TensorView& k_out, const TensorView& v_out) = 0;
  // MLA variants (descriptor().mla()): a token's latent record, R = mla_kv_lora_rank values then
  // P = mla_rope_dim, is K then V of the variant's one head (head_dim = (R + P) / 2), so these are
  // append and gather of the record's two halves; every check and error is theirs. Other variants:
  // UnsupportedError.
  //   latent:     [T, 1, R + P], as append's k
  //   latent_out: [1, end - begin, R + P], as gather's k_out
  void append_latent(int layer, const TensorView& latent, const TokenTargets& targets);
  void gather_latent(int layer, const GatherRange& range, const TensorView& latent_out);
  // Zeros every layer, scales and row lengths (per-tensor scales are kept).
  virtual void reset() = 0;
  // Zeros one row of every layer; row in [0, rows). Contiguous and ring only (else UnsupportedError).
  virtual void reset_row(int64_t row) = 0;
  // New row i takes old row beam[i]: beam int32 [rows], each in [0, rows), on the cache's device.
  // Contiguous and ring only.
  virtual void reorder(const IndexView& beam) = 0;
  // For each pair (src, dst), page dst of every layer becomes a copy of page src: pairs int32 [2n],
  // pages in [0, config().pages), no page a destination twice or both source and destination.
  // Paged only.
  virtual void copy_blocks(const IndexView& pairs) = 0;
  // Raw pointers and element strides of one layer (layer in [0, L)), for attention kernels.
  virtual LayerView view(int layer) const = 0;
  // Paged layouts: bytes one page of every layer takes packed, codes and scales (offload moves these).
  virtual int64_t packed_page_bytes() const = 0;
  // Page pages[i] of every layer goes to packed + i * packed_page_bytes(), or comes back from there.
  //   pages:  int32 [n] in [0, config().pages), on the cache's device
  //   packed: n * packed_page_bytes() bytes of the cache's device's memory. One launch each. Paged only.
  virtual void pack_pages(const IndexView& pages, void* packed) = 0;
  virtual void unpack_pages(const void* packed, const IndexView& pages) = 0;
  // per_tensor quantized layouts: the static scales of one layer (layer in [0, L)); tensor-scaled
  // per_group layouts (NVFP4): the second-level scale under that layer's group scales, which codes
  // already written are read with too. Held in device memory so a captured graph picks up new values;
  // both finite and > 0. Others: UnsupportedError.
  virtual void set_tensor_scale(int layer, float k_scale, float v_scale) = 0;
  // The highest position written to a row (row in [0, rows)), plus one; 0 after reset. Contiguous and
  // ring only. Synchronizes on CUDA.
  virtual int64_t row_length(int64_t row) const = 0;
  // Waits for queued work and raises any error a device-side check found (CUDA only).
  virtual void synchronize() = 0;
  virtual MemoryReport memory() const = 0;
  // Raw storage pool; for tests and tools that read physical bytes.
  virtual const void* storage() const = 0;
  // The scale buffer beside the pool (separate or per_tensor scales), else null.
  virtual const void* scale_storage() const = 0;
  // A tensor-scaled layout's second-level scales, [layers, 2] fp32 (K then V of each layer) in the
  // cache's device memory, for an attention kernel to read; else null.
  virtual const float* tensor_scale_storage() const = 0;

  // The stream every later operation is queued on: a cudaStream_t on CUDA (a graph captured on it
  // records the operations captured there), ignored on the CPU. The caller orders the switch: work
  // queued on the old stream is not waited for.
  virtual void set_stream(void* stream) = 0;

  // Launch parameters now in force. set_tuning checks each against the range a tuning file is held to
  // (vocab.hpp's tunables; OutOfRangeError or ArgumentError naming the field) before changing anything.
  virtual Tuning tuning() const = 0;
  virtual void set_tuning(const Tuning& t) = 0;

  // Hybrid variants keep one member cache per layer group; every other cache is its own only group.
  // g in [0, num_groups()); layer in [0, L).
  virtual int num_groups() const { return 1; }
  virtual Cache& group(int g);
  virtual int group_of(int layer) const;
  virtual int group_layer(int layer) const;  // the layer's index within its group
};

}  // namespace kvforge
