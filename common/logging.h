// Logging for every rubato process: spdlog underneath, one logger per subsystem.
//
// Warnings and errors always print. Info and debug are filtered by level, globally through
// RUBATO_LOG_LEVEL (trace|debug|info|warn|error|off, default warn) or per subsystem through
// RUBATO_LOG_SUBSYS (e.g. "model=debug,tokenizer=info"). Logs go to stderr so that generated
// text on stdout stays clean.
#pragma once

#include <spdlog/spdlog.h>

#include <memory>
#include <string_view>

#include "common/status.h"

namespace rubato {

// The logger of a subsystem ("model", "tokenizer", "config", "engine", "transport", ...),
// created on first use with the level the environment asks for.
std::shared_ptr<spdlog::logger> Logger(std::string_view subsystem);

// Overrides the global level ("info", "debug", ...), e.g. from the YAML `logging.level`.
Status SetGlobalLogLevel(std::string_view level);

}  // namespace rubato

#define RUBATO_LOG_DEBUG(subsys, ...) ::rubato::Logger(subsys)->debug(__VA_ARGS__)
#define RUBATO_LOG_INFO(subsys, ...) ::rubato::Logger(subsys)->info(__VA_ARGS__)
#define RUBATO_LOG_WARN(subsys, ...) ::rubato::Logger(subsys)->warn(__VA_ARGS__)
#define RUBATO_LOG_ERROR(subsys, ...) ::rubato::Logger(subsys)->error(__VA_ARGS__)
