// The registry's reference tests on the tests' own executor (serial_exec.hpp), which reaches the
// kernels only through the generic path's tables: every variant the generic path serves, under
// random traffic and its upkeep, against the same reference as the CPU executor.
#include "caches/generic_path.hpp"
#include "serial_exec.hpp"
#include "variant_driver.hpp"

namespace kvtest {
namespace {

class EverySerialTwin : public testing::TestWithParam<Case> {};

TEST_P(EverySerialTwin, SerialExecutorMatchesReference) {
  const VariantDescriptor& d = *GetParam().entry->descriptor;
  twin_traffic_matches_reference(
      d, [&d](const CacheConfig& c) { return kvforge::generic_path::generic_cache_with<SerialTables>(d, c); }, {3u},
      "serial executor");
}
INSTANTIATE_TEST_SUITE_P(Registry, EverySerialTwin, testing::ValuesIn(generic_cases()), case_name);

}  // namespace
}  // namespace kvtest
