// The type-erased cache interface every variant implements. See docs/contract.md.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>

#include "kvforge/attend.hpp"
#include "kvforge/cache_ops.hpp"
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
  int stored_dim = 0;  // stored elements of a head's row: the last axis of k and v (stored_row)
};

// Memory the cache holds, split into the KV storage itself and the runtime's own overhead.
struct MemoryReport {
  int64_t storage_bytes = 0;      // codes or values, and their scales
  int64_t scale_bytes = 0;        // the part of storage_bytes that is scales
  int64_t staging_bytes = 0;   // lazy staging of appended tokens and their targets
  int64_t bookkeeping_bytes = 0;  // row lengths, error flag, reorder scratch once used
  int64_t overhead_bytes() const { return staging_bytes + bookkeeping_bytes; }
  MemoryReport& operator+=(const MemoryReport& o) {  // a cache made of members holds their sum
    storage_bytes += o.storage_bytes;
    scale_bytes += o.scale_bytes;
    staging_bytes += o.staging_bytes;
    bookkeeping_bytes += o.bookkeeping_bytes;
    return *this;
  }
};

// A record's two halves as the K and V views a cache takes: the last axis of `record` (2 * head_dim
// wide, contiguous) split in two, the other axes as they are. ShapeError naming `arg` where the record
// is not the variant's; UnsupportedError where the variant keeps no records (descriptor().records()).
struct RecordHalves {
  TensorView k, v;
};
RecordHalves record_halves(const VariantDescriptor& d, const TensorView& record, const char* arg);

// A layer's records in place, where a float layout keeps each head's record whole (its V half right
// after its K half: axes ending [.., kv, head, dim] with one head, or [.., head, kv, dim]), as engines
// hand them to their kernels. Each part is [rows or pages, positions or slots, heads, width] with
// `strides` (elements; the last axis contiguous): the whole record (record_width() values) at `record`,
// its first part (record_first() values: an MLA model's kv_lora_rank, FlashInfer's ckv_cache; K of
// another width than V) there too, its second (record_second(): the RoPE part, kpe_cache; V) at `second`.
struct RecordView {
  const void* record = nullptr;
  const void* second = nullptr;
  DType dtype = DType::f32;
  Device device = Device::cpu;
  Strides strides;  // row_or_page, seq_or_slot, head, as LayerView's
  int64_t rows_or_pages = 0;
  int64_t seq_or_slots = 0;
  int heads = 0;
  int first_width = 0;
  int second_width = 0;  // 0 for a record format's records, whose bytes are one part (second is null;
                         // its parts are the descriptor's record_format)
};
class Cache;
// The view of `layer`, or nothing where the variant keeps no records, its layout splits them (K's and V's
// halves apart), or it stores codes with scales apart from them (each half with its own). A record
// format's records (FlashMLA's fp8 record, a spec's own), scales inside, are one part of record bytes.
std::optional<RecordView> record_view(const Cache& cache, int layer);

// Every variant implements this interface (TypedCache<Traits> in cache_impl.hpp; the generic path too),
// and so do the caches made of member caches (HybridCache, PairedCache). Its operations are the rows of
// cache_ops.hpp. Tensors may have any token and head stride; the last axis must be contiguous
// (stride 1). Every argument is checked before anything is written, and a refused call raises a typed
// error (errors.hpp) naming the argument: the cache is then unchanged. On CUDA, index arrays are
// checked on the device and a failure raises at synchronize() (docs/contract.md).
class Cache {
 public:
  virtual ~Cache() = default;

  // The operations, each documented on its row of the table: pure virtuals; the derived rows (records
  // and latents), which every cache has through append and gather; and the layer groups, which Cache
  // answers for a cache of one group (cache.cpp).
  KVFORGE_CACHE_OPS(KVFORGE_CACHE_OP_PURE)

};

}  // namespace kvforge
