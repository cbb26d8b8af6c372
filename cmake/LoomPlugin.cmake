# loom_add_plugin(<kind> <name> SOURCES <src>... [LIBRARIES <lib>...])
#
# Builds libloom-<kind>-<name>.so against the Loom SDK. Used in-tree and, once
# installed, by out-of-tree plugins after find_package(Loom).
function(loom_add_plugin kind name)
  cmake_parse_arguments(ARG "" "" "SOURCES;LIBRARIES" ${ARGN})
  set(valid_kinds precision attention sharding data)
  if(NOT kind IN_LIST valid_kinds)
    message(FATAL_ERROR "loom_add_plugin: unknown kind '${kind}' (expected one of: ${valid_kinds})")
  endif()
  set(target loom-${kind}-${name})
  add_library(${target} MODULE ${ARG_SOURCES})
  set_target_properties(${target} PROPERTIES PREFIX "lib" OUTPUT_NAME "loom-${kind}-${name}"
    CXX_VISIBILITY_PRESET hidden VISIBILITY_INLINES_HIDDEN ON)
  if(TARGET loom)
    target_link_libraries(${target} PRIVATE loom ${ARG_LIBRARIES})
  else()
    target_link_libraries(${target} PRIVATE Loom::loom ${ARG_LIBRARIES})
  endif()
  if(DEFINED LOOM_PLUGIN_OUTPUT_DIR)
    set_target_properties(${target} PROPERTIES LIBRARY_OUTPUT_DIRECTORY ${LOOM_PLUGIN_OUTPUT_DIR})
    install(TARGETS ${target} LIBRARY DESTINATION ${LOOM_INSTALL_PLUGINDIR})
  endif()
endfunction()
