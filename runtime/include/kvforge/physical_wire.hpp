// The physical wire format: one layer of a sequence's K and V in the receiver's own page order, so that
// each run of the receiver's adjacent blocks arrives straight in its pool, and the layout conversion is
// the sender's one pass over its pool. The MPI transfers (transfer.hpp) and kvforge.nixl's prepared
// pulls (docs/transfer.md) both use it; neither side knows the other's layout, only this description.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "kvforge/cache.hpp"

namespace kvforge {

// Where a piece's values go on the wire: the receiver's dense blocks in the order its pool holds them.
// A block is a wire page's values (page_size positions: a pool page, a whole row of a contiguous or
// ring cache, or one position where K and V interleave by position), or one head's of them where the
// receiver's heads lie apart. The value of (K|V kv, position t, head h) starts at wire element
//   block[((kv * pages + t / page_size) * head_blocks + (head_blocks > 1 ? h : 0)]
//     + (t % page_size) * slot_stride + h * head_stride          (head_stride is 0 when head_blocks > 1)
struct PhysicalPlacement {
  int64_t page_size = 1, slot_stride = 0, head_stride = 0, pages = 0, head_blocks = 1, wire_bytes = 0;
  std::vector<int64_t> block;   // [2][pages][head_blocks], elements
  std::vector<int64_t> runs;    // run lengths in bytes, in wire order (one message or descriptor each)
  std::vector<int64_t> run_at;  // the receiver's: where each run starts, bytes from its layer's K element 0
  int64_t at(int kv, int64_t t, int h) const {
    return block[size_t((kv * pages + t / page_size) * head_blocks + (head_blocks > 1 ? h : 0))] +
           (t % page_size) * slot_stride + h * head_stride;
  }
};

// The receiver's side: the placement of positions [0, tokens) of a sequence on `pages` (paged, a host
// array; null for row `row` of a contiguous or ring cache), when the cache is unquantized and its pages'
// slots and dims (and maybe heads) are dense, the same way in every layer. The cache may be on any
// device: run_at counts bytes within its memory, which a transport reaches directly or through host
// staging (TransferOptions::stage_physical). Empty otherwise: the caller then moves values (gather and
// append). Every layer's runs start at the same offsets from its own K element 0.
std::optional<PhysicalPlacement> physical_placement(const Cache& receiver, const int32_t* pages, int64_t row, int64_t tokens);

// Whether the placement's page count covers `tokens` positions (no arithmetic of it wraps).
bool pages_cover(const PhysicalPlacement& p, int64_t tokens);

// A placement that came from elsewhere, checked before anything is written by it: every value of
// `heads` heads of head_dim D and `tokens` positions, elements of `element_bytes`, falls inside the
// wire, each slot its own, and the runs add up to it. Empty when it holds, else what is wrong.
std::string placement_problem(const PhysicalPlacement& p, int64_t tokens, int heads, int64_t D, int64_t element_bytes);

// The sender's side: one layer of its heads [head_offset, head_offset + heads) of positions [0, tokens)
// into a wire placed by `p`, in one pass over its pool; the last page's positions past `tokens` are
// zeros. `pages` is the sequence's page list (paged) or null (row `row`). The range must be checked
// first (check_physical_range).
void write_physical(const LayerView& src, const int32_t* pages, int64_t src_page_size, int64_t row, int head_offset,
                    int heads, int64_t tokens, int64_t D, const PhysicalPlacement& p, char* wire);

// The range a physical write reads, checked as gather would check it (write_physical reads the pool
// with plain loops, not through gather).
void check_physical_range(const Cache& c, const GatherRange& range, int64_t tokens);

}  // namespace kvforge
