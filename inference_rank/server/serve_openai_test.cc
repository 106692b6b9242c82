// Integration tests of `rubato serve`'s OpenAI conformance and metrics, through the real binary
// started with a config (CORS origin, a metrics_port listener, one running request, a queue of
// one, a 1 s request timeout): unsupported fields refused by name, logit_bias and penalties,
// models.retrieve, max_completion_tokens, HEAD /health, CORS, Retry-After on 429, x-should-retry
// on a timeout, the metrics listener, the new metrics' counts and `promtool check metrics`.
// Every wait is bounded; nothing depends on timing but the 1 s timeout of a request of thousands
// of tokens.
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <memory>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "common/test_temp_dir.h"
#include "common/tokenizer/tokenizer.h"
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
constexpr const char* kModel = "tiny-qwen3-longctx";
constexpr const char* kOrigin = "https://app.example";

double MetricValue(const std::string& exposition, const std::string& sample) {
  const size_t at = exposition.find("\n" + sample + " ");
  if (at == std::string::npos) return -1;
  return std::atof(exposition.c_str() + at + sample.size() + 2);
}

std::string Sample(const std::string& name) { return name + "{model_name=\"" + kModel + "\"}"; }

class ServeOpenAiTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = new TestTempDir("serve_openai");
    metrics_port_ = testing::FreePort();
    const std::filesystem::path config = dir_->WriteFile(
        "rubato.yaml", "engine:\n  max_batch: 1\nserver:\n  metrics_port: " +
                           std::to_string(metrics_port_) + "\n  cors_allowed_origins: [\"" +
                           kOrigin + "\"]\nlimits:\n  max_queue: 1\n  request_timeout_s: 1\n");
    server_ = new BackgroundProcess(RUBATO_BINARY, {"serve", "--config", config.string(), "--model",
                                                    kModelDir, "--port", "0", "--threads", "1"});
    EXPECT_TRUE(server_->WaitForOutput("listening on http://", milliseconds(30000)))
        << server_->Err();
    const std::string out = server_->Out();
    const std::string prefix = "listening on http://127.0.0.1:";
    const size_t at = out.find(prefix);
    port_ = at == std::string::npos ? 0 : std::atoi(out.c_str() + at + prefix.size());
    auto tokenizer = Tokenizer::LoadFromDirectory(kModelDir);
    EXPECT_TRUE(tokenizer.ok());
    if (tokenizer.ok()) tokenizer_ = std::move(tokenizer).value().release();
  }
  static void TearDownTestSuite() {
    delete server_;
    delete tokenizer_;
    delete dir_;
  }
  void SetUp() override { ASSERT_GT(port_, 0) << server_->Err(); }
  void TearDown() override {
    EXPECT_EQ(Request(port_, "GET", "/health").status, 200) << server_->Err();
  }

  static HttpResponse Post(const std::string& path, const json& body) {
    return Request(port_, "POST", path, body.dump());
  }
  // A greedy completion of `prompt` with extra fields.
  static HttpResponse Complete(json fields) {
    fields["model"] = kModel;
    if (!fields.contains("prompt")) fields["prompt"] = "Once upon a time";
    fields["temperature"] = 0;
    return Post("/v1/completions", fields);
  }

  static TestTempDir* dir_;
  static BackgroundProcess* server_;
  static Tokenizer* tokenizer_;
  static int port_;
  static int metrics_port_;
};
TestTempDir* ServeOpenAiTest::dir_ = nullptr;
BackgroundProcess* ServeOpenAiTest::server_ = nullptr;
Tokenizer* ServeOpenAiTest::tokenizer_ = nullptr;
int ServeOpenAiTest::port_ = 0;
int ServeOpenAiTest::metrics_port_ = 0;

void ExpectRefused(const HttpResponse& response, const std::string& param) {
  EXPECT_EQ(response.status, 400) << param << ": " << response.body;
  const json body = json::parse(response.body, nullptr, false);
  ASSERT_TRUE(body.is_object()) << response.body;
  EXPECT_EQ(body["error"]["param"], param) << response.body;
  EXPECT_NE(body["error"]["message"].get<std::string>().find(param), std::string::npos);
}

