# kvforge_generate(): expand layout and model specs into C++/CUDA sources and add them to a target.
#
#   kvforge_generate(TARGET <target>
#                    LAYOUTS <files or folders...> MODELS <files or folders...> [TUNING <files or folders...>]
#                    [OUTPUT_DIR <dir>] [REGISTRY_FUNCTION <ns::name>]
#                    [LAYOUT_FILTER a,b] [MODEL_FILTER a,b] [DTYPE_FILTER a,b] [COVER])
#
# COVER keeps, of the variants the filters keep, those that cover every kernel (codegen's --cover).
#
# The list of outputs is known at configure time (codegen `outputs`), so every generated file is a
# real source of the target. Folders are globbed with CONFIGURE_DEPENDS: a new spec file re-runs
# configure and becomes a new variant with no CMake edit. Generation re-runs at build time when any
# spec, template or codegen file changes, and rewrites only files whose content changed.
include_guard(GLOBAL)

# The spec compiler lives at ${KVFORGE_ROOT}/codegen: the source tree's, or the installed copy
# (kvforge-config.cmake sets KVFORGE_ROOT before including this file).
if(NOT KVFORGE_ROOT)
  set(KVFORGE_ROOT "${CMAKE_CURRENT_LIST_DIR}/.." CACHE INTERNAL "kvforge source root")
endif()
find_package(Python3 3.9 REQUIRED COMPONENTS Interpreter)
# The options every generated CPU kernel file is built with, on top of its level's -march: kept to those
# files (never on a target that links them). -fno-trapping-math lets GCC turn the quantizer's float
# selects into vector blends; it changes no result (kvforge never reads floating-point exception flags).
# Never -ffast-math: rounding is exact.
set(KVFORGE_CPU_BASE_LEVEL 2 CACHE INTERNAL "the x86-64 level every kvforge CPU build runs on (vocab.py)")
set(KVFORGE_KERNEL_OPTIONS -Wall -Wextra -fno-trapping-math CACHE INTERNAL "")
# Cached, because a downstream project that adds kvforge with add_subdirectory() calls kvforge_generate()
# from its own scope, where the variables find_package set here are not visible.
set(KVFORGE_PYTHON "${Python3_EXECUTABLE}" CACHE INTERNAL "the Python that runs kvforge's codegen")

function(_kvforge_spec_files out)
  set(files "")
  foreach(path IN LISTS ARGN)
    if(IS_DIRECTORY "${path}")
      file(GLOB found CONFIGURE_DEPENDS "${path}/*.yaml" "${path}/*.yml")
      list(APPEND files ${found})
    else()
      list(APPEND files "${path}")
    endif()
  endforeach()
  list(SORT files)
  set(${out} "${files}" PARENT_SCOPE)
endfunction()

