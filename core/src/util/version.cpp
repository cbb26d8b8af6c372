#include "loom/version.hpp"

namespace loom {
const char* version_string() { return LOOM_VERSION_STRING; }
const char* build_id() { return LOOM_BUILD_ID; }
}  // namespace loom
