// `rubato serve` (see serve_command.h): config -> model -> Engine -> ServingEngine -> routes ->
// HTTP server, then waits for a signal, drains (server.shutdown_grace_s) and shuts down in the
// reverse order.
#include "inference_rank/cli/serve_command.h"

#include <fmt/format.h>

#include <atomic>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <memory>
#include <string>
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

// SIGINT / SIGTERM: the first starts the drain, a second ends it at once. Lock-free atomics
// are safe in a signal handler.
std::atomic<int> signals_received{0};
std::atomic<int> first_signal{0};
static_assert(std::atomic<int>::is_always_lock_free);
void OnSignal(int signal) {
  int none = 0;
  first_signal.compare_exchange_strong(none, signal);
  signals_received.fetch_add(1);
}

// "1.5", "30": seconds as a user writes them.
std::string Seconds(double seconds) {
  char text[32];
  std::snprintf(text, sizeof(text), "%g", seconds);
  return text;
}

// After the drain, the errors that end the requests left get this long to be written.
constexpr std::chrono::seconds kLastRepliesFlush(5);

// Stops gracefully after a signal: no new connections or requests (/health 503); requests in
// flight get `grace` to finish (a second signal ends it); those left end with an error naming
// the setting; their replies are written; the listeners close.
void Drain(server::HttpServer& http, server::ServingEngine& serving, double grace_s) {
  http.StopAccepting();
  serving.Drain();
  const char* name = first_signal.load() == SIGINT ? "SIGINT" : "SIGTERM";
  std::printf("rubato serve: %s: draining; %d requests in flight get up to %s s "
              "(server.shutdown_grace_s), a second signal ends them now\n",
              name, http.pending_replies(), Seconds(grace_s).c_str());
  std::fflush(stdout);
  const auto deadline = std::chrono::steady_clock::now() +
                        std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                            std::chrono::duration<double>(grace_s));
  while (http.pending_replies() > 0 && signals_received.load() < 2 &&
         std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  const int left = http.pending_replies();
  const std::string why =
      signals_received.load() >= 2
          ? "a second signal ended the grace period"
          : "the request did not finish within server.shutdown_grace_s (" + Seconds(grace_s) +
                " s)";
  if (left > 0) RUBATO_LOG_WARN("cli", "ending {} requests still running: {}", left, why);
  // Ends every request left with this error; the HTTP server writes them out.
  serving.Stop(UnavailableError("the server is shutting down: " + why));
  http.Stop(kLastRepliesFlush);
}

// Loads the model and serves HTTP until SIGINT / SIGTERM.
Status Serve(const RubatoConfig& config);

// `rubato serve --check`: what Serve refuses before its first token, without the weights.
Status CheckServe(const RubatoConfig& config);

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
  // The default model.path is the random-weight test model: serving it answers gibberish, so a
  // server names its model (--model, or model.path in --config) or does not start.
  if (!args.overrides.model_dir && config.model.path == DefaultConfig().model.path) {
    return InvalidArgumentError(
        "no model to serve: pass --model DIR (a Hugging Face model directory, e.g. --model "
        "models/tiny-qwen3-longctx) or set model.path in --config FILE (the default, " +
        config.model.path + ", has random weights: pass it with --model to serve it anyway)");
  }
  if (args.host) config.server.host = *args.host;
  if (args.port) {
    if (*args.port < 0 || *args.port > 65535) {
      return InvalidArgumentError("--port: " + std::to_string(*args.port) +
                                  " is not a TCP port (0..65535; 0 picks a free one)");
    }
    config.server.port = *args.port;
  }
  if (args.shutdown_grace_s) config.server.shutdown_grace_s = *args.shutdown_grace_s;
  if (args.metrics_names) config.server.metrics_names = *args.metrics_names;
  if (const char* key = std::getenv("RUBATO_API_KEY"); key != nullptr && *key != '\0') {
    config.server.api_key = key;  // as vLLM's VLLM_API_KEY
  }
  if (args.api_key) config.server.api_key = *args.api_key;
  RUBATO_RETURN_IF_ERROR(SetGlobalLogLevel(config.logging.level));
  if (args.check) return CheckServe(config);
  // Under mpirun with topology.ranks: a cache rank serves KV; this rank serves HTTP against it.
  return RunWithMpiRoles(config, [](RubatoConfig& resolved) { return Serve(resolved); });
}

