# Run by ctest (see CMakeLists.txt here). Every failure names what is missing
# or prints the failing command's output.
foreach(v LOOM_BUILD_DIR LOOM_SOURCE_DIR WORK_DIR GENERATOR CXX_COMPILER)
  if(NOT DEFINED ${v} OR "${${v}}" STREQUAL "")
    message(FATAL_ERROR "install_and_build_example.cmake: -D${v}=... is required")
  endif()
endforeach()

set(prefix ${WORK_DIR}/prefix)
set(example_build ${WORK_DIR}/example-build)
file(REMOVE_RECURSE ${WORK_DIR})
file(MAKE_DIRECTORY ${WORK_DIR})

function(run_step what)
  execute_process(COMMAND ${ARGN} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "${what} failed (${rc}):\n${ARGN}\n${out}\n${err}")
  endif()
  set(step_output "${out}${err}" PARENT_SCOPE)
endfunction()

# 1. Install.
run_step("cmake --install" ${CMAKE_COMMAND} --install ${LOOM_BUILD_DIR} --prefix ${prefix})

# 2. The installed layout: the command, the library, every public header, the
#    CMake package, and every plugin the build produced.
set(expected bin/loom lib/libloom.so lib/cmake/Loom/LoomConfig.cmake lib/cmake/Loom/LoomConfigVersion.cmake
  lib/cmake/Loom/LoomTargets.cmake lib/cmake/Loom/LoomPlugin.cmake)
file(GLOB headers RELATIVE ${LOOM_SOURCE_DIR}/core/include ${LOOM_SOURCE_DIR}/core/include/loom/*.hpp)
foreach(h ${headers})
  list(APPEND expected include/${h})
endforeach()
file(GLOB built_plugins RELATIVE ${LOOM_BUILD_DIR} ${LOOM_BUILD_DIR}/lib/loom/plugins/libloom-*.so)
list(APPEND expected ${built_plugins})
set(missing "")
foreach(f ${expected})
  if(NOT EXISTS ${prefix}/${f})
    list(APPEND missing ${f})
  endif()
endforeach()
file(GLOB sonames ${prefix}/lib/libloom.so.*)
if(NOT sonames)
  list(APPEND missing "lib/libloom.so.<version>")
endif()
if(missing)
  message(FATAL_ERROR "the install into ${prefix} lacks: ${missing}")
endif()
list(LENGTH built_plugins n_plugins)
message(STATUS "installed layout complete (${n_plugins} in-tree plugins)")

# 3. Build the example against the installed SDK only.
set(launcher "")
if(CXX_LAUNCHER)
  set(launcher -DCMAKE_CXX_COMPILER_LAUNCHER=${CXX_LAUNCHER})
endif()
run_step("configuring examples/third_party_plugin"
  ${CMAKE_COMMAND} -S ${LOOM_SOURCE_DIR}/examples/third_party_plugin -B ${example_build} -G ${GENERATOR}
  -DCMAKE_BUILD_TYPE=Release -DCMAKE_CXX_COMPILER=${CXX_COMPILER} ${launcher} -DCMAKE_PREFIX_PATH=${prefix})
file(STRINGS ${example_build}/CMakeCache.txt loom_dir REGEX "^Loom_DIR:")
if(NOT loom_dir MATCHES "${prefix}/")
  message(FATAL_ERROR "the example found Loom outside the scratch prefix ${prefix}: ${loom_dir}")
endif()
run_step("building examples/third_party_plugin" ${CMAKE_COMMAND} --build ${example_build} -j 2)
set(plugin ${example_build}/libloom-data-arith.so)
if(NOT EXISTS ${plugin})
  message(FATAL_ERROR "building the example produced no ${plugin}")
endif()

# 4. The installed loom lists it (with $LOOM_PLUGIN_PATH cleared, so only --path
#    and the install's own plugin directory are searched) and refuses nothing.
run_step("${prefix}/bin/loom plugins"
  ${CMAKE_COMMAND} -E env --unset=LOOM_PLUGIN_PATH ${prefix}/bin/loom plugins --path ${example_build})
set(out "${step_output}")
if(NOT out MATCHES "\ndata +arith +1\\.0\\.0 +arithmetic progressions[^\n]* ${plugin}\n")
  message(FATAL_ERROR "the installed loom does not list the example plugin:\n${out}")
endif()
if(out MATCHES "Problems \\(")
  message(FATAL_ERROR "the installed loom refused plugins:\n${out}")
endif()
if(NOT out MATCHES "\n  ${prefix}/lib/loom/plugins")
  message(FATAL_ERROR "the installed loom does not search its own plugin directory ${prefix}/lib/loom/plugins:\n${out}")
endif()
message(STATUS "installed loom lists the out-of-tree plugin:\n${out}")
