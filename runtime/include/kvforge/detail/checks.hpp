// The argument checks every cache implementation shares (runtime/src/caches/checks.cpp). Each throws a
// typed error naming the argument before anything is written.
#pragma once

#include <array>
#include <cstdint>

#include "kvforge/cache.hpp"
#include "kvforge/detail/host_checks.hpp"
#include "kvforge/detail/op_args.hpp"

namespace kvforge::detail {

void check_layer(int layer, int layers);
void check_tensor(const char* name, const TensorView& t, const std::array<int64_t, 3>& shape, DType dtype,
                  Device device);
void check_index_view(const char* name, const IndexView& v, DType dtype, int64_t min_size, Device device,
                      int64_t exact_size = -1);
// Refuses targets that leave out the arrays the layout's addressing needs (tokens > 0).
void check_targets_addressing(const TokenTargets& targets, bool paged, int64_t tokens);
void check_config(const VariantDescriptor& d, const CacheConfig& c);
Capacity capacity_of(const VariantDescriptor& d, const CacheConfig& c);
int64_t staged_capacity(const VariantDescriptor& d, const CacheConfig& c);
void check_pairs_disjoint_on_host(const int32_t* pairs, int64_t count);
void check_tuning(const Tuning& t);

}  // namespace kvforge::detail
