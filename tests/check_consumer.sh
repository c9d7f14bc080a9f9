#!/usr/bin/env bash
# Builds and runs tests/consumer, a downstream project with its own spec, against kvforge:
#   check_consumer.sh install <kvforge build dir> <work dir>  through `cmake --install` + find_package
#   check_consumer.sh subdirectory <work dir>                 through add_subdirectory of this tree
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
mode="$1"
# Unoptimized: these builds check the CMake wiring and the results on a few tokens; the optimized kernels
# are kvforge's own tests. (An optimized add_subdirectory build took 70 s of the suite, this one 16.)
build_type=(-DCMAKE_BUILD_TYPE=Debug -DCMAKE_CXX_FLAGS_DEBUG=-O0)
if [ "$mode" = install ]; then
  build="$2" work="$3"
  rm -rf "$work" && mkdir -p "$work"
  cmake --install "$build" --prefix "$work/prefix" >/dev/null
  cmake -S "$here/consumer" -B "$work/build" -G Ninja "${build_type[@]}" -DCMAKE_PREFIX_PATH="$work/prefix" >/dev/null
else
  work="$2"
  rm -rf "$work" && mkdir -p "$work"
  # The CPU levels of the build that runs this test (tests/CMakeLists.txt passes them), as a user's
  # project would choose its own.
  # A unity build (CMake's CMAKE_UNITY_BUILD, 16 sources a unit), as a project may build its tree: kvforge's
  # sources must build that way too, and this build then takes 15 s here where it took 32 (45 s of compile
  # where it took 118).
  cmake -S "$here/consumer" -B "$work/build" -G Ninja "${build_type[@]}" -DKVFORGE_SOURCE="$here/.." \
        -DKVFORGE_CPU_LEVELS="${KVFORGE_CPU_LEVELS:-all}" -DCMAKE_UNITY_BUILD=ON -DCMAKE_UNITY_BUILD_BATCH_SIZE=16 >/dev/null
fi
cmake --build "$work/build" >/dev/null
"$work/build/consumer"
KVFORGE_CACHE_DIR="$work/on-demand" "$work/build/load_shared" "$work/build/libconsumer_shared.so"
if [ -x "$work/build/consumer_transfer" ]; then
  mpirun -np 2 --oversubscribe --allow-run-as-root "$work/build/consumer_transfer"
elif [ "$mode" = install ] && [ -f "$build/libkvforge_mpi.a" ]; then
  echo "check_consumer: kvforge was built with MPI, but the installed package gave no kvforge::mpi" >&2
  exit 1
fi
if [ "$mode" = install ] && [ -d "$work/prefix/python/kvforge" ]; then
  # The installed Python package: its module, and spec validation through the installed spec compiler.
  (cd "$work" && KVFORGE_CACHE_DIR="$work/on-demand" PYTHONPATH="$work/prefix/python" python3 -c '
import sys, kvforge, kvforge.specs
names = kvforge.specs.validate([sys.argv[1] + "/layouts"], [sys.argv[1] + "/models"])
assert names == ["consumer_paged.odd_model.bf16", "consumer_paged.odd_model.fp32"], names
assert kvforge.variants(), "the installed module registers no variant"
d = kvforge.variant("vllm_paged_nhd", {"name": "installed", "layers": 1, "kv_heads": 2, "head_dim": 40,
                                       "max_seq_len": 32}, "bf16")  # on demand, from the installed headers
assert (d.heads, d.head_dim) == (2, 40) and kvforge.create(d.name, pages=2).descriptor.name == d.name
names = kvforge.load_variants(sys.argv[2], "consumer_shared::registry")  # the project own library
assert names == ["consumer_paged.odd_model.bf16", "consumer_paged.odd_model.fp32"], names
assert kvforge.create("consumer_paged.odd_model.fp32", pages=2).descriptor.head_dim == 24
print("installed Python package: ok, builds variants on demand, loads the project library")' \
      "$here/consumer/specs" "$work/build/libconsumer_shared.so")
fi
