// The generic path's caches of float storage (generic_path.hpp).
#include "caches/generic_path.hpp"

template std::unique_ptr<kvforge::Cache> kvforge::generic_path::generic_cache_of<float>(
    std::shared_ptr<const OwnedDescriptor>, const CacheConfig&);