TEST_F(ServeOpenAiTest, UnsupportedFieldsAreRefusedByName) {
  ExpectRefused(Complete({{"suffix", "end"}}), "suffix");
  ExpectRefused(Complete({{"frobnicate", 1}}), "frobnicate");
  ExpectRefused(Complete({{"stream", true}, {"stream_options", {{"continuous", true}}}}),
                "stream_options.continuous");
  ExpectRefused(Complete({{"presence_penalty", 3}}), "presence_penalty");
  ExpectRefused(Complete({{"logit_bias", {{"abc", 1}}}}), "logit_bias");
  ExpectRefused(Complete({{"logit_bias", {{"5", 101}}}}), "logit_bias");
  ExpectRefused(Complete({{"logit_bias", {{"99999", 1}}}}), "logit_bias");
  const json chat = {{"model", kModel}, {"messages", {{{"role", "user"}, {"content", "Hi"}}}}};
  for (const char* field : {"tools", "response_format", "tool_choice", "parallel_tool_calls"}) {
    json body = chat;
    body[field] = json::object();
    ExpectRefused(Post("/v1/chat/completions", body), field);
  }
  // A field sent as null is absent, as OpenAI reads it; `user` is accepted.
  json body = chat;
  body["tools"] = nullptr;
  body["user"] = "someone";
  body["max_tokens"] = 2;
  EXPECT_EQ(Post("/v1/chat/completions", body).status, 200);
}

TEST_F(ServeOpenAiTest, LogitBiasAndPenaltiesChangeTheText) {
  ASSERT_NE(tokenizer_, nullptr);
  const int token = tokenizer_->Encode("hello")[0];
  // +100 on one token: greedy picks it every time.
  const HttpResponse forced =
      Complete({{"max_tokens", 3}, {"logit_bias", {{std::to_string(token), 100}}}});
  ASSERT_EQ(forced.status, 200) << forced.body;
  const std::vector<int> thrice = {token, token, token};
  EXPECT_EQ(json::parse(forced.body)["choices"][0]["text"], tokenizer_->Decode(thrice, true));
  // -100 on the greedy text's first token: the text starts with another one.
  const HttpResponse plain = Complete({{"max_tokens", 1}});
  ASSERT_EQ(plain.status, 200);
  const std::string first = json::parse(plain.body)["choices"][0]["text"];
  const std::vector<int> first_ids = tokenizer_->Encode(first);
  ASSERT_EQ(first_ids.size(), 1u) << first;
  const HttpResponse banned =
      Complete({{"max_tokens", 1}, {"logit_bias", {{std::to_string(first_ids[0]), -100}}}});
  ASSERT_EQ(banned.status, 200);
  EXPECT_NE(json::parse(banned.body)["choices"][0]["text"], first);
  // Penalties, against a reference built from the formula: the penalized text's second token is
  // the greedy token after the first with logit_bias -(frequency + presence) on the first (its
  // count is 1 there).
  const std::vector<int> prompt = tokenizer_->Encode("Once upon a time", true);
  const HttpResponse step1 = Complete({{"prompt", prompt}, {"max_tokens", 1}});
  ASSERT_EQ(step1.status, 200);
  const std::string text1 = json::parse(step1.body)["choices"][0]["text"];
  const std::vector<int> ids1 = tokenizer_->Encode(text1);
  ASSERT_EQ(ids1.size(), 1u) << text1;
  std::vector<int> extended = prompt;
  extended.push_back(ids1[0]);
  const HttpResponse step2 = Complete(
      {{"prompt", extended}, {"max_tokens", 1}, {"logit_bias", {{std::to_string(ids1[0]), -1.5}}}});
  ASSERT_EQ(step2.status, 200);
  const std::string text2 = json::parse(step2.body)["choices"][0]["text"];
  const HttpResponse penalized = Complete({{"prompt", prompt},
                                           {"max_tokens", 2},
                                           {"frequency_penalty", 1.0},
                                           {"presence_penalty", 0.5}});
  ASSERT_EQ(penalized.status, 200) << penalized.body;
  EXPECT_EQ(json::parse(penalized.body)["choices"][0]["text"], text1 + text2);
}

TEST_F(ServeOpenAiTest, ModelsRetrieve) {
  const HttpResponse found = Request(port_, "GET", std::string("/v1/models/") + kModel);
  ASSERT_EQ(found.status, 200) << found.body;
  const json model = json::parse(found.body);
  EXPECT_EQ(model["id"], kModel);
  EXPECT_EQ(model["object"], "model");
  const HttpResponse missing = Request(port_, "GET", "/v1/models/gpt-4");
  EXPECT_EQ(missing.status, 404);
  const json error = json::parse(missing.body)["error"];
  EXPECT_EQ(error["code"], "model_not_found");
  EXPECT_EQ(error["type"], "invalid_request_error");
  EXPECT_NE(error["message"].get<std::string>().find("gpt-4"), std::string::npos);
}

