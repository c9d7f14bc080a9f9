#include "kvforge/cache.hpp"

#include "kvforge/backend.hpp"
#include "kvforge/detail/checks.hpp"
#include "kvforge/errors.hpp"

#include <string>

namespace kvforge {

// The defaults for every cache that is not hybrid: one group, itself.
int Cache::num_groups() const { return 1; }
Cache& Cache::group(int g) {
  if (g != 0) throw OutOfRangeError("group", g, 0, 1);
  return *this;
}
int Cache::group_of(int layer) const {
  if (layer < 0 || layer >= descriptor().layers) throw OutOfRangeError("layer", layer, 0, descriptor().layers);
  return 0;
}
int Cache::group_layer(int layer) const { return group_of(layer), layer; }

RecordHalves record_halves(const VariantDescriptor& d, const TensorView& record, const char* arg) {
  if (!d.records())
    throw UnsupportedError(std::string(arg) + ": " + d.name + " caches K and V of one width, not a record a "
                           "head; append and gather take them");
  const int64_t width = 2 * int64_t(d.head_dim);
  const std::string what = d.mla() ? "MLA record" : "record of K then V";
  if (record.shape[2] != width || record.stride[2] != 1)
    throw ShapeError(arg, "its last axis holds " + std::to_string(record.shape[2]) +
                     " values with stride " + std::to_string(record.stride[2]) + ", " + d.name +
                     "'s " + what + " is " + std::to_string(d.record_first()) + " + " +
                     std::to_string(d.record_second()) + " = " + std::to_string(d.record_width()) +
                     " contiguous values" + (d.record_width() < width ? " (or " + std::to_string(width) +
                     " with its pad)" : ""));
  if (record.dtype != d.input)
    throw DtypeError(arg, "is " + std::string(dtype_name(record.dtype)) + ", " + d.name + " takes " +
                     std::string(dtype_name(d.input)));
  RecordHalves h{record, record};
  h.k.shape[2] = h.v.shape[2] = d.head_dim;
  h.v.data = static_cast<char*>(record.data) + d.head_dim * dtype_size(record.dtype);
  return h;
}

namespace {

// A record of odd width is stored with one value of zero padding at its end, so that its halves are
// K and V of one width. A caller's records of the odd width go through this buffer of whole stored
// records [A, B, 2 * head_dim] on their device: copied in before an append, gathered into and copied
// out after a gather, a copy a record. Only such models pay it; records given with their pad do not.
class PaddedRecords {
 public:
  PaddedRecords(const VariantDescriptor& d, const TensorView& caller, Device device, const char* arg)
      : backend_(kvforge::backend(device)), width_(d.record_width()), stored_(2 * int64_t(d.head_dim)) {
    // The checks an append or gather makes of its tensors, before the copy that would read this one.
    detail::check_tensor(arg, caller, {caller.shape[0], caller.shape[1], width_}, d.input, device);
    staged_ = caller;
    staged_.shape[2] = stored_;
    staged_.stride = {caller.shape[1] * stored_, stored_, 1};
    const int64_t bytes = caller.shape[0] * caller.shape[1] * stored_ * dtype_size(caller.dtype);
    staged_.data = bytes > 0 ? backend_.allocate(bytes) : nullptr;  // zero-filled: the pads
  }
  ~PaddedRecords() {
    if (staged_.data) backend_.release(staged_.data);
  }
  PaddedRecords(const PaddedRecords&) = delete;
  PaddedRecords& operator=(const PaddedRecords&) = delete;

  const TensorView& staged() const { return staged_; }
  void copy_in(const TensorView& from) { move(from, true); }
  void copy_out(const TensorView& to) { move(to, false); }

 private:
  void move(const TensorView& caller, bool in) {
    const int64_t size = dtype_size(caller.dtype);
    for (int64_t a = 0; a < caller.shape[0]; ++a)
      for (int64_t b = 0; b < caller.shape[1]; ++b) {
        char* s = static_cast<char*>(staged_.data) + ((a * caller.shape[1] + b) * stored_) * size;
        char* c = static_cast<char*>(caller.data) + (a * caller.stride[0] + b * caller.stride[1]) * size;
        in ? backend_.copy(s, c, width_ * size, nullptr) : backend_.copy(c, s, width_ * size, nullptr);
      }
    backend_.synchronize(nullptr);
  }

