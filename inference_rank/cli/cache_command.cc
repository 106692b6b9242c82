// `rubato cache` (cache_command.h): CacheService + its RPC server until asked to stop.
#include "inference_rank/cli/cache_command.h"

#include <boost/asio/ip/address.hpp>
#include <chrono>
#include <condition_variable>
#include <csignal>
#include <cstdio>
#include <mutex>
#include <optional>
#include <string>

#include "cache_rank/cache_rpc_handler.h"
#include "cache_rank/cache_service.h"
#ifdef RUBATO_HAS_DEVICE_CACHE_RANK
#include "cache_rank/device/device_cache_rpc_handler.h"
#endif
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

// Whether `host` (an IP literal) reaches this machine only: 127.0.0.0/8 or ::1.
bool IsLoopback(const std::string& host) {
  boost::system::error_code ec;
  const boost::asio::ip::address address = boost::asio::ip::make_address(host, ec);
  return !ec && address.is_loopback();
}

// A cache rank other hosts can reach needs a token; one on loopback may run without, with a
// warning (WarnIfNoRpcToken: any local process can then use the budget). `listen` and
// `listen_name` for messages.
Status CheckRpcToken(const rpc::RpcEndpoint& endpoint, const std::string& listen,
                     const std::string& listen_name, const std::string& token) {
  if (!token.empty()) return Status::Ok();
  if (!IsLoopback(endpoint.host)) {
    return FailedPreconditionError(
        listen_name + " " + listen +
        " is not a loopback address and no RPC token is set: any host that reaches it could "
        "hold the whole KV budget. Set " +
        rpc::kTokenEnv + " (or " + rpc::kTokenFileEnv +
        ", the path of a file that holds it) for the cache rank and its inference ranks, or "
        "listen on 127.0.0.1");
  }
  return Status::Ok();
}

// On loopback without a token (CheckRpcToken allowed it): said once the rank is about to
// listen, after every other check, so that a refused start prints its one error line only.
void WarnIfNoRpcToken(const std::string& token) {
  if (!token.empty()) return;
  RUBATO_LOG_WARN("cache",
                  "no RPC token ({} or {}): any local process can connect to this cache rank "
                  "and reserve its whole KV budget; set a token to allow only its inference "
                  "ranks",
                  rpc::kTokenEnv, rpc::kTokenFileEnv);
}

// GET or HEAD /metrics (the registry's Prometheus text) and /health (HEAD: the same status and
// headers, no body; HttpServer drops it); 404 for other paths, 405 with Allow for other methods.
server::HttpReply MetricsReply(const MetricsRegistry& registry,
                               const server::HttpRequest& request) {
  if (request.path != "/metrics" && request.path != "/health") {
    return server::HttpReply{
        404, "text/plain; charset=utf-8",
        "no route for " + request.path + " (a cache rank serves /metrics and /health)\n", nullptr};
  }
  if (request.method != "GET" && request.method != "HEAD") {
    return server::HttpReply{405,
                             "text/plain; charset=utf-8",
                             request.path + " takes GET or HEAD, not " + request.method + "\n",
                             nullptr,
                             {{"Allow", "GET, HEAD"}}};
  }
  if (request.path == "/health") {
    return server::HttpReply{200, "text/plain; charset=utf-8", "ok", nullptr};
  }
  return server::HttpReply{200, kExpositionContentType, registry.ExpositionText(), nullptr};
}

std::mutex stop_mutex;
std::condition_variable stop_requested;
std::string pending_stop;  // under stop_mutex: why to stop, once a peer asked

void RequestStop(const std::string& reason) {
  std::lock_guard lock(stop_mutex);
  pending_stop = "a peer asked: " + reason;
  stop_requested.notify_all();
}

// Blocks until a peer asks to stop or a signal arrives; the reason.
std::string WaitForStop() {
  std::unique_lock lock(stop_mutex);
  while (pending_stop.empty() && signal_received == 0) {
    stop_requested.wait_for(lock, std::chrono::milliseconds(100));
  }
  std::string reason =
      pending_stop.empty() ? "signal " + std::to_string(signal_received) : pending_stop;
  pending_stop.clear();  // a later run in this process waits again
  return reason;
}

// The RPC server's options of a cache rank.
rpc::RpcServerOptions ServerOptions(const rpc::RpcEndpoint& endpoint, const LimitsSection& limits,
                                    const std::string& token) {
  rpc::RpcServerOptions server_options;
  server_options.host = endpoint.host;
  server_options.port = endpoint.port;
  server_options.peer_timeout_ms = 5 * limits.heartbeat_ms;
  server_options.auth_token = token;
  return server_options;
}

