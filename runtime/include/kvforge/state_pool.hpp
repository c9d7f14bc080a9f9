// Per-sequence state slots for the linear-attention and state-space layers of hybrid models (Mamba-2,
// gated delta net): a layer keeps no K/V per token but a fixed record per sequence, such as a
// convolution window and a recurrent state. See docs/memory.md, "State slots".
//
// A record is a list of named parts, each a shape and a dtype. A pool holds a record for each of
// `layers` layers per slot, in one of two places:
// - its own memory, in the order of its axes (StateAxes: slot, layer and part, outermost first). The
//   default is slot-major: slot s's record of every layer is one run of slot_bytes(), so copying a
//   sequence's state (a fork, a beam) or checkpointing it is one copy. [layer, slot, part] is vLLM's:
//   a tensor a layer, a slot's parts together in it; [part, layer, slot] is SGLang's: a tensor a part,
//   [layers, slots, *shape]. Each part starts on a 64-byte boundary, and a slot-major slot is padded to
//   256 bytes, so every part's rows suit vector loads. Checkpoints are `checkpoints` more slots after
//   the others (slot index slots + i), and the pool takes slot_bytes() a slot whatever its order.
// - a paged cache's own pages (vLLM's page_size_padded): slot s is page s of the cache, and a state
//   takes a page from the same free list as K/V (SequenceManager::take_pages), so one allocation and
//   one allocator serve both. Each part of each layer lies in one of the page's contiguous runs (a
//   layer's K or V block of the page, or the whole page where the layout keeps a page together), at the
//   same place in every page; a page must be large enough (state_page_size() says how large).
//
// A state is updated in place: view(layer, part) is [slots, *shape] over the memory, for a model's own
// kernels. The copies run on the pool's device (Backend::copy), queued on its stream.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "kvforge/backend.hpp"
#include "kvforge/descriptor.hpp"
#include "kvforge/dtype.hpp"

namespace kvforge {

// One part of a state record: conv [conv_dim, kernel - 1], ssm [heads, head_dim, state_size], ...
struct StatePart {
  std::string name;            // unique in the record; [a-z][a-z0-9_]*
  std::vector<int64_t> shape;  // 1 to 4 extents, each >= 1
  DType dtype = DType::f32;    // a float dtype: fp32, fp16 or bf16
};

struct StatePoolConfig {
  Device device = Device::cpu;
  int64_t slots = 0;        // sequences that hold a state at once, >= 1 (in a cache's pages: its pages)
  int64_t checkpoints = 0;  // checkpoint records, >= 0 (in a cache's pages: the most pages StateSlots
                            // keeps checkpoints in at once)
  void* stream = nullptr;   // cudaStream_t for a CUDA pool; null is the default stream
};

// Where one part of every slot of one layer lies: [slots, *shape], strides in elements.
struct StateView {
  void* data = nullptr;
  DType dtype = DType::f32;
  Device device = Device::cpu;
  std::vector<int64_t> shape;    // slots, then the part's shape
  std::vector<int64_t> strides;  // the slot stride / element size, then row-major over the part's shape
};

// The state record a variant's model spec states (linear_layers), as StatePool takes it.
std::vector<StatePart> state_parts(const VariantDescriptor& d);

class Cache;

// The fewest tokens a page of `d`'s layout must hold for one page to hold its model's whole state
// record in place (StatePool over a cache): the smallest multiple of d.page_size that fits, or 0 where
// no page of up to 2^20 tokens does (a layout whose pages have no contiguous runs of whole rows).
int64_t state_page_size(const VariantDescriptor& d);
// The same for a record of the caller's: `parts` in each of `layers` linear layers.
int64_t state_page_size(const VariantDescriptor& d, const std::vector<StatePart>& parts, int layers);

class StatePool {
 public:
  // Checks every argument before allocating: a bad part, a layer count outside [1, 1024], a slot
  // count below 1 or an order that does not name each axis once raises ArgumentError or
  // OutOfRangeError naming it. The pool starts zeroed.
  StatePool(std::vector<StatePart> parts, int layers, StatePoolConfig config, StateAxes axes = kSlotMajor);
  // The pool of a variant whose model spec names linear_layers: its record, over those layers, in its
  // layout's order (state_axes). UnsupportedError for another variant.
  StatePool(const VariantDescriptor& d, StatePoolConfig config);
  // In the pages of a paged, non-hybrid `cache` (which must outlive the pool): the same checks, then
  // every part of every layer is placed in a page's runs, or ShapeError("cache") says the page is too
  // small and which page size would do. Allocates nothing. checkpoints: StatePoolConfig's.
  StatePool(std::vector<StatePart> parts, int layers, Cache& cache, int64_t checkpoints = 0);
  // The record of the cache's own variant (its model's linear_layers), in its pages.
  explicit StatePool(Cache& cache, int64_t checkpoints = 0);