function(kvforge_generate)
  cmake_parse_arguments(KG "COVER" "TARGET;OUTPUT_DIR;REGISTRY_FUNCTION;LAYOUT_FILTER;MODEL_FILTER;DTYPE_FILTER"
                        "LAYOUTS;MODELS;TUNING" ${ARGN})
  if(NOT KG_TARGET OR NOT KG_LAYOUTS OR NOT KG_MODELS)
    message(FATAL_ERROR "kvforge_generate: TARGET, LAYOUTS and MODELS are required")
  endif()
  if(NOT KG_OUTPUT_DIR)
    set(KG_OUTPUT_DIR "${CMAKE_CURRENT_BINARY_DIR}/${KG_TARGET}_generated")
  endif()
  if(NOT KG_REGISTRY_FUNCTION)
    set(KG_REGISTRY_FUNCTION "kvforge::registry")
  endif()

  set(codegen_env "${CMAKE_COMMAND}" -E env "PYTHONPATH=${KVFORGE_ROOT}/codegen")
  # Tuning files (specs/tuning/<model>.yaml, written by kvforge_bench --kvf_tune) bake measured launch
  # parameters into their model's variants; a folder that does not exist yet is simply empty.
  # Globbed even while a folder does not exist, so that the first tuning file written re-runs configure.
  set(tuning "")
  foreach(path IN LISTS KG_TUNING)
    if(path MATCHES "\\.ya?ml$")
      list(APPEND tuning "${path}")
    else()
      file(GLOB found CONFIGURE_DEPENDS "${path}/*.yaml" "${path}/*.yml")
      list(APPEND tuning ${found})
    endif()
  endforeach()
  set(spec_args --layouts ${KG_LAYOUTS} --models ${KG_MODELS} --tuning ${tuning} --source-root "${CMAKE_CURRENT_SOURCE_DIR}"
                "--layout=${KG_LAYOUT_FILTER}" "--model=${KG_MODEL_FILTER}" "--dtype=${KG_DTYPE_FILTER}")
  if(KG_COVER)
    list(APPEND spec_args --cover)
  endif()
  # The backends this build has (CMakeLists.txt sets KVFORGE_BACKENDS): each gets its kernel files.
  set(backends_list cpu)
  if(DEFINED KVFORGE_BACKENDS)
    set(backends_list ${KVFORGE_BACKENDS})
  endif()
  string(REPLACE ";" "," backends_list "${backends_list}")
  set(backend_flag "--backends=${backends_list}")
  # A build of one x86-64 level (KVFORGE_CPU_ONLY_LEVEL, cpu_levels.cmake) writes one CPU file a variant,
  # holding the kernels of the level it is compiled for.
  if(KVFORGE_CPU_ONLY_LEVEL)
    list(APPEND backend_flag --one-cpu-level)
  endif()

  execute_process(
    COMMAND ${codegen_env} "${KVFORGE_PYTHON}" -m kvforge_codegen outputs ${spec_args} ${backend_flag}
            --registry-function "${KG_REGISTRY_FUNCTION}"
    OUTPUT_VARIABLE outputs ERROR_VARIABLE errors RESULT_VARIABLE status
    OUTPUT_STRIP_TRAILING_WHITESPACE
    # The loader bounds every spec's size, depth and values, so this takes well under a second; the
    # timeout only makes sure a configure step can never hang.
    TIMEOUT 120)
  if(NOT status EQUAL 0)
    message(FATAL_ERROR "kvforge specs for ${KG_TARGET} are invalid:\n${errors}")
  endif()
  string(REPLACE "\n" ";" outputs "${outputs}")
  list(TRANSFORM outputs PREPEND "${KG_OUTPUT_DIR}/")

  _kvforge_spec_files(spec_files ${KG_LAYOUTS} ${KG_MODELS})
  list(APPEND spec_files ${tuning})
  # Any edit to a spec can change the set of variants (a dtype added to `expand`, a model removed), and
  # so the outputs, which CMake must know before it builds: an edited spec re-runs configure, which asks
  # the spec compiler again (well under a second), as a new or removed file does through the globs.
  set_property(DIRECTORY APPEND PROPERTY CMAKE_CONFIGURE_DEPENDS ${spec_files})
  file(GLOB codegen_files CONFIGURE_DEPENDS "${KVFORGE_ROOT}/codegen/kvforge_codegen/*.py"
                                            "${KVFORGE_ROOT}/codegen/templates/*.j2")
  # A removed spec changes no remaining input, so the set of inputs and outputs itself is a dependency,
  # rewritten only when it changes.
  set(inputs_file "${KG_OUTPUT_DIR}/.inputs")
  string(REPLACE ";" "\n" inputs_text "${spec_files};${outputs};${KG_REGISTRY_FUNCTION}")
  set(old_inputs_text "")
  if(EXISTS "${inputs_file}")
    file(READ "${inputs_file}" old_inputs_text)
  endif()
  if(NOT old_inputs_text STREQUAL inputs_text)
    file(WRITE "${inputs_file}" "${inputs_text}")
  endif()
  set(stamp "${KG_OUTPUT_DIR}/.stamp")
  add_custom_command(
    OUTPUT "${stamp}"
    BYPRODUCTS ${outputs}
    COMMAND ${codegen_env} "${KVFORGE_PYTHON}" -m kvforge_codegen generate ${spec_args} ${backend_flag}
            --out "${KG_OUTPUT_DIR}" --registry-function "${KG_REGISTRY_FUNCTION}"
    COMMAND "${CMAKE_COMMAND}" -E touch "${stamp}"
    DEPENDS ${spec_files} ${codegen_files} "${inputs_file}"
    COMMENT "kvforge: generating variants for ${KG_TARGET}"
    VERBATIM)
  add_custom_target(${KG_TARGET}_codegen DEPENDS "${stamp}")
  add_dependencies(${KG_TARGET} ${KG_TARGET}_codegen)

  set(sources ${outputs})
  list(FILTER sources EXCLUDE REGEX "\\.(hpp|md|txt)$")  # every backend's kernel files, whatever their extension
  # The CPU files are built in object libraries of their own, one per x86-64 level, so that each level
  # gets its -march, kvforge's warnings and float options without any of them reaching the code of the
  # user's own target, and, where a level has enough files to pay for it, one precompiled header of the
  # runtime (parsing it was most of each file's compile time). <variant>.cpp is the base level's;
  # <variant>.cpu_v<N>.cpp level N's.
  set(cpu_sources ${sources})
  list(FILTER cpu_sources INCLUDE REGEX "\\.cpp$")
  list(FILTER sources EXCLUDE REGEX "\\.cpp$")
  set(levels "")
  set(base_level ${KVFORGE_CPU_BASE_LEVEL})
  if(KVFORGE_CPU_ONLY_LEVEL)
    set(base_level ${KVFORGE_CPU_ONLY_LEVEL})
  endif()
  foreach(source IN LISTS cpu_sources)
    if(source MATCHES "\\.cpu_v([0-9]+)\\.cpp$")
      list(APPEND level_${CMAKE_MATCH_1}_sources "${source}")
      list(APPEND levels "${CMAKE_MATCH_1}")
    else()
      list(APPEND level_${base_level}_sources "${source}")
    endif()
  endforeach()
  list(APPEND levels ${base_level})
  list(REMOVE_DUPLICATES levels)
  foreach(level IN LISTS levels)
    set(objects ${KG_TARGET}_cpu_v${level})
    add_library(${objects} OBJECT ${level_${level}_sources})
    add_dependencies(${objects} ${KG_TARGET}_codegen)
    target_include_directories(${objects} PRIVATE "${KG_OUTPUT_DIR}")
    target_link_libraries(${objects} PRIVATE kvforge::runtime)
    target_compile_options(${objects} PRIVATE ${KVFORGE_KERNEL_OPTIONS} -march=x86-64-v${level})
    set_target_properties(${objects} PROPERTIES POSITION_INDEPENDENT_CODE ON)
    # The header costs 5 s to precompile at -O3 (10 s in a -O0 build) and saves each file about 1.1 s
    # of parsing (2026-12-03): a downstream target of a few variants builds faster without it.
    list(LENGTH level_${level}_sources level_files)
    if(level_files GREATER_EQUAL 8)
      target_precompile_headers(${objects} PRIVATE <kvforge/detail/cache_impl.hpp> <kvforge/backends/cpu/cpu_ops.hpp>)
    endif()
    target_sources(${KG_TARGET} PRIVATE $<TARGET_OBJECTS:${objects}>)
  endforeach()
  # CUDA's kernel files, KVFORGE_CUDA_BATCH variants to one nvcc run where that is over 1: a variant's
  # own kernels were 4.2 of its 6.9 s alone (2026-12-03, sm_90), the rest the headers that every run
  # parses again. A batch is a file of #include lines, written at configure time and only when its
  # list changes; an edited spec then recompiles its batch, not its variant alone.
  set(cuda_sources ${sources})
  list(FILTER cuda_sources INCLUDE REGEX "\\.cu$")
  if(KVFORGE_CUDA_BATCH GREATER 1 AND cuda_sources)
    list(FILTER sources EXCLUDE REGEX "\\.cu$")
    list(LENGTH cuda_sources count)
    set(batch_dir "${CMAKE_CURRENT_BINARY_DIR}/${KG_TARGET}_cuda_batches")
    set(first 0)
    while(first LESS count)
      math(EXPR last "${first} + ${KVFORGE_CUDA_BATCH} - 1")
      if(last GREATER_EQUAL count)
        math(EXPR last "${count} - 1")
      endif()
      set(lines "// kvforge_generate(): variants ${first}..${last} of ${KG_TARGET}'s CUDA kernel files, one nvcc run\n")
      foreach(i RANGE ${first} ${last})
        list(GET cuda_sources ${i} source)
        string(APPEND lines "#include \"${source}\"\n")
      endforeach()
      file(CONFIGURE OUTPUT "${batch_dir}/batch_${first}.cu" CONTENT "${lines}" @ONLY)
      list(APPEND sources "${batch_dir}/batch_${first}.cu")
      math(EXPR first "${last} + 1")
    endwhile()
  endif()
  target_sources(${KG_TARGET} PRIVATE ${sources})  # the other backends' kernel files (CUDA's .cu)
  target_include_directories(${KG_TARGET} PUBLIC "${KG_OUTPUT_DIR}")
  target_link_libraries(${KG_TARGET} PUBLIC kvforge::runtime)
endfunction()
