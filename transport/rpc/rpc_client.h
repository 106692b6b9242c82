// The client side of the RPC control plane, used by an inference rank to talk to one cache rank.
// Calls are blocking, typed, thread-safe and bounded by a deadline (kDeadlineExceeded); a server
// Error comes back as its Status. A background heartbeat marks the client unhealthy within
// peer_timeout_ms + heartbeat_ms of silence or a drop: then every call fails with kUnavailable
// until Reconnect() (and a new Hello). Narrative: docs/transport.md "The RPC client".
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>

#include "common/config.h"
#include "common/proto/rpc.pb.h"
#include "common/status.h"
#include "transport/rpc/rpc_frame.h"

namespace rubato::rpc {

struct RpcClientOptions {
  int call_timeout_ms = 5000;  // default deadline of one call (LimitsSection::rpc_timeout_ms)
  int heartbeat_ms = 1000;     // interval between heartbeats (LimitsSection::heartbeat_ms)
  // Silence after which the server counts as lost. Default: 5 heartbeats, enough to ride out
  // a busy server or a scheduling hiccup while still noticing a dead peer within seconds.
  int peer_timeout_ms = 5000;
  uint32_t max_frame_bytes = kDefaultMaxFrameBytes;
  // Sent in every Hello that carries none of its own (the server's token, rpc_auth.h).
  std::string auth_token;
  // When set: once *abandon is true, a connect or call in progress gives up within ~20 ms with
  // kUnavailable (an owner that is shutting down does not wait out a stalled peer), and later
  // ones fail at once. Must outlive the client.
  const std::atomic<bool>* abandon = nullptr;

  // rpc_timeout_ms and heartbeat_ms from the config, peer timeout = 5 heartbeats, the token
  // from the environment (RUBATO_CACHE_TOKEN / RUBATO_CACHE_TOKEN_FILE; none when unreadable:
  // the server then refuses the Hello, naming the token).
  static RpcClientOptions FromLimits(const LimitsSection& limits);
};

// "host:port" (or "[v6]:port") split into its parts; kInvalidArgument naming the endpoint and
// what is wrong (no port, port not a number in [1, 65535], empty host).
struct RpcEndpoint {
  std::string host;
  uint16_t port = 0;
};
Result<RpcEndpoint> ParseRpcEndpoint(std::string_view endpoint);

class ClientConnection;  // rpc_client.cc: one TCP connection and its I/O thread

class RpcClient {
 public:
  // A timeout of 0 in the calls below means RpcClientOptions::call_timeout_ms.
  static constexpr std::chrono::milliseconds kDefaultTimeout{0};

  // Connects within `connect_timeout`. Errors: kInvalidArgument for a bad endpoint string or
  // bad options, kUnavailable when the host does not resolve or refuses the connection,
  // kDeadlineExceeded when no connection is made in time.
  static Result<std::unique_ptr<RpcClient>> Connect(std::string_view endpoint,
                                                    std::chrono::milliseconds connect_timeout,
                                                    const RpcClientOptions& options = {});

  ~RpcClient();  // Close()
  RpcClient(const RpcClient&) = delete;
  RpcClient& operator=(const RpcClient&) = delete;

  // protocol_version 0 in the request is sent as kProtocolVersion. Fails with
  // kFailedPrecondition if the server answers with another version.
  Result<HelloResponse> Hello(HelloRequest request, std::chrono::milliseconds timeout = {});
  Result<OpenSessionResponse> OpenSession(const OpenSessionRequest& request,
                                          std::chrono::milliseconds timeout = {});
  Result<CloseSessionResponse> CloseSession(const CloseSessionRequest& request,
                                            std::chrono::milliseconds timeout = {});
  Result<StatsResponse> Stats(std::chrono::milliseconds timeout = {});
  Result<HealthResponse> Health(std::chrono::milliseconds timeout = {});
  Result<ShutdownResponse> Shutdown(const ShutdownRequest& request,
                                    std::chrono::milliseconds timeout = {});

  bool Healthy() const;
  Status LostReason() const;  // ok while healthy

  // Drops the current connection (its pending calls fail with kUnavailable) and connects to
  // the same endpoint again. On failure the client keeps the old, unhealthy connection.
  Status Reconnect(std::chrono::milliseconds connect_timeout);

  // Closes the connection and joins the I/O thread; later calls fail with kUnavailable.
  void Close();

  const std::string& endpoint() const { return endpoint_; }

 private:
  RpcClient(std::string endpoint, RpcClientOptions options,
            std::shared_ptr<ClientConnection> connection);

  // Sends `request`, waits for the response whose body is `expected`, or the error.
  Result<Envelope> Call(Envelope request, Envelope::BodyCase expected,
                        std::chrono::milliseconds timeout);
  std::shared_ptr<ClientConnection> Current() const;

  const std::string endpoint_;
  const RpcClientOptions options_;
  mutable std::mutex connection_mutex_;           // guards connection_ (the pointer)
  std::shared_ptr<ClientConnection> connection_;  // never null
};

}  // namespace rubato::rpc