TEST_F(ServeOpenAiTest, MaxCompletionTokensWinsOverMaxTokens) {
  ASSERT_NE(tokenizer_, nullptr);
  const int token = tokenizer_->Encode("hello")[0];  // forced: no stop token ends it early
  const json body = {{"model", kModel},
                     {"messages", {{{"role", "user"}, {"content", "Hi"}}}},
                     {"temperature", 0},
                     {"max_tokens", 2},
                     {"max_completion_tokens", 5},
                     {"logit_bias", {{std::to_string(token), 100}}}};
  const HttpResponse response = Post("/v1/chat/completions", body);
  ASSERT_EQ(response.status, 200) << response.body;
  EXPECT_EQ(json::parse(response.body)["usage"]["completion_tokens"], 5);
}

TEST_F(ServeOpenAiTest, HeadHealthHasNoBody) {
  const HttpResponse head = Request(port_, "HEAD", "/health");
  EXPECT_EQ(head.status, 200);
  EXPECT_EQ(head.headers.at("content-length"), "2");  // the GET body "ok"
  EXPECT_EQ(head.body, "");
  EXPECT_EQ(Request(port_, "DELETE", "/health").status, 405);
}

TEST_F(ServeOpenAiTest, CorsHeadersForAllowedOriginsOnly) {
  const std::string origin = std::string("Origin: ") + kOrigin + "\r\n";
  const HttpResponse allowed = Request(port_, "GET", "/v1/models", "", origin);
  ASSERT_EQ(allowed.status, 200);
  EXPECT_EQ(allowed.headers.at("access-control-allow-origin"), kOrigin);
  const HttpResponse other =
      Request(port_, "GET", "/v1/models", "", "Origin: https://x.example\r\n");
  EXPECT_EQ(other.headers.count("access-control-allow-origin"), 0u);
  const HttpResponse preflight =
      Request(port_, "OPTIONS", "/v1/chat/completions", "",
              origin +
                  "Access-Control-Request-Method: POST\r\n"
                  "Access-Control-Request-Headers: authorization, content-type\r\n");
  EXPECT_EQ(preflight.status, 204);
  EXPECT_EQ(preflight.headers.at("access-control-allow-origin"), kOrigin);
  EXPECT_NE(preflight.headers.at("access-control-allow-methods").find("POST"), std::string::npos);
  EXPECT_EQ(preflight.headers.at("access-control-allow-headers"), "authorization, content-type");
  // A reply that completes later (a completion) carries them too.
  const HttpResponse completion =
      Request(port_, "POST", "/v1/completions",
              json({{"prompt", "Hi"}, {"max_tokens", 1}, {"temperature", 0}}).dump(), origin);
  EXPECT_EQ(completion.status, 200);
  EXPECT_EQ(completion.headers.at("access-control-allow-origin"), kOrigin);
  EXPECT_EQ(completion.headers.at("access-control-expose-headers"), "x-request-id");
  EXPECT_FALSE(completion.headers.at("x-request-id").empty());
}

// A request that has not answered within `wait` (the socket stays open), or its response.
struct Pending {
  int fd = -1;
  HttpResponse response;  // status 0 while pending
};
Pending SendWithin(int port, const std::string& body, milliseconds wait) {
  Pending pending;
  pending.fd = Connect(port);
  SendAll(pending.fd, "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: " +
                          std::to_string(body.size()) + "\r\nConnection: close\r\n\r\n" + body);
  pollfd poll_fd{pending.fd, POLLIN, 0};
  if (::poll(&poll_fd, 1, static_cast<int>(wait.count())) > 0) {
    pending.response = ParseResponse(ReadToEof(pending.fd));
    ::close(pending.fd);
    pending.fd = -1;
  }
  return pending;
}

