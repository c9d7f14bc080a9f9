// TypedCache<Traits> whole: the class and every operation, as a generated variant instantiates it
// (typed_cache.hpp, and its operations by job in typed_cache_writes.hpp, typed_cache_gather.hpp,
// typed_cache_attend.hpp and typed_cache_upkeep.hpp).
#pragma once

#include "kvforge/detail/typed_cache.hpp"
#include "kvforge/detail/typed_cache_attend.hpp"
#include "kvforge/detail/typed_cache_gather.hpp"
#include "kvforge/detail/typed_cache_upkeep.hpp"
#include "kvforge/detail/typed_cache_writes.hpp"
