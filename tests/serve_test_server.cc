// Helpers of the `rubato serve` integration tests (serve_test_server.h).
#include "tests/serve_test_server.h"

#include <sys/socket.h>
#include <unistd.h>

#include <cstdlib>
#include <thread>

#include "tests/http_test_client.h"

namespace rubato::testing {

std::unique_ptr<BackgroundProcess> StartServe(const std::string& binary,
                                              const std::string& model_dir,
                                              const std::vector<std::string>& args, int* port) {
  std::vector<std::string> argv = {"serve", "--model", model_dir, "--port", "0", "--threads", "1"};
  argv.insert(argv.end(), args.begin(), args.end());
  auto server = std::make_unique<BackgroundProcess>(binary, argv);
  *port = 0;
  if (!server->WaitForOutput("listening on http://", std::chrono::milliseconds(30000))) {
    return server;
  }
  // "rubato serve: listening on http://127.0.0.1:PORT"
  const std::string out = server->Out();
  const std::string prefix = "listening on http://127.0.0.1:";
  const size_t at = out.find(prefix);
  if (at != std::string::npos) *port = std::atoi(out.c_str() + at + prefix.size());
  return server;
}

int SendRequest(int port, const std::string& path, const std::string& body,
                const std::string& headers, const std::string& more, const std::string& method) {
  const int fd = Connect(port);
  if (fd < 0) return -1;
  SendAll(fd, method + " " + path +
                  " HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
                  "Content-Length: " +
                  std::to_string(body.size()) + "\r\n" + headers + "\r\n" + body + more);
  return fd;
}

double MetricValue(const std::string& exposition, const std::string& sample) {
  const size_t at = exposition.find("\n" + sample + " ");
  if (at == std::string::npos) return -1;
  return std::atof(exposition.c_str() + at + sample.size() + 2);
}

bool WaitUntil(const std::function<bool()>& condition, std::chrono::milliseconds timeout) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  while (!condition()) {
    if (std::chrono::steady_clock::now() > deadline) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return true;
}

std::vector<std::string> SseData(const std::string& body) {
  std::vector<std::string> events;
  size_t at = 0;
  while ((at = body.find("data: ", at)) != std::string::npos) {
    const size_t end = body.find("\n\n", at);
    if (end == std::string::npos) break;  // a truncated last event
    events.push_back(body.substr(at + 6, end - at - 6));
    at = end + 2;
  }
  return events;
}

}  // namespace rubato::testing
