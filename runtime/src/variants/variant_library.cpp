#include "kvforge/variant_library.hpp"

#include <dlfcn.h>

#include <map>
#include <mutex>

#include "kvforge/errors.hpp"

namespace kvforge {

std::string registry_symbol(const std::string& registry_function) {
  std::string symbol = "kvforge_registry__";
  for (size_t i = 0; i < registry_function.size(); ++i) {
    if (registry_function.compare(i, 2, "::") == 0) {
      symbol += "__";
      ++i;
    } else {
      symbol += registry_function[i];
    }
  }
  return symbol;
}

const Registry& load_variants(const std::string& path, const std::string& registry_function) {
  static std::mutex lock;
  static std::map<std::pair<std::string, std::string>, const Registry*> loaded;
  const std::lock_guard<std::mutex> hold(lock);
  const auto key = std::make_pair(path, registry_function);
  if (auto it = loaded.find(key); it != loaded.end()) return *it->second;
  void* library = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (library == nullptr) {
    const char* why = dlerror();
    throw ArgumentError("path", path + ": cannot be loaded: " + (why ? why : "unknown reason"));
  }
  using Accessor = const Registry* (*)();
  const std::string symbol = registry_symbol(registry_function);
  auto accessor = reinterpret_cast<Accessor>(dlsym(library, symbol.c_str()));
  if (accessor == nullptr) {
    dlclose(library);
    throw ArgumentError("registry_function", path + " defines no registry '" + registry_function + "' (no symbol " +
                                                 symbol + "; kvforge_generate's REGISTRY_FUNCTION names it)");
  }
  const Registry* r = accessor();
  loaded.emplace(key, r);
  return *r;
}

Registry merged(const Registry& first, const Registry& more) {
  std::vector<VariantEntry> entries = first.variants();
  for (const VariantEntry& e : more.variants())
    if (first.find(e.descriptor->name) == nullptr) entries.push_back(e);
  return Registry(std::move(entries));
}

}  // namespace kvforge
