#include "kvforge/physical_wire.hpp"

#include <algorithm>
#include <cstring>

#include "kvforge/detail/checks.hpp"

namespace kvforge {
namespace {

template <size_t N> void copy_fixed(char* to, const char* from) { std::memcpy(to, from, N); }

// One head's row of head_dim values; the common widths get a copy of known size.
void copy_row(char* to, const char* from, int64_t bytes) {
  switch (bytes) {
    case 64: return copy_fixed<64>(to, from);
    case 128: return copy_fixed<128>(to, from);
    case 256: return copy_fixed<256>(to, from);
    case 512: return copy_fixed<512>(to, from);
    default: std::memcpy(to, from, size_t(bytes));
  }
}

}  // namespace

bool pages_cover(const PhysicalPlacement& p, int64_t tokens) {
  return p.page_size >= 1 && __int128(p.pages) == (__int128(tokens) + p.page_size - 1) / p.page_size;
}

std::string placement_problem(const PhysicalPlacement& p, int64_t tokens, int heads, int64_t D, int64_t es) {
  if (p.page_size < 1 || p.slot_stride < 0 || p.head_stride < 0 || p.wire_bytes < 0 || p.pages < 0)
    return "a negative size or stride";
  if (p.head_blocks != 1 && (p.head_blocks != heads || p.head_stride != 0)) return "blocks that are not per page or per head";
  if (!pages_cover(p, tokens)) return "a page count that does not cover the tokens";
  // Every slot of a page is written (the last page's past the tokens with zeros): slots that share
  // memory, or more of them than the wire holds rows, are no placement, and would loop past the wire.
  if (p.page_size > 1 && p.slot_stride < D) return "slots that overlap (a slot_stride under head_dim)";
  if (__int128(p.pages) * p.page_size * D > p.wire_bytes / es) return "more slots than the wire holds";
  if (p.block.size() != 2 * size_t(p.pages) * size_t(p.head_blocks)) return "a block count that is not 2 x pages x head_blocks";
  int64_t total = 0;
  for (int64_t r : p.runs) {
    if (r <= 0) return "an empty message";
    if (r > p.wire_bytes - total) return "message lengths that do not add up to the wire";
    total += r;
  }
  if (total != p.wire_bytes || p.wire_bytes % es) return "message lengths that do not add up to the wire";
  // Wide arithmetic: a placement from another process may hold any numbers, and none may wrap.
  using Wide = __int128;
  const Wide extent = Wide(p.page_size - 1) * p.slot_stride + Wide(heads - 1) * p.head_stride + D;
  for (int64_t base : p.block)
    if (base < 0 || Wide(base) + extent > p.wire_bytes / es) return "a block outside the wire";
  return {};
}

std::optional<PhysicalPlacement> physical_placement(const Cache& c, const int32_t* pages, int64_t row, int64_t tokens) {
  const VariantDescriptor& d = c.descriptor();
  if (!d.plain_values() || d.is_hybrid() || tokens <= 0) return std::nullopt;
  const int heads = d.heads;
  if (d.addressing == Addressing::ring && tokens > d.window) return std::nullopt;  // positions wrap: not one block
  const LayerView first = c.view(0);
  const Strides& s = first.strides;
  const int64_t P = d.paged() ? d.page_size : tokens, D = d.head_dim, es = dtype_size(first.dtype);
  // The dense block: a page's slots and dims, with its heads too if they follow on; or a page's heads
  // and dims and slots; or, where K and V interleave by position, one position's heads and dims (the
  // wire then has pages of one position, W = 1).
  int64_t dense = D, head_blocks = heads, W = P;
  if (P == 1 || s.seq_or_slot == D) {
    dense = P * D;
    if (heads == 1 || s.head == dense) dense *= heads, head_blocks = 1;
  } else if (heads == 1 || s.head == D) {
    head_blocks = 1;
    if (s.seq_or_slot == heads * D) dense = P * heads * D;
    else dense = heads * D, W = 1;
  } else {
    return std::nullopt;  // one row of head_dim values per block: as many messages as rows
  }
  const auto* k0 = static_cast<const char*>(first.k);
  const int64_t v_at = static_cast<const char*>(first.v) - k0;
  for (int layer = 1; layer < d.layers; ++layer) {
    const LayerView v = c.view(layer);
    if (v.strides.row_or_page != s.row_or_page || v.strides.seq_or_slot != s.seq_or_slot || v.strides.head != s.head ||
        static_cast<const char*>(v.v) - static_cast<const char*>(v.k) != v_at)
      return std::nullopt;
  }
  PhysicalPlacement p;
  p.page_size = W, p.slot_stride = W > 1 ? s.seq_or_slot : 0, p.head_stride = head_blocks > 1 ? 0 : s.head;
  p.pages = (tokens + W - 1) / W, p.head_blocks = head_blocks;
  const int64_t bytes = dense * es;  // one block
  struct Block {
    int64_t at;
    size_t entry;
  };
  std::vector<Block> blocks;
  for (int kv = 0; kv < 2; ++kv)
    for (int64_t i = 0; i < p.pages; ++i) {
      // Wire page i is pool page i (W = P) or position i (W = 1).
      const int64_t position = i * W, page = pages ? pages[position / P] : row, slot = position % P;
      for (int64_t hb = 0; hb < head_blocks; ++hb)
        blocks.push_back({(kv ? v_at : 0) + (element_offset(s, 0, 0, page, slot) + (head_blocks > 1 ? hb * s.head : 0)) * es,
                          size_t((kv * p.pages + i) * head_blocks + hb)});
    }
  std::sort(blocks.begin(), blocks.end(), [](const Block& a, const Block& b) { return a.at < b.at; });
  p.block.assign(blocks.size(), 0);
  for (const Block& b : blocks) {
    if (!p.runs.empty() && b.at < p.run_at.back() + p.runs.back()) return std::nullopt;  // blocks overlap
    if (!p.runs.empty() && b.at == p.run_at.back() + p.runs.back()) p.runs.back() += bytes;
    else p.run_at.push_back(b.at), p.runs.push_back(bytes);
    p.block[b.entry] = p.wire_bytes / es;
    p.wire_bytes += bytes;
  }
  return p;
}

void write_physical(const LayerView& src, const int32_t* pages, int64_t src_page_size, int64_t row, int head_offset,
                    int heads, int64_t tokens, int64_t D, const PhysicalPlacement& p, char* wire) {
  const Strides& s = src.strides;
  const int64_t es = dtype_size(src.dtype), row_bytes = D * es;
  // A token's heads adjacent on both sides: one copy per token.
  const bool whole_tokens = heads == 1 || (s.head == D && p.head_blocks == 1 && p.head_stride == D);
  for (int kv = 0; kv < 2; ++kv) {
    const char* base = static_cast<const char*>(kv ? src.v : src.k) + head_offset * s.head * es;
    for (int64_t t = 0; t < tokens; ++t) {
      // The view's K and V bases hold the layer and K/V coordinates; the formula adds the rest.
      const int64_t at = pages ? element_offset(s, 0, 0, pages[t / src_page_size], t % src_page_size)
                               : element_offset(s, 0, 0, row, t);
      const char* from = base + at * es;
      if (whole_tokens) std::memcpy(wire + p.at(kv, t, 0) * es, from, size_t(heads * row_bytes));
      else
        for (int h = 0; h < heads; ++h) copy_row(wire + p.at(kv, t, h) * es, from + h * s.head * es, row_bytes);
    }
    // The last page past the sequence: zeros, never bytes a buffer held for another request.
    for (int64_t t = tokens; t < p.pages * p.page_size; ++t)
      for (int h = 0; h < heads; ++h) std::memset(wire + p.at(kv, t, h) * es, 0, size_t(row_bytes));
  }
}

void check_physical_range(const Cache& c, const GatherRange& range, int64_t tokens) {
  const VariantDescriptor& d = c.descriptor();
  // A hybrid cache's groups each have their own pages and page size: a placement is a group's.
  if (d.is_hybrid())
    throw UnsupportedError(std::string("cache: ") + d.name + " is hybrid; a physical placement is one group's "
                           "(cache.group(g))");
  const Capacity capacity = detail::capacity_of(d, c.config());
  if (d.paged()) {
    const int64_t pages = (tokens + d.page_size - 1) / d.page_size;
    detail::check_index_view("range.pages", range.pages, DType::i32, pages, c.config().device);
    detail::check_indices_on_host(
        detail::IndexCheckArgs{range.pages.data, false, pages, 0, capacity.pages, false, detail::kCheckPages, nullptr});
  } else {
    if (range.row < 0 || range.row >= capacity.rows) throw OutOfRangeError("range.row", range.row, 0, capacity.rows);
    if (tokens > capacity.positions)
      throw OutOfRangeError("tokens.size()", tokens, 0, capacity.positions + 1, -1,
                            "the cache holds max_seq_len=" + std::to_string(capacity.positions) + " positions per row");
  }
}

}  // namespace kvforge
