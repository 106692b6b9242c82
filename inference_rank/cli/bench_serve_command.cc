// `rubato bench serve` (see bench_serve_command.h): request schedule, one thread per request in
// flight over a blocking socket, Server-Sent Events timing, percentiles and the report.
#include "inference_rank/cli/bench_serve_command.h"

#include <arpa/inet.h>
#include <netdb.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <fstream>
#include <mutex>
#include <nlohmann/json.hpp>
#include <random>
#include <thread>
#include <vector>

namespace rubato {
namespace {

using nlohmann::json;
using Clock = std::chrono::steady_clock;

double Seconds(Clock::duration d) { return std::chrono::duration<double>(d).count(); }

// What one request measured.
struct RequestOutcome {
  bool ok = false;
  std::string error;
  double ttft = 0;  // seconds
  double e2e = 0;
  std::vector<double> itl;  // gaps between text chunks after the first
  int prompt_tokens = 0;
  int output_tokens = 0;
};

// A blocking TCP connection to host:port with 600 s timeouts, or -1 and `error`.
int Dial(const std::string& host, int port, std::string& error) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* found = nullptr;
  if (getaddrinfo(host.c_str(), std::to_string(port).c_str(), &hints, &found) != 0) {
    error = "cannot resolve " + host;
    return -1;
  }
  int fd = -1;
  for (addrinfo* a = found; a != nullptr && fd < 0; a = a->ai_next) {
    fd = ::socket(a->ai_family, a->ai_socktype, a->ai_protocol);
    if (fd >= 0 && ::connect(fd, a->ai_addr, a->ai_addrlen) != 0) {
      ::close(fd);
      fd = -1;
    }
  }
  freeaddrinfo(found);
  if (fd < 0) {
    error = "cannot connect to " + host + ":" + std::to_string(port);
    return -1;
  }
  timeval timeout{600, 0};
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &timeout, sizeof(timeout));
  setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &timeout, sizeof(timeout));
  return fd;
}

bool SendAll(int fd, const std::string& data) {
  for (size_t sent = 0; sent < data.size();) {
    const ssize_t n = ::send(fd, data.data() + sent, data.size() - sent, MSG_NOSIGNAL);
    if (n <= 0) return false;
    sent += static_cast<size_t>(n);
  }
  return true;
}

std::string HttpRequestText(const std::string& method, const std::string& host,
                            const std::string& path, const std::string& body) {
  return method + " " + path + " HTTP/1.1\r\nHost: " + host +
         "\r\nContent-Type: application/json\r\nContent-Length: " + std::to_string(body.size()) +
         "\r\nConnection: close\r\n\r\n" + body;
}

// GET /v1/models: the first model's id.
Result<std::string> FirstModel(const BenchServeArgs& args) {
  std::string error;
  const int fd = Dial(args.host, args.port, error);
  if (fd < 0) return UnavailableError("bench serve: " + error);
  std::string raw;
  if (SendAll(fd, HttpRequestText("GET", args.host, "/v1/models", ""))) {
    char buffer[4096];
    for (ssize_t n; (n = ::recv(fd, buffer, sizeof(buffer), 0)) > 0;) raw.append(buffer, n);
  }
  ::close(fd);
  const size_t body_at = raw.find("\r\n\r\n");
  const size_t json_at = raw.find('{', body_at == std::string::npos ? 0 : body_at);
  const json list =
      json::parse(json_at == std::string::npos ? "" : raw.substr(json_at), nullptr, false);
  if (list.is_discarded() || !list.contains("data") || list["data"].empty()) {
    return UnavailableError("bench serve: GET /v1/models on " + args.host + ":" +
                            std::to_string(args.port) + " gave no model; pass --model");
  }
  return list["data"][0]["id"].get<std::string>();
}

