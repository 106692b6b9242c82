// `rubato bench serve` (see bench_serve_command.h): the server's address and model, vLLM's
// random dataset (lengths, offsets and token ids from --seed, each body built when its request
// is sent), the arrival schedule, then the load (bench_serve_load.h) and the report and result
// file (bench_serve_result.h).
#include "inference_rank/cli/bench_serve_command.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <ctime>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <random>

#include "inference_rank/cli/bench_serve_load.h"
#include "inference_rank/cli/bench_serve_result.h"

namespace rubato {
namespace {

using bench::Clock;
using nlohmann::json;

// What the chat backend's prompts are made of: common words, about one token each.
constexpr const char* kWords[] = {
    "the",   "of",    "and",   "to",    "in",    "is",   "that", "for",   "it",    "as",
    "was",   "with",  "be",    "by",    "on",    "not",  "he",   "this",  "are",   "or",
    "his",   "from",  "at",    "which", "but",   "have", "an",   "had",   "they",  "you",
    "were",  "their", "one",   "all",   "we",    "can",  "her",  "has",   "there", "been",
    "if",    "more",  "when",  "will",  "would", "who",  "so",   "no",    "time",  "day",
    "water", "house", "light", "world", "year",  "work", "hand", "place", "point", "city"};
constexpr int64_t kWordCount = sizeof(kWords) / sizeof(kWords[0]);

Clock::duration SecondsToDuration(double seconds) {
  return std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(seconds));
}

// --base-url http://HOST[:PORT][/PREFIX], else --host and --port.
Result<bench::ServerAddress> ServerAddressOf(const BenchServeArgs& args) {
  bench::ServerAddress server{args.host, std::to_string(args.port), ""};
  if (!args.base_url) return server;
  const std::string& url = *args.base_url;
  constexpr std::string_view kScheme = "http://";
  if (url.rfind(kScheme, 0) != 0) {
    return InvalidArgumentError(
        "bench serve: --base-url must start with http:// (no TLS here), got '" +
        bench::Excerpt(url) + "'");
  }
  const std::string rest = url.substr(kScheme.size());
  const size_t slash = rest.find('/');
  const std::string authority = rest.substr(0, slash);
  server.path_prefix = slash == std::string::npos ? "" : rest.substr(slash);
  while (!server.path_prefix.empty() && server.path_prefix.back() == '/') {
    server.path_prefix.pop_back();
  }
  const size_t bracket = authority.rfind(']');
  const size_t colon = authority.rfind(':');
  const bool has_port =
      colon != std::string::npos && (bracket == std::string::npos || colon > bracket);
  server.host = authority.substr(0, has_port ? colon : std::string::npos);
  server.port = has_port ? authority.substr(colon + 1) : "80";
  if (server.host.size() > 2 && server.host.front() == '[' && server.host.back() == ']') {
    server.host = server.host.substr(1, server.host.size() - 2);
  }
  const bool port_ok = !server.port.empty() && server.port.size() <= 5 &&
                       std::all_of(server.port.begin(), server.port.end(), ::isdigit) &&
                       std::stoi(server.port) >= 1 && std::stoi(server.port) <= 65535;
  if (server.host.empty() || !port_ok) {
    return InvalidArgumentError("bench serve: --base-url '" + bench::Excerpt(url) +
                                "' has no valid host and port");
  }
  return server;
}

Result<std::string> EndpointOf(const BenchServeArgs& args) {
  const bool chat = args.backend == "openai-chat";
  const std::string endpoint =
      args.endpoint.value_or(chat ? "/v1/chat/completions" : "/v1/completions");
  const bool ends_chat =
      endpoint.size() >= 16 && endpoint.compare(endpoint.size() - 16, 16, "chat/completions") == 0;
  const bool ends_completions =
      endpoint.size() >= 11 && endpoint.compare(endpoint.size() - 11, 11, "completions") == 0;
  if (endpoint.empty() || endpoint[0] != '/' || (chat && !ends_chat) ||
      (!chat && (!ends_completions || ends_chat))) {
    return InvalidArgumentError("bench serve: --endpoint '" + bench::Excerpt(endpoint) +
                                "' does not fit --backend " + args.backend + " (a path ending in " +
                                (chat ? "chat/completions" : "/completions") + ")");
  }
  return endpoint;
}

// The first model id of GET /v1/models.
Result<std::string> FirstModel(const bench::ServerAddress& server, Clock::duration timeout) {
  RUBATO_ASSIGN_OR_RETURN(const std::string body, bench::FetchBody(server, "/v1/models", timeout));
  const json list = json::parse(body, nullptr, false);
  if (list.is_object()) {
    const auto data = list.find("data");
    if (data != list.end() && data->is_array() && !data->empty() && (*data)[0].is_object()) {
      const auto id = (*data)[0].find("id");
      if (id != (*data)[0].end() && id->is_string()) return id->get<std::string>();
    }
  }
  return UnavailableError("bench serve: GET /v1/models on " + server.host + ":" + server.port +
                          " gave no model id (" + bench::Excerpt(body) + "); pass --model");
}

// vLLM's random dataset, without a tokenizer: request i has input_lens[i] tokens after the
// shared prefix, the ids (offsets[i] + i + j) mod (vocab - 1) + 1, and asks for output_lens[i].
struct RandomDataset {
  std::vector<int64_t> prefix;
  std::vector<int64_t> input_lens;
  std::vector<int64_t> output_lens;
  std::vector<int64_t> offsets;
};

RandomDataset MakeDataset(const BenchServeArgs& args, std::mt19937_64& rng) {
  RandomDataset data;
  const int64_t vocab = args.backend == "openai-chat" ? kWordCount : args.vocab_limit - 1;
  std::uniform_int_distribution<int64_t> token(0, vocab - 1);
  for (int64_t j = 0; j < args.prefix_len; ++j) data.prefix.push_back(token(rng));
  const double r = args.range_ratio;
  const auto low = [r](int64_t len) {
    return std::max<int64_t>(1, static_cast<int64_t>(std::floor(len * (1 - r))));
  };
  const auto high = [r](int64_t len) { return static_cast<int64_t>(std::ceil(len * (1 + r))); };
  std::uniform_int_distribution<int64_t> input(low(args.input_len), high(args.input_len));
  std::uniform_int_distribution<int64_t> output(low(args.output_len), high(args.output_len));
  for (int64_t i = 0; i < args.num_prompts; ++i) data.input_lens.push_back(input(rng));
  for (int64_t i = 0; i < args.num_prompts; ++i) data.output_lens.push_back(output(rng));
  for (int64_t i = 0; i < args.num_prompts; ++i) data.offsets.push_back(token(rng));
  return data;
}

std::string RequestBody(const BenchServeArgs& args, const std::string& model,
                        const RandomDataset& data, size_t i) {
  const bool chat = args.backend == "openai-chat";
  json body = {{"model", model}, {"stream", true}, {"stream_options", {{"include_usage", true}}}};
  if (chat) {
    std::string text;
    const auto add_word = [&text](int64_t k) {
      if (!text.empty()) text += ' ';
      text += kWords[k % kWordCount];
    };
    for (int64_t k : data.prefix) add_word(k);
    for (int64_t j = 0; j < data.input_lens[i]; ++j) {
      add_word(data.offsets[i] + static_cast<int64_t>(i) + j);
    }
    body["messages"] = {{{"role", "user"}, {"content", {{{"type", "text"}, {"text", text}}}}}};
    body["max_completion_tokens"] = data.output_lens[i];
  } else {
    const int64_t vocab = args.vocab_limit - 1;
    std::vector<int64_t> ids;
    ids.reserve(data.prefix.size() + static_cast<size_t>(data.input_lens[i]));
    for (int64_t k : data.prefix) ids.push_back(k + 1);
    for (int64_t j = 0; j < data.input_lens[i]; ++j) {
      ids.push_back((data.offsets[i] + static_cast<int64_t>(i) + j) % vocab + 1);
    }
    body["prompt"] = std::move(ids);
    body["max_tokens"] = data.output_lens[i];
  }
  if (args.ignore_eos) body["ignore_eos"] = true;
  if (args.temperature) body["temperature"] = *args.temperature;
  return body.dump();
}

// vLLM's arrivals: gamma gaps of shape burstiness and mean 1/rate (exponential for 1),
// cumulated, then scaled so the last is at num_prompts / rate; all 0 for an infinite rate.
std::vector<double> Arrivals(const BenchServeArgs& args, std::mt19937_64& rng) {
  const double rate = args.request_rate == 0 ? INFINITY : args.request_rate;
  std::vector<double> at(static_cast<size_t>(args.num_prompts), 0.0);
  if (std::isinf(rate)) return at;
  std::gamma_distribution<double> gap(
      std::isinf(args.burstiness) ? 1.0 : args.burstiness,
      std::isinf(args.burstiness) ? 1.0 : 1.0 / (rate * args.burstiness));
  double total = 0;
  for (double& t : at) t = total += std::isinf(args.burstiness) ? 1.0 / rate : gap(rng);
  if (total > 0) {
    const double scale = static_cast<double>(args.num_prompts) / rate / total;
    for (double& t : at) t *= scale;
  }
  return at;
}

void DrawProgress(size_t done, size_t total) {
  constexpr size_t kWidth = 40;
  const size_t filled = total == 0 ? kWidth : done * kWidth / total;
  std::fprintf(stderr, "\r[%s%s] %zu/%zu", std::string(filled, '#').c_str(),
               std::string(kWidth - filled, ' ').c_str(), done, total);
  if (done == total) std::fprintf(stderr, "\n");
  std::fflush(stderr);
}

std::string Now(const char* format) {
  const std::time_t now = std::time(nullptr);
  std::tm local{};
  localtime_r(&now, &local);
  char text[64];
  std::strftime(text, sizeof(text), format, &local);
  return text;
}

}  // namespace

