# loom_add_plugin(<kind> <name> SOURCES <src>... [LIBRARIES <lib>...])
#
# Builds libloom-<kind>-<name>.so against the Loom SDK. Used in-tree and, once
# installed, by out-of-tree plugins after find_package(Loom).
#
# In-tree (LOOM_PLUGIN_OUTPUT_DIR set) the plugin lands in <build>/lib/loom/plugins
# and installs into <prefix>/lib/loom/plugins, where `loom` finds it. Out of tree
# it lands in the current binary dir (point --path or $LOOM_PLUGIN_PATH at it) and
# installs into <its prefix>/lib/loom/plugins.
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
  # The SDK headers use C++20; an out-of-tree project need not set the standard itself.
  target_compile_features(${target} PRIVATE cxx_std_20)
  if(TARGET loom)
    target_link_libraries(${target} PRIVATE loom ${ARG_LIBRARIES})
  else()
    target_link_libraries(${target} PRIVATE Loom::loom ${ARG_LIBRARIES})
  endif()
  if(DEFINED LOOM_PLUGIN_OUTPUT_DIR)
    set_target_properties(${target} PROPERTIES LIBRARY_OUTPUT_DIRECTORY ${LOOM_PLUGIN_OUTPUT_DIR})
    # <prefix>/lib/loom/plugins -> <prefix>/lib, so that ldd on an installed plugin
    # resolves libloom (when loom loads it, libloom is already in the process).
    set_target_properties(${target} PROPERTIES INSTALL_RPATH "$ORIGIN/../..")
    install(TARGETS ${target} LIBRARY DESTINATION ${LOOM_INSTALL_PLUGINDIR})
  else()
    include(GNUInstallDirs)
    install(TARGETS ${target} LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR}/loom/plugins)
  endif()
endfunction()
