// The arguments of Cache::attend (cache_ops.hpp's row): which sequences a batch of queries attends over,
// and how. The names follow the sequence manager's BatchMetadata, whose DeviceBatch arrays they take as
// they are (query_start, lengths, page_table), so a step's append and its attention share one plan.
#pragma once

#include <cstdint>

#include "kvforge/tensor.hpp"

namespace kvforge {

// B sequences, T query tokens in all. Every array lies on the cache's device.
struct AttendBatch {
  IndexView query_start;  // int32 [B + 1]: sequence b's queries are tokens [query_start[b], query_start[b + 1])
  IndexView lengths;      // int32 [B]: positions each sequence holds, its new tokens appended already; >= 1
  // int32 [T]: each query's own position, for the causal mask; may be left empty, which places sequence b's
  // n queries at its newest positions, lengths[b] - n .. lengths[b] - 1 (a decode step or a prefill chunk).
  IndexView positions;
  // int32 [B] or empty: the first position each sequence's queries see, in [0, lengths[b]); the positions
  // before it are unseen (a batch's left padding). A query before it (a pad's own) sees nothing: its
  // output row is zeros and its lse -inf.
  IndexView begins;
  IndexView rows;           // contiguous and ring: int32 [B], each sequence's row
  IndexView page_table;     // paged: int32 [B * max_pages], row b the sequence's pages (vLLM's block_tables)
  int64_t max_pages = 0;    // paged: the page table's row length
  // Planning hints that a device-resident batch cannot be read back for without a synchronization: the
  // most queries and positions of any sequence. 0: read from the arrays (CPU), or T and the cache's
  // capacity (CUDA). A hint below the truth is refused on the CPU and read as an error on CUDA.
  int64_t max_query_len = 0;
  int64_t max_kv_len = 0;
};

struct AttendOptions {
  float scale = 0.0f;  // applied to q . k; 0: 1 / sqrt(key width)
  // Query t sees positions <= its own; off, every query sees all of its sequence's positions.
  bool causal = true;
  int window = 0;         // > 0: a query at position p sees only positions > p - window (sliding window)
  float softcap = 0.0f;   // > 0: a score s becomes softcap * tanh(s / softcap) (Gemma 2), after the scale
  // fp32 [1, 1, q_heads] or empty: a learned logit per query head that joins each softmax's denominator
  // and adds no value (gpt-oss's attention sinks).
  TensorView sinks;
};

}  // namespace kvforge
