// rubato_bench_host_path: what each layer above Model::Forward adds per generated token. The
// same requests (batch x greedy, ignore_eos) run through: the Engine's Step loop alone; `rubato
// generate`'s token loop (detokenisation, writes to /dev/null); the ServingEngine's thread with a
// null client (routing, detokenisation, stop strings, metrics); the OpenAI router with a
// consumer thread in place of the HTTP I/O thread (JSON / SSE encoding, reply hand-over,
// wakeups); and the HTTP server with local clients. A wrapper model times every Forward, so each
// layer's host time is its wall time minus the forward time of the same run. Component costs
// (detokenise, SSE chunk, reply write) are timed alone as well. A benchmark, not a test.
// docs/benchmarks.md "Host path of generate and serve".
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <fstream>
#include <functional>
#include <memory>
#include <mutex>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "bench/host_path_model.h"
#include "common/metrics.h"
#include "common/tokenizer/stream_decoder.h"
#include "inference_rank/cli/engine_setup.h"
#include "inference_rank/cli/generate_stream.h"
#include "inference_rank/server/http_server.h"
#include "inference_rank/server/openai_api.h"
#include "inference_rank/server/openai_router.h"
#include "inference_rank/server/pending_reply.h"
#include "inference_rank/server/serving_engine.h"

#ifndef RUBATO_GIT_COMMIT
#define RUBATO_GIT_COMMIT "unknown"
#endif

