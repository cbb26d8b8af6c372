// Logging. spdlog lives behind these functions (in libloom only), so plugins and
// CUDA translation units log without including spdlog or fmt.
#pragma once
#include <string>
#include <string_view>

namespace loom {

enum class LogLevel { trace, debug, info, warn, error };

void log(LogLevel level, std::string_view msg);
inline void log_debug(std::string_view m) { log(LogLevel::debug, m); }
inline void log_info(std::string_view m) { log(LogLevel::info, m); }
inline void log_warn(std::string_view m) { log(LogLevel::warn, m); }
inline void log_error(std::string_view m) { log(LogLevel::error, m); }

// Set the threshold ("trace", "debug", "info", "warn", "error"); throws on other names.
void set_log_level(std::string_view level);
// Only rank 0 logs info and below in multi-process runs; warnings and errors from all.
void set_log_rank(int rank);

}  // namespace loom
