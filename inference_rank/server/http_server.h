// A small HTTP/1.1 server on Boost.Beast / Boost.Asio for `rubato serve`: parses requests within
// size limits, hands each to one handler and writes its reply (keep-alive, 100-continue, replies
// that complete later or stream as chunked Server-Sent Events). One I/O thread runs every
// connection; handlers run on it and must not block (heavy work goes to another thread, which
// completes a PendingReply). Bad input never takes the server down; a client that goes away
// cancels its pending reply (one that only half-closes is answered). HEAD gets the GET reply's
// head without body. Stops gracefully: StopAccepting, then Stop(grace).
// Narrative: docs/engine_and_models.md "The HTTP server".
#pragma once

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "common/status.h"
#include "inference_rank/server/pending_reply.h"

namespace rubato::server {

struct HttpRequest {
  std::string method;  // "GET", "POST", ...
  std::string path;    // the target without its query string
  std::string body;
  std::map<std::string, std::string> headers = {};  // lower-case names; a repeated one: the last

  // The header's value, or "" when absent. `name` in lower case.
  std::string Header(const std::string& name) const {
    const auto it = headers.find(name);
    return it == headers.end() ? std::string() : it->second;
  }
};

struct HttpReply {
  int status = 200;
  std::string content_type = "application/json";
  std::string body;
  std::shared_ptr<PendingReply> pending;  // set: status/body come later through it
  HttpHeaders headers = {};  // extra headers of a whole reply (not `pending`'s)
};

using HttpHandler = std::function<HttpReply(const HttpRequest&)>;

struct HttpServerOptions {
  std::string host = "127.0.0.1";
  uint16_t port = 8000;                  // 0: any free port (see HttpServer::port)
  size_t max_body_bytes = 16 << 20;      // larger bodies: 413
  size_t max_header_bytes = 64 << 10;    // larger request line + headers: 431
  std::chrono::milliseconds idle_timeout{60000};   // reading a request, or idle keep-alive
  std::chrono::milliseconds write_timeout{60000};  // a client that stops reading its reply
};

class HttpServer {
 public:
  // Binds, listens and starts the I/O thread. Unavailable when the address cannot be bound.
  static Result<std::unique_ptr<HttpServer>> Start(const HttpServerOptions& options,
                                                   HttpHandler handler);
  ~HttpServer();  // Stop(0)
  HttpServer(const HttpServer&) = delete;
  HttpServer& operator=(const HttpServer&) = delete;

  uint16_t port() const { return port_; }  // the bound port
  // Closes the listening socket (new connections are refused) and the connections that wait for
  // a next request. A connection in the middle of a request, or with a reply to write, goes on
  // and closes after that reply (`Connection: close`). Returns once done; idempotent.
  void StopAccepting();
  // Replies handlers left pending (PendingReply) that are not written out yet.
  int pending_replies() const;
  // StopAccepting; connections with a pending reply get up to `grace` to finish it; then every
  // connection is closed and the I/O thread joined.
  void Stop(std::chrono::milliseconds grace = std::chrono::milliseconds(0));

  struct State;  // the Asio objects and connections; defined in http_server.cc only

 private:
  HttpServer() = default;

  std::shared_ptr<State> state_;
  std::thread io_thread_;
  uint16_t port_ = 0;
};

}  // namespace rubato::server
