#!/usr/bin/env bash
# What a user's specs cost the build and the tests, against a build that tools/test-all made:
#   bash bench/spec_growth.sh [build dir] [count]
# 1. One layout spec dropped into a folder the build reads: `cmake --build` alone (it sees the new file,
#    configures, generates and compiles), then the tests that pick its variant up (`ctest -R <its name>`),
#    timed apart.
# 2. `count` layout specs in all (default 10) dropped in, and tools/test-all run over them: timed whole and
#    its ctest apart, the objects it compiled counted (newer than the drop), and its tests counted. The
#    build should grow by the new variants (and the registry that lists them), never by the default
#    matrix's.
# The specs lie in a scratch folder passed as KVFORGE_EXTRA_SPECS beside tests/user_specs; the build is
# put back as test-all left it at the end. Each spec is one variant: NHD pages of its own size (3, 4, ...
# tokens) over the tiny model in fp32, a shape every registry-driven test runs.
set -euo pipefail
cd "$(dirname "$0")/.."
build="${1:-build}" count="${2:-10}"
[ -f "$build/CMakeCache.txt" ] || { echo "spec_growth: no build at $build (run tools/test-all first)" >&2; exit 2; }
scratch=$(mktemp -d)
restore() {
  cmake -S . -B "$build" -DKVFORGE_EXTRA_SPECS=tests/user_specs >/dev/null 2>&1 && cmake --build "$build" >/dev/null
  rm -rf "$scratch"
}
trap restore EXIT
mkdir -p "$scratch/layouts" "$scratch/models"
spec() {  # spec <page size>: a layout of one variant, growth_pages<N>.tiny.fp32
  cat >"$scratch/layouts/growth_pages$1.yaml" <<EOF
name: growth_pages$1
addressing: paged
page_size: $1
axes: [page, slot, kv, head, dim]
update: eager
expand:
  - models: [tiny]
    dtypes: [fp32]
EOF
}
seconds() { local start=$1; echo $(( $(date +%s%N) / 1000000 - start )) | awk '{printf "%.1f", $1 / 1000}'; }
now() { echo $(( $(date +%s%N) / 1000000 )); }

cmake -S . -B "$build" -DKVFORGE_EXTRA_SPECS="tests/user_specs;$scratch" >/dev/null 2>&1  # no spec there yet
cmake --build "$build" >/dev/null
spec 3
start=$(now)
cmake --build "$build" >/dev/null 2>&1
built=$(seconds "$start")
start=$(now)
ran=$(ctest --test-dir "$build" -j "$(nproc)" -R growth_pages3 | awk '/tests passed/ {print $NF}')
echo "spec_growth: one layout spec: cmake --build ${built} s, then its ${ran} tests $(seconds "$start") s"

for ((n = 4; n < 3 + count; ++n)); do spec "$n"; done
touch "$scratch/mark"
start=$(now)
if ! KVFORGE_BUILD_DIR="$build" bash tools/test-all -DKVFORGE_EXTRA_SPECS="tests/user_specs;$scratch" >"$scratch/test-all.log" 2>&1; then
  cp "$scratch/test-all.log" "$build/spec_growth.log"
  echo "spec_growth: tools/test-all failed over the $count specs; its log is $build/spec_growth.log" >&2
  grep -A30 "tests FAILED" "$build/spec_growth.log" >&2 || true
  exit 1
fi
whole=$(seconds "$start")
# The build's own objects: the install tests build projects of their own inside it (consumer-*) every run.
compiled=$(find "$build" -path "$build/consumer-*" -prune -o -name '*.o' -newer "$scratch/mark" -print | wc -l)
tests=$(awk '/tests passed/ {print $NF}' "$scratch/test-all.log")
ctest_s=$(awk '/Total Test time/ {print $(NF-1)}' "$scratch/test-all.log")
echo "spec_growth: $count layout specs: tools/test-all ${whole} s, of which ctest ${ctest_s} s over ${tests} tests;" \
     "the build compiled ${compiled} objects of its own"
