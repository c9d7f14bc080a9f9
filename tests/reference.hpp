// The independent reference: what every logical (layer, sequence, position) should hold, kept as the id
// of the write that last landed there. Values are a pure function of (write id, kv, head, dim), so
// the reference needs no copy of the data. It knows the cache contract, not kvforge's indexing:
//   contiguous: position p of sequence s is its own cell;
//   ring: only the last `window` positions are readable, and position p shares its cell with every
//         position congruent to it mod window (the later write wins);
//   paged: the test's own page table gives each sequence distinct pages.
#pragma once

#include <map>
#include <tuple>

#include "support.hpp"

namespace kvtest {

struct Reference {
  int window = 0;  // ring only
  // (layer, sequence, cell) -> write id; cell = position, or position mod window for a ring.
  std::map<std::tuple<int, int64_t, int64_t>, uint64_t> cells;

  int64_t cell_of(int64_t pos) const { return window ? pos % window : pos; }
  void write(int layer, int64_t seq, int64_t pos, uint64_t id) { cells[{layer, seq, cell_of(pos)}] = id; }
  // 0 means never written: the cache must read back zeros there.
  uint64_t at(int layer, int64_t seq, int64_t pos) const {
    auto it = cells.find({layer, seq, cell_of(pos)});
    return it == cells.end() ? 0 : it->second;
  }
  static float value(uint64_t id, int kv, int head, int dim, int heads, int head_dim) {
    if (id == 0) return 0.0f;
    return exact_value(((id * 2 + uint64_t(kv)) * uint64_t(heads) + uint64_t(head)) * uint64_t(head_dim) + uint64_t(dim));
  }
};

}  // namespace kvtest
