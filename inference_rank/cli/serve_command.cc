// `rubato serve` (see serve_command.h): config -> model -> Engine -> ServingEngine -> routes ->
// HTTP server, then waits for a signal and shuts down in the reverse order.
#include "inference_rank/cli/serve_command.h"

#include <chrono>
#include <csignal>
#include <cstdio>
#include <filesystem>
#include <memory>
#include <thread>

#include "common/logging.h"
#include "common/metrics.h"
#include "common/process_metrics.h"
#include "inference_rank/cli/mpi_launch.h"
#include "common/tokenizer/tokenizer.h"
#include "inference_rank/server/http_server.h"
#include "inference_rank/server/openai_router.h"
#include "inference_rank/server/serving_engine.h"

namespace rubato {
namespace {

volatile std::sig_atomic_t signal_received = 0;
void OnSignal(int signal) { signal_received = signal; }

// Running requests get this long to finish after a signal; the rest are cancelled.
constexpr std::chrono::seconds kShutdownGrace(5);

// Loads the model and serves HTTP until SIGINT / SIGTERM.
Status Serve(const RubatoConfig& config);

// The server.metrics_port listener: GET (or HEAD) /metrics, 404 / 405 otherwise.
server::HttpReply MetricsOnly(const MetricsRegistry& metrics, const server::HttpRequest& request) {
  if (request.path != "/metrics") {
    return server::HttpReply{404, "text/plain; charset=utf-8",
                             "no route for " + request.path +
                                 " (server.metrics_port serves /metrics only)\n",
                             nullptr};
  }
  if (request.method != "GET" && request.method != "HEAD") {
    return server::HttpReply{405, "text/plain; charset=utf-8",
                             "/metrics takes GET, not " + request.method + "\n", nullptr};
  }
  return server::HttpReply{200, kExpositionContentType, metrics.ExpositionText(), nullptr};
}

}  // namespace

Status RunServe(const ServeArgs& args) {
  RUBATO_ASSIGN_OR_RETURN(RubatoConfig config, ResolveConfig(args.overrides));
  if (args.host) config.server.host = *args.host;
  if (args.port) {
    if (*args.port < 0 || *args.port > 65535) {
      return InvalidArgumentError("--port: " + std::to_string(*args.port) +
                                  " is not a TCP port (0..65535; 0 picks a free one)");
    }
    config.server.port = *args.port;
  }
  RUBATO_RETURN_IF_ERROR(SetGlobalLogLevel(config.logging.level));
  // Under mpirun with topology.ranks: a cache rank serves KV; this rank serves HTTP against it.
  return RunWithMpiRoles(config, [](RubatoConfig& resolved) { return Serve(resolved); });
}

namespace {

Status Serve(const RubatoConfig& config) {
  RUBATO_ASSIGN_OR_RETURN(PolicyChoice policy, ResolveAndCheck(config));
  const std::filesystem::path model_dir = config.model.path;
  if (!std::filesystem::exists(model_dir / "tokenizer.json")) {
    return NotFoundError("model directory '" + model_dir.string() +
                         "' has no tokenizer.json; `rubato serve` needs it to read prompts "
                         "and write text");
  }
  RUBATO_ASSIGN_OR_RETURN(std::unique_ptr<Tokenizer> tokenizer,
                          Tokenizer::LoadFromDirectory(model_dir));
  RUBATO_ASSIGN_OR_RETURN(std::unique_ptr<Model> model, LoadModel(config, model_dir));
  RUBATO_LOG_INFO("cli", "model {}: {} parameters, {} backend, policy {}", model_dir.string(),
                  model->parameter_count(), model->backend_name(), policy.name);

  // Declared before everything that points into them: destroyed last.
  MetricsRegistry metrics;
  RUBATO_RETURN_IF_ERROR(RegisterProcessMetrics(metrics, "inference"));
  OffloadTarget offload;
  EngineOptions engine_options = EngineOptionsFromConfig(config);
  engine_options.metrics = &metrics;
  RUBATO_RETURN_IF_ERROR(ApplyPolicy(policy, tokenizer.get(), engine_options));
  if (policy.offload.has_value()) {
    RUBATO_ASSIGN_OR_RETURN(offload, ConnectOffload(config, policy, model->config()));
    // A remote cache rank adds its link's metrics to the client's.
    RUBATO_RETURN_IF_ERROR(offload.remote != nullptr
                               ? offload.remote->RegisterMetrics(metrics)
                               : offload.colocated->client().RegisterMetrics(metrics));
    engine_options.offload = offload.client;
  }
  RUBATO_ASSIGN_OR_RETURN(std::unique_ptr<Engine> engine,
                          Engine::Create(std::move(model), engine_options));
  server::ServingEngineOptions serving_options;
  serving_options.max_queue = config.limits.max_queue;
  serving_options.request_timeout_s = config.limits.request_timeout_s;
  serving_options.metrics = &metrics;
  const std::string model_name = server::ModelNameFromDirectory(model_dir.string());
  serving_options.model_name = model_name;
  RUBATO_ASSIGN_OR_RETURN(
      std::unique_ptr<server::ServingEngine> serving,
      server::ServingEngine::Create(std::move(engine), tokenizer.get(), serving_options));
  server::OpenAiRouter router(
      serving.get(), tokenizer.get(), &metrics,
      {model_name, config.limits.max_prompt_tokens, config.server.cors_allowed_origins});
  serving->Start();

  server::HttpServerOptions http_options;
  http_options.host = config.server.host;
  http_options.port = static_cast<uint16_t>(config.server.port);
  RUBATO_ASSIGN_OR_RETURN(
      std::unique_ptr<server::HttpServer> http,
      server::HttpServer::Start(http_options, [&router](const server::HttpRequest& request) {
        return router.Handle(request);
      }));
  // server.metrics_port: /metrics alone on a second listener (e.g. a port only the monitoring
  // network reaches); the API port serves /metrics as well.
  std::unique_ptr<server::HttpServer> metrics_http;
  if (config.server.metrics_port != 0) {
    server::HttpServerOptions metrics_options;
    metrics_options.host = config.server.host;
    metrics_options.port = static_cast<uint16_t>(config.server.metrics_port);
    Result<std::unique_ptr<server::HttpServer>> started = server::HttpServer::Start(
        metrics_options,
        [&metrics](const server::HttpRequest& request) { return MetricsOnly(metrics, request); });
    if (!started.ok()) return started.status().WithContext("server.metrics_port");
    metrics_http = std::move(started).value();
  }
  std::signal(SIGINT, OnSignal);
  std::signal(SIGTERM, OnSignal);
  if (metrics_http != nullptr) {
    std::printf("rubato serve: metrics on http://%s:%u/metrics\n", config.server.host.c_str(),
                static_cast<unsigned>(metrics_http->port()));
  }
  std::printf("rubato serve: listening on http://%s:%u\n", config.server.host.c_str(),
              static_cast<unsigned>(http->port()));
  std::fflush(stdout);

  while (signal_received == 0) std::this_thread::sleep_for(std::chrono::milliseconds(50));
  RUBATO_LOG_INFO("cli", "signal {}: stopping", static_cast<int>(signal_received));
  // Stop accepting; running requests finish (the engine still steps) within the grace period;
  // then the engine loop ends every request left.
  http->Stop(kShutdownGrace);
  if (metrics_http != nullptr) metrics_http->Stop();
  serving->Stop();
  return Status::Ok();
}

}  // namespace
}  // namespace rubato
