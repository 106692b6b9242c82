// The server side of the RPC control plane, run by a cache rank: RpcServer reads frames on its
// own Boost.Asio thread and hands requests to an RpcHandler on a pool of handler threads; it
// enforces Hello, answers heartbeats, closes silent or malformed connections and reports lost
// ones (OnConnectionLost). Handler methods may run concurrently and must be thread-safe; they
// must not call Stop() (OnShutdown signals the owner, which calls it).
// Narrative: docs/transport.md "The RPC server".
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>

#include "common/proto/rpc.pb.h"
#include "common/status.h"
#include "transport/rpc/rpc_frame.h"

namespace rubato {
class Counter;  // common/metrics.h
}  // namespace rubato

namespace rubato::rpc {

// Identifies one accepted TCP connection for the server's lifetime (1, 2, 3, ...).
using ConnectionId = uint64_t;

class RpcServerImpl;  // rpc_server.cc

// What a cache rank implements. Each method gets the connection the request came on.
class RpcHandler {
 public:
  virtual ~RpcHandler() = default;

  // Called after the server checked version, role and model shape. The server sets
  // protocol_version (and, when the handler leaves them unset, role and model_shape) of the
  // response.
  virtual Result<HelloResponse> OnHello(ConnectionId connection, const HelloRequest& request) = 0;
  virtual Result<OpenSessionResponse> OnOpenSession(ConnectionId connection,
                                                    const OpenSessionRequest& request) = 0;
  virtual Result<CloseSessionResponse> OnCloseSession(ConnectionId connection,
                                                      const CloseSessionRequest& request) = 0;
  virtual Result<StatsResponse> OnStats(ConnectionId connection, const StatsRequest& request) = 0;
  virtual Result<HealthResponse> OnHealth(ConnectionId connection,
                                          const HealthRequest& request) = 0;
  virtual Result<ShutdownResponse> OnShutdown(ConnectionId connection,
                                              const ShutdownRequest& request) = 0;
  // The connection ended (peer closed it, peer timeout, protocol error, I/O error); `reason`
  // says which. Called once per connection, never after Stop() returned, not for Stop() itself.
  virtual void OnConnectionLost(ConnectionId connection, const Status& reason) {}
};

struct RpcServerOptions {
  std::string host = "127.0.0.1";  // address to bind: an IP literal ("0.0.0.0" for all)
  uint16_t port = 0;               // 0: the OS picks a free port (RpcServer::port() says which)
  Role own_role = ROLE_CACHE;      // put in Hello responses
  Role served_peer_role = ROLE_INFERENCE;  // a Hello from another role is refused
  std::optional<ModelShape> model_shape;   // when set, a Hello with another shape is refused
  // A connection from which nothing arrives for this long is closed. Clients heartbeat every
  // LimitsSection::heartbeat_ms (1000 by default), so 5 heartbeats' worth is the default.
  int peer_timeout_ms = 5000;
  uint32_t max_frame_bytes = kDefaultMaxFrameBytes;
  int handler_threads = 2;  // threads running RpcHandler methods, [1, 256]
  // Non-empty: every Hello must carry this token (transport/rpc/rpc_auth.h); else no
  // authentication.
  std::string auth_token;
  // A Hello with a missing or wrong token is checked on the I/O thread in the connection's
  // order, logged (the peer's address, never a token), counted, and answered after this delay;
  // then the connection is closed. Nothing the peer sends after that Hello is read, so each
  // connection gets one guess, answered no sooner than this. Other connections are served
  // meanwhile (a timer, not a sleeping thread). [0, 60000].
  int auth_failure_delay_ms = 1000;
  Counter* auth_failures = nullptr;  // when set, incremented per refused Hello
};

class RpcServer {
 public:
  // Binds, listens and starts serving. `handler` must outlive the server (or its Stop()).
  // Errors: kInvalidArgument for bad options (naming the option), kUnavailable when the address
  // cannot be bound (e.g. "127.0.0.1:7000: Address already in use").
  static Result<std::unique_ptr<RpcServer>> Start(const RpcServerOptions& options,
                                                  RpcHandler* handler);

  ~RpcServer();  // Stop()
  RpcServer(const RpcServer&) = delete;
  RpcServer& operator=(const RpcServer&) = delete;

  // Closes the listening socket and every connection, waits for running handler calls and
  // joins all threads. Idempotent; safe from any thread except a handler call.
  void Stop();

  uint16_t port() const { return bound_port_; }
  std::string endpoint() const;  // "host:port" with the bound port
  size_t num_connections() const;

 private:
  RpcServer(std::unique_ptr<RpcServerImpl> impl, uint16_t bound_port);

  std::unique_ptr<RpcServerImpl> impl_;
  uint16_t bound_port_;
};

}  // namespace rubato::rpc
