#include "kvforge/registry.hpp"

#include <algorithm>

#include "kvforge/generic.hpp"

namespace kvforge {

namespace {
size_t edit_distance(std::string_view a, std::string_view b) {
  std::vector<size_t> row(b.size() + 1);
  for (size_t j = 0; j <= b.size(); ++j) row[j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    size_t diagonal = row[0];
    row[0] = i;
    for (size_t j = 1; j <= b.size(); ++j) {
      const size_t up = row[j];
      row[j] = std::min({row[j] + 1, row[j - 1] + 1, diagonal + (a[i - 1] == b[j - 1] ? 0 : 1)});
      diagonal = up;
    }
  }
  return row[b.size()];
}
}  // namespace

Registry::Registry(std::vector<VariantEntry> entries) : entries_(std::move(entries)) {}

const VariantEntry* Registry::find(std::string_view name) const {
  for (const auto& e : entries_)
    if (name == e.descriptor->name) return &e;
  return nullptr;
}

std::vector<std::string> Registry::nearest(std::string_view name, size_t count) const {
  std::vector<std::pair<size_t, std::string>> scored;
  for (const auto& e : entries_) scored.emplace_back(edit_distance(name, e.descriptor->name), e.descriptor->name);
  std::sort(scored.begin(), scored.end());
  std::vector<std::string> out;
  for (size_t i = 0; i < scored.size() && i < count; ++i) out.push_back(scored[i].second);
  return out;
}

const VariantEntry& Registry::at(std::string_view name) const {
  if (const VariantEntry* e = find(name)) return *e;
  throw UnknownVariantError(std::string(name), nearest(name));
}

std::vector<const VariantEntry*> Registry::select(const VariantQuery& q) const {
  std::vector<const VariantEntry*> out;
  for (const auto& e : entries_) {
    const VariantDescriptor& d = *e.descriptor;
    if (!q.layout.empty() && q.layout != d.layout) continue;
    if (!q.model.empty() && q.model != d.model) continue;
    if (q.storage && *q.storage != d.storage) continue;
    if (q.input && *q.input != d.input) continue;
    if (!q.record.empty() && (!d.record_format || q.record != d.record_format->name)) continue;
    out.push_back(&e);
  }
  return out;
}

std::string variant_name(std::string_view layout, std::string_view model, std::string_view storage, DType input) {
  std::string name = std::string(layout) + "." + std::string(model) + "." + std::string(storage);
  if (dtype_name(input) != storage) name += "_in_" + std::string(dtype_name(input));
  return name;
}

std::string variant_name(std::string_view layout, std::string_view model, DType storage, DType input) {
  return variant_name(layout, model, dtype_name(storage), input);
}

std::optional<VariantDescriptor> Registry::synthesize(const VariantQuery& q) const {
  std::string why;
  return synthesize(q, why);
}

std::optional<VariantDescriptor> Registry::synthesize(const VariantQuery& q, std::string& why) const {
  // The layout's facts from any variant of that layout, the model's from any variant of that model.
  if (q.layout.empty() || q.model.empty() || !q.storage) {
    why = "it needs a layout, a model and a storage dtype";
    return std::nullopt;
  }
  const DType storage = *q.storage, input = q.input.value_or(storage);
  const VariantDescriptor* by_layout = nullptr;
  const VariantDescriptor* by_model = nullptr;
  for (const auto& e : entries_) {
    if (e.descriptor->is_hybrid()) continue;
    if (q.layout == e.descriptor->layout) by_layout = e.descriptor;
    if (q.model == e.descriptor->model) by_model = e.descriptor;
  }
  // A ring's window may follow the model, which a descriptor of another model cannot tell; and the
  // generic path stores floats only.
  if (!by_layout) why = "no registered variant has layout '" + q.layout + "'";
  else if (!by_model) why = "no registered variant has model '" + q.model + "'";
  else if (by_layout->addressing == Addressing::ring) why = "a ring's window may follow the model";
  else if (is_quantized(storage) || is_quantized(input)) why = "quantized storage needs a generated variant";
  if (!why.empty()) return std::nullopt;
  VariantDescriptor d = *by_layout;
  d.name = nullptr;  // the caller names it
  d.model = by_model->model;
  d.storage = storage;
  d.input = input;
  d.layers = by_model->layers;
  d.heads = by_model->heads;
  d.head_dim = by_model->head_dim;
  d.max_seq_len = by_model->max_seq_len;
  // Every other fact of the model too: the layout's variant may be of a shard, a hybrid or an MLA model.
  d.tensor_parallel = by_model->tensor_parallel;
  d.model_heads = by_model->model_heads;
  d.shard_of = by_model->shard_of;
  d.states = by_model->states;
  d.mla_kv_lora_rank = by_model->mla_kv_lora_rank;
  d.mla_rope_dim = by_model->mla_rope_dim;
  d.k_head_dim = by_model->k_head_dim;
  d.v_head_dim = by_model->v_head_dim;
  d.quant = Quant::none;  // the layout's other variants may be quantized; this one stores floats
  d.quant_group = 0;
  d.tensor_scaled = false;
  d.scale = DType::f32;
  d.scale_placement = ScalePlacement::separate;
  d.record_format = nullptr;  // nor records of its parts
  d.bytes_per_token = bytes_per_token(d.layers, d.heads, d.stored_dim(), d.storage, d.quant, d.scale, 1);
  return d;
}

std::unique_ptr<Cache> Registry::create(std::string_view name, const CacheConfig& config) const {
  return at(name).create(config);
}

std::unique_ptr<Cache> Registry::create(const VariantQuery& q, const CacheConfig& config) const {
  const auto matches = select(q);
  if (matches.size() == 1) return matches[0]->create(config);
  // The query as a name, with the input dtype where it is given (storage int8 from bf16 input reads
  // *.*.int8_in_bf16, as the variant would be named).
  const std::string layout = q.layout.empty() ? "*" : q.layout, model = q.model.empty() ? "*" : q.model;
  std::string described = q.storage ? variant_name(layout, model, *q.storage, q.input.value_or(*q.storage))
                                    : layout + "." + model + ".*" + (q.input ? "_in_" + std::string(dtype_name(*q.input)) : "");
  std::string why;
  if (matches.empty()) {
    // Not generated: the generic runtime-strided path serves it where it can, and says so through
    // descriptor().generic. Where it cannot, the error says why.
    std::optional<VariantDescriptor> d = synthesize(q, why);
    if (d) why = generic_unsupported_reason(*d, config);
    if (d && why.empty()) {
      const std::string name = variant_name(d->layout, d->model, d->storage_name(), d->input);
      d->name = name.c_str();  // make_generic_cache copies the strings
      return make_generic_cache(*d, config);
    }
  }
  std::vector<std::string> names;
  for (const auto* m : matches) names.emplace_back(m->descriptor->name);
  if (names.empty()) names = nearest(described);
  if (!matches.empty()) described += " (ambiguous: " + std::to_string(matches.size()) + " match)";
  else described += " (not generated, and no generic path: " + why + ")";
  throw UnknownVariantError(described, names);
}

}  // namespace kvforge
