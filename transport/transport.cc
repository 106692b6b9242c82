// What every Transport backend shares: memory kind names, the validation of a Post's ops and
// the polling Wait (transfer_validation.h).
#include "transport/transport.h"

#include <fmt/format.h>

#include <chrono>
#include <string>
#include <thread>

#include "transport/transfer_validation.h"

namespace rubato::transport {

std::string_view MemoryKindName(MemoryKind memory) {
  switch (memory) {
    case MemoryKind::kHost:
      return "host";
    case MemoryKind::kCuda:
      return "cuda";
  }
  return "unknown";
}

std::string DescribeOp(const TransferOp& op) {
  const bool send = op.direction == TransferOp::Direction::kSend;
  return fmt::format("{} peer {}, tag {}, {} bytes of {} memory", send ? "send to" : "receive from",
                     op.peer, op.tag, op.bytes, MemoryKindName(op.memory));
}

namespace {

// The problem with one op, or "" when it is valid.
std::string OpProblem(const Transport& transport, const TransferOp& op) {
  if (op.direction != TransferOp::Direction::kSend &&
      op.direction != TransferOp::Direction::kRecv) {
    return fmt::format("direction {} is neither send nor receive", static_cast<int>(op.direction));
  }
  if (op.peer < 0 || op.peer >= transport.WorldSize()) {
    return fmt::format("peer {} is out of range [0, {})", op.peer, transport.WorldSize());
  }
  if (op.peer == transport.Rank()) {
    return fmt::format("peer {} is this transport's own rank (transfers go to another rank)",
                       op.peer);
  }
  if (op.tag > kMaxTag) {
    return fmt::format("tag {} exceeds kMaxTag {} (tags are 48-bit)", op.tag, kMaxTag);
  }
  if (op.data == nullptr && op.bytes > 0) {
    return fmt::format("data is null but bytes is {} (null is allowed only for 0 bytes)",
                       op.bytes);
  }
  if (op.memory != MemoryKind::kHost && op.memory != MemoryKind::kCuda) {
    return fmt::format("memory kind {} is unknown", static_cast<int>(op.memory));
  }
  if (!transport.SupportsMemory(op.memory)) {
    return fmt::format("{} memory is not supported by this {} transport",
                       MemoryKindName(op.memory), transport.BackendName());
  }
  return {};
}

}  // namespace

Status ValidateOps(const Transport& transport, std::span<const TransferOp> ops) {
  if (ops.empty()) {
    return InvalidArgumentError(
        fmt::format("{}: Post needs at least one op, got none", transport.BackendName()));
  }
  for (size_t i = 0; i < ops.size(); ++i) {
    const std::string problem = OpProblem(transport, ops[i]);
    if (!problem.empty()) {
      return InvalidArgumentError(fmt::format("{}: Post op {} of {} ({}): {}",
                                              transport.BackendName(), i, ops.size(),
                                              DescribeOp(ops[i]), problem));
    }
  }
  return Status::Ok();
}

Status WaitBySpinning(Transport& transport, TransferId id, std::chrono::milliseconds timeout,
                      std::chrono::microseconds spin, std::chrono::microseconds pause) {
  const auto start = std::chrono::steady_clock::now();
  const auto deadline = start + timeout;
  const auto spin_until = start + spin;
  while (true) {
    RUBATO_ASSIGN_OR_RETURN(const bool done, transport.Test(id));
    if (done) return Status::Ok();
    const auto now = std::chrono::steady_clock::now();
    if (now >= deadline) {
      return DeadlineExceededError(std::string(transport.BackendName()) + ": transfer " +
                                   std::to_string(id) + " of rank " +
                                   std::to_string(transport.Rank()) + " not done within " +
                                   std::to_string(timeout.count()) + " ms");
    }
    if (now < spin_until) {
      std::this_thread::yield();
    } else {
      std::this_thread::sleep_for(pause);
    }
  }
}

Status WaitByTesting(Transport& transport, TransferId id, std::chrono::milliseconds timeout,
                     std::chrono::microseconds pause) {
  return WaitBySpinning(transport, id, timeout, std::chrono::microseconds(0), pause);
}

}  // namespace rubato::transport
