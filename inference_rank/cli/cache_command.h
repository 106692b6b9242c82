// `rubato cache --listen HOST:PORT`: a standalone cache rank (docs/design.md §1
// "Disaggregated mode", what a Kubernetes cache pod runs). Serves the RPC control plane on
// HOST:PORT (port 0: any free port) and each connecting inference rank's KV packs over UCX or NCCL
// (the inference rank's topology.transport; NCCL from GPU --device), until a peer's Shutdown call,
// SIGINT or SIGTERM. Prints "rubato cache: listening on HOST:PORT" (the bound port) once ready,
// and with --metrics HOST:PORT "rubato cache: metrics on http://HOST:PORT/metrics" before it.
// Its storage (budget, memory, GPU) is the config's `cache:` section; the flags override it.
// Without an RPC token (RUBATO_CACHE_TOKEN / RUBATO_CACHE_TOKEN_FILE) it starts on a loopback
// address only, with a warning (docs/security.md "The cache rank's RPC").
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <string>

#include "common/config.h"
#include "common/status.h"

namespace rubato {

// Unset optional flags take the config's cache section.
struct CacheArgs {
  std::string listen = "127.0.0.1:0";  // host:port of the RPC server
  std::optional<int64_t> budget_mb;  // KV storage all sessions may reserve, MiB (cache.budget_gib)
  int64_t peer_budget_mb = 0;        // what one peer's sessions may reserve (0: the budget)
  int max_sessions_per_peer = 4096;  // sessions one peer may hold open
  // "pageable" (or "host") | "pinned" (cudaHostAlloc) | "device" (cache.memory)
  std::optional<std::string> memory;
  // YAML config: the cache section, limits (heartbeat, timeouts), logging
  std::optional<std::string> config_file;
  // host:port (port 0: any free port) of an HTTP endpoint serving GET and HEAD of /metrics
  // (Prometheus text: sessions, memory, transport bytes, refused authentications) and /health;
  // none when empty.
  std::string metrics_listen;
  // This rank's GPU: its side of NCCL data planes, its pinned or device memory (cache.device;
  // 0 when both leave it to the mode).
  std::optional<int> device;
};

Status RunCache(const CacheArgs& args);

// The cache rank's serving loop, shared by `rubato cache` and the cache role of an mpirun
// launch: binds `listen`, calls `on_listening(bound endpoint)` once the RPC server runs (an
// error from it stops the rank), and serves until a peer's Shutdown, SIGINT or SIGTERM.
// `args.config_file` is not read here (RunCache reads it into `config`: its cache section and
// limits); the flags of `args` override the cache section, and bad values are refused naming
// the flag or the key.
Status ServeCacheRank(const CacheArgs& args, const RubatoConfig& config,
                      const std::function<Status(const std::string&)>& on_listening);

}  // namespace rubato
