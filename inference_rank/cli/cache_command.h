// `rubato cache --listen HOST:PORT`: a standalone cache rank (DESIGN §1 "Disaggregated mode",
// what a Kubernetes cache pod runs). Serves the RPC control plane on HOST:PORT (port 0: any free
// port) and each connecting inference rank's KV packs over UCX, until a peer's Shutdown call,
// SIGINT or SIGTERM. Prints "rubato cache: listening on HOST:PORT" (the bound port) once ready.
#pragma once

#include <cstdint>
#include <optional>
#include <string>

#include "common/status.h"

namespace rubato {

struct CacheArgs {
  std::string listen = "127.0.0.1:0";      // host:port of the RPC server
  int64_t budget_mb = 1024;                // KV storage all sessions may reserve, MiB
  std::optional<std::string> config_file;  // YAML config: limits (heartbeat, timeouts), logging
};

Status RunCache(const CacheArgs& args);

}  // namespace rubato
