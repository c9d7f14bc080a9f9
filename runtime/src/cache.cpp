#include "kvforge/cache.hpp"

#include <string>

namespace kvforge {

// The defaults for every cache that is not hybrid: one group, itself.
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
                     std::to_string(d.record_second()) + " = " + std::to_string(width) + " contiguous values");
  if (record.dtype != d.input)
    throw DtypeError(arg, "is " + std::string(dtype_name(record.dtype)) + ", " + d.name + " takes " +
                     std::string(dtype_name(d.input)));
  RecordHalves h{record, record};
  h.k.shape[2] = h.v.shape[2] = d.head_dim;
  h.v.data = static_cast<char*>(record.data) + d.head_dim * dtype_size(record.dtype);
  return h;
}

std::optional<RecordView> record_view(const Cache& cache, int layer) {
  const VariantDescriptor& d = cache.descriptor();
  const LayerView v = cache.view(layer);
  const int64_t size = dtype_size(v.dtype);
  if (!d.records() || v.quant != Quant::none ||
      static_cast<const char*>(v.v) - static_cast<const char*>(v.k) != int64_t(v.stored_dim) * size)
    return std::nullopt;
  RecordView r;
  r.record = v.k;
  r.dtype = v.dtype, r.device = v.device, r.strides = v.strides;
  r.rows_or_pages = v.rows_or_pages, r.seq_or_slots = v.seq_or_slots, r.heads = v.heads;
  if (d.flashmla_records()) {  // bytes of mixed types: the record is one part
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

void Cache::append_latent(int layer, const TensorView& latent, const TokenTargets& targets) {
  require_mla(descriptor(), "latent");
  if (latent.shape[1] != 1)
    throw ShapeError("latent", "has " + std::to_string(latent.shape[1]) + " heads; an MLA record has one ([T, 1, R + P])");
  append_record(layer, latent, targets, "latent");
}

void Cache::gather_latent(int layer, const GatherRange& range, const TensorView& latent_out) {
  require_mla(descriptor(), "latent_out");
  if (latent_out.shape[0] != 1)
    throw ShapeError("latent_out", "has " + std::to_string(latent_out.shape[0]) +
                     " heads; an MLA record has one ([1, end - begin, R + P])");
  gather_record(layer, range, latent_out, "latent_out");
}

void Cache::append_record(int layer, const TensorView& record, const TokenTargets& targets, const char* arg) {
  const RecordHalves h = record_halves(descriptor(), record, arg);
  append(layer, h.k, h.v, targets);
}

void Cache::gather_record(int layer, const GatherRange& range, const TensorView& record_out, const char* arg) {
  const RecordHalves h = record_halves(descriptor(), record_out, arg);
  if (range.end >= range.begin && record_out.shape[1] != range.end - range.begin)
    throw ShapeError(arg, "holds " + std::to_string(record_out.shape[1]) + " positions, the range [" +
                     std::to_string(range.begin) + ", " + std::to_string(range.end) + ") reads " +
                     std::to_string(range.end - range.begin));
  gather(layer, range, h.k, h.v);
}

}  // namespace kvforge
