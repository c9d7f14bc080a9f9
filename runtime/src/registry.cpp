#include "kvforge/registry.hpp"

#include <algorithm>

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
    out.push_back(&e);
  }
  return out;
}

std::unique_ptr<Cache> Registry::create(std::string_view name, const CacheConfig& config) const {
  return at(name).create(config);
}

std::unique_ptr<Cache> Registry::create(const VariantQuery& q, const CacheConfig& config) const {
  const auto matches = select(q);
  if (matches.size() == 1) return matches[0]->create(config);
  std::string described = q.layout.empty() ? "*" : q.layout;
  described += "." + (q.model.empty() ? std::string("*") : q.model) + "." +
               (q.storage ? std::string(dtype_name(*q.storage)) : std::string("*"));
  std::vector<std::string> names;
  for (const auto* m : matches) names.emplace_back(m->descriptor->name);
  if (names.empty()) names = nearest(described);
  throw UnknownVariantError(described + (matches.empty() ? "" : " (ambiguous: " + std::to_string(matches.size()) + " match)"),
                            names);
}

}  // namespace kvforge
