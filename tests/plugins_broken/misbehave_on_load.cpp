// A plugin file whose own initialisation code misbehaves when the library is
// loaded — before Loom can look at its descriptor: MISBEHAVE_CRASH raises
// SIGSEGV, MISBEHAVE_HANG never returns, MISBEHAVE_EXIT ends the process,
// MISBEHAVE_BLOCK blocks in read() on a pipe that is never written (restarted
// after a signal handler installed with SA_RESTART returns).
// `loom plugins` must report each as that file's problem and list the rest
// (tests/test_reliability_plugins.cpp). Built into their own directory so that
// the registry suite's scan of the broken directory is unchanged.
#include <unistd.h>

#include <csignal>
#include <cstdlib>

#include "loom/data.hpp"
#include "loom/plugin.hpp"

namespace {

__attribute__((constructor)) void misbehave() {
#if defined(MISBEHAVE_CRASH)
  std::raise(SIGSEGV);
#elif defined(MISBEHAVE_HANG)
  for (;;) ::pause();
#elif defined(MISBEHAVE_EXIT)
  std::_Exit(7);
#elif defined(MISBEHAVE_BLOCK)
  int fds[2];
  if (::pipe(fds) == 0) {
    char c;
    for (;;) (void)::read(fds[0], &c, 1);  // the write end stays open: never any data, never end of file
  }
#endif
}

class Never final : public loom::DataSource {
 public:
  explicit Never(const loom::PluginInit&) {}
  void open(const loom::DataSpec&) override {}
  bool has_split(loom::Split) const override { return true; }
  void next(loom::Split, int32_t*) override {}
  void reset(loom::Split) override {}
  std::string state() const override { return "{}"; }
  void restore(const std::string&) override {}
};

}  // namespace

LOOM_PLUGIN(data, Never, MISBEHAVE_NAME, "0.0.1", "test plugin whose load-time code misbehaves")