namespace rubato {
namespace {

using Clock = std::chrono::steady_clock;
using nlohmann::json;

struct Options {
  std::string model_dir = "models/tiny-qwen3-random";
  std::string tokenizer_dir;  // empty: the model directory
  std::string backend = "cpu";
  bool random_weights = false;
  std::string batches = "1,4";
  int tokens = 128;        // generated per request
  int prompt_tokens = 16;  // per request
  int repeats = 5;
  int threads = 1;
  std::string layers =
      "engine,generate,serving,serving_stop,serving_metrics,router_full,"
      "router_stream,http_full,http_stream";
  std::string device;  // a label for the report (e.g. the CPU's name)
  std::string commit;  // empty: the build's
  std::string out;
  std::string command_line;
};

// What one run of one layer measured.
struct RunTimes {
  double wall_s = 0, forward_s = 0;
  int64_t steps = 0, tokens = 0;
  // Between two Forwards, on the stepping thread: the median wall gap and the mean CPU.
  double gap_wall_median_us = 0, gap_cpu_mean_us = 0;
  double edges_ms = 0;  // wall before the first Forward and after the last (per-request work)
  double process_cpu_s = 0, forward_cpu_s = 0;  // every thread's CPU; the Forwards'
};

double ProcessCpuSeconds() {
  timespec t{};
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &t);
  return static_cast<double>(t.tv_sec) + 1e-9 * static_cast<double>(t.tv_nsec);
}

// The run's times from its model, `start` / `end` its wall bounds (TimedModel::WallSeconds) and
// `cpu_start` the process CPU at its start.
void Fill(RunTimes& times, const TimedModel& timed, double start, double end, double cpu_start) {
  times.wall_s = end - start;
  times.forward_s = timed.forward_seconds();
  times.forward_cpu_s = timed.forward_cpu_seconds();
  times.process_cpu_s = ProcessCpuSeconds() - cpu_start;
  times.steps = timed.forwards();
  std::vector<double> wall = timed.wall_gaps();
  std::sort(wall.begin(), wall.end());
  if (!wall.empty()) times.gap_wall_median_us = wall[wall.size() / 2] * 1e6;
  double cpu = 0;
  for (double gap : timed.cpu_gaps()) cpu += gap;
  if (!timed.cpu_gaps().empty()) times.gap_cpu_mean_us = cpu * 1e6 / timed.cpu_gaps().size();
  times.edges_ms = (timed.first_start() - start + end - timed.last_end()) * 1e3;
}

std::vector<std::string> Split(const std::string& text) {
  std::vector<std::string> items;
  std::stringstream stream(text);
  for (std::string item; std::getline(stream, item, ',');) {
    if (!item.empty()) items.push_back(item);
  }
  return items;
}

double Seconds(Clock::duration d) { return std::chrono::duration<double>(d).count(); }
double Now() { return TimedModel::WallSeconds(); }

double Median(std::vector<double> values) {
  std::sort(values.begin(), values.end());
  return values.empty() ? 0.0 : values[values.size() / 2];
}

// The model, loaded once; every run wraps it in a fresh TimedModel and Engine.
struct Setup {
  Options options;
  std::unique_ptr<Model> model;
  std::unique_ptr<Tokenizer> tokenizer;
  std::vector<int> prompt;
};

Result<std::unique_ptr<Engine>> MakeEngine(Setup& setup, int batch, MetricsRegistry* metrics,
                                           TimedModel** timed_out) {
  auto timed = std::make_unique<TimedModel>(*setup.model);
  *timed_out = timed.get();
  EngineOptions options;
  options.max_batch = batch;
  options.block_size = 16;
  options.max_context = setup.options.prompt_tokens + setup.options.tokens + 16;
  options.max_kv_blocks = batch * ((options.max_context + 15) / 16);
  options.num_threads = setup.options.threads;
  options.metrics = metrics;
  return Engine::Create(std::move(timed), options);
}

GenerationRequest Request(const Setup& setup) {
  GenerationRequest request;
  request.prompt_ids = setup.prompt;
  request.max_new_tokens = setup.options.tokens;
  request.ignore_eos = true;
  return request;
}

// Engine::Step alone, or `rubato generate`'s loop writing to /dev/null.
Result<RunTimes> RunEngine(Setup& setup, int batch, bool generate_loop) {
  TimedModel* timed = nullptr;
  RUBATO_ASSIGN_OR_RETURN(std::unique_ptr<Engine> engine,
                          MakeEngine(setup, batch, nullptr, &timed));
  for (int i = 0; i < batch; ++i) RUBATO_RETURN_IF_ERROR(engine->Submit(Request(setup)).status());
  RunTimes times;
  const double cpu_start = ProcessCpuSeconds();
  const double start_s = Now();
  const Clock::time_point start = Clock::now();
  if (generate_loop) {
    std::FILE* null_out = std::fopen("/dev/null", "w");
    if (null_out == nullptr) return UnavailableError("cannot open /dev/null");
    StreamDecoder decoder(*setup.tokenizer, /*skip_special_tokens=*/true);
    GenerateStreamStats stats;
    const Status status = StreamGeneratedTokens(*engine, &decoder, null_out, start, stats);
    std::fclose(null_out);
    RUBATO_RETURN_IF_ERROR(status);
    times.tokens = stats.generated;
  } else {
    while (engine->HasWork()) {
      RUBATO_ASSIGN_OR_RETURN(std::vector<TokenEvent> events, engine->Step());
      times.tokens += static_cast<int64_t>(events.size());
    }
  }
  Fill(times, *timed, start_s, Now(), cpu_start);
  return times;
}

// Counts requests that finished; wakes the waiter at the last.
class Finished {
 public:
  void One() {
    std::lock_guard<std::mutex> lock(mutex_);
    ++count_;
    done_.notify_all();
  }
  void WaitFor(int n) {
    std::unique_lock<std::mutex> lock(mutex_);
    done_.wait(lock, [&] { return count_ >= n; });
  }

