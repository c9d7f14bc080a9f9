// Step metadata built where the kernels run. A SequenceManager keeps a persistent block table on the
// cache's device and uploads only what changed since the last step: table entries a new page, a
// copy-on-write, a window, a fork, an offload or a restore wrote, and the rows whose length the device
// cannot work out itself. A decode step in which every sequence of the same batch advanced by one
// token uploads nothing else: the device advances the lengths. The batch arrays are then built on the
// device, by the kernels of step_build.hpp, from one source for both backends. See docs/memory.md.
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#include "kvforge/backend.hpp"
#include "kvforge/cache.hpp"  // TokenTargets
#include "kvforge/detail/step_writes.hpp"
#include "kvforge/tensor.hpp"

namespace kvforge {

// What one step changed, as the manager records it on the host: O(sequences + changes), never
// O(sequences x pages).
struct StepChanges {
  std::vector<detail::TableWrite> table;  // entries written since the last step
  std::vector<detail::RowWrite> rows_reset;
  std::vector<int32_t> rows;        // [n] per sequence of the batch, its table row
  std::vector<int32_t> new_tokens;  // [n]
  bool batch_changed = true;        // rows or new_tokens differ from the previous step's
  int64_t total_new_tokens = 0;
  int64_t total_held_pages = 0;
  int32_t table_rows = 0;  // rows the table must have
  int32_t max_pages = 0;   // the longest page list of the batch
};

// A step's arrays on the cache's device (the BatchMetadata fields, built there). The block table is
// the persistent one: sequence i's pages are block_table[rows[i] * block_table_stride + j] for
// j < ceil(seq_lens[i] / page_size), as vLLM v1 indexes its persistent table by request row.
struct DeviceStep {
  IndexView slots;          // int64 [new tokens]
  IndexView query_start;    // int32 [n + 1]
  IndexView seq_lens;       // int32 [n]
  IndexView rows;           // int32 [n]
  IndexView block_table;    // int32 [table rows * stride]
  int32_t block_table_stride = 0;
  IndexView indptr;         // int32 [n + 1]
  IndexView indices;        // int32 [held pages]; empty unless asked for
  IndexView last_page_len;  // int32 [n]
  int64_t uploaded_bytes = 0;  // what this step sent to the device: changes, and the batch if it changed
  TokenTargets targets() const { return TokenTargets::paged(slots); }
};

// The device side: persistent buffers, grown geometrically and never shrunk, so a steady state
// allocates nothing; uploads go through one staging area.
class DeviceStepState {
 public:
  DeviceStepState(Device device, void* stream, int32_t page_size);
  // Whether the table holds `rows` rows of `pages` entries; when it does not, grow() must run and
  // every row be uploaded again.
  // A table of no rows or no pages never fits: block_table_stride is never 0, even for an empty batch.
  bool fits(int32_t rows, int32_t pages) const {
    return std::max(rows, 1) <= table_rows_ && std::max(pages, 1) <= stride_;
  }
  void grow(int32_t rows, int32_t pages);
  // Uploads `c` and builds the step's arrays (FlashInfer's `indices` too where `indices` is set).
  const DeviceStep& build(const StepChanges& c, bool indices);

 private:
  template <class T> T* reserve(Buffer& b, int64_t count);
  Device device_;
  void* stream_;
  int32_t page_size_;
  Backend& backend_;
  int32_t table_rows_ = 0, stride_ = 0;
  Buffer table_, lengths_, dropped_;
  Buffer rows_, new_tokens_, seq_lens_, held_, query_start_, indptr_, last_page_len_, slots_, indices_;
  Buffer table_writes_, row_writes_, scan_temp_;
  DeviceStep step_;
};

}  // namespace kvforge
