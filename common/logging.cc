// Per-subsystem spdlog loggers configured from the environment (see logging.h).
#include "common/logging.h"

#include <spdlog/sinks/stdout_color_sinks.h>

#include <map>
#include <mutex>
#include <string>

#include "common/env.h"

namespace rubato {
namespace {

struct LogSettings {
  std::mutex mu;
  spdlog::level::level_enum global = spdlog::level::warn;
  std::map<std::string, spdlog::level::level_enum, std::less<>> per_subsystem;
  bool env_read = false;
};

LogSettings& Settings() {
  static LogSettings settings;
  return settings;
}

bool ParseLevel(std::string_view text, spdlog::level::level_enum* level) {
  static const std::map<std::string, spdlog::level::level_enum, std::less<>> kLevels = {
      {"trace", spdlog::level::trace}, {"debug", spdlog::level::debug},
      {"info", spdlog::level::info},   {"warn", spdlog::level::warn},
      {"error", spdlog::level::err},   {"off", spdlog::level::off}};
  auto it = kLevels.find(text);
  if (it == kLevels.end()) return false;
  *level = it->second;
  return true;
}

// Reads RUBATO_LOG_LEVEL and RUBATO_LOG_SUBSYS once. Malformed values are reported on stderr
// and ignored: logging must never stop a process from starting.
void ReadEnvLocked(LogSettings& s) {
  if (s.env_read) return;
  s.env_read = true;
  if (auto level = GetEnv("RUBATO_LOG_LEVEL")) {
    if (!ParseLevel(*level, &s.global)) {
      spdlog::warn("RUBATO_LOG_LEVEL='{}' is not one of trace|debug|info|warn|error|off", *level);
    }
  }
  if (auto spec = GetEnv("RUBATO_LOG_SUBSYS")) {
    size_t start = 0;
    while (start <= spec->size()) {
      size_t end = spec->find(',', start);
      if (end == std::string::npos) end = spec->size();
      std::string item = spec->substr(start, end - start);
      size_t eq = item.find('=');
      spdlog::level::level_enum level;
      if (eq == std::string::npos || !ParseLevel(item.substr(eq + 1), &level)) {
        if (!item.empty()) spdlog::warn("RUBATO_LOG_SUBSYS entry '{}' is not name=level", item);
      } else {
        s.per_subsystem[item.substr(0, eq)] = level;
      }
      start = end + 1;
    }
  }
}

}  // namespace

std::shared_ptr<spdlog::logger> Logger(std::string_view subsystem) {
  LogSettings& s = Settings();
  std::lock_guard<std::mutex> lock(s.mu);
  ReadEnvLocked(s);
  const std::string name = "rubato." + std::string(subsystem);
  if (auto existing = spdlog::get(name)) return existing;
  auto logger = spdlog::stderr_color_mt(name);
  auto it = s.per_subsystem.find(subsystem);
  logger->set_level(it != s.per_subsystem.end() ? it->second : s.global);
  logger->set_pattern("[%H:%M:%S.%e] [%n] [%^%l%$] %v");
  return logger;
}

Status SetGlobalLogLevel(std::string_view level) {
  spdlog::level::level_enum parsed;
  if (!ParseLevel(level, &parsed)) {
    return InvalidArgumentError("log level '" + std::string(level) +
                                "' is not one of trace|debug|info|warn|error|off");
  }
  LogSettings& s = Settings();
  std::lock_guard<std::mutex> lock(s.mu);
  ReadEnvLocked(s);
  s.global = parsed;
  spdlog::apply_all([&](const std::shared_ptr<spdlog::logger>& logger) {
    std::string_view name = logger->name();
    if (name.rfind("rubato.", 0) != 0) return;
    if (s.per_subsystem.count(name.substr(7)) == 0) logger->set_level(parsed);
  });
  return Status::Ok();
}

}  // namespace rubato