// One running request (max_batch 1) and a full queue of one: the next gets 429 with Retry-After;
// the queued one times out (1 s) with 504 and x-should-retry: false. The metrics count both.
TEST_F(ServeOpenAiTest, QueueFullAndTimeoutReplies) {
  const std::string before = Request(port_, "GET", "/metrics").body;
  const std::string long_body =
      json({{"prompt", "Once upon a time"}, {"max_tokens", 8000}, {"temperature", 0}}).dump();
  Pending running = SendWithin(port_, long_body, milliseconds(0));
  ASSERT_GE(running.fd, 0);
  // The engine admits it within a loop turn: wait (bounded) until the metrics say it runs.
  for (int i = 0; i < 200; ++i) {
    if (MetricValue(Request(port_, "GET", "/metrics").body,
                    Sample("rubato:num_requests_running")) == 1) {
      break;
    }
    std::this_thread::sleep_for(milliseconds(10));
  }
  std::vector<Pending> queued;
  std::vector<HttpResponse> replies;
  // The first of these queues; a later one finds the queue full. More tries only in case the
  // queued one was between the queue and the engine when the next came (it then queues too), or
  // a 429 took longer than the wait (it is read below).
  for (int i = 0; i < 4 && replies.empty(); ++i) {
    Pending next = SendWithin(port_, long_body, milliseconds(300));
    if (next.fd >= 0) {
      queued.push_back(next);
    } else {
      replies.push_back(next.response);
    }
  }
  queued.push_back(running);
  for (Pending& pending : queued) {  // the accepted ones end within the 1 s timeout
    replies.push_back(ParseResponse(ReadToEof(pending.fd)));
    ::close(pending.fd);
  }
  int busy = 0;
  int timed_out = 0;
  for (const HttpResponse& reply : replies) {
    if (reply.status == 429) {
      ++busy;
      EXPECT_EQ(reply.headers.at("retry-after"), "1");
      EXPECT_EQ(json::parse(reply.body)["error"]["code"], "queue_full");
    } else {
      EXPECT_EQ(reply.status, 504) << reply.body;
      ++timed_out;
      EXPECT_EQ(reply.headers.at("x-should-retry"), "false");
    }
  }
  EXPECT_GE(busy, 1);
  EXPECT_GE(timed_out, 1);
  // Both are counted (a scrape after the 504 sees the timeout: it was counted before the reply).
  const std::string after = Request(port_, "GET", "/metrics").body;
  const auto delta = [&](const char* name) {
    return MetricValue(after, Sample(name)) - std::max(0.0, MetricValue(before, Sample(name)));
  };
  EXPECT_GE(delta("rubato:requests_rejected_total"), 1);
  EXPECT_GE(delta("rubato:requests_timed_out_total"), 1);
}

TEST_F(ServeOpenAiTest, MetricsListenerServesTheNewMetrics) {
  ASSERT_EQ(Complete({{"max_tokens", 2}}).status, 200);
  const HttpResponse metrics = Request(metrics_port_, "GET", "/metrics");
  ASSERT_EQ(metrics.status, 200);
  EXPECT_EQ(Request(metrics_port_, "GET", "/v1/models").status, 404);
  const std::string& text = metrics.body;
  for (const char* name :
       {"process_cpu_seconds_total ", "process_resident_memory_bytes ", "process_open_fds ",
        "rubato:build_info{version=\"", "rubato:request_queue_time_seconds_count{",
        "rubato:request_prefill_time_seconds_count{", "rubato:request_decode_time_seconds_count{",
        "rubato:request_prompt_tokens_count{", "rubato:request_generation_tokens_count{",
        "rubato:requests_aborted_total{", "rubato:requests_failed_total{",
        "rubato:retained_kv_ratio_count "}) {
    EXPECT_NE(text.find(name), std::string::npos) << name;
  }
  EXPECT_NE(text.find("role=\"inference\"} 1\n"), std::string::npos);
  EXPECT_GT(MetricValue(text, "process_resident_memory_bytes"), 0);
  EXPECT_GT(MetricValue(text, "process_open_fds"), 0);
}

// `promtool check metrics` finds nothing to say but that the names hold ':' (vLLM's style).
TEST_F(ServeOpenAiTest, PromtoolChecksTheExposition) {
  ASSERT_EQ(Complete({{"max_tokens", 2}}).status, 200);
  const std::filesystem::path file =
      dir_->WriteFile("metrics.txt", Request(port_, "GET", "/metrics").body);
  const std::string command = "promtool check metrics < '" + file.string() + "' 2>&1";
  FILE* pipe = ::popen(command.c_str(), "r");
  ASSERT_NE(pipe, nullptr);
  std::string output;
  char buffer[4096];
  while (size_t n = std::fread(buffer, 1, sizeof(buffer), pipe)) output.append(buffer, n);
  const int status = ::pclose(pipe);
  ASSERT_NE(WEXITSTATUS(status), 127) << "promtool is missing (scripts/setup --test installs it)";
  std::istringstream lines(output);
  int warnings = 0;
  for (std::string line; std::getline(lines, line);) {
    ++warnings;
    EXPECT_NE(line.find("metric names should not contain ':'"), std::string::npos) << line;
  }
  EXPECT_GT(warnings, 0) << "promtool said nothing about ':' names: is it promtool?";
}

}  // namespace
}  // namespace rubato
