// Integration tests of `rubato serve`: the real binary on a free port, spoken to over raw TCP
// sockets. Completions and chat completions (whole and streamed) give the text `rubato generate`
// gives; concurrent requests are all answered; 400 / 404 / 405 / 413 replies; garbage bytes,
// half requests and a client leaving mid-stream do not take the server down; /metrics counts
// what was served; `rubato bench serve` loads it and reports; SIGTERM ends the server with exit
// code 0. Every wait is bounded.
#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <fstream>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <thread>
#include <vector>

#include "common/test_temp_dir.h"
#include "tests/cli_runner.h"
#include "tests/http_test_client.h"

namespace rubato {
namespace {

using nlohmann::json;
using std::chrono::milliseconds;
using testing::BackgroundProcess;
using testing::Connect;
using testing::HttpResponse;
using testing::ParseResponse;
using testing::ReadToEof;
using testing::Request;
using testing::SendAll;

constexpr const char* kModelDir = "models/tiny-qwen3-longctx";

// The text of an SSE stream's chunks (choices[0].text or .delta.content) and its last
// finish_reason; `done` says the stream ended with [DONE].
struct StreamText {
  std::string text;
  std::string finish_reason;
  bool done = false;
  int chunks = 0;
};
StreamText ReadStream(const std::string& body) {
  StreamText result;
  size_t at = 0;
  while ((at = body.find("data: ", at)) != std::string::npos) {
    const size_t end = body.find("\n\n", at);
    const std::string payload = body.substr(at + 6, end - at - 6);
    at = end;
    if (payload == "[DONE]") {
      result.done = true;
      continue;
    }
    const json chunk = json::parse(payload);
    ++result.chunks;
    if (chunk["choices"].empty()) continue;
    const json& choice = chunk["choices"][0];
    if (choice.contains("text")) result.text += choice["text"].get<std::string>();
    if (choice.contains("delta") && choice["delta"].contains("content")) {
      result.text += choice["delta"]["content"].get<std::string>();
    }
    if (!choice["finish_reason"].is_null()) result.finish_reason = choice["finish_reason"];
  }
  return result;
}

// `rubato generate`'s text for a prompt (stdout without the stats line).
std::string GenerateText(const std::string& prompt, int max_tokens, bool chat) {
  std::vector<std::string> args = {"generate", "--model", kModelDir, "--prompt", prompt,
                                   "--max-tokens", std::to_string(max_tokens), "--threads", "1"};
  if (chat) args.push_back("--chat");
  const testing::ProcessResult result = testing::RunProcess(RUBATO_BINARY, args, 60);
  EXPECT_EQ(result.exit_code, 0) << result.err;
  return result.out.substr(0, result.out.rfind("\n[rubato]"));
}

double MetricValue(const std::string& exposition, const std::string& sample) {
  const size_t at = exposition.find("\n" + sample + " ");
  if (at == std::string::npos) return -1;
  return std::atof(exposition.c_str() + at + sample.size() + 2);
}

// ---- the server under test -------------------------------------------------------------------

std::unique_ptr<BackgroundProcess> StartServer(int* port) {
  auto server = std::make_unique<BackgroundProcess>(
      RUBATO_BINARY, std::vector<std::string>{"serve", "--model", kModelDir, "--port", "0",
                                              "--threads", "1"});
  EXPECT_TRUE(server->WaitForOutput("listening on http://", milliseconds(30000))) << server->Err();
  // "rubato serve: listening on http://127.0.0.1:PORT"
  const std::string out = server->Out();
  const std::string prefix = "listening on http://127.0.0.1:";
  const size_t at = out.find(prefix);
  EXPECT_NE(at, std::string::npos) << out;
  *port = at == std::string::npos ? 0 : std::atoi(out.c_str() + at + prefix.size());
  return server;
}

class ServeHttpTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() { server_ = StartServer(&port_).release(); }
  static void TearDownTestSuite() {
    delete server_;
    server_ = nullptr;
  }
  void TearDown() override {
    // Whatever a test did, the server is still up.
    EXPECT_EQ(Request(port_, "GET", "/health").status, 200) << server_->Err();
  }

