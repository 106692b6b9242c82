// `rubato cache` (cache_command.h): CacheService + its RPC server until asked to stop.
#include "inference_rank/cli/cache_command.h"

#include <chrono>
#include <condition_variable>
#include <csignal>
#include <cstdio>
#include <mutex>
#include <optional>
#include <string>

#include "cache_rank/cache_rpc_handler.h"
#include "cache_rank/cache_service.h"
#include "common/config.h"
#include "common/logging.h"
#include "common/metrics.h"
#include "common/process_metrics.h"
#include "inference_rank/residency/offloaded/colocated_cache.h"
#include "inference_rank/server/http_server.h"
#include "transport/rpc/rpc_auth.h"
#include "transport/rpc/rpc_client.h"
#include "transport/rpc/rpc_server.h"

namespace rubato {
namespace {

volatile std::sig_atomic_t signal_received = 0;

void OnSignal(int signal) { signal_received = signal; }

// "host:port" where port 0 asks for any free port (ParseRpcEndpoint, for connecting, wants a
// real one); `flag` names the option in errors.
Result<rpc::RpcEndpoint> ParseListenAddress(const std::string& listen, const std::string& flag) {
  const size_t colon = listen.rfind(':');
  if (colon != std::string::npos && listen.substr(colon + 1) == "0") {
    Result<rpc::RpcEndpoint> endpoint = rpc::ParseRpcEndpoint(listen.substr(0, colon + 1) + "1");
    if (!endpoint.ok()) return endpoint.status().WithContext(flag);
    endpoint->port = 0;
    return endpoint;
  }
  Result<rpc::RpcEndpoint> parsed = rpc::ParseRpcEndpoint(listen);
  if (!parsed.ok()) return parsed.status().WithContext(flag);
  return parsed;
}

// GET /metrics (the registry's Prometheus text) and GET /health; 404 / 405 otherwise.
server::HttpReply MetricsReply(const MetricsRegistry& registry,
                               const server::HttpRequest& request) {
  if (request.path != "/metrics" && request.path != "/health") {
    return server::HttpReply{
        404, "text/plain; charset=utf-8",
        "no route for " + request.path + " (a cache rank serves /metrics and /health)\n", nullptr};
  }
  if (request.method != "GET") {
    return server::HttpReply{405, "text/plain; charset=utf-8",
                             request.path + " takes GET, not " + request.method + "\n", nullptr};
  }
  if (request.path == "/health") {
    return server::HttpReply{200, "text/plain; charset=utf-8", "ok", nullptr};
  }
  return server::HttpReply{200, kExpositionContentType, registry.ExpositionText(), nullptr};
}

}  // namespace

Status RunCache(const CacheArgs& args) {
  RubatoConfig config = DefaultConfig();
  if (args.config_file) {
    RUBATO_ASSIGN_OR_RETURN(config, LoadConfigFile(*args.config_file));
  }
  RUBATO_RETURN_IF_ERROR(SetGlobalLogLevel(config.logging.level));
  return ServeCacheRank(args, config, [](const std::string& endpoint) {
    std::printf("rubato cache: listening on %s\n", endpoint.c_str());
    std::fflush(stdout);
    return Status::Ok();
  });
}

Status ServeCacheRank(const CacheArgs& args, const RubatoConfig& config,
                      const std::function<Status(const std::string&)>& on_listening) {
  const LimitsSection& limits = config.limits;
  // The config's cache section, then the flags.
  CacheSection cache = config.cache;
  int device = cache.device >= 0 ? cache.device : 0;
  if (args.device.has_value()) {
    if (*args.device < 0) {
      return InvalidArgumentError("--device must be >= 0, got " + std::to_string(*args.device));
    }
    device = *args.device;
  }
  std::string memory_key = "cache.memory";
  if (args.memory.has_value()) {
    memory_key = "--memory";
    if (*args.memory == "pageable" || *args.memory == "host") {
      cache.memory = CacheSection::Memory::kPageable;
    } else if (*args.memory == "pinned") {
      cache.memory = CacheSection::Memory::kPinned;
    } else if (*args.memory == "device") {
      cache.memory = CacheSection::Memory::kDevice;
    } else {
      return InvalidArgumentError("--memory: '" + *args.memory +
                                  "' is not one of pageable (or host), pinned, device");
    }
  }
  RUBATO_ASSIGN_OR_RETURN(const rpc::RpcEndpoint endpoint,
                          ParseListenAddress(args.listen, "--listen"));
  std::optional<rpc::RpcEndpoint> metrics_endpoint;
  if (!args.metrics_listen.empty()) {
    RUBATO_ASSIGN_OR_RETURN(metrics_endpoint, ParseListenAddress(args.metrics_listen, "--metrics"));
  }
  RUBATO_ASSIGN_OR_RETURN(CacheServiceOptions service_options,
                          CacheServiceOptionsFromConfig(cache, device, memory_key));
  std::string budget_name = "cache.budget_gib";
  if (args.budget_mb.has_value()) {
    if (*args.budget_mb < 1 || *args.budget_mb > (int64_t{1} << 30)) {
      return InvalidArgumentError("--budget-mb must be in [1, 2^30], got " +
                                  std::to_string(*args.budget_mb));
    }
    service_options.budget_bytes = static_cast<uint64_t>(*args.budget_mb) << 20;
    budget_name = "--budget-mb";
  }
  if (args.peer_budget_mb < 0 ||
      static_cast<uint64_t>(args.peer_budget_mb) << 20 > service_options.budget_bytes) {
    return InvalidArgumentError("--peer-budget-mb must be in [0, " +
                                std::to_string(service_options.budget_bytes >> 20) + "] (" +
                                budget_name + "), got " + std::to_string(args.peer_budget_mb));
  }
  if (args.max_sessions_per_peer < 1) {
    return InvalidArgumentError("--max-sessions-per-peer must be >= 1, got " +
                                std::to_string(args.max_sessions_per_peer));
  }
  service_options.peer_budget_bytes = static_cast<uint64_t>(args.peer_budget_mb) << 20;
  service_options.max_sessions_per_peer = args.max_sessions_per_peer;
  CacheService service(service_options);
  std::mutex mutex;
  std::condition_variable stop_requested;
  std::string stop_reason;
  RUBATO_ASSIGN_OR_RETURN(const std::string token, rpc::AuthTokenFromEnvironment());
  CacheRpcHandlerOptions handler_options;
  handler_options.peers_authenticated = !token.empty();
  handler_options.nccl_device = device;
  handler_options.nccl_init_timeout = std::chrono::milliseconds(limits.rpc_timeout_ms);
  CacheRpcHandler handler(
      service,
      [&](const std::string& reason) {
        std::lock_guard lock(mutex);
        stop_reason = "a peer asked: " + reason;
        stop_requested.notify_all();
      },
      handler_options);
  rpc::RpcServerOptions server_options;
  server_options.host = endpoint.host;
  server_options.port = endpoint.port;
  server_options.peer_timeout_ms = 5 * limits.heartbeat_ms;
  server_options.auth_token = token;
  MetricsRegistry metrics;
  RUBATO_RETURN_IF_ERROR(service.RegisterMetrics(metrics));
  RUBATO_RETURN_IF_ERROR(RegisterProcessMetrics(metrics, "cache"));
  std::unique_ptr<server::HttpServer> metrics_server;
  if (metrics_endpoint.has_value()) {
    server::HttpServerOptions http;
    http.host = metrics_endpoint->host;
    http.port = metrics_endpoint->port;
    Result<std::unique_ptr<server::HttpServer>> started = server::HttpServer::Start(
        http,
        [&metrics](const server::HttpRequest& request) { return MetricsReply(metrics, request); });
    if (!started.ok()) return started.status().WithContext("--metrics");
    metrics_server = std::move(started).value();
    std::printf("rubato cache: metrics on http://%s:%u/metrics\n", http.host.c_str(),
                static_cast<unsigned>(metrics_server->port()));
    std::fflush(stdout);
  }
  service.Start();
  RUBATO_ASSIGN_OR_RETURN(std::unique_ptr<rpc::RpcServer> server,
                          rpc::RpcServer::Start(server_options, &handler));
  std::signal(SIGINT, OnSignal);
  std::signal(SIGTERM, OnSignal);
  RUBATO_RETURN_IF_ERROR(on_listening(server->endpoint()));

  std::unique_lock lock(mutex);
  while (stop_reason.empty() && signal_received == 0) {
    stop_requested.wait_for(lock, std::chrono::milliseconds(100));
  }
  if (stop_reason.empty()) stop_reason = "signal " + std::to_string(signal_received);
  lock.unlock();
  RUBATO_LOG_INFO("cache", "stopping ({})", stop_reason);
  server->Stop();
  service.Stop();
  if (metrics_server != nullptr) metrics_server->Stop();
  const CacheServiceStats stats = service.Stats();
  std::printf(
      "rubato cache: stopped (%s) packs=%llu replies=%llu bytes_received=%llu "
      "bytes_sent=%llu\n",
      stop_reason.c_str(), static_cast<unsigned long long>(stats.packs_received),
      static_cast<unsigned long long>(stats.replies_sent),
      static_cast<unsigned long long>(stats.bytes_received),
      static_cast<unsigned long long>(stats.bytes_sent));
  std::fflush(stdout);
  return Status::Ok();
}

}  // namespace rubato