// One streamed completion; the events are read as they arrive (each chunk of the reply holds
// whole events, so scanning the bytes for "data: ...\n\n" needs no de-chunking).
RequestOutcome RunRequest(const BenchServeArgs& args, const std::string& body) {
  RequestOutcome outcome;
  const Clock::time_point start = Clock::now();
  const int fd = Dial(args.host, args.port, outcome.error);
  if (fd < 0) return outcome;
  if (!SendAll(fd, HttpRequestText("POST", args.host, "/v1/completions", body))) {
    ::close(fd);
    outcome.error = "the request could not be sent";
    return outcome;
  }
  std::string raw;
  size_t scanned = 0;
  bool first = true;
  bool done = false;
  Clock::time_point last = start;
  char buffer[16384];
  while (!done) {
    const ssize_t n = ::recv(fd, buffer, sizeof(buffer), 0);
    if (n <= 0) break;
    const Clock::time_point now = Clock::now();
    raw.append(buffer, static_cast<size_t>(n));
    if (raw.rfind("HTTP/1.1 200", 0) != 0 && raw.find("\r\n\r\n") != std::string::npos) {
      continue;  // an error reply: read it whole
    }
    for (size_t at; (at = raw.find("data: ", scanned)) != std::string::npos;) {
      const size_t end = raw.find("\n\n", at);
      if (end == std::string::npos) break;
      scanned = end + 2;
      const std::string payload = raw.substr(at + 6, end - at - 6);
      if (payload == "[DONE]") {
        done = true;
        break;
      }
      const json event = json::parse(payload, nullptr, false);
      if (event.is_discarded()) continue;
      if (event.contains("error")) {
        outcome.error = event["error"].value("message", "error event");
        continue;
      }
      if (event.contains("usage") && event["usage"].is_object()) {
        outcome.prompt_tokens = event["usage"].value("prompt_tokens", 0);
        outcome.output_tokens = event["usage"].value("completion_tokens", 0);
      }
      if (!event.contains("choices") || event["choices"].empty()) continue;
      const std::string text = event["choices"][0].value("text", "");
      if (text.empty()) continue;
      if (first) {
        outcome.ttft = Seconds(now - start);
        first = false;
      } else {
        outcome.itl.push_back(Seconds(now - last));
      }
      last = now;
    }
  }
  ::close(fd);
  outcome.e2e = Seconds(Clock::now() - start);
  if (!done && outcome.error.empty()) {
    const size_t line_end = raw.find("\r\n");
    outcome.error = raw.empty()
                        ? "no reply"
                        : raw.substr(0, line_end) + " " + raw.substr(raw.find("\r\n\r\n") + 4, 300);
  }
  outcome.ok = done && outcome.error.empty();
  return outcome;
}

double Percentile(std::vector<double> values, double p) {
  if (values.empty()) return 0;
  std::sort(values.begin(), values.end());
  // Linear interpolation between closest ranks (numpy's default, as vllm bench serve).
  const double rank = p / 100.0 * static_cast<double>(values.size() - 1);
  const size_t low = static_cast<size_t>(rank);
  const size_t high = std::min(low + 1, values.size() - 1);
  return values[low] + (values[high] - values[low]) * (rank - static_cast<double>(low));
}

json Summary(const std::vector<double>& seconds) {
  double sum = 0;
  for (double s : seconds) sum += s;
  const auto ms = [](double s) { return s * 1e3; };
  return {{"mean", ms(seconds.empty() ? 0 : sum / static_cast<double>(seconds.size()))},
          {"p50", ms(Percentile(seconds, 50))},
          {"p90", ms(Percentile(seconds, 90))},
          {"p99", ms(Percentile(seconds, 99))}};
}

void DrawProgress(int done, int total) {
  constexpr int kWidth = 40;
  const int filled = total == 0 ? kWidth : done * kWidth / total;
  std::fprintf(stderr, "\r[%s%s] %d/%d", std::string(filled, '#').c_str(),
               std::string(kWidth - filled, ' ').c_str(), done, total);
  if (done == total) std::fprintf(stderr, "\n");
  std::fflush(stderr);
}

}  // namespace