Status RunBenchServe(const BenchServeArgs& args) {
  RUBATO_ASSIGN_OR_RETURN(const bench::ServerAddress server, ServerAddressOf(args));
  RUBATO_ASSIGN_OR_RETURN(const std::string endpoint, EndpointOf(args));
  const Clock::duration request_timeout = SecondsToDuration(args.request_timeout_s);
  std::string model;
  if (args.model) {
    model = *args.model;
  } else {
    RUBATO_ASSIGN_OR_RETURN(model, FirstModel(server, request_timeout));
  }
  const double rate = args.request_rate == 0 ? INFINITY : args.request_rate;

  // The same load for the same seed: the dataset, then the arrivals, from one generator.
  std::mt19937_64 rng(args.seed);
  const RandomDataset data = MakeDataset(args, rng);
  bench::LoadPlan plan;
  plan.server = server;
  plan.target = server.path_prefix + endpoint;
  plan.api =
      args.backend == "openai-chat" ? bench::StreamApi::kChat : bench::StreamApi::kCompletions;
  plan.arrival_s = Arrivals(args, rng);
  plan.make_body = [&](size_t i) { return RequestBody(args, model, data, i); };
  plan.prompt_len = [&](size_t i) {
    return static_cast<int64_t>(data.prefix.size()) + data.input_lens[i];
  };
  plan.max_concurrency = static_cast<int>(args.max_concurrency);
  plan.limits = {request_timeout, args.max_reply_bytes, /*max_event_bytes=*/1 << 20};
  plan.run_timeout = SecondsToDuration(args.run_timeout_s);
  plan.keep_text = args.save_detailed;
  if (args.progress) {
    plan.on_progress = DrawProgress;
    DrawProgress(0, plan.arrival_s.size());
  }
  RUBATO_ASSIGN_OR_RETURN(const bench::LoadResult load, bench::RunLoad(plan));

  const bench::MetricSelection selection{args.percentile_metrics, args.metric_percentiles};
  const std::string label = args.label.empty() ? args.backend : args.label;
  const std::string date = Now("%Y%m%d-%H%M%S");
  json result = {
      {"date", date},
      {"endpoint_type", args.backend},
      {"backend", args.backend},
      {"label", args.label.empty() ? json(nullptr) : json(args.label)},
      {"model_id", model},
      {"tokenizer_id", nullptr},
      {"num_prompts", args.num_prompts},
      {"request_rate", std::isinf(rate) ? json("inf") : json(rate)},
      {"burstiness", std::isinf(args.burstiness) ? json("inf") : json(args.burstiness)},
      {"max_concurrency", args.max_concurrency > 0 ? json(args.max_concurrency) : json(nullptr)}};
  result.update(bench::BenchmarkJson(load, selection));

  std::string errors;
  int shown = 0;
  for (const bench::RequestOutcome& outcome : load.outcomes) {
    if (outcome.success || shown == 10) continue;
    if (shown == 0) errors += "Failed requests during benchmark run detected (capping to 10):\n";
    errors += "Error " + std::to_string(shown++) + ": " + outcome.error + "\n";
  }
  std::fputs(errors.c_str(), stdout);
  std::fputs(bench::ReportText(result, selection, plan.max_concurrency, rate).c_str(), stdout);
  std::fflush(stdout);

  if (!args.save_detailed) {
    for (const char* field : {"input_lens", "output_lens", "start_times", "ttfts", "itls",
                              "generated_texts", "errors"}) {
      result.erase(field);
    }
  }
  if (args.save_result) {
    std::string file = args.result_filename.value_or(
        bench::DefaultResultFilename(label, rate, plan.max_concurrency, model, date));
    if (args.result_dir) {
      std::error_code ec;
      std::filesystem::create_directories(*args.result_dir, ec);
      if (ec) {
        return IoError("bench serve: cannot create --result-dir " + *args.result_dir + ": " +
                       ec.message());
      }
      file = (std::filesystem::path(*args.result_dir) / file).string();
    }
    RUBATO_RETURN_IF_ERROR(bench::WriteResultFile(file, result));
  }
  const int64_t completed = result["completed"].get<int64_t>();
  if (load.run_deadline_passed) {
    return DeadlineExceededError("bench serve: the run's deadline (--run-timeout " +
                                 bench::PythonFloatText(args.run_timeout_s) + " s) passed with " +
                                 std::to_string(args.num_prompts - completed) +
                                 " requests unfinished");
  }
  if (completed == 0) {
    return UnavailableError("bench serve: all " + std::to_string(args.num_prompts) +
                            " requests failed; the first: " + load.outcomes[0].error);
  }
  return Status::Ok();
}

}  // namespace rubato