 private:
  std::mutex mutex_;
  std::condition_variable done_;
  int count_ = 0;
};

// The ServingEngine with a null client: `stops` adds stop strings that never match, `metrics`
// the serving metrics (and the engine's).
Result<RunTimes> RunServing(Setup& setup, int batch, bool stops, bool with_metrics) {
  MetricsRegistry metrics;
  TimedModel* timed = nullptr;
  RUBATO_ASSIGN_OR_RETURN(std::unique_ptr<Engine> engine,
                          MakeEngine(setup, batch, with_metrics ? &metrics : nullptr, &timed));
  server::ServingEngineOptions options;
  if (with_metrics) options.metrics = &metrics;
  options.model_name = "bench";
  RUBATO_ASSIGN_OR_RETURN(
      std::unique_ptr<server::ServingEngine> serving,
      server::ServingEngine::Create(std::move(engine), setup.tokenizer.get(), options));
  Finished finished;
  std::atomic<int64_t> tokens{0};
  serving->Start();
  const double cpu_start = ProcessCpuSeconds();
  const double start = Now();
  for (int i = 0; i < batch; ++i) {
    server::ServingRequest request;
    request.generation = Request(setup);
    if (stops) request.stop_strings = {"\n\nUser:", "<|im_end|>"};
    request.on_update = [&](const server::ServingUpdate& update) {
      if (!update.finished) return;
      tokens += update.completion_tokens;
      finished.One();
    };
    RUBATO_RETURN_IF_ERROR(serving->Submit(std::move(request)).status());
  }
  finished.WaitFor(batch);
  RunTimes times;
  Fill(times, *timed, start, Now(), cpu_start);
  serving->Stop();
  times.tokens = tokens;
  return times;
}

std::string CompletionBody(const Setup& setup, bool stream) {
  json body = {{"prompt", setup.prompt},
               {"max_tokens", setup.options.tokens},
               {"temperature", 0},
               {"ignore_eos", true},
               {"stream", stream}};
  return body.dump();
}

// One HTTP/1.1 request over a blocking socket; the reply read to the server's close.
Result<std::string> HttpPost(uint16_t port, const std::string& body) {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) return UnavailableError("socket() failed");
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_port = htons(port);
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (::connect(fd, reinterpret_cast<sockaddr*>(&address), sizeof(address)) != 0) {
    ::close(fd);
    return UnavailableError("cannot connect to 127.0.0.1:" + std::to_string(port));
  }
  const std::string request =
      "POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
      "Connection: close\r\nContent-Length: " +
      std::to_string(body.size()) + "\r\n\r\n" + body;
  for (size_t sent = 0; sent < request.size();) {
    const ssize_t n = ::send(fd, request.data() + sent, request.size() - sent, 0);
    if (n <= 0) {
      ::close(fd);
      return UnavailableError("send() failed");
    }
    sent += static_cast<size_t>(n);
  }
  std::string reply;
  char buffer[16384];
  for (ssize_t n; (n = ::recv(fd, buffer, sizeof(buffer), 0)) > 0;) reply.append(buffer, n);
  ::close(fd);
  return reply;
}

// The OpenAI router on the ServingEngine (metrics on, as `rubato serve`), its replies taken by a
// consumer thread per request (`http` false: what the I/O thread does, without sockets) or
// written by the HTTP server to local clients (`http` true).
Result<RunTimes> RunRouter(Setup& setup, int batch, bool stream, bool http) {
  MetricsRegistry metrics;
  TimedModel* timed = nullptr;
  RUBATO_ASSIGN_OR_RETURN(std::unique_ptr<Engine> engine,
                          MakeEngine(setup, batch, &metrics, &timed));
  server::ServingEngineOptions options;
  options.metrics = &metrics;
  options.model_name = "bench";
  RUBATO_ASSIGN_OR_RETURN(
      std::unique_ptr<server::ServingEngine> serving,
      server::ServingEngine::Create(std::move(engine), setup.tokenizer.get(), options));
  server::OpenAiRouterOptions router_options;
  router_options.model_name = "bench";
  server::OpenAiRouter router(serving.get(), setup.tokenizer.get(), &metrics, router_options);
  serving->Start();
  const std::string body = CompletionBody(setup, stream);
  std::vector<std::thread> clients;
  std::vector<Status> errors(static_cast<size_t>(batch));
  std::unique_ptr<server::HttpServer> server;
  if (http) {
    server::HttpServerOptions http_options;
    http_options.port = 0;
    RUBATO_ASSIGN_OR_RETURN(
        server, server::HttpServer::Start(http_options, [&router](const server::HttpRequest& r) {
          return router.Handle(r);
        }));
  }
  const double cpu_start = ProcessCpuSeconds();
  const double start = Now();
  for (int i = 0; i < batch; ++i) {
    clients.emplace_back([&, i] {
      Status& error = errors[static_cast<size_t>(i)];
      if (http) {
        Result<std::string> reply = HttpPost(server->port(), body);
        if (!reply.ok())
          error = reply.status();
        else if (reply->rfind("HTTP/1.1 200", 0) != 0)
          error = InternalError(reply->substr(0, 200));
        return;
      }
      server::HttpRequest request;
      request.method = "POST";
      request.path = "/v1/completions";
      request.body = body;
      const server::HttpReply reply = router.Handle(request);
      if (reply.pending == nullptr) {
        error = InternalError("no pending reply: " + reply.body);
        return;
      }
      std::mutex mutex;
      std::condition_variable ready;
      bool notified = false;
      reply.pending->SetNotify([&] {
        std::lock_guard<std::mutex> lock(mutex);
        notified = true;
        ready.notify_one();
      });
      while (true) {
        {
          std::unique_lock<std::mutex> lock(mutex);
          ready.wait(lock, [&] { return notified; });
          notified = false;
        }
        const server::PendingReply::Progress progress = reply.pending->Take();
        if (progress.complete && progress.status != 200) error = InternalError(progress.body);
        if (progress.complete || progress.stream_ended) break;
      }
      reply.pending->SetNotify(nullptr);
    });
  }
  for (std::thread& client : clients) client.join();
  RunTimes times;
  Fill(times, *timed, start, Now(), cpu_start);
  if (server != nullptr) server->Stop();
  serving->Stop();
  for (const Status& error : errors) RUBATO_RETURN_IF_ERROR(error);
  times.tokens = static_cast<int64_t>(batch) * setup.options.tokens;
  return times;
}

