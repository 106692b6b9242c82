// StreamExchange (stream_exchange.h): Enqueue where the transport has it, else PostOnStream and
// a StreamWait retried until the peer's side is posted.
#include "transport/stream_exchange.h"

#include <thread>

namespace rubato::transport {

StreamExchange::~StreamExchange() {
  for (const TransferId id : posted_) transport_.Cancel(id);
}

Status StreamExchange::Exchange(std::span<const TransferOp> ops, void* stream) {
  if (transport_.SupportsEnqueue()) return transport_.Enqueue(ops, stream);
  RUBATO_ASSIGN_OR_RETURN(const TransferId id, transport_.PostOnStream(ops, stream));
  posted_.push_back(id);
  const auto deadline = std::chrono::steady_clock::now() + timeout_;
  while (true) {
    const Status waited = transport_.StreamWait(id, stream);
    if (waited.code() != StatusCode::kFailedPrecondition) return waited;
    // The peer has not posted its side yet: it runs on another thread of this process.
    if (std::chrono::steady_clock::now() >= deadline) {
      return DeadlineExceededError(std::string(transport_.BackendName()) +
                                   ": the peer did not post its side of a stream-ordered "
                                   "transfer within " +
                                   std::to_string(timeout_.count()) + " ms (" + waited.message() +
                                   ")");
    }
    std::this_thread::yield();
  }
}

Status StreamExchange::Drain() {
  Status first;
  for (const TransferId id : posted_) {
    const Status waited = transport_.Wait(id, timeout_);
    if (waited.code() == StatusCode::kDeadlineExceeded) transport_.Cancel(id);
    if (first.ok() && !waited.ok()) first = waited;
  }
  posted_.clear();
  return first;
}

}  // namespace rubato::transport
