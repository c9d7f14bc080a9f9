#include "kvforge/detail/host_checks.hpp"

#include "kvforge/errors.hpp"

namespace kvforge::detail {

void check_indices_on_host(const IndexCheckArgs& a) {
  for (int64_t i = 0; i < a.count; ++i) {
    int64_t v;
    if (!index_passes(a, i, v))
      throw OutOfRangeError(index_check_argument(a.code), v, a.lo, a.hi, i, a.allow_padding ? "-1 marks padding" : "");
  }
}

void check_indices_on_host(const IndexChecks& checks) {
  for (int c = 0; c < checks.count; ++c) check_indices_on_host(checks.check[c]);
}

}  // namespace kvforge::detail