Result<RunTimes> RunLayer(Setup& setup, const std::string& layer, int batch) {
  if (layer == "engine") return RunEngine(setup, batch, false);
  if (layer == "generate") return RunEngine(setup, batch, true);
  if (layer == "serving") return RunServing(setup, batch, false, false);
  if (layer == "serving_stop") return RunServing(setup, batch, true, false);
  if (layer == "serving_metrics") return RunServing(setup, batch, true, true);
  if (layer == "router_full") return RunRouter(setup, batch, false, false);
  if (layer == "router_stream") return RunRouter(setup, batch, true, false);
  if (layer == "http_full") return RunRouter(setup, batch, false, true);
  if (layer == "http_stream") return RunRouter(setup, batch, true, true);
  return InvalidArgumentError("--layers: unknown layer '" + layer + "'");
}

// Per-token costs of the pieces, each alone on this thread (nanoseconds per call).
json Components(const Setup& setup) {
  const int n = 20000;
  std::vector<int> ids(n);
  for (int i = 0; i < n; ++i) ids[i] = (i * 7919 + 13) % setup.model->config().vocab_size;
  json result;
  auto time_ns = [&](const std::function<void(int)>& body) {
    const Clock::time_point start = Clock::now();
    for (int i = 0; i < n; ++i) body(i);
    return Seconds(Clock::now() - start) * 1e9 / n;
  };
  StreamDecoder decoder(*setup.tokenizer, true);
  size_t sink = 0;
  result["detokenize_push_ns"] = time_ns([&](int i) { sink += decoder.Push(ids[i]).size(); });
  std::string text;
  result["detokenize_push_to_ns"] = time_ns([&](int i) {
    text.clear();
    decoder.PushTo(ids[i], &text);
    sink += text.size();
  });
  server::CompletionResult head;
  head.id = "cmpl-0123456789abcdef";
  head.model = "bench";
  head.created = 1700000000;
  result["sse_chunk_ns"] = time_ns([&](int) {
    sink += server::SseEvent(server::CompletionChunkJson(server::CompletionKind::kText, head,
                                                         " word", "", false, nullptr))
                .size();
  });
  server::PendingReply reply;
  reply.StartStream("text/event-stream");
  reply.SetNotify([] {});
  result["reply_write_ns"] = time_ns([&](int i) {
    reply.Write("data: {\"x\": 1}\n\n");
    if (i % 64 == 63) sink += reply.Take().body.size();
  });
  result["sink"] = sink;  // keeps the work
  return result;
}

