// Per-sequence state slots for the linear-attention and state-space layers of hybrid models (Mamba-2,
// gated delta net): a layer keeps no K/V per token but a fixed record per sequence, such as a
// convolution window and a recurrent state. See docs/memory.md, "State slots".
//
// A record is a list of named parts, each a shape and a dtype. A pool holds `slots` records for each of
// `layers` layers, slot-major: slot s's record of every layer is one run of slot_bytes(), so copying a
// sequence's state (a fork, a beam) or checkpointing it is one copy. Each part starts on a 64-byte
// boundary, and a slot's run is padded to 256 bytes, so every part's rows are aligned for vector loads.
// Checkpoints are `checkpoints` more records in a region of their own: a slot's state at a block
// boundary, which a prefix hit restores instead of recomputing from the start.
//
// A state is updated in place: view(layer, part) is [slots, *shape] over the pool, for a model's own
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
  int64_t slots = 0;        // sequences that hold a state at once, >= 1
  int64_t checkpoints = 0;  // checkpoint records, >= 0
  void* stream = nullptr;   // cudaStream_t for a CUDA pool; null is the default stream
};

// Where one part of every slot of one layer lies: [slots, *shape], strides in elements.
struct StateView {
  void* data = nullptr;
  DType dtype = DType::f32;
  Device device = Device::cpu;
  std::vector<int64_t> shape;    // slots, then the part's shape
  std::vector<int64_t> strides;  // slot_bytes() / element size, then row-major over the part's shape
};

// The state record a variant's model spec states (linear_layers), as StatePool takes it.
std::vector<StatePart> state_parts(const VariantDescriptor& d);

class StatePool {
 public:
  // Checks every argument before allocating: a bad part, a layer count outside [1, 1024] or a slot
  // count below 1 raises ArgumentError or OutOfRangeError naming it. The pool starts zeroed.
  StatePool(std::vector<StatePart> parts, int layers, StatePoolConfig config);
  // The pool of a variant whose model spec names linear_layers: its record, over those layers.
  // UnsupportedError for another variant.
  StatePool(const VariantDescriptor& d, StatePoolConfig config);

  const std::vector<StatePart>& parts() const { return parts_; }
  int layers() const { return layers_; }
  const StatePoolConfig& config() const { return config_; }
  int part_index(const std::string& name) const;  // ArgumentError listing the parts
  int64_t part_bytes(int part) const;             // one part of one layer of one slot
  int64_t record_bytes() const;                   // every part of one layer, padded as stored
  int64_t slot_bytes() const { return slot_bytes_; }  // one sequence's state over every layer
  // Bytes the pool allocated: slots and checkpoints, and the bytes of that which are padding.
  int64_t bytes() const { return slot_bytes_ * (config_.slots + config_.checkpoints); }
  int64_t padding_bytes() const;

  StateView view(int layer, int part) const;
  // The pool's memory, bytes() of it: the slots, then the checkpoints (for registering with a transport).
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
  void checkpoint(int64_t slot, int64_t index);  // slot's state into checkpoint record `index`
  void restore(int64_t index, int64_t slot);     // and back, into any slot
  void synchronize() const;                      // the pool's stream

 private:
  char* slot_at(int64_t slot) const;
  char* checkpoint_at(int64_t index) const;
  void check_slot(const char* argument, int64_t slot) const;
  void check_part(int layer, int part) const;

  std::vector<StatePart> parts_;
  std::vector<int64_t> part_offset_;  // within a layer's record
  int layers_;
  StatePoolConfig config_;
  int64_t record_bytes_ = 0, slot_bytes_ = 0;
  Buffer pool_;
};

}  // namespace kvforge
