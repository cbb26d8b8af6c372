// The only place spdlog is included: everything else logs through loom/log.hpp.
#include "loom/log.hpp"

#include <atomic>

#include <spdlog/sinks/stdout_color_sinks.h>
#include <spdlog/spdlog.h>

#include "loom/error.hpp"
#include "util/quiet_log.hpp"
#include "util/terminal.hpp"

namespace loom {
namespace {
std::atomic<int> g_rank{0};

spdlog::logger& logger() {
  static std::shared_ptr<spdlog::logger> l = [] {
    // Colours only for a person at a terminal (util/terminal.hpp).
    auto lg = spdlog::stderr_color_mt("loom", interactive_terminal(STDERR_FILENO) ? spdlog::color_mode::automatic
                                                                                 : spdlog::color_mode::never);
    lg->set_pattern("[%Y-%m-%d %H:%M:%S.%e] [%^%l%$] %v");
    lg->set_level(spdlog::level::info);
    return lg;
  }();
  return *l;
}
}  // namespace

void log(LogLevel level, std::string_view msg) {
  if (g_rank.load() != 0 && level < LogLevel::warn) return;
  switch (level) {
    case LogLevel::trace: logger().trace("{}", msg); break;
    case LogLevel::debug: logger().debug("{}", msg); break;
    case LogLevel::info: logger().info("{}", msg); break;
    case LogLevel::warn: logger().warn("{}", msg); break;
    case LogLevel::error: logger().error("{}", msg); break;
  }
}

void set_log_level(std::string_view level) {
  static const std::pair<std::string_view, spdlog::level::level_enum> levels[] = {
      {"trace", spdlog::level::trace}, {"debug", spdlog::level::debug}, {"info", spdlog::level::info},
      {"warn", spdlog::level::warn},   {"error", spdlog::level::err}};
  for (auto& [name, lvl] : levels)
    if (name == level) { logger().set_level(lvl); return; }
  throw Error(cat("unknown log level '", level, "': use one of trace, debug, info, warn, error"));
}

void set_log_rank(int rank) { g_rank.store(rank); }

QuietLog::QuietLog() : saved_(static_cast<int>(logger().level())) { logger().set_level(spdlog::level::err); }
QuietLog::~QuietLog() { logger().set_level(static_cast<spdlog::level::level_enum>(saved_)); }

}  // namespace loom
