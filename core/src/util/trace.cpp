#include "loom/trace.hpp"

namespace loom::trace {
std::atomic<Sink*> g_sink{nullptr};
}  // namespace loom::trace
