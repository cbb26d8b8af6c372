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
file(GLOB_RECURSE headers RELATIVE ${LOOM_SOURCE_DIR}/core/include ${LOOM_SOURCE_DIR}/core/include/loom/*.hpp)
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

# 2b. Every installed header compiles on its own against the prefix alone (no
#     source tree on the path): what it needs it includes itself.
set(header_tu ${WORK_DIR}/header.cpp)
foreach(h ${headers})
  file(WRITE ${header_tu} "#include \"${h}\"\n")
  run_step("compiling the installed ${h} alone" ${CXX_COMPILER} -std=c++20 -fsyntax-only -DBOOST_DLL_USE_STD_FS
    -I${prefix}/include ${header_tu})
endforeach()
list(LENGTH headers n_headers)
message(STATUS "every installed header compiles on its own (${n_headers})")

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

# An example of examples/plugins/<name>, built as a user builds it
# (find_package(Loom) + loom_add_plugin against the scratch prefix, nothing
# else on the include path) into WORK_DIR/<name>-build, where the test suites
# load it from; the installed `loom plugins` must list it with its kind,
# version and description. The plugin's path lands in ${out_var}.
function(build_example name kind description out_var)
  set(dir ${WORK_DIR}/${name}-build)
  run_step("configuring examples/plugins/${name}"
    ${CMAKE_COMMAND} -S ${LOOM_SOURCE_DIR}/examples/plugins/${name} -B ${dir} -G ${GENERATOR}
    -DCMAKE_BUILD_TYPE=Release -DCMAKE_CXX_COMPILER=${CXX_COMPILER} ${launcher} -DCMAKE_PREFIX_PATH=${prefix})
  file(STRINGS ${dir}/CMakeCache.txt loom_dir REGEX "^Loom_DIR:")
  if(NOT loom_dir MATCHES "${prefix}/")
    message(FATAL_ERROR "examples/plugins/${name} found Loom outside the scratch prefix ${prefix}: ${loom_dir}")
  endif()
  run_step("building examples/plugins/${name}" ${CMAKE_COMMAND} --build ${dir} -j 2)
  set(plugin ${dir}/libloom-${kind}-${name}.so)
  if(NOT EXISTS ${plugin})
    message(FATAL_ERROR "building examples/plugins/${name} produced no ${plugin}")
  endif()
  run_step("${prefix}/bin/loom plugins --path ${dir}"
    ${CMAKE_COMMAND} -E env --unset=LOOM_PLUGIN_PATH ${prefix}/bin/loom plugins --path ${dir})
  if(NOT step_output MATCHES "\n${kind} +${name} +1\\.0\\.0 +${description}[^\n]* ${plugin}\n")
    message(FATAL_ERROR "the installed loom does not list examples/plugins/${name}:\n${step_output}")
  endif()
  set(${out_var} ${plugin} PARENT_SCOPE)
endfunction()

# 5. The third-party data source examples/plugins/jsonl.
build_example(jsonl data "JSON Lines text" jsonl)

# 6. `loom train` (installed) with data.plugin = "jsonl": a few steps of a tiny
#    model on the CPU, with validation, read from JSON Lines files.
set(run_dir ${WORK_DIR}/jsonl-run)
file(MAKE_DIRECTORY ${run_dir})
set(lines "")
foreach(i RANGE 1 60)
  string(APPEND lines "{\"text\": \"Document ${i}: the quick brown fox jumps over the lazy dog ${i} times.\"}\n")
endforeach()
file(WRITE ${run_dir}/train.jsonl "${lines}")
file(WRITE ${run_dir}/val.jsonl "{\"text\": \"A held-out document, long enough for a window or two of validation.\"}\n")
file(WRITE ${run_dir}/jsonl.toml "[run]
name = \"jsonl\"
out_dir = \"${run_dir}/out\"
device = \"cpu\"
[model]
hidden = 32
num_layers = 1
num_heads = 2
num_kv_heads = 1
ffn_hidden = 64
vocab_size = 258
max_seq_len = 32
[train]
steps = 4
micro_batch = 2
seq_len = 32
lr = 1e-3
validation_every = 2
validation_batches = 2
[checkpoint]
every = 0
[precision]
plugin = \"fp32\"
[attention]
plugin = \"naive\"
[sharding]
plugin = \"none\"
[data]
plugin = \"jsonl\"
path = \"${jsonl}\"
train = \"${run_dir}/train.jsonl\"
val = \"${run_dir}/val.jsonl\"
tokenizer = \"bytes\"
")
run_step("${prefix}/bin/loom train ${run_dir}/jsonl.toml"
  ${CMAKE_COMMAND} -E env --unset=LOOM_PLUGIN_PATH OMP_NUM_THREADS=2 ${prefix}/bin/loom train ${run_dir}/jsonl.toml)
if(NOT step_output MATCHES "done: 4 steps in [^\n]*val loss [0-9.]+ -> [0-9.]+")
  message(FATAL_ERROR "loom train with data.plugin = \"jsonl\" did not finish its 4 steps with validation:\n${step_output}")
endif()
message(STATUS "installed loom trained on examples/plugins/jsonl")

# 7. The third-party precision recipe examples/plugins/fp8_rowwise, loaded
#    from its folder by tests/test_fp8_rowwise_example.cpp as well.
build_example(fp8_rowwise precision "FP8 with per-row scales" rowwise)

# 8. `loom train` (installed) with precision.plugin = "fp8_rowwise" on the CPU,
#    on the JSON Lines files of step 6 (the FP8 emulation; the GPU run is
#    tests/test_fp8_rowwise_example.cpp's).
file(READ ${run_dir}/jsonl.toml toml)
string(REPLACE "name = \"jsonl\"" "name = \"fp8_rowwise\"" toml "${toml}")
string(REPLACE "${run_dir}/out" "${run_dir}/out-rowwise" toml "${toml}")
string(REPLACE "plugin = \"fp32\"" "plugin = \"fp8_rowwise\"\npath = \"${rowwise}\"" toml "${toml}")
file(WRITE ${run_dir}/fp8_rowwise.toml "${toml}")
run_step("${prefix}/bin/loom train ${run_dir}/fp8_rowwise.toml"
  ${CMAKE_COMMAND} -E env --unset=LOOM_PLUGIN_PATH OMP_NUM_THREADS=2 ${prefix}/bin/loom train ${run_dir}/fp8_rowwise.toml)
if(NOT step_output MATCHES "done: 4 steps in [^\n]*val loss [0-9.]+ -> [0-9.]+")
  message(FATAL_ERROR "loom train with precision.plugin = \"fp8_rowwise\" did not finish its 4 steps:\n${step_output}")
endif()
message(STATUS "installed loom trained with examples/plugins/fp8_rowwise")
