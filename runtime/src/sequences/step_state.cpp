#include "kvforge/step_state.hpp"

#include <algorithm>

#include "kvforge/backend.hpp"
#include "kvforge/errors.hpp"
#include "kvforge/detail/step_build.hpp"

namespace kvforge {
DeviceStepState::DeviceStepState(Device device, void* stream, int32_t page_size)
    : device_(device), stream_(stream), page_size_(page_size), backend_(backend(device)) {}

template <class T> T* DeviceStepState::reserve(Buffer& b, int64_t count) {
  const int64_t bytes = std::max<int64_t>(count, 1) * int64_t(sizeof(T));
  if (b.bytes() < bytes) b = Buffer(backend_, std::max<int64_t>(bytes, 2 * b.bytes()));
  return b.as<T>();
}

void DeviceStepState::grow(int32_t rows, int32_t pages) {
  // Geometric, with a quarter of headroom, so that a growing batch or sequence reallocates O(log)
  // times and not at the next page. The new table starts empty (allocate() zero-fills): the manager
  // uploads every row again.
  auto grown = [](int32_t need, int32_t have) { return need <= have ? have : std::max({need + need / 4, 2 * have, 16}); };
  table_rows_ = grown(std::max(rows, 1), table_rows_);
  stride_ = grown(std::max(pages, 1), stride_);
  table_ = Buffer(backend_, int64_t(table_rows_) * stride_ * int64_t(sizeof(int32_t)));
  lengths_ = Buffer(backend_, int64_t(table_rows_) * int64_t(sizeof(int32_t)));
  dropped_ = Buffer(backend_, int64_t(table_rows_) * int64_t(sizeof(int32_t)));
}

const DeviceStep& DeviceStepState::build(const StepChanges& c, bool with_indices) {
  if (!fits(c.table_rows, c.max_pages))
    throw StateError("step", "the device block table holds " + std::to_string(table_rows_) + " rows of " +
                                 std::to_string(stride_) + " pages; grow() it first");
  const int64_t n = int64_t(c.rows.size());
  step_.uploaded_bytes = 0;
  auto upload = [&](Buffer& b, const auto& host, int64_t count) {
    using T = typename std::decay_t<decltype(host)>::value_type;
    T* device = reserve<T>(b, count);
    if (!host.empty()) backend_.from_host(device, host.data(), int64_t(host.size() * sizeof(T)), stream_);
    step_.uploaded_bytes += int64_t(host.size() * sizeof(T));
    return device;
  };
  detail::StepBuildArgs a{};
  a.table = table_.as<int32_t>();
  a.lengths = lengths_.as<int32_t>();
  a.dropped = dropped_.as<int32_t>();
  a.stride = stride_;
  a.page_size = page_size_;
  a.table_writes = upload(table_writes_, c.table, int64_t(c.table.size()));
  a.table_write_count = int64_t(c.table.size());
  a.row_writes = upload(row_writes_, c.rows_reset, int64_t(c.rows_reset.size()));
  a.row_write_count = int64_t(c.rows_reset.size());
  // The batch's rows and new-token counts go up only when they changed; a steady decode step keeps
  // last step's. new_tokens carries a trailing 0 so that its scan ends with the total.
  const bool fresh = rows_.bytes() < (n + 1) * int64_t(sizeof(int32_t));
  if (c.batch_changed || fresh) {
    a.rows = upload(rows_, c.rows, n + 1);
    int32_t* counts = reserve<int32_t>(new_tokens_, n + 1);
    if (n) backend_.from_host(counts, c.new_tokens.data(), n * int64_t(sizeof(int32_t)), stream_);
    step_.uploaded_bytes += n * int64_t(sizeof(int32_t));
    backend_.fill(counts + n, 0, sizeof(int32_t), stream_);
    a.new_tokens = counts;
  } else {
    a.rows = rows_.as<int32_t>();
    a.new_tokens = new_tokens_.as<int32_t>();
  }
  a.sequences = n;
  a.seq_lens = reserve<int32_t>(seq_lens_, n);
  a.held_pages = reserve<int32_t>(held_, n + 1);
  a.query_start = reserve<int32_t>(query_start_, n + 1);
  a.indptr = reserve<int32_t>(indptr_, n + 1);
  a.last_page_len = reserve<int32_t>(last_page_len_, n);
  a.slots = reserve<int64_t>(slots_, c.total_new_tokens);
  a.indices = with_indices ? reserve<int32_t>(indices_, c.total_held_pages) : nullptr;

  const int64_t need = backend_.step_scratch_bytes(n + 1);
  if (scan_temp_.bytes() < need) scan_temp_ = Buffer(backend_, std::max(need, 2 * scan_temp_.bytes()));
  backend_.build_step(a, stream_, scan_temp_.data(), scan_temp_.bytes());

  auto view = [&](const void* p, DType t, int64_t count) { return IndexView{p, t, device_, count}; };
  step_.slots = view(a.slots, DType::i64, c.total_new_tokens);
  step_.query_start = view(a.query_start, DType::i32, n + 1);
  step_.seq_lens = view(a.seq_lens, DType::i32, n);
  step_.rows = view(a.rows, DType::i32, n);
  step_.block_table = view(a.table, DType::i32, int64_t(table_rows_) * stride_);
  step_.block_table_stride = stride_;
  step_.indptr = view(a.indptr, DType::i32, n + 1);
  step_.indices = with_indices ? view(a.indices, DType::i32, c.total_held_pages) : IndexView{};
  step_.last_page_len = view(a.last_page_len, DType::i32, n);
  return step_;
}

}  // namespace kvforge
