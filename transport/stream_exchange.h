// Device transfers ordered by a CUDA stream on any StreamOrderedTransport, with one contract:
// after Exchange returns, work enqueued on the stream sees the received bytes and may overwrite
// the sent buffers, and the host never waits for the device. Where the transport has Enqueue
// (nccl) that is all there is, and it may be captured in a CUDA graph; elsewhere (cuda_peer, in
// one process) the group is posted on the stream and the stream made to wait for it, which
// needs the peer's side posted first: Exchange retries until it is (a host wait on the peer
// thread's posting, never on the device), and the group is released by a later Drain.
// Thread-compatible, like the transport. docs/transport.md "Stream-ordered transfers".
#pragma once

#include <chrono>
#include <span>
#include <vector>

#include "common/status.h"
#include "transport/transport.h"

namespace rubato::transport {

class StreamExchange {
 public:
  // `timeout` bounds Exchange's wait for the peer's posts and Drain's wait for each group.
  StreamExchange(StreamOrderedTransport& transport, std::chrono::milliseconds timeout)
      : transport_(transport), timeout_(timeout) {}
  ~StreamExchange();
  StreamExchange(const StreamExchange&) = delete;
  StreamExchange& operator=(const StreamExchange&) = delete;

  // Whether Exchange may run while `stream` is captured (Enqueue: the transport's own order).
  bool capturable() const { return transport_.SupportsEnqueue(); }

  // Orders `ops` (one group) on `stream` behind its work, and `stream` after them. Errors:
  // the transport's; kDeadlineExceeded when the peer did not post its side within the timeout.
  Status Exchange(std::span<const TransferOp> ops, void* stream);

  // Host, once the streams Exchange ordered are synchronized (or about to be): releases every
  // group posted so far, waiting for each at most the timeout.
  Status Drain();

  StreamOrderedTransport& transport() { return transport_; }

 private:
  StreamOrderedTransport& transport_;
  const std::chrono::milliseconds timeout_;
  std::vector<TransferId> posted_;  // groups ordered on a stream, not yet released
};

}  // namespace rubato::transport
