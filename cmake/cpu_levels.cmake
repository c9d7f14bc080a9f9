# KVFORGE_CPU_LEVELS (CMakeLists.txt) resolved into KVFORGE_CPU_ONLY_LEVEL: empty where every variant
# carries its kernels for every x86-64 level (a binary for any x86-64 machine), else the one level all
# of them are built for. kvforge_generate() reads it (one file a variant, codegen's --one-cpu-level),
# the runtime gets it as a definition (cpu_level() then runs that level, and refuses a CPU without it),
# and the installed package carries it, so that a downstream project's variants match its runtime.
include_guard(GLOBAL)
string(TOLOWER "${KVFORGE_CPU_LEVELS}" levels)
if(levels STREQUAL "all")
  set(only "")
elseif(levels STREQUAL "native")
  # The build machine's widest level, by the runtime's own detection (cpu_detect.hpp).
  try_run(probe_ran probe_built "${CMAKE_CURRENT_BINARY_DIR}/cpu_level_probe"
          "${CMAKE_CURRENT_LIST_DIR}/cpu_level_probe.cpp"
          CMAKE_FLAGS "-DINCLUDE_DIRECTORIES=${CMAKE_CURRENT_LIST_DIR}/../runtime/include"
          COMPILE_OUTPUT_VARIABLE probe_log RUN_OUTPUT_VARIABLE probe_out)
  string(STRIP "${probe_out}" only)
  if(NOT probe_built OR NOT probe_ran EQUAL 0 OR NOT only MATCHES "^[234]$")
    message(FATAL_ERROR "KVFORGE_CPU_LEVELS=native: could not read this machine's x86-64 level:\n${probe_log}")
  endif()
elseif(levels MATCHES "^[234]$")
  set(only "${levels}")
else()
  message(FATAL_ERROR "KVFORGE_CPU_LEVELS=${KVFORGE_CPU_LEVELS}: not a choice (allowed: all, native, 2, 3, 4)")
endif()
set(KVFORGE_CPU_ONLY_LEVEL "${only}" CACHE INTERNAL "the one x86-64 level every CPU kernel is built for; empty: all")
if(only)
  message(STATUS "kvforge: CPU kernels for x86-64-v${only} only (KVFORGE_CPU_LEVELS=${KVFORGE_CPU_LEVELS})")
endif()
