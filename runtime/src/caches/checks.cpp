// Argument checks shared by every variant; each throws before anything is written.
#include <algorithm>
#include <climits>
#include <string>
#include <unordered_set>

#include "kvforge/detail/cache_impl.hpp"

namespace kvforge::detail {

namespace {
// The largest pool or staging buffer kvforge creates: far beyond any device, and small enough that no
// byte offset into it can overflow int64.
constexpr int64_t kMaxPoolBytes = int64_t(1) << 48;
// A paged lazy cache's staging when config.max_staged_tokens is 0 (docs/contract.md).
constexpr int64_t kDefaultPagedStagedTokens = 4096;
}  // namespace

void check_tuning(const Tuning& t) {
  // The ranges a tuning file may set (vocab.hpp), so that what the spec refuses the runtime refuses too.
  for_each_tunable(t, [](const char* name, int64_t value, const tunables::Range& r) {
    const std::string field = std::string("tuning.") + name;
    if (value < r.lo || value > r.hi) throw OutOfRangeError(field, value, r.lo, r.hi + 1);
    if (value % r.multiple)
      throw ArgumentError(field, "must be a multiple of " + std::to_string(r.multiple) + ", got " + std::to_string(value));
  });
}

void check_layer(int layer, int layers) {
  if (layer < 0 || layer >= layers) throw OutOfRangeError("layer", layer, 0, layers);
}

void check_tensor(const char* name, const TensorView& t, const std::array<int64_t, 3>& shape, DType dtype,
                  Device device) {
  const std::string n(name);
  for (int i = 0; i < 3; ++i)
    if (t.shape[size_t(i)] < 0)
      throw ShapeError(n, "shape[" + std::to_string(i) + "] = " + std::to_string(t.shape[size_t(i)]) + " is negative");
  if (t.device != device)
    throw DeviceError(n, std::string("is on ") + name_of(t.device) + ", the cache is on " + name_of(device));
  if (t.dtype != dtype)
    throw DtypeError(n, "is " + std::string(dtype_name(t.dtype)) + ", expected " + std::string(dtype_name(dtype)));
  if (t.shape != shape)
    throw ShapeError(n, "has shape [" + std::to_string(t.shape[0]) + ", " + std::to_string(t.shape[1]) + ", " +
                            std::to_string(t.shape[2]) + "], expected [" + std::to_string(shape[0]) + ", " +
                            std::to_string(shape[1]) + ", " + std::to_string(shape[2]) + "]");
  if (t.stride[2] != 1) throw ShapeError(n, "the last axis must be contiguous (stride 1), got " + std::to_string(t.stride[2]));
  if (shape[0] * shape[1] > 0 && t.data == nullptr) throw ArgumentError(n, "data is null");
}

void check_index_view(const char* name, const IndexView& v, DType dtype, int64_t min_size, Device device,
                      int64_t exact_size) {
  const std::string n(name);
  if (v.device != device)
    throw DeviceError(n, std::string("is on ") + name_of(v.device) + ", the cache is on " + name_of(device));
  if (v.dtype != dtype)
    throw DtypeError(n, "is " + std::string(dtype_name(v.dtype)) + ", expected " + std::string(dtype_name(dtype)));
  if (exact_size >= 0 && v.size != exact_size)
    throw ShapeError(n, "has " + std::to_string(v.size) + " entries, expected " + std::to_string(exact_size));
  if (v.size < min_size)
    throw ShapeError(n, "has " + std::to_string(v.size) + " entries, needs at least " + std::to_string(min_size));
  if (v.size > 0 && v.data == nullptr) throw ArgumentError(n, "data is null");
}

void check_targets_addressing(const TokenTargets& targets, bool paged, int64_t tokens) {
  // Targets of the other addressing would otherwise read as a dtype or size error of the array left out.
  const auto absent = [](const IndexView& v) { return v.data == nullptr && v.size == 0; };
  if (tokens == 0) return;
  if (paged) {
    if (absent(targets.slots))
      throw ArgumentError("targets.slots", std::string("missing: a paged layout addresses each token by slot "
                                                       "(page * page_size + offset, int64)") +
                                               (absent(targets.rows) && absent(targets.positions)
                                                    ? ""
                                                    : "; rows and positions address contiguous and ring layouts"));
    return;
  }
  for (const auto& [name, v] : {std::pair{"targets.rows", &targets.rows}, std::pair{"targets.positions", &targets.positions}})
    if (absent(*v))
      throw ArgumentError(name, std::string("missing: a contiguous or ring layout addresses each token by row and "
                                            "position (int32 each)") +
                                    (absent(targets.slots) ? "" : "; slots address paged layouts"));
}

void check_config(const VariantDescriptor& d, const CacheConfig& c) {
  std::string why;
  if (!backend_available(c.device, &why))
    throw DeviceError("config.device", std::string(name_of(c.device)) + " is not usable here: " + why);
  if (d.addressing == Addressing::paged) {
    const int64_t max_pages = INT32_MAX / d.page_size;
    if (c.pages < 1 || c.pages > max_pages)
      throw OutOfRangeError("config.pages", c.pages, 1, max_pages + 1, -1, "a paged cache needs pages");
  } else {
    if (c.rows < 1 || c.rows > INT32_MAX) throw OutOfRangeError("config.rows", c.rows, 1, INT32_MAX);
    if (d.addressing == Addressing::contiguous && (c.max_seq_len < 0 || c.max_seq_len > d.max_seq_len))
      throw OutOfRangeError("config.max_seq_len", c.max_seq_len, 0, int64_t(d.max_seq_len) + 1, -1,
                            std::string("0 means the model's ") + std::to_string(d.max_seq_len));
    if (d.addressing == Addressing::ring && c.max_seq_len != 0 && c.max_seq_len != d.window)
      throw OutOfRangeError("config.max_seq_len", c.max_seq_len, 0, 1, -1,
                            "a ring holds exactly its window of " + std::to_string(d.window) + " positions; pass 0");
  }
  if (c.max_staged_tokens < 0 || c.max_staged_tokens > INT32_MAX)
    throw OutOfRangeError("config.max_staged_tokens", c.max_staged_tokens, 0, int64_t(INT32_MAX) + 1);
  // Size before allocating: an absurd capacity is refused by name, never wrapped into a small pool.
  const bool paged = d.addressing == Addressing::paged;
  const int64_t tokens_per_unit = paged ? d.page_size
                                  : d.addressing == Addressing::ring ? d.window
                                  : c.max_seq_len ? c.max_seq_len : d.max_seq_len;
  const int64_t unit_bytes = std::max<int64_t>(1, tokens_per_unit * d.bytes_per_token);
  const int64_t max_units = std::max<int64_t>(1, kMaxPoolBytes / unit_bytes);
  const int64_t units = paged ? c.pages : c.rows;
  if (units > max_units)
    throw OutOfRangeError(paged ? "config.pages" : "config.rows", units, 1, max_units + 1, -1,
                          "the pool would exceed kvforge's limit of 2^48 bytes");
  if (d.update == UpdateMode::lazy) {
    const int64_t token_bytes = int64_t(2) * d.layers * d.heads * d.head_dim * dtype_size(d.input);
    const int64_t max_staged = kMaxPoolBytes / token_bytes;
    if (staged_capacity(d, c) > max_staged)
      throw OutOfRangeError("config.max_staged_tokens", c.max_staged_tokens, 0, max_staged + 1, -1,
                            "the staging buffers would exceed kvforge's limit of 2^48 bytes");
  }
}

Capacity capacity_of(const VariantDescriptor& d, const CacheConfig& c) {
  Capacity cap;
  switch (d.addressing) {
    case Addressing::contiguous:
      cap.rows = c.rows;
      cap.positions = c.max_seq_len ? c.max_seq_len : d.max_seq_len;
      break;
    case Addressing::ring:
      cap.rows = c.rows;
      cap.positions = d.window;
      break;
    case Addressing::paged:
      cap.pages = c.pages;
      break;
  }
  return cap;
}

int64_t staged_capacity(const VariantDescriptor& d, const CacheConfig& c) {
  if (c.max_staged_tokens) return c.max_staged_tokens;
  // Contiguous and ring: a decode step of every row. Paged: the pool's slots, up to a cap, since a
  // sequence manager's step may carry prefill chunks and one token per row would refuse them; the cap
  // keeps a large pool from doubling its memory in staging (set max_staged_tokens for more).
  return d.paged() ? std::min<int64_t>(c.pages * d.page_size, kDefaultPagedStagedTokens) : c.rows;
}

void check_pairs_disjoint_on_host(const int32_t* pairs, int64_t count) {
  std::unordered_set<int32_t> sources, targets;
  for (int64_t i = 0; i < count; ++i) sources.insert(pairs[2 * i]);
  for (int64_t i = 0; i < count; ++i) {
    const int32_t dst = pairs[2 * i + 1];
    if (!targets.insert(dst).second)
      throw ArgumentError("pairs", "page " + std::to_string(dst) + " is a destination twice (pair " +
                                       std::to_string(i) + "); the result would depend on ordering");
    if (sources.count(dst))
      throw ArgumentError("pairs", "page " + std::to_string(dst) + " is both a source and a destination (pair " +
                                       std::to_string(i) + "); copy through a free page instead");
  }
}

}  // namespace kvforge::detail
