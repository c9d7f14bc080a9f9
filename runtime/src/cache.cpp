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

LatentHalves latent_halves(const VariantDescriptor& d, const TensorView& latent, const char* arg) {
  if (!d.mla())
    throw UnsupportedError(std::string(arg) + ": " + d.name + " caches K and V, not an MLA latent record; "
                           "append and gather take them");
  const int64_t width = 2 * int64_t(d.head_dim);
  if (latent.shape[2] != width || latent.stride[2] != 1)
    throw ShapeError(arg, "its last axis holds " + std::to_string(latent.shape[2]) +
                     " values with stride " + std::to_string(latent.stride[2]) + ", " + d.name +
                     "'s record is " + std::to_string(d.mla_kv_lora_rank) + " + " + std::to_string(d.mla_rope_dim) +
                     " = " + std::to_string(width) + " contiguous values");
  if (latent.dtype != d.input)
    throw DtypeError(arg, "is " + std::string(dtype_name(latent.dtype)) + ", " + d.name + " takes " +
                     std::string(dtype_name(d.input)));
  LatentHalves h{latent, latent};
  h.k.shape[2] = h.v.shape[2] = d.head_dim;
  h.v.data = static_cast<char*>(latent.data) + d.head_dim * dtype_size(latent.dtype);
  return h;
}

void Cache::append_latent(int layer, const TensorView& latent, const TokenTargets& targets) {
  const LatentHalves h = latent_halves(descriptor(), latent, "latent");
  if (latent.shape[1] != 1)
    throw ShapeError("latent", "has " + std::to_string(latent.shape[1]) + " heads; an MLA record has one ([T, 1, R + P])");
  append(layer, h.k, h.v, targets);
}

void Cache::gather_latent(int layer, const GatherRange& range, const TensorView& latent_out) {
  const LatentHalves h = latent_halves(descriptor(), latent_out, "latent_out");
  if (latent_out.shape[0] != 1)
    throw ShapeError("latent_out", "has " + std::to_string(latent_out.shape[0]) +
                     " heads; an MLA record has one ([1, end - begin, R + P])");
  if (range.end >= range.begin && latent_out.shape[1] != range.end - range.begin)
    throw ShapeError("latent_out", "holds " + std::to_string(latent_out.shape[1]) + " positions, the range [" +
                     std::to_string(range.begin) + ", " + std::to_string(range.end) + ") reads " +
                     std::to_string(range.end - range.begin));
  gather(layer, range, h.k, h.v);
}

}  // namespace kvforge
