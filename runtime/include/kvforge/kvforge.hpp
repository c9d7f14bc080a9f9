// Everything a user of kvforge includes.
#pragma once

#include "kvforge/backend.hpp"
#include "kvforge/cache.hpp"
#include "kvforge/cpu_level.hpp"
#include "kvforge/dtype.hpp"
#include "kvforge/errors.hpp"
#include "kvforge/generic.hpp"
#include "kvforge/hybrid.hpp"
#include "kvforge/descriptor.hpp"
#include "kvforge/geometry.hpp"
#include "kvforge/memory.hpp"
#include "kvforge/on_demand.hpp"
#include "kvforge/registry.hpp"
#include "kvforge/state_pool.hpp"
#include "kvforge/state_slots.hpp"
#include "kvforge/tensor.hpp"
#include "kvforge/variant_library.hpp"
