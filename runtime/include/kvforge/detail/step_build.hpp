// The kernels that build a step's batch arrays where the cache lives, from a persistent block table:
// one source for both backends, through the executors (exec_cpu.hpp, exec_cuda.cuh), as ops.hpp is.
// An item is one sequence of the batch (or one change); on CUDA its lanes stride through the
// sequence's tokens or pages, on the CPU one thread takes it whole. Scans go through the executor's
// `exclusive_scan` (a loop on the CPU, CUB's DeviceScan on CUDA).
#pragma once

#include <cstdint>

#include "kvforge/detail/config.hpp"
#include "kvforge/detail/op_args.hpp"
#include "kvforge/detail/step_writes.hpp"

namespace kvforge::detail {

// Device arrays of one step; sizes in brackets (n = sequences in the batch, R = table rows,
// S = the table's row stride in pages).
struct StepBuildArgs {
  // persistent, on the device
  int32_t* table;    // [R, S] page ids
  int32_t* lengths;  // [R] tokens each row holds, advanced by every step
  int32_t* dropped;  // [R]
  int32_t stride;    // S
  int32_t page_size;
  // this step's uploads
  const TableWrite* table_writes;  // [table_write_count]
  int64_t table_write_count;
  const RowWrite* row_writes;  // [row_write_count]
  int64_t row_write_count;
  const int32_t* rows;        // [n] the batch's table rows
  const int32_t* new_tokens;  // [n + 1], the last 0
  int64_t sequences;          // n
  // outputs
  int32_t* seq_lens;       // [n] tokens held after the step (BatchMetadata::lengths)
  int32_t* held_pages;     // [n + 1] pages each holds from `dropped` on, the last 0 (scanned into indptr)
  int32_t* query_start;    // [n + 1]
  int32_t* indptr;         // [n + 1]
  int32_t* last_page_len;  // [n]
  int64_t* slots;          // [total new tokens]
  int32_t* indices;        // [total held pages], or null: FlashInfer's arrays are not asked for
};

template <class Exec> void apply_writes(const Exec& ex, const StepBuildArgs& a) {
  ex.for_each_item(a.row_write_count, Fixed<1>{}, 12, [a] KVF_HD(int64_t i, int, int) {
    const RowWrite w = a.row_writes[i];
    a.lengths[w.row] = w.length;
    a.dropped[w.row] = w.dropped;
  });
  ex.for_each_item(a.table_write_count, Fixed<1>{}, 12, [a] KVF_HD(int64_t i, int, int) {
    const TableWrite w = a.table_writes[i];
    a.table[int64_t(w.row) * a.stride + w.index] = w.page;
  });
}

// Advances every row of the batch by its new tokens; its length, last page fill and held pages.
template <class Exec> void advance_lengths(const Exec& ex, const StepBuildArgs& a) {
  ex.for_each_item(a.sequences + 1, Fixed<1>{}, 16, [a] KVF_HD(int64_t i, int, int) {
    if (i == a.sequences) {
      a.held_pages[i] = 0;
      return;
    }
    const int32_t row = a.rows[i];
    const int32_t length = a.lengths[row] + a.new_tokens[i];
    a.lengths[row] = length;
    a.seq_lens[i] = length;
    a.last_page_len[i] = length == 0 ? 0 : (length - 1) % a.page_size + 1;
    a.held_pages[i] = (length + a.page_size - 1) / a.page_size - a.dropped[row];
  });
}

// The slot of each new token: page * page_size + offset, or -1 where its page left the window.
template <class Exec, int Lanes> void build_slots(const Exec& ex, const StepBuildArgs& a, Fixed<Lanes> lanes) {
  ex.for_each_item(a.sequences, lanes, 64, [a] KVF_HD(int64_t i, int lane, int lanes_) {
    const int32_t row = a.rows[i], count = a.new_tokens[i];
    const int32_t first = a.seq_lens[i] - count;
    const int32_t* pages = a.table + int64_t(row) * a.stride;
    int64_t* out = a.slots + a.query_start[i];
    for (int32_t t = lane; t < count; t += lanes_) {
      const int32_t position = first + t;
      const int32_t page = pages[position / a.page_size];
      out[t] = page < 0 ? -1 : int64_t(page) * a.page_size + position % a.page_size;
    }
  });
}

// FlashInfer's `indices`: each sequence's held pages, concatenated at its indptr.
template <class Exec, int Lanes> void build_indices(const Exec& ex, const StepBuildArgs& a, Fixed<Lanes> lanes) {
  ex.for_each_item(a.sequences, lanes, 256, [a] KVF_HD(int64_t i, int lane, int lanes_) {
    const int32_t row = a.rows[i];
    const int32_t* pages = a.table + int64_t(row) * a.stride + a.dropped[row];
    int32_t* out = a.indices + a.indptr[i];
    const int32_t count = a.held_pages[i];
    for (int32_t j = lane; j < count; j += lanes_) out[j] = pages[j];
  });
}

// The whole build, in launch order on one stream.
template <class Exec> void build_step(const Exec& ex, const StepBuildArgs& a, void* scan_temp, int64_t scan_temp_bytes) {
  constexpr Fixed<32> kLanes{};  // CUDA: a warp per sequence; the CPU takes each whole
  apply_writes(ex, a);
  advance_lengths(ex, a);
  exclusive_scan(ex, a.new_tokens, a.query_start, a.sequences + 1, scan_temp, scan_temp_bytes);
  exclusive_scan(ex, a.held_pages, a.indptr, a.sequences + 1, scan_temp, scan_temp_bytes);
  build_slots(ex, a, kLanes);
  if (a.indices) build_indices(ex, a, kLanes);
}

}  // namespace kvforge::detail
