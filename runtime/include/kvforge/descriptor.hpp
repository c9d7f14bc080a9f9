// What the spec fixed about a variant: its addressing, axes, shape, dtypes, quantization and launch
// parameters. A generated traits struct holds these as named constants; describe<Traits>() builds the
// descriptor from them field by field, so a field can never land in the wrong slot.
#pragma once

#include <array>
#include <cstdint>
#include <iterator>
#include <type_traits>

#include "kvforge/dtype.hpp"
#include "kvforge/quant.hpp"
#include "kvforge/record_format.hpp"
#include "kvforge/vocab.hpp"

namespace kvforge {

struct HybridDescriptor;  // hybrid_cache.hpp: the layer groups of a hybrid variant

// One part of a hybrid model's per-sequence state as its spec states it (StatePart at run time).
struct StatePartSpec {
  const char* name;
  int rank;
  int64_t shape[4];  // the first `rank` extents (a shard model's: one rank's)
  DType dtype;
  // How tensor parallelism splits it (the model spec's shard_axis): the axis each rank holds
  // extent / degree of, kWhole where every rank holds it whole, kShapesPerDegree where the spec gives
  // each degree's shape (shard_shapes), which only a group of the same degree can take.
  int shard_axis = kWhole;
  static constexpr int kWhole = -1, kShapesPerDegree = -2;
};

// The order of a state pool's memory, outermost first: a permutation of slot, layer and part.
using StateAxes = std::array<StateAxis, 3>;
inline constexpr StateAxes kSlotMajor{StateAxis::slot, StateAxis::layer, StateAxis::part};

// A model spec's `linear_layers`: which of its layers keep a state per sequence instead of K/V, and that
// state's record. Its variants hold the other, attention, layers.
struct StateRecord {
  int model_layers;
  int num_linear;
  const int* linear_layers;  // [num_linear], ascending
  int num_parts;
  const StatePartSpec* parts;  // [num_parts]
};

// Everything the spec fixed about a variant. Generated as a constexpr per variant.
struct VariantDescriptor {
  const char* name;
  const char* layout;
  const char* model;
  DType storage;
  DType input;
  Addressing addressing;
  UpdateMode update;
  int layers;
  int heads;
  int head_dim;
  int page_size;    // paged only, else 0
  int window;       // ring only, else 0
  int max_seq_len;  // the model's
  int num_axes;
  Axis axes[kNumAxes];
  int64_t bytes_per_token;  // K and V of all layers for one token, scales included (bytes_per_token())
  Quant quant = Quant::none;  // quantized storage only
  int quant_group = 0;        // per_group: values of a head's row that share a scale; else 0
  bool tensor_scaled = false; // per_group under a second-level fp32 scale per layer and K/V (NVFP4)
  DType scale = DType::f32;
  ScalePlacement scale_placement = ScalePlacement::separate;
  const HybridDescriptor* hybrid = nullptr;  // hybrid variants: one member per layer group
  bool generic = false;                      // served by the generic runtime-strided path
  Tuning tuning = {};
  // A shard (a model spec's tensor_parallel): one rank's slice of the model `shard_of`, whose
  // `model_heads` KV heads are split over `tensor_parallel` ranks (shard.hpp). A whole model: 1, its
  // own heads, null.
  int tensor_parallel = 1;
  int model_heads = 0;
  const char* shard_of = nullptr;
  const StateRecord* states = nullptr;  // a hybrid model with linear layers; `layers` counts its attention layers
  StateAxes state_axes = kSlotMajor;     // the layout's order of a state pool of its own (`state_axes`)
  // An MLA model (a model spec's `mla`): each token caches a latent record of mla_kv_lora_rank values
  // then mla_rope_dim RoPE values, stored as one head whose K is the record's first half and V its
  // second (head_dim = half the record, rounded up: an odd record's last stored value is a zero pad;
  // record_halves in cache.hpp splits one). 0 for a K/V model.
  int mla_kv_lora_rank = 0;
  int mla_rope_dim = 0;
  // K and V of different widths (a model spec's `v_head_dim`): each head's record, k_head_dim values of K
  // then v_head_dim of V, is stored as an MLA record is (head_dim = half the record). 0 where K and V
  // are one width.
  int k_head_dim = 0;
  int v_head_dim = 0;
  // A record format's variants (storage DType::record): the parts of each head's record and their bytes.
  const RecordFormat* record_format = nullptr;