  const std::vector<StatePart>& parts() const { return parts_; }
  int layers() const { return layers_; }
  const StatePoolConfig& config() const { return config_; }
  int part_index(const std::string& name) const;  // ArgumentError listing the parts
  int64_t part_bytes(int part) const;             // one part of one layer of one slot
  int64_t record_bytes() const;                   // every part of one layer, padded as in the image
  // One sequence's state over every layer, as read_slot() writes it to the host: the layers' records
  // one after another, each part on 64 bytes, padded to 256. Wherever the slots lie, so that offload,
  // transfers and NIXL move one image between any two pools of one record.
  int64_t slot_bytes() const { return slot_bytes_; }
  // Where one part of one layer lies in that image: bytes from its start.
  int64_t image_offset(int layer, int part) const;
  // Bytes the pool allocated (slots and checkpoints; 0 in a cache's pages), and the part of those that
  // is padding.
  int64_t bytes() const { return cache_ ? 0 : slot_bytes_ * (config_.slots + config_.checkpoints); }
  int64_t padding_bytes() const;
  bool in_pages() const { return cache_ != nullptr; }
  const StateAxes& axes() const { return axes_; }  // a pool of its own's order; kSlotMajor in pages
  // Where one part of one layer of one slot (or checkpoint record slots + i, in a pool of its own)
  // lies: bytes from data(), or in a cache's pages from the cache's storage. For a transport that
  // moves a slot's parts itself (NIXL).
  int64_t offset(int64_t slot, int layer, int part) const;
  int64_t slot_stride(int layer, int part) const;  // bytes from one slot's part to the next slot's
  Cache* cache() const { return cache_; }
  // In a cache's pages: the bytes a page takes in the cache (scales included), and those of them that a
  // state leaves unused. 0 for a pool of its own.
  int64_t page_bytes() const { return page_bytes_; }
  int64_t page_padding_bytes() const;

  StateView view(int layer, int part) const;
  // The pool's memory, bytes() of it: the slots, then the checkpoints (for registering with a transport).
  // Null in a cache's pages: register the cache's storage instead.
  void* data() const { return pool_.data(); }
  // One part of one slot: `bytes` must be part_bytes(part); src and dst are contiguous, on `device`
  // (the pool's own, or the host).
  void write(int64_t slot, int layer, int part, const void* src, Device device);
  void read(int64_t slot, int layer, int part, void* dst, Device device) const;
  void copy_slot(int64_t src, int64_t dst);  // a fork or a beam: the whole state of every layer
  // A whole slot to or from host memory of slot_bytes() (offload); queued on the pool's stream.
  void read_slot(int64_t slot, void* host) const;
  void write_slot(int64_t slot, const void* host);
  void zero_slot(int64_t slot);              // a new sequence's state
  // slot's state into checkpoint record `index`, and back, into any slot. In a cache's pages a
  // checkpoint is a page too: `index` is a page in [0, slots), as copy_slot's.
  void checkpoint(int64_t slot, int64_t index);
  void restore(int64_t index, int64_t slot);
  void synchronize() const;                      // the pool's stream

 private:
  // Where a slot's bytes lie: runs at base_ + offset + slot * stride (one run for a slot-major pool of
  // its own; a run a layer or a part in another order; in a cache's pages, each page run a state uses).
  struct Span {
    int64_t offset, bytes, stride;
  };
  void check_parts();
  void place_own();
  char* part_at(int64_t record, int layer, int part) const {
    const size_t item = size_t(layer) * parts_.size() + size_t(part);
    return base_ + place_[item] + record * stride_[item];
  }
  void copy_record(int64_t src, int64_t dst);
  void* stream() const;
  void check_slot(const char* argument, int64_t slot) const;
  void check_index(int64_t index) const;
  void check_part(int layer, int part) const;

  std::vector<StatePart> parts_;
  int layers_;
  StatePoolConfig config_;
  Cache* cache_ = nullptr;
  StateAxes axes_ = kSlotMajor;
  std::vector<int64_t> place_;   // [layer][part]: the part's offset from base_ in record 0
  std::vector<int64_t> stride_;  // [layer][part]: bytes from one slot's part to the next's
  std::vector<int64_t> image_;  // [layer][part]: its offset in the slot image (place_'s, in a pool of its own)
  std::vector<Span> spans_;
  int64_t record_bytes_ = 0, slot_bytes_ = 0, page_bytes_ = 0;
  char* base_ = nullptr;
  Buffer pool_;
};

}  // namespace kvforge
