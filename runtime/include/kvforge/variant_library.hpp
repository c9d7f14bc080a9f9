// Variant libraries loaded while a program runs: a shared library of generated variants (built on
// demand by kvforge.variant(), or a downstream kvforge_generate() target built SHARED) joins the
// variants the program was linked with. See docs/on_demand.md.
#pragma once

#include <string>

#include "kvforge/registry.hpp"

namespace kvforge {

// Loads the shared library at `path` (local symbols: two libraries may hold variants of one name) and
// returns the registry its generated registry.cpp defines for `registry_function` (kvforge_generate's
// REGISTRY_FUNCTION). Loading a path again returns the first load's registry. The library stays loaded
// for the life of the process. Throws ArgumentError naming `path` where the library cannot be loaded
// (the loader's own words), or `registry_function` where it defines no such registry.
const Registry& load_variants(const std::string& path, const std::string& registry_function = "kvforge::registry");

// The C symbol through which load_variants() finds a registry: kvforge_registry__<name with :: as __>
// (codegen/templates/registry.cpp.j2 defines it beside the registry function).
std::string registry_symbol(const std::string& registry_function);

// `first`'s variants, then each of `more`'s whose name `first` does not already have.
Registry merged(const Registry& first, const Registry& more);

}  // namespace kvforge