  Backend& backend_;
  int64_t width_, stored_;
  TensorView staged_;
};

bool needs_pad(const VariantDescriptor& d, const TensorView& record) {
  return d.records() && d.record_width() % 2 && record.shape[2] == d.record_width() && record.stride[2] == 1;
}

}  // namespace

std::optional<RecordView> record_view(const Cache& cache, int layer) {
  const VariantDescriptor& d = cache.descriptor();
  const LayerView v = cache.view(layer);
  const int64_t size = dtype_size(v.dtype);
  if (!(d.records() || d.coded_records()) || v.quant != Quant::none ||
      static_cast<const char*>(v.v) - static_cast<const char*>(v.k) != int64_t(v.stored_dim) * size)
    return std::nullopt;
  RecordView r;
  r.record = v.k;
  r.dtype = v.dtype, r.device = v.device, r.strides = v.strides;
  r.rows_or_pages = v.rows_or_pages, r.seq_or_slots = v.seq_or_slots, r.heads = v.heads;
  if (d.coded_records()) {  // bytes of mixed types: the record is one part (views name its parts)
    r.first_width = 2 * v.stored_dim;
    return r;
  }
  r.second = static_cast<const char*>(v.k) + int64_t(d.record_first()) * size;
  r.first_width = d.record_first(), r.second_width = d.record_second();
  return r;
}

// The latent calls are the record calls of an MLA variant, whose record has one head.
static void require_mla(const VariantDescriptor& d, const char* arg) {
  if (!d.mla())
    throw UnsupportedError(std::string(arg) + ": " + d.name + " caches K and V, not an MLA latent record; " +
                           (d.records() ? "append_record and gather_record take each head's K then V"
                                        : "append and gather take them"));
}

// A record's halves through append and gather, every check and error naming `arg`.
static void append_halves(Cache& cache, int layer, const TensorView& record, const TokenTargets& targets,
                          const char* arg) {
  const VariantDescriptor& d = cache.descriptor();
  if (needs_pad(d, record)) {
    PaddedRecords padded(d, record, cache.config().device, arg);
    const RecordHalves h = record_halves(d, padded.staged(), arg);
    padded.copy_in(record);
    cache.append(layer, h.k, h.v, targets);
    cache.synchronize();  // the append has read the buffer before it goes
    return;
  }
  const RecordHalves h = record_halves(d, record, arg);
  cache.append(layer, h.k, h.v, targets);
}

static void gather_halves(Cache& cache, int layer, const GatherRange& range, const TensorView& record_out,
                          const char* arg) {
  const VariantDescriptor& d = cache.descriptor();
  if (range.end >= range.begin && record_out.shape[1] != range.end - range.begin)
    throw ShapeError(arg, "holds " + std::to_string(record_out.shape[1]) + " positions, the range [" +
                     std::to_string(range.begin) + ", " + std::to_string(range.end) + ") reads " +
                     std::to_string(range.end - range.begin));
  if (needs_pad(d, record_out)) {
    PaddedRecords padded(d, record_out, cache.config().device, arg);
    const RecordHalves h = record_halves(d, padded.staged(), arg);
    cache.gather(layer, range, h.k, h.v);
    cache.synchronize();
    padded.copy_out(record_out);
    return;
  }
  const RecordHalves h = record_halves(d, record_out, arg);
  cache.gather(layer, range, h.k, h.v);
}

void Cache::append_record(int layer, const TensorView& record, const TokenTargets& targets) {
  append_halves(*this, layer, record, targets, "record");
}

void Cache::gather_record(int layer, const GatherRange& range, const TensorView& record_out) {
  gather_halves(*this, layer, range, record_out, "record_out");
}

void Cache::append_latent(int layer, const TensorView& latent, const TokenTargets& targets) {
  require_mla(descriptor(), "latent");
  if (latent.shape[1] != 1)
    throw ShapeError("latent", "has " + std::to_string(latent.shape[1]) + " heads; an MLA record has one ([T, 1, R + P])");
  append_halves(*this, layer, latent, targets, "latent");
}

void Cache::gather_latent(int layer, const GatherRange& range, const TensorView& latent_out) {
  require_mla(descriptor(), "latent_out");
  if (latent_out.shape[0] != 1)
    throw ShapeError("latent_out", "has " + std::to_string(latent_out.shape[0]) +
                     " heads; an MLA record has one ([1, end - begin, R + P])");
  gather_halves(*this, layer, range, latent_out, "latent_out");
}

}  // namespace kvforge