Status RunBenchServe(const BenchServeArgs& args) {
  if (args.num_prompts < 1 || args.input_len < 1 || args.output_len < 1 || args.vocab_limit < 2 ||
      args.request_rate < 0 || args.max_concurrency < 0) {
    return InvalidArgumentError(
        "bench serve: --num-prompts, --input-len, --output-len must be "
        ">= 1, --request-rate and --max-concurrency >= 0");
  }
  std::string model;
  if (args.model) {
    model = *args.model;
  } else {
    RUBATO_ASSIGN_OR_RETURN(model, FirstModel(args));
  }
  // Prompts and arrival gaps from the seed: the same load every run.
  std::mt19937_64 rng(args.seed);
  std::uniform_int_distribution<int> token(1, args.vocab_limit - 1);
  std::exponential_distribution<double> gap(args.request_rate > 0 ? args.request_rate : 1.0);
  std::vector<std::string> bodies;
  std::vector<double> arrivals;  // seconds after the start
  double at = 0;
  for (int i = 0; i < args.num_prompts; ++i) {
    std::vector<int> prompt(static_cast<size_t>(args.input_len));
    for (int& id : prompt) id = token(rng);
    bodies.push_back(json({{"model", model},
                           {"prompt", prompt},
                           {"max_tokens", args.output_len},
                           {"temperature", 0},
                           {"stream", true},
                           {"stream_options", {{"include_usage", true}}}})
                         .dump());
    arrivals.push_back(at);
    if (args.request_rate > 0) at += gap(rng);
  }

  std::vector<RequestOutcome> outcomes(bodies.size());
  std::mutex mutex;
  std::condition_variable changed;
  int in_flight = 0;
  int finished = 0;
  std::vector<std::thread> threads;
  const Clock::time_point start = Clock::now();
  if (args.progress) DrawProgress(0, args.num_prompts);
  for (size_t i = 0; i < bodies.size(); ++i) {
    std::this_thread::sleep_until(start + std::chrono::duration_cast<Clock::duration>(
                                              std::chrono::duration<double>(arrivals[i])));
    {
      std::unique_lock<std::mutex> lock(mutex);
      changed.wait(lock,
                   [&] { return args.max_concurrency == 0 || in_flight < args.max_concurrency; });
      ++in_flight;
    }
    threads.emplace_back([&, i] {
      outcomes[i] = RunRequest(args, bodies[i]);
      std::lock_guard<std::mutex> lock(mutex);
      --in_flight;
      ++finished;
      if (args.progress) DrawProgress(finished, args.num_prompts);
      changed.notify_all();
    });
  }
  for (std::thread& thread : threads) thread.join();
  const double duration = Seconds(Clock::now() - start);

  std::vector<double> ttft, tpot, itl, e2el;
  json errors = json::array();
  int completed = 0;
  int64_t input_tokens = 0;
  int64_t output_tokens = 0;
  for (const RequestOutcome& outcome : outcomes) {
    if (!outcome.ok) {
      errors.push_back(outcome.error);
      continue;
    }
    ++completed;
    input_tokens += outcome.prompt_tokens;
    output_tokens += outcome.output_tokens;
    ttft.push_back(outcome.ttft);
    e2el.push_back(outcome.e2e);
    if (outcome.output_tokens > 1) {
      tpot.push_back((outcome.e2e - outcome.ttft) / (outcome.output_tokens - 1));
    }
    itl.insert(itl.end(), outcome.itl.begin(), outcome.itl.end());
  }
  const json result = {
      {"model", model},
      {"num_prompts", args.num_prompts},
      {"request_rate", args.request_rate > 0 ? json(args.request_rate) : json("inf")},
      {"max_concurrency", args.max_concurrency},
      {"input_len", args.input_len},
      {"output_len", args.output_len},
      {"seed", args.seed},
      {"duration_s", duration},
      {"completed", completed},
      {"failed", args.num_prompts - completed},
      {"errors", errors},
      {"total_input_tokens", input_tokens},
      {"total_output_tokens", output_tokens},
      {"request_throughput", completed / duration},
      {"output_throughput", static_cast<double>(output_tokens) / duration},
      {"ttft_ms", Summary(ttft)},
      {"tpot_ms", Summary(tpot)},
      {"itl_ms", Summary(itl)},
      {"e2el_ms", Summary(e2el)}};
  std::printf("============ Serving Benchmark Result ============\n");
  std::printf("%-40s %d\n%-40s %d\n%-40s %.2f\n", "Successful requests:", completed,
              "Failed requests:", args.num_prompts - completed,
              "Benchmark duration (s):", duration);
  std::printf("%-40s %lld\n%-40s %lld\n",
              "Total input tokens:", static_cast<long long>(input_tokens),
              "Total generated tokens:", static_cast<long long>(output_tokens));
  std::printf("%-40s %.2f\n%-40s %.2f\n", "Request throughput (req/s):", completed / duration,
              "Output token throughput (tok/s):", static_cast<double>(output_tokens) / duration);
  for (const char* name : {"ttft_ms", "tpot_ms", "itl_ms", "e2el_ms"}) {
    const json& s = result[name];
    std::printf("%-8s mean %.2f  p50 %.2f  p90 %.2f  p99 %.2f (ms)\n", name,
                s["mean"].get<double>(), s["p50"].get<double>(), s["p90"].get<double>(),
                s["p99"].get<double>());
  }
  for (const auto& error : errors) std::printf("error: %s\n", error.get<std::string>().c_str());
  std::fflush(stdout);
  if (args.result_file) {
    std::ofstream out(*args.result_file);
    out << result.dump(2) << "\n";
    if (!out) return UnavailableError("bench serve: cannot write " + *args.result_file);
  }
  return Status::Ok();
}

}  // namespace rubato
