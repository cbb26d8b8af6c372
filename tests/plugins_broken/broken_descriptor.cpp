// Hand-written descriptors, each wrong in exactly one way (chosen by a
// BROKEN_* definition from CMakeLists.txt), so that every registry check is
// exercised by a real shared library rather than by a mocked descriptor.
#include <cstddef>
#include <cstdint>

#include <boost/dll/alias.hpp>

#include "loom/error.hpp"
#include "loom/plugin.hpp"
#include "loom/version.hpp"

#ifndef BROKEN_NAME
#error "BROKEN_NAME must be set by tests/plugins_broken/CMakeLists.txt"
#endif

namespace broken_plugin {

// The host must refuse these files before it calls the factory; reaching it
// means a check let a broken descriptor through, and the test sees this text.
static loom::Plugin* create(const loom::PluginInit*) {
  throw loom::Error("factory of a broken test plugin was called: the registry accepted a descriptor it must refuse");
}

#if defined(BROKEN_STRUCT_SIZE)
constexpr uint32_t kStructSize = offsetof(loom::PluginDescriptor, build_id);  // an older, shorter layout
#else
constexpr uint32_t kStructSize = sizeof(loom::PluginDescriptor);
#endif

#if defined(BROKEN_ABI_MAJOR)
constexpr uint32_t kAbiMajor = LOOM_ABI_MAJOR + 1, kAbiMinor = 0;
#elif defined(BROKEN_ABI_MINOR)
constexpr uint32_t kAbiMajor = LOOM_ABI_MAJOR, kAbiMinor = LOOM_ABI_MINOR + 7;
#else
constexpr uint32_t kAbiMajor = LOOM_ABI_MAJOR, kAbiMinor = LOOM_ABI_MINOR;
#endif

#if defined(BROKEN_KIND_ATTENTION)
constexpr uint32_t kKind = static_cast<uint32_t>(loom::PluginKind::attention);
#elif defined(BROKEN_KIND_UNKNOWN)
constexpr uint32_t kKind = 77;
#else
constexpr uint32_t kKind = static_cast<uint32_t>(loom::PluginKind::data);
#endif

#if defined(BROKEN_BUILD_ID)
// Only the compiler field differs from this SDK's build id.
#define BROKEN_BUILD_ID_TEXT "othercc-1;" LOOM_CXXABI_TAG ";loom-" LOOM_STR_(LOOM_VERSION_MAJOR) "." LOOM_STR_(LOOM_VERSION_MINOR)
#else
#define BROKEN_BUILD_ID_TEXT LOOM_BUILD_ID
#endif

static const loom::PluginDescriptor descriptor = {kStructSize, kAbiMajor, kAbiMinor, kKind, BROKEN_NAME, "0.0.1",
                                                  "deliberately broken test plugin", BROKEN_BUILD_ID_TEXT, &create};
static const loom::PluginDescriptor* entry() { return &descriptor; }

}  // namespace broken_plugin

BOOST_DLL_ALIAS(broken_plugin::entry, loom_plugin_entry)
