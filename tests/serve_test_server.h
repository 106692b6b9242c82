// Helpers of the integration tests that start the real `rubato serve`: the server on a free port
// (its "listening on" line read for the port), raw requests left open for the test to close,
// half-close or read, Prometheus samples by name, and the events of an SSE body.
#pragma once

#include <chrono>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "tests/cli_runner.h"

namespace rubato::testing {

// `rubato serve --model DIR --port 0 --threads 1 ARGS...`; sets *port once it listens (0 when it
// did not within 30 s: the test then fails on the port).
std::unique_ptr<BackgroundProcess> StartServe(const std::string& binary,
                                              const std::string& model_dir,
                                              const std::vector<std::string>& args, int* port);

// Connects and sends `method path` with a JSON `body` (Content-Length set) and `more` after it
// (bytes of a next request, or nothing); returns the socket, or -1 when it cannot connect.
// `headers`: extra header lines, each ending in "\r\n".
int SendRequest(int port, const std::string& path, const std::string& body,
                const std::string& headers = "", const std::string& more = "",
                const std::string& method = "POST");

// The value of `sample` (name and labels as exposed) in a Prometheus exposition; -1 if absent.
double MetricValue(const std::string& exposition, const std::string& sample);

// Polls `condition` every 20 ms until it holds (true) or `timeout` passes (false).
bool WaitUntil(const std::function<bool()>& condition, std::chrono::milliseconds timeout);

// The payloads of an SSE body's `data:` events, in order ("[DONE]" included).
std::vector<std::string> SseData(const std::string& body);

}  // namespace rubato::testing
