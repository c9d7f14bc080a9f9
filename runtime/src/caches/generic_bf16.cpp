// The generic path's caches of bf16 storage (generic_path.hpp).
#include "caches/generic_path.hpp"

template std::unique_ptr<kvforge::Cache> kvforge::generic_path::generic_cache_of<kvforge::bf16>(
    std::shared_ptr<const OwnedDescriptor>, const CacheConfig&);
