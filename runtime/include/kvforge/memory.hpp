// Owning the pages of a paged or blocked cache, one unit a header: the block allocator, the prefix
// cache, the sequence manager and memory planning. See docs/memory.md.
#pragma once

#include "kvforge/block_allocator.hpp"
#include "kvforge/memory_plan.hpp"
#include "kvforge/prefix_cache.hpp"
#include "kvforge/sequence_manager.hpp"