  constexpr bool has_axis(Axis a) const {
    for (int i = 0; i < num_axes; ++i)
      if (axes[i] == a) return true;
    return false;
  }
  constexpr bool paged() const { return addressing == Addressing::paged; }
  constexpr bool stacked() const { return has_axis(Axis::layer); }
  constexpr bool kv_fused() const { return has_axis(Axis::kv); }
  constexpr bool quantized() const { return quant != Quant::none; }
  constexpr bool lazy() const { return update == UpdateMode::lazy; }
  constexpr bool is_hybrid() const { return hybrid != nullptr; }
  constexpr bool mla() const { return mla_kv_lora_rank > 0; }
  constexpr bool split_widths() const { return k_head_dim > 0; }
  // Whether each head's token is one record whose halves are the stored K and V (append_record).
  constexpr bool records() const { return mla() || split_widths(); }
  // The two parts of that record: the MLA latent's (kv_lora_rank, rope), or K's and V's widths; 0, 0
  // for K and V of head_dim each. And which of the three kinds (0, 1 MLA, 2 widths) it is.
  constexpr int record_first() const { return mla() ? mla_kv_lora_rank : k_head_dim; }
  constexpr int record_second() const { return mla() ? mla_rope_dim : v_head_dim; }
  constexpr int record_kind() const { return mla() ? 1 : split_widths() ? 2 : 0; }
  // Values of a head's record as the caller sees it; one less than the stored 2 * head_dim where it is odd.
  constexpr int record_width() const { return records() ? record_first() + record_second() : 2 * head_dim; }
  // Whether set_tensor_scale applies: a per_tensor layout's scales, or a tensor-scaled one's second level.
  constexpr bool takes_tensor_scale() const { return quant == Quant::per_tensor || tensor_scaled; }
  // Those scales' bytes, a fixed cost beside the tokens' (at most: a tensor-scaled layout's fp32 scales
  // follow its group scales on a 4-byte boundary, up to 3 bytes after them).
  constexpr int64_t tensor_scale_bytes() const {
    return quant == Quant::per_tensor ? int64_t(2) * layers * dtype_size(scale)
           : tensor_scaled            ? int64_t(2) * layers * 4 + 3
                                      : 0;
  }
  constexpr bool scales_in_page() const { return quantized() && scale_placement == ScalePlacement::in_page; }
  // Scales of one head's row: head_dim / quant_group for per_group, else 1. A head's groups are adjacent
  // in the scales, as its values are in the pool (`dim` is every layout's last axis).
  constexpr int scale_groups() const { return quant == Quant::per_group ? head_dim / quant_group : 1; }
  // Stored elements of a head's row in the pool: what its `dim` axis counts (stored_row).
  constexpr int stored_dim() const {
    return stored_row(storage, head_dim, record_format ? record_format->stored_row() : 0);
  }
  // Whether tokens are records of named parts, coded whole (record_format.hpp).
  constexpr bool coded_records() const { return record_format != nullptr; }
  // Whether their scales follow the page's records (an fp8 index key's page): no row of the pool is then
  // a token's whole record.
  constexpr bool page_end_scales() const { return record_format && record_format->page_end_scales(); }
  // The name its expansions give the storage: the record format's, or the dtype's.
  constexpr const char* storage_name() const { return record_format ? record_format->name : dtype_name(storage).data(); }
  // Whether the pool holds values element for element, with no scales (what the physical transfer
  // format moves): not codes, and not records coded whole.
  constexpr bool plain_values() const { return !quantized() && !coded_records(); }
};

// Bytes one token of one sequence occupies: K and V of every layer and head, and their dynamic scales.
// The one formula; `kvforge-codegen list` prints the same figure, and a test holds the two equal.
// `row` is the stored elements of a head's row (stored_row).
constexpr int64_t bytes_per_token(int layers, int heads, int row, DType storage, Quant quant, DType scale,
                                  int scale_groups) {
  return int64_t(2) * layers * (int64_t(heads) * row * dtype_size(storage) +
                                int64_t(scales_per_token(quant, heads, scale_groups)) * dtype_size(scale));
}

// A per_group layout's traits state its group (variant.hpp.j2); traits written by hand may say nothing.
template <class T, class = void> struct quant_group_of {
  static constexpr int value = 0;
};
template <class T> struct quant_group_of<T, std::void_t<decltype(T::quant_group)>> {
  static constexpr int value = T::quant_group;
};

// A tensor-scaled layout's traits say so (variant.hpp.j2); others may say nothing.
template <class T, class = void> struct tensor_scaled_of : std::false_type {};
template <class T> struct tensor_scaled_of<T, std::void_t<decltype(T::tensor_scaled)>> : std::bool_constant<T::tensor_scaled> {};

// A shard's traits state its degree (variant.hpp.j2); a whole model's say nothing.
template <class T, class = void> struct shard_traits {
  static constexpr int tensor_parallel = 1;
  static constexpr int model_heads = T::heads;
  static constexpr const char* shard_of = nullptr;
};
template <class T> struct shard_traits<T, std::void_t<decltype(T::tensor_parallel)>> {
  static constexpr int tensor_parallel = T::tensor_parallel;
  static constexpr int model_heads = T::model_heads;
  static constexpr const char* shard_of = T::shard_of;
};

// A model with linear layers states them (variant.hpp.j2); another says nothing.
template <class T, class = void> struct state_traits {
  static constexpr const StateRecord* record = nullptr;
};
template <class T, class = void> struct state_axes_of {
  static constexpr StateAxes value = kSlotMajor;
};
template <class T> struct state_axes_of<T, std::void_t<decltype(T::state_axes)>> {
  static constexpr StateAxes value{T::state_axes[0], T::state_axes[1], T::state_axes[2]};
};
template <class T> struct state_traits<T, std::void_t<decltype(T::state_parts)>> {
  static constexpr StateRecord value{T::model_layers, int(std::size(T::linear_layers)), T::linear_layers,
                                     int(std::size(T::state_parts)), T::state_parts};
  static constexpr const StateRecord* record = &value;
};

// An MLA model states its latent record (variant.hpp.j2); a K/V model says nothing.
template <class T, class = void> struct mla_traits {
  static constexpr int kv_lora_rank = 0;
  static constexpr int rope_dim = 0;
};
template <class T> struct mla_traits<T, std::void_t<decltype(T::mla_kv_lora_rank)>> {
  static constexpr int kv_lora_rank = T::mla_kv_lora_rank;
  static constexpr int rope_dim = T::mla_rope_dim;
  static_assert((kv_lora_rank + rope_dim + 1) / 2 == T::head_dim, "an MLA record is the K and V of one head");
};

// A record format's variant states its parts (variant.hpp.j2); another says nothing.
template <class T, class = void> struct record_traits {
  static constexpr const RecordFormat* format = nullptr;
};
template <class T> struct record_traits<T, std::void_t<decltype(T::record_parts)>> {
  static constexpr RecordFormat value{T::record_name, int(std::size(T::record_parts)), T::record_parts,
                                      T::record_values, T::record_bytes, T::record_tail_bytes};
  static constexpr const RecordFormat* format = &value;
};

// A model whose K and V differ in width states both (variant.hpp.j2); another says nothing.
template <class T, class = void> struct kv_width_traits {
  static constexpr int k_head_dim = 0;
  static constexpr int v_head_dim = 0;
};
template <class T> struct kv_width_traits<T, std::void_t<decltype(T::v_head_dim)>> {
  static constexpr int k_head_dim = T::k_head_dim;
  static constexpr int v_head_dim = T::v_head_dim;
  static_assert((k_head_dim + v_head_dim + 1) / 2 == T::head_dim, "a head's K and V are the halves of its record");
};

// What every generated traits struct states, hybrid or not: names, dtypes, the model's shape and the
// launch parameters (variant.hpp.j2's `common`).
template <class T> constexpr VariantDescriptor describe_common() {
  VariantDescriptor d{};
  d.name = T::name;
  d.layout = T::layout;
  d.model = T::model;
  d.storage = dtype_of<typename T::storage_t>::value;
  d.input = dtype_of<typename T::input_t>::value;
  d.layers = T::layers;
  d.heads = T::heads;
  d.head_dim = T::head_dim;
  d.max_seq_len = T::max_seq_len;
  d.tuning = tuning_of<T>();
  d.tensor_parallel = shard_traits<T>::tensor_parallel;
  d.model_heads = shard_traits<T>::model_heads;
  d.shard_of = shard_traits<T>::shard_of;
  d.states = state_traits<T>::record;
  d.mla_kv_lora_rank = mla_traits<T>::kv_lora_rank;
  d.mla_rope_dim = mla_traits<T>::rope_dim;
  d.k_head_dim = kv_width_traits<T>::k_head_dim;
  d.v_head_dim = kv_width_traits<T>::v_head_dim;
  d.record_format = record_traits<T>::format;
  return d;
}

// The descriptor of a generated variant, from its traits' named constants (see variant.hpp.j2).
template <class T> constexpr VariantDescriptor describe() {
  VariantDescriptor d = describe_common<T>();
  d.addressing = T::addressing;
  d.update = T::update;
  d.page_size = T::page_size;
  d.window = T::window;
  d.num_axes = int(std::size(T::axes));
  for (int i = 0; i < d.num_axes; ++i) d.axes[i] = T::axes[i];
  d.quant = T::quant;
  d.scale = d.quant == Quant::none ? DType::f32 : dtype_of<typename T::scale_t>::value;
  d.quant_group = quant_group_of<T>::value;
  d.tensor_scaled = tensor_scaled_of<T>::value;
  d.scale_placement = T::scale_placement;
  d.state_axes = state_axes_of<T>::value;
  d.bytes_per_token = bytes_per_token(d.layers, d.heads, d.stored_dim(), d.storage, d.quant, d.scale, d.scale_groups());
  return d;
}

// Every variant's descriptor, one object per program: Traits::describe() runs where the traits struct
// is complete.
template <class T> inline constexpr VariantDescriptor descriptor_of = T::describe();

}  // namespace kvforge
