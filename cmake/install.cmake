# `cmake --install <build> --prefix <prefix>` installs kvforge as a CMake package:
#   <prefix>/include/kvforge/                    the runtime's headers
#   <prefix>/lib/libkvforge_runtime.a            the runtime (exported as kvforge::runtime)
#   <prefix>/lib/libkvforge_mpi.a                transfers over MPI (kvforge::mpi), where MPI was found
#   <prefix>/lib/cmake/kvforge/                  kvforge-config.cmake, the exported targets, kvforge.cmake
#   <prefix>/share/kvforge/codegen/              the spec compiler and its templates
#   <prefix>/share/kvforge/specs/                the default specs, to expand or to learn from
#   <prefix>/<KVFORGE_PYTHON_INSTALL_DIR>/kvforge/  the Python package, where KVFORGE_PYTHON is on
# find_package(kvforge) then gives kvforge::runtime and kvforge_generate() for the project's own specs.
include(GNUInstallDirs)
include(CMakePackageConfigHelpers)
set(KVFORGE_INSTALL_CMAKEDIR "${CMAKE_INSTALL_LIBDIR}/cmake/kvforge")
set(KVFORGE_INSTALL_DATADIR "${CMAKE_INSTALL_DATADIR}/kvforge")

# Where kvforge::variant() (on_demand.hpp) finds the spec compiler, the headers and the runtime to link,
# in the tree and installed: compile definitions that kvforge::runtime gives its users.
# A device backend's runtime library comes with its row's link items (the build-variant's --device).
target_compile_definitions(kvforge_runtime PUBLIC
  "KVFORGE_ON_DEMAND_PYTHON=\"${Python3_EXECUTABLE}\""
  "KVFORGE_ON_DEMAND_DEVICE=\"${KVFORGE_ON_DEMAND_DEVICE}\""
  "KVFORGE_ON_DEMAND_CXX=\"${CMAKE_CXX_COMPILER}\""
  "$<BUILD_INTERFACE:KVFORGE_ON_DEMAND_CODEGEN=\"${PROJECT_SOURCE_DIR}/codegen\">"
  "$<BUILD_INTERFACE:KVFORGE_ON_DEMAND_SPECS=\"${PROJECT_SOURCE_DIR}/specs\">"
  "$<BUILD_INTERFACE:KVFORGE_ON_DEMAND_INCLUDE=\"${PROJECT_SOURCE_DIR}/runtime/include\">"
  "$<BUILD_INTERFACE:KVFORGE_ON_DEMAND_LINK=\"$<TARGET_FILE:kvforge_runtime>\">"
  "$<INSTALL_INTERFACE:KVFORGE_ON_DEMAND_CODEGEN=\"$<INSTALL_PREFIX>/${KVFORGE_INSTALL_DATADIR}/codegen\">"
  "$<INSTALL_INTERFACE:KVFORGE_ON_DEMAND_SPECS=\"$<INSTALL_PREFIX>/${KVFORGE_INSTALL_DATADIR}/specs\">"
  "$<INSTALL_INTERFACE:KVFORGE_ON_DEMAND_INCLUDE=\"$<INSTALL_PREFIX>/${CMAKE_INSTALL_INCLUDEDIR}\">"
  "$<INSTALL_INTERFACE:KVFORGE_ON_DEMAND_LINK=\"$<INSTALL_PREFIX>/${CMAKE_INSTALL_LIBDIR}/${CMAKE_STATIC_LIBRARY_PREFIX}kvforge_runtime${CMAKE_STATIC_LIBRARY_SUFFIX}\">")
install(TARGETS kvforge_runtime EXPORT kvforgeTargets ARCHIVE DESTINATION "${CMAKE_INSTALL_LIBDIR}")
# Transfers between processes over MPI, where this build has them (kvforge::mpi).
set(KVFORGE_HAS_MPI OFF)
if(TARGET kvforge_mpi)
  set(KVFORGE_HAS_MPI ON)
  install(TARGETS kvforge_mpi EXPORT kvforgeTargets ARCHIVE DESTINATION "${CMAKE_INSTALL_LIBDIR}")
endif()
install(DIRECTORY runtime/include/ DESTINATION "${CMAKE_INSTALL_INCLUDEDIR}")
install(EXPORT kvforgeTargets NAMESPACE kvforge:: DESTINATION "${KVFORGE_INSTALL_CMAKEDIR}")
install(DIRECTORY codegen/kvforge_codegen codegen/templates DESTINATION "${KVFORGE_INSTALL_DATADIR}/codegen"
        PATTERN "__pycache__" EXCLUDE)
install(DIRECTORY specs/ DESTINATION "${KVFORGE_INSTALL_DATADIR}/specs")
install(FILES cmake/kvforge.cmake DESTINATION "${KVFORGE_INSTALL_CMAKEDIR}")

configure_package_config_file(cmake/kvforge-config.cmake.in "${PROJECT_BINARY_DIR}/kvforge-config.cmake"
                              INSTALL_DESTINATION "${KVFORGE_INSTALL_CMAKEDIR}"
                              PATH_VARS KVFORGE_INSTALL_DATADIR)
write_basic_package_version_file("${PROJECT_BINARY_DIR}/kvforge-config-version.cmake" COMPATIBILITY SameMinorVersion)
install(FILES "${PROJECT_BINARY_DIR}/kvforge-config.cmake" "${PROJECT_BINARY_DIR}/kvforge-config-version.cmake"
        DESTINATION "${KVFORGE_INSTALL_CMAKEDIR}")

if(KVFORGE_PYTHON)
  set(KVFORGE_PYTHON_INSTALL_DIR "python" CACHE STRING "Where the Python package goes, under the install prefix")
  install(TARGETS _native LIBRARY DESTINATION "${KVFORGE_PYTHON_INSTALL_DIR}/kvforge")
  install(DIRECTORY python/kvforge/ DESTINATION "${KVFORGE_PYTHON_INSTALL_DIR}/kvforge" FILES_MATCHING PATTERN "*.py"
          PATTERN "__pycache__" EXCLUDE)
  # The installed package finds the installed spec compiler.
  install(CODE "file(WRITE \"\$ENV{DESTDIR}\${CMAKE_INSTALL_PREFIX}/${KVFORGE_PYTHON_INSTALL_DIR}/kvforge/_paths.py\"
                     \"CODEGEN = \\\"\${CMAKE_INSTALL_PREFIX}/${KVFORGE_INSTALL_DATADIR}/codegen\\\"\\n\"
                     \"INCLUDE = \\\"\${CMAKE_INSTALL_PREFIX}/${CMAKE_INSTALL_INCLUDEDIR}\\\"\\n\"
                     \"SPECS = \\\"\${CMAKE_INSTALL_PREFIX}/${KVFORGE_INSTALL_DATADIR}/specs\\\"\\n\"
                     \"CXX = \\\"${CMAKE_CXX_COMPILER}\\\"\\n\"
                     \"DEVICE = \\\"${KVFORGE_ON_DEMAND_DEVICE}\\\"\\n\")")
endif()
