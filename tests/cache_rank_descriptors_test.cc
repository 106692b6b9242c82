// A cache rank and `rubato serve` out of file descriptors (`prlimit --nofile`, then hundreds of
// idle TCP connections to their port): the accept loop backs off instead of spinning and logs
// the failures at most once per interval (they were megabytes of identical lines a second), and
// once the connections close it accepts again and serves. docs/security.md "Descriptors".
#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <regex>
#include <string>
#include <thread>
#include <vector>

#include "common/test_temp_dir.h"
#include "tests/cli_runner.h"

namespace rubato {
namespace {

using std::chrono::milliseconds;
using testing::BackgroundProcess;
using testing::ProcessResult;
using testing::RunProcess;

// A TCP connection to 127.0.0.1:port (the kernel completes it into the listen backlog whether or
// not the server accepts it), or -1.
int Connect(int port) {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) return -1;
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_port = htons(static_cast<uint16_t>(port));
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (connect(fd, reinterpret_cast<sockaddr*>(&address), sizeof(address)) != 0) {
    close(fd);
    return -1;
  }
  return fd;
}

size_t Count(const std::string& text, const std::string& needle) {
  size_t count = 0;
  for (size_t at = text.find(needle); at != std::string::npos; at = text.find(needle, at + 1)) {
    ++count;
  }
  return count;
}

// Far more connections to `port` than `process` has descriptors for (each it accepts costs one),
// for 3 s: its accept loop meets EMFILE and must log at most two lines (spinning, it logged
// megabytes in this time). Then every connection closes again.
void ExhaustDescriptorsQuietly(int port, BackgroundProcess& process) {
  std::vector<int> sockets;
  for (int i = 0; i < 300; ++i) {
    const int fd = Connect(port);
    if (fd >= 0) sockets.push_back(fd);
  }
  EXPECT_GT(sockets.size(), 150u) << "could not open the connections";
  std::this_thread::sleep_for(milliseconds(3000));
  const std::string err = process.Err();
  EXPECT_LT(err.size(), 8192u) << "the accept loop floods its log:\n" << err.substr(0, 2000);
  EXPECT_LE(Count(err, "accept failed"), 2u) << err;
  EXPECT_GE(Count(err, "accept failed"), 1u) << "descriptors were never exhausted:\n" << err;
  for (int fd : sockets) close(fd);
}

TEST(CacheRankDescriptors, ExhaustedDescriptorsBackOffQuietlyAndRecover) {
  setenv("UCX_TLS", "tcp", 1);
  BackgroundProcess cache("/usr/bin/prlimit",
                          {"--nofile=128:128", RUBATO_BINARY, "cache", "--listen", "127.0.0.1:0"});
  ASSERT_TRUE(cache.WaitForOutput("listening on", milliseconds(30000)))
      << cache.Out() << cache.Err();
  std::smatch match;
  const std::string out = cache.Out();
  ASSERT_TRUE(std::regex_search(out, match, std::regex("listening on (\\S+):(\\d+)"))) << out;
  const std::string endpoint = match[1].str() + ":" + match[2].str();
  const int port = std::stoi(match[2]);

  ExhaustDescriptorsQuietly(port, cache);
  // Freed descriptors: the next accept succeeds and a whole offloaded run is served.
  const ProcessResult run = RunProcess(
      RUBATO_BINARY,
      {"generate", "--model", "models/tiny-qwen3-longctx", "--prompt", "The pass key is 4711.",
       "--max-tokens", "4", "--policy", "offload_dense", "--threads", "1", "--cache", endpoint},
      120);
  EXPECT_EQ(run.exit_code, 0) << run.err;
  EXPECT_FALSE(run.signaled);
}

TEST(ServeDescriptors, ExhaustedDescriptorsBackOffQuietlyAndRecover) {
  BackgroundProcess server("/usr/bin/prlimit",
                           {"--nofile=64:64", RUBATO_BINARY, "serve", "--model",
                            "models/tiny-qwen3-longctx", "--port", "0", "--threads", "1"});
  ASSERT_TRUE(server.WaitForOutput("listening on http://", milliseconds(30000)))
      << server.Out() << server.Err();
  std::smatch match;
  const std::string out = server.Out();
  ASSERT_TRUE(std::regex_search(out, match, std::regex("listening on http://\\S+:(\\d+)"))) << out;
  const int port = std::stoi(match[1]);

  ExhaustDescriptorsQuietly(port, server);
  // Freed descriptors: a new connection is accepted and answered (within the 1 s backoff).
  bool served = false;
  for (int attempt = 0; attempt < 100 && !served; ++attempt) {
    const int fd = Connect(port);
    if (fd >= 0) {
      const std::string request = "GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n";
      if (send(fd, request.data(), request.size(), 0) == static_cast<ssize_t>(request.size())) {
        char reply[64] = {};
        const ssize_t got = recv(fd, reply, sizeof(reply) - 1, 0);
        served = got > 0 && std::string(reply).rfind("HTTP/1.1 200", 0) == 0;
      }
      close(fd);
    }
    if (!served) std::this_thread::sleep_for(milliseconds(100));
  }
  EXPECT_TRUE(served) << server.Err();
  server.Signal(SIGTERM);
  EXPECT_EQ(server.Wait(milliseconds(15000)).exit_code, 0);
}

}  // namespace
}  // namespace rubato