  static BackgroundProcess* server_;
  static int port_;
};
BackgroundProcess* ServeHttpTest::server_ = nullptr;
int ServeHttpTest::port_ = 0;

std::string CompletionBody(const std::string& prompt, int max_tokens, bool stream) {
  return json({{"model", "tiny-qwen3-longctx"}, {"prompt", prompt}, {"max_tokens", max_tokens},
               {"temperature", 0}, {"stream", stream}})
      .dump();
}

TEST_F(ServeHttpTest, CompletionGivesGenerateText) {
  const std::string expected = GenerateText("Once upon a time", 12, false);
  ASSERT_FALSE(expected.empty());
  const HttpResponse whole =
      Request(port_, "POST", "/v1/completions", CompletionBody("Once upon a time", 12, false));
  ASSERT_EQ(whole.status, 200) << whole.body;
  EXPECT_EQ(whole.headers.at("content-type"), "application/json");
  const json body = json::parse(whole.body);
  EXPECT_EQ(body["object"], "text_completion");
  EXPECT_EQ(body["model"], "tiny-qwen3-longctx");
  EXPECT_EQ(body["choices"][0]["text"], expected);
  EXPECT_EQ(body["choices"][0]["finish_reason"], "length");
  EXPECT_EQ(body["usage"]["completion_tokens"], 12);
  EXPECT_EQ(body["usage"]["total_tokens"], body["usage"]["prompt_tokens"].get<int>() + 12);

  const HttpResponse streamed =
      Request(port_, "POST", "/v1/completions", CompletionBody("Once upon a time", 12, true));
  ASSERT_EQ(streamed.status, 200);
  EXPECT_EQ(streamed.headers.at("content-type"), "text/event-stream");
  const StreamText stream = ReadStream(streamed.body);
  EXPECT_EQ(stream.text, expected);
  EXPECT_EQ(stream.finish_reason, "length");
  EXPECT_TRUE(stream.done);
  EXPECT_GT(stream.chunks, 2);
}

TEST_F(ServeHttpTest, ChatCompletionGivesGenerateChatText) {
  const std::string expected = GenerateText("Tell me a story", 10, /*chat=*/true);
  const json request = {{"messages", {{{"role", "user"}, {"content", "Tell me a story"}}}},
                        {"max_tokens", 10}, {"temperature", 0}};
  const HttpResponse whole = Request(port_, "POST", "/v1/chat/completions", request.dump());
  ASSERT_EQ(whole.status, 200) << whole.body;
  const json body = json::parse(whole.body);
  EXPECT_EQ(body["object"], "chat.completion");
  EXPECT_EQ(body["choices"][0]["message"]["role"], "assistant");
  EXPECT_EQ(body["choices"][0]["message"]["content"], expected);

  json stream_request = request;
  stream_request["stream"] = true;
  stream_request["stream_options"] = {{"include_usage", true}};
  const HttpResponse streamed =
      Request(port_, "POST", "/v1/chat/completions", stream_request.dump());
  ASSERT_EQ(streamed.status, 200);
  const StreamText stream = ReadStream(streamed.body);
  EXPECT_EQ(stream.text, expected);
  EXPECT_TRUE(stream.done);
  EXPECT_NE(streamed.body.find("\"chat.completion.chunk\""), std::string::npos);
  EXPECT_NE(streamed.body.find("\"role\":\"assistant\""), std::string::npos);
  EXPECT_NE(streamed.body.find("\"completion_tokens\":" +
                               body["usage"]["completion_tokens"].dump()),
            std::string::npos);
}

TEST_F(ServeHttpTest, FourConcurrentRequestsAreAllAnswered) {
  const std::vector<std::string> prompts = {"The cat", "In the beginning", "Hello there",
                                            "Once upon a time"};
  std::vector<HttpResponse> responses(prompts.size());
  std::vector<std::thread> clients;
  for (size_t i = 0; i < prompts.size(); ++i) {
    clients.emplace_back([&, i] {
      responses[i] = Request(port_, "POST", "/v1/completions",
                             CompletionBody(prompts[i], 10, /*stream=*/i % 2 == 1));
    });
  }
  for (std::thread& client : clients) client.join();
  for (size_t i = 0; i < prompts.size(); ++i) {
    ASSERT_EQ(responses[i].status, 200) << prompts[i] << ": " << responses[i].body;
    const std::string text = i % 2 == 1 ? ReadStream(responses[i].body).text
                                        : json::parse(responses[i].body)["choices"][0]["text"]
                                              .get<std::string>();
    EXPECT_EQ(text, GenerateText(prompts[i], 10, false)) << prompts[i];
  }
}

void ExpectError(const HttpResponse& response, int status, const std::string& param) {
  EXPECT_EQ(response.status, status) << response.body;
  const json body = json::parse(response.body, nullptr, false);
  ASSERT_TRUE(body.is_object() && body.contains("error")) << response.body;
  EXPECT_TRUE(body["error"]["message"].is_string());
  EXPECT_TRUE(body["error"]["type"].is_string());
  if (param.empty()) {
    EXPECT_TRUE(body["error"]["param"].is_null()) << response.body;
  } else {
    EXPECT_EQ(body["error"]["param"], param) << response.body;
  }
}

TEST_F(ServeHttpTest, BadRequestsGetJsonErrors) {
  ExpectError(Request(port_, "POST", "/v1/completions", "{\"prompt\": "), 400, "");
  ExpectError(Request(port_, "POST", "/v1/completions", R"({"prompt": "x", "top_p": 7})"), 400,
              "top_p");
  ExpectError(Request(port_, "POST", "/v1/chat/completions", R"({"messages": 1})"), 400,
              "messages");
  ExpectError(Request(port_, "POST", "/v1/completions", R"({"prompt": [1, 99999]})"), 400,
              "prompt");
  // Longer than the model's 8192-token context.
  ExpectError(Request(port_, "POST", "/v1/completions",
                      json({{"prompt", std::vector<int>(9000, 5)}}).dump()),
              400, "prompt");
  ExpectError(Request(port_, "POST", "/v1/completions", R"({"prompt": "x", "model": "gpt-4"})"),
              404, "model");
  ExpectError(Request(port_, "GET", "/v2/nothing"), 404, "");
  ExpectError(Request(port_, "GET", "/v1/completions"), 405, "");
  ExpectError(Request(port_, "DELETE", "/v1/models"), 405, "");
  // A body over the 16 MiB limit is refused from its Content-Length, with the client's
  // x-request-id echoed (the HTTP layer answers it, not the router).
  const int fd = Connect(port_);
  ASSERT_GE(fd, 0);
  SendAll(fd,
          "POST /v1/completions HTTP/1.1\r\nHost: x\r\nx-request-id: big-1\r\n"
          "Content-Length: 17000000\r\n\r\n{");
  const HttpResponse too_large = ParseResponse(ReadToEof(fd));
  ::close(fd);
  ExpectError(too_large, 413, "");
  ASSERT_EQ(too_large.headers.count("x-request-id"), 1u);
  EXPECT_EQ(too_large.headers.at("x-request-id"), "big-1");
  // Headers over the 64 KiB limit: 431, with an id of the server's own.
  const int big_fd = Connect(port_);
  ASSERT_GE(big_fd, 0);
  SendAll(big_fd, "GET /v1/models HTTP/1.1\r\nHost: x\r\nx-padding: " +
                      std::string(70 << 10, 'a') + "\r\n\r\n");
  const HttpResponse too_many_headers = ParseResponse(ReadToEof(big_fd));
  ::close(big_fd);
  ExpectError(too_many_headers, 431, "");
  ASSERT_EQ(too_many_headers.headers.count("x-request-id"), 1u);
  EXPECT_EQ(too_many_headers.headers.at("x-request-id").size(), 24u);
}

TEST_F(ServeHttpTest, ModelsAndHealth) {
  const HttpResponse models = Request(port_, "GET", "/v1/models");
  ASSERT_EQ(models.status, 200);
  const json list = json::parse(models.body);
  ASSERT_EQ(list["data"].size(), 1u);
  EXPECT_EQ(list["data"][0]["id"], "tiny-qwen3-longctx");
  const HttpResponse health = Request(port_, "GET", "/health");
  EXPECT_EQ(health.status, 200);
  EXPECT_EQ(health.body, "ok");
}

TEST_F(ServeHttpTest, CorsIsOffByDefault) {
  const HttpResponse get = Request(port_, "GET", "/v1/models", "", "Origin: https://x.example\r\n");
  EXPECT_EQ(get.status, 200);
  EXPECT_EQ(get.headers.count("access-control-allow-origin"), 0u);
  const HttpResponse preflight =
      Request(port_, "OPTIONS", "/v1/models", "",
              "Origin: https://x.example\r\nAccess-Control-Request-Method: GET\r\n");
  EXPECT_EQ(preflight.status, 405);
  EXPECT_EQ(preflight.headers.count("access-control-allow-origin"), 0u);
}

TEST_F(ServeHttpTest, GarbageAndHalfRequestsDoNotTakeTheServerDown) {
  {  // garbage bytes: a 400 and a closed connection
    const int fd = Connect(port_);
    ASSERT_GE(fd, 0);
    std::string garbage = "\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03 GET / HTTP/9.9\r\n\r\n";
    for (int i = 0; i < 256; ++i) garbage.push_back(static_cast<char>(i * 37 + 11));
    SendAll(fd, garbage);
    const HttpResponse response = ParseResponse(ReadToEof(fd));
    ::close(fd);
    EXPECT_EQ(response.status, 400);
  }
  // A half request left open (a slow client), and one that hangs up half-way.
  const int slow = Connect(port_);
  ASSERT_GE(slow, 0);
  SendAll(slow, "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Len");
  const int half = Connect(port_);
  ASSERT_GE(half, 0);
  SendAll(half, "POST /v1/completions HTTP/1.1\r\nContent-Length: 100\r\n\r\n{\"pro");
  ::close(half);
  // Others are served meanwhile.
  const HttpResponse response =
      Request(port_, "POST", "/v1/completions", CompletionBody("Hello", 4, false));
  EXPECT_EQ(response.status, 200) << response.body;
  ::close(slow);
}

TEST_F(ServeHttpTest, ClientLeavingMidStreamCancelsItsRequest) {
  const int fd = Connect(port_);
  ASSERT_GE(fd, 0);
  const std::string body = CompletionBody("Once upon a time", 5000, true);
  SendAll(fd, "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: " +
                  std::to_string(body.size()) + "\r\n\r\n" + body);
  char buffer[512];
  ASSERT_GT(::recv(fd, buffer, sizeof(buffer), 0), 0);  // the stream has started
  ::close(fd);
  // The engine drops the request: nothing runs any more (bounded wait), and the server serves.
  double running = -1;
  for (int i = 0; i < 200 && running != 0; ++i) {
    std::this_thread::sleep_for(milliseconds(50));
    running = MetricValue(Request(port_, "GET", "/metrics").body,
                          "rubato:num_requests_running{model_name=\"tiny-qwen3-longctx\"}");
  }
  EXPECT_EQ(running, 0);
  const HttpResponse after =
      Request(port_, "POST", "/v1/completions", CompletionBody("Hello", 3, false));
  EXPECT_EQ(after.status, 200) << after.body;
}

TEST_F(ServeHttpTest, MetricsCountServedRequests) {
  const HttpResponse before = Request(port_, "GET", "/metrics");
  ASSERT_EQ(before.status, 200);
  EXPECT_EQ(before.headers.at("content-type"), "text/plain; version=0.0.4; charset=utf-8");
  const std::string model = "{model_name=\"tiny-qwen3-longctx\"}";
  const std::string length_sample =
      "rubato:request_success_total{model_name=\"tiny-qwen3-longctx\",finished_reason=\"length\"}";
  const double length_before = std::max(0.0, MetricValue(before.body, length_sample));
  const double prompt_before = MetricValue(before.body, "rubato:prompt_tokens_total" + model);
  const double generated_before =
      MetricValue(before.body, "rubato:generation_tokens_total" + model);
  const double ttft_before =
      MetricValue(before.body, "rubato:time_to_first_token_seconds_count" + model);
  int prompt_tokens = 0;
  int generated = 0;
  int length_finished = 0;
  constexpr int kRequests = 3;
  for (int i = 0; i < kRequests; ++i) {
    const HttpResponse response = Request(port_, "POST", "/v1/completions",
                                          CompletionBody("Count " + std::to_string(i), 5, false));
    ASSERT_EQ(response.status, 200);
    const json body = json::parse(response.body);
    prompt_tokens += body["usage"]["prompt_tokens"].get<int>();
    generated += body["usage"]["completion_tokens"].get<int>();
    length_finished += body["choices"][0]["finish_reason"] == "length";
  }
  const std::string after = Request(port_, "GET", "/metrics").body;
  EXPECT_EQ(MetricValue(after, "rubato:prompt_tokens_total" + model) - prompt_before,
            prompt_tokens);
  EXPECT_EQ(MetricValue(after, "rubato:generation_tokens_total" + model) - generated_before,
            generated);
  EXPECT_EQ(MetricValue(after, length_sample) - length_before, length_finished);
  EXPECT_EQ(MetricValue(after, "rubato:time_to_first_token_seconds_count" + model) - ttft_before,
            kRequests);
  EXPECT_NE(after.find("# TYPE rubato:inter_token_latency_seconds histogram"), std::string::npos);
  EXPECT_NE(after.find("# TYPE rubato:e2e_request_latency_seconds histogram"), std::string::npos);
  EXPECT_NE(after.find("# TYPE rubato:num_requests_waiting gauge"), std::string::npos);
}

// `rubato bench serve` against the server with vLLM's flags: every request completes, the
// result file has vLLM's flat keys, and the same prompts (seeded) give the same token counts.
TEST_F(ServeHttpTest, BenchServeReportsLatenciesAndThroughput) {
  TestTempDir dir("bench_serve");
  const std::string result_file = (dir.path() / "result.json").string();
  for (const char* backend : {"openai", "openai-chat"}) {
    const testing::ProcessResult run = testing::RunProcess(
        RUBATO_BINARY,
        {"bench", "serve", "--backend", backend, "--port", std::to_string(port_),
         "--num-prompts", "6", "--max-concurrency", "2", "--random-input-len", "8",
         "--random-output-len", "4", "--request-rate", "inf", "--seed", "1",
         "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,99",
         "--save-result", "--result-filename", result_file},
        120);
    ASSERT_EQ(run.exit_code, 0) << backend << ": " << run.err;
    EXPECT_NE(run.out.find("Successful requests:"), std::string::npos) << run.out;
    EXPECT_NE(run.err.find("6/6"), std::string::npos) << "no progress bar: " << run.err;
    std::ifstream file(result_file);
    const json result = json::parse(file, nullptr, false);
    ASSERT_TRUE(result.is_object());
    EXPECT_EQ(result["model_id"], "tiny-qwen3-longctx");
    EXPECT_EQ(result["backend"], backend);
    EXPECT_EQ(result["completed"], 6);
    EXPECT_EQ(result["failed"], 0);
    if (std::string(backend) == "openai") {
      EXPECT_EQ(result["total_input_tokens"], 48);
    }
    EXPECT_GT(result["total_output_tokens"].get<int>(), 0);
    EXPECT_LE(result["total_output_tokens"].get<int>(), 24);
    for (const char* metric : {"ttft", "tpot", "itl", "e2el"}) {
      const std::string m = metric;
      EXPECT_LE(result["p50_" + m + "_ms"].get<double>(), result["p99_" + m + "_ms"].get<double>())
          << metric;
      EXPECT_EQ(result["median_" + m + "_ms"], result["p50_" + m + "_ms"]) << metric;
    }
    EXPECT_GT(result["median_ttft_ms"].get<double>(), 0);
    EXPECT_GE(result["median_e2el_ms"].get<double>(), result["median_ttft_ms"].get<double>());
    EXPECT_GT(result["request_throughput"].get<double>(), 0);
  }
  // Nothing listening: GET /v1/models (for the model name) fails and the run is refused.
  const testing::ProcessResult nowhere = testing::RunProcess(
      RUBATO_BINARY, {"bench", "serve", "--port", "1", "--num-prompts", "1"}, 30);
  EXPECT_EQ(nowhere.exit_code, 1) << nowhere.out;
  EXPECT_NE(nowhere.err.find("cannot connect"), std::string::npos) << nowhere.err;
}

TEST(ServeProcessTest, SigtermEndsTheServerWithExitCodeZero) {
  int port = 0;
  std::unique_ptr<BackgroundProcess> server = StartServer(&port);
  ASSERT_GT(port, 0);
  ASSERT_EQ(Request(port, "GET", "/health").status, 200);
  server->Signal(SIGTERM);
  const testing::ProcessResult result = server->Wait(milliseconds(15000));
  EXPECT_FALSE(result.signaled) << "signal " << result.signal << ": " << result.err;
  EXPECT_EQ(result.exit_code, 0) << result.err;
}

TEST(ServeProcessTest, BadFlagsAreRefusedByName) {
  const testing::ProcessResult missing = testing::RunProcess(
      RUBATO_BINARY, {"serve", "--model", "models/no-such-model", "--port", "0"}, 30);
  EXPECT_EQ(missing.exit_code, 1);
  EXPECT_NE(missing.err.find("models/no-such-model"), std::string::npos) << missing.err;
  const testing::ProcessResult port = testing::RunProcess(
      RUBATO_BINARY, {"serve", "--model", kModelDir, "--port", "70000"}, 30);
  EXPECT_EQ(port.exit_code, 2);
  EXPECT_NE(port.err.find("--port"), std::string::npos) << port.err;
}

}  // namespace
}  // namespace rubato