Status Run(const Options& options, json& report) {
  ConfigOverrides overrides;
  overrides.model_dir = options.model_dir;
  overrides.random_weights = options.random_weights;
  overrides.backend = options.backend;
  overrides.threads = options.threads;
  RUBATO_ASSIGN_OR_RETURN(RubatoConfig config, ResolveConfig(overrides));
  Setup setup;
  setup.options = options;
  RUBATO_ASSIGN_OR_RETURN(setup.model, LoadModel(config, options.model_dir));
  RUBATO_ASSIGN_OR_RETURN(
      setup.tokenizer,
      Tokenizer::LoadFromDirectory(options.tokenizer_dir.empty() ? options.model_dir
                                                                 : options.tokenizer_dir));
  for (int i = 0; i < options.prompt_tokens; ++i) {
    setup.prompt.push_back((i * 31 + 7) % setup.model->config().vocab_size);
  }
  report["components"] = Components(setup);
  std::printf("%-16s %5s %9s %12s %12s %10s %12s\n", "layer", "batch", "step_ms", "gap_cpu_us",
              "gap_wall_us", "edges_ms", "cpu_us/tok");
  for (const std::string& batch_text : Split(options.batches)) {
    const int batch = std::stoi(batch_text);
    for (const std::string& layer : Split(options.layers)) {
      std::vector<double> step_ms, gap_cpu, gap_wall, edges, cpu_token;
      RunTimes last;
      for (int r = 0; r < options.repeats; ++r) {
        RUBATO_ASSIGN_OR_RETURN(last, RunLayer(setup, layer, batch));
        step_ms.push_back(last.forward_s * 1e3 / std::max<int64_t>(1, last.steps));
        gap_cpu.push_back(last.gap_cpu_mean_us);
        gap_wall.push_back(last.gap_wall_median_us);
        edges.push_back(last.edges_ms);
        cpu_token.push_back((last.process_cpu_s - last.forward_cpu_s) * 1e6 /
                            std::max<int64_t>(1, last.tokens));
      }
      json row = {{"layer", layer},
                  {"batch", batch},
                  {"tokens", last.tokens},
                  {"steps", last.steps},
                  {"forward_ms_per_step", Median(step_ms)},
                  {"gap_cpu_us_per_step", Median(gap_cpu)},
                  {"gap_cpu_us_per_step_min", *std::min_element(gap_cpu.begin(), gap_cpu.end())},
                  {"gap_wall_us_per_step", Median(gap_wall)},
                  {"edges_ms", Median(edges)},
                  {"process_cpu_us_per_token_outside_forward", Median(cpu_token)}};
      report["runs"].push_back(row);
      std::printf("%-16s %5d %9.3f %12.2f %12.2f %10.2f %12.2f\n", layer.c_str(), batch,
                  Median(step_ms), Median(gap_cpu), Median(gap_wall), Median(edges),
                  Median(cpu_token));
      std::fflush(stdout);
    }
  }
  return Status::Ok();
}

}  // namespace
}  // namespace rubato

int main(int argc, char** argv) {
  rubato::Options options;
  CLI::App app{"Host time per generated token of each layer above Model::Forward"};
  app.add_option("--model", options.model_dir, "model directory (config.json, weights)");
  app.add_option("--tokenizer", options.tokenizer_dir,
                 "directory with tokenizer.json (default: the model's)");
  app.add_option("--backend", options.backend, "cpu | cuda");
  app.add_flag("--random-weights", options.random_weights, "random weights of config.json");
  app.add_option("--batches", options.batches, "comma-separated batch sizes");
  app.add_option("--tokens", options.tokens, "tokens generated per request");
  app.add_option("--prompt-tokens", options.prompt_tokens, "prompt tokens per request");
  app.add_option("--repeats", options.repeats, "runs per layer and batch (medians reported)");
  app.add_option("--threads", options.threads, "engine threads (engine.threads)");
  app.add_option("--layers", options.layers, "comma-separated layers to run");
  app.add_option("--device", options.device, "device label for the report");
  app.add_option("--commit", options.commit, "commit to record (default: the build's)");
  app.add_option("--out", options.out, "JSON report path");
  CLI11_PARSE(app, argc, argv);
  if (options.tokens < 2 || options.prompt_tokens < 1 || options.repeats < 1) {
    std::fprintf(stderr,
                 "rubato_bench_host_path: --tokens >= 2, --prompt-tokens and --repeats >= 1\n");
    return 2;
  }
  for (int i = 0; i < argc; ++i) options.command_line += (i ? " " : "") + std::string(argv[i]);
  nlohmann::json report = {{"benchmark", "host_path"},
                           {"device", options.device},
                           {"backend", options.backend},
                           {"model", options.model_dir},
                           {"commit", options.commit.empty() ? RUBATO_GIT_COMMIT : options.commit},
                           {"command", options.command_line},
                           {"tokens_per_request", options.tokens},
                           {"prompt_tokens", options.prompt_tokens},
                           {"threads", options.threads},
                           {"repeats", options.repeats}};
  const rubato::Status status = rubato::Run(options, report);
  if (!status.ok()) {
    std::fprintf(stderr, "rubato_bench_host_path: %s\n", status.message().c_str());
    return 1;
  }
  if (!options.out.empty()) {
    std::ofstream file(options.out);
    file << report.dump(2) << "\n";
    if (!file) {
      std::fprintf(stderr, "rubato_bench_host_path: cannot write %s\n", options.out.c_str());
      return 1;
    }
  }
  return 0;
}