namespace {

// The config and flags (already parsed), the policy and its KV residency, what this build runs,
// the model's shapes (config.json) and the engine's sizes against them, the residency's own check
// of the policy: each refused with the message serving would give. Not done: reading the
// weights and tokenizer.json, and reaching an offloaded residency's cache rank.
Status CheckServe(const RubatoConfig& config) {
  RUBATO_ASSIGN_OR_RETURN(PolicyChoice policy, ResolveAndCheck(config));
  const std::filesystem::path model_dir = config.model.path;
  RUBATO_ASSIGN_OR_RETURN(ModelConfig model, LoadModelConfig(model_dir));
  RUBATO_ASSIGN_OR_RETURN(EngineOptions sizes,
                          Engine::ResolveSizes(model, EngineOptionsFromConfig(config)));
  if (policy.residency != KvResidency::kOffloaded) {
    RUBATO_RETURN_IF_ERROR(MakeResidency(config, policy, model).status());
  }
  // The pool's size needs the weights in memory: --check says how it will be sized.
  const std::string pool =
      sizes.max_kv_blocks > 0
          ? fmt::format("KV pool of {} blocks of {} tokens (engine.kv_pool_tokens)",
                        sizes.max_kv_blocks, sizes.block_size)
          : fmt::format("KV pool sized at start: gpu_memory_utilization {}",
                        sizes.gpu_memory_utilization);
  std::printf(
      "rubato serve --check: ok: %s (%s, %d layers, %d/%d heads x %d, %d positions), "
      "backend %s, policy %s, %s KV, max_batch %d, max_context %d, %s, "
      "http://%s:%d; weights and tokenizer.json not read%s\n",
      model_dir.string().c_str(), model.architecture.c_str(), model.num_layers, model.num_heads,
      model.num_kv_heads, model.head_dim, model.max_position_embeddings,
      std::string(ConfigEnumName(config.engine.backend)).c_str(), policy.name.c_str(),
      std::string(KvResidencyName(policy.residency)).c_str(), sizes.max_batch, sizes.max_context,
      pool.c_str(), config.server.host.c_str(), config.server.port,
      policy.residency == KvResidency::kOffloaded ? ", cache rank not contacted" : "");
  return Status::Ok();
}

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
  EngineOptions engine_options = EngineOptionsFromConfig(config);
  engine_options.metrics = &metrics;
  RUBATO_RETURN_IF_ERROR(ApplyPolicy(policy, tokenizer.get(), engine_options));
  RUBATO_ASSIGN_OR_RETURN(engine_options.residency,
                          MakeResidency(config, policy, model->config()));
  // E.g. a cache rank's transport bytes and waits (a remote one adds its link's).
  RUBATO_RETURN_IF_ERROR(engine_options.residency->RegisterMetrics(metrics));
  RUBATO_ASSIGN_OR_RETURN(std::unique_ptr<Engine> engine,
                          Engine::Create(std::move(model), engine_options));
  const std::string kv_pool = engine->kv_pool_summary();
  server::ServingEngineOptions serving_options;
  serving_options.max_queue = config.limits.max_queue;
  serving_options.request_timeout_s = config.limits.request_timeout_s;
  serving_options.metrics = &metrics;
  const std::string model_name = server::ModelNameFromDirectory(model_dir.string());
  serving_options.model_name = model_name;
  for (const auto& [name, names] : server::kMetricNames) {  // the config checked the name
    if (name == config.server.metrics_names) serving_options.metric_names = names;
  }
  RUBATO_ASSIGN_OR_RETURN(
      std::unique_ptr<server::ServingEngine> serving,
      server::ServingEngine::Create(std::move(engine), tokenizer.get(), serving_options));
  // Its request workers stop before the engine and the tokenizer they use go.
  server::OpenAiRouter router(
      serving.get(), tokenizer.get(), &metrics,
      {model_name, config.limits.max_prompt_tokens, config.server.cors_allowed_origins,
       server::RequestThreads(config.server.request_threads), config.server.request_queue,
       config.server.api_key, config.server.api_key_protects_metrics});
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
  std::printf("rubato serve: %s\n", kv_pool.c_str());
  std::printf("rubato serve: listening on http://%s:%u\n", config.server.host.c_str(),
              static_cast<unsigned>(http->port()));
  std::fflush(stdout);

  while (signals_received.load() == 0) std::this_thread::sleep_for(std::chrono::milliseconds(50));
  // The metrics listener stays up while the API drains (the drain shows in the metrics).
  Drain(*http, *serving, config.server.shutdown_grace_s);
  if (metrics_http != nullptr) metrics_http->Stop();
  return Status::Ok();
}

}  // namespace
}  // namespace rubato