// `cache.memory: device`: the KV on this process's GPU, attention there, the device data plane
// over NCCL (cache_rank/device/device_cache_rpc_handler.h).
Status ServeDeviceCacheRank(const CacheArgs& args, const RubatoConfig& config,
                            const CacheSection& cache, int device, const std::string& memory_key,
                            const rpc::RpcEndpoint& endpoint, const std::string& token,
                            const std::function<Status(const std::string&)>& on_listening) {
#ifndef RUBATO_HAS_DEVICE_CACHE_RANK
  (void)args;
  (void)token;
  (void)config;
  (void)cache;
  (void)device;
  (void)endpoint;
  (void)on_listening;
  return UnsupportedError(memory_key +
                          " 'device': this rubato was built without CUDA and NCCL, which a GPU "
                          "cache rank needs (pageable or pinned keep the KV in host memory)");
#else
  if (Status usable = DeviceCacheRpcHandler::CheckDevice(device); !usable.ok()) {
    return usable.WithContext(memory_key + " 'device'");
  }
  DeviceCacheRpcHandlerOptions options;
  options.device = device;
  options.budget_bytes = cache.budget_bytes();
  options.budget_name = "cache.budget_gib";
  if (args.budget_mb.has_value()) {
    if (*args.budget_mb < 1 || *args.budget_mb > (int64_t{1} << 30)) {
      return InvalidArgumentError("--budget-mb must be in [1, 2^30], got " +
                                  std::to_string(*args.budget_mb));
    }
    options.budget_bytes = static_cast<uint64_t>(*args.budget_mb) << 20;
    options.budget_name = "--budget-mb";
  }
  if (args.metrics_listen.size() > 0 || args.peer_budget_mb != 0) {
    return UnsupportedError(
        "--metrics and --peer-budget-mb are served by a cache rank in host memory; a GPU cache "
        "rank (--memory device) reports through the Stats RPC and has one budget");
  }
  options.nccl_init_timeout = std::chrono::milliseconds(config.limits.rpc_timeout_ms);
  options.peers_authenticated = !token.empty();
  DeviceCacheRpcHandler handler(RequestStop, options);
  WarnIfNoRpcToken(token);
  RUBATO_ASSIGN_OR_RETURN(
      std::unique_ptr<rpc::RpcServer> server,
      rpc::RpcServer::Start(ServerOptions(endpoint, config.limits, token), &handler));
  std::printf(
      "rubato cache: KV on GPU %d (%llu bytes), attention there, device data plane "
      "over NCCL\n",
      device, static_cast<unsigned long long>(options.budget_bytes));
  RUBATO_RETURN_IF_ERROR(on_listening(server->endpoint()));
  const std::string reason = WaitForStop();
  RUBATO_LOG_INFO("cache", "stopping ({})", reason);
  server->Stop();
  const DeviceCacheRpcHandler::Totals totals = handler.totals();
  std::printf("rubato cache: stopped (%s) steps=%llu bytes_received=%llu bytes_sent=%llu\n",
              reason.c_str(), static_cast<unsigned long long>(totals.steps),
              static_cast<unsigned long long>(totals.bytes_received),
              static_cast<unsigned long long>(totals.bytes_sent));
  std::fflush(stdout);
  return Status::Ok();
#endif
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
  std::signal(SIGINT, OnSignal);
  std::signal(SIGTERM, OnSignal);
  std::optional<rpc::RpcEndpoint> metrics_endpoint;
  if (!args.metrics_listen.empty()) {
    RUBATO_ASSIGN_OR_RETURN(metrics_endpoint, ParseListenAddress(args.metrics_listen, "--metrics"));
  }
  RUBATO_ASSIGN_OR_RETURN(const std::string token, rpc::AuthTokenFromEnvironment());
  RUBATO_RETURN_IF_ERROR(CheckRpcToken(endpoint, args.listen, "--listen", token));
  if (cache.memory == CacheSection::Memory::kDevice) {
    return ServeDeviceCacheRank(args, config, cache, device, memory_key, endpoint, token,
                                on_listening);
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
  CacheRpcHandlerOptions handler_options;
  handler_options.peers_authenticated = !token.empty();
  handler_options.nccl_device = device;
  handler_options.nccl_init_timeout = std::chrono::milliseconds(limits.rpc_timeout_ms);
  CacheRpcHandler handler(service, RequestStop, handler_options);
  rpc::RpcServerOptions server_options = ServerOptions(endpoint, limits, token);
  MetricsRegistry metrics;
  RUBATO_RETURN_IF_ERROR(service.RegisterMetrics(metrics));
  RUBATO_RETURN_IF_ERROR(RegisterProcessMetrics(metrics, "cache"));
  RUBATO_ASSIGN_OR_RETURN(server_options.auth_failures,
                          metrics.AddCounter("rubato:cache_rank_auth_failures_total",
                                             "RPC Hellos refused for a missing or wrong token "
                                             "(each closes its connection)."));
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
  WarnIfNoRpcToken(token);
  RUBATO_ASSIGN_OR_RETURN(std::unique_ptr<rpc::RpcServer> server,
                          rpc::RpcServer::Start(server_options, &handler));
  RUBATO_RETURN_IF_ERROR(on_listening(server->endpoint()));
  const std::string stop_reason = WaitForStop();
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
