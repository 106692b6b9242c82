// Validation of a Post's ops that every Transport backend shares (transport.h: "Invalid ops are
// refused before anything starts, with an error naming the op's index and the problem").
#pragma once

#include <chrono>
#include <span>
#include <string>

#include "common/status.h"
#include "transport/transport.h"

namespace rubato::transport {

// kInvalidArgument for the first invalid op of `ops`, ok when all are valid. Checks, in order:
// at least one op; peer in [0, WorldSize()) and != Rank(); tag <= kMaxTag; data non-null when
// bytes > 0; memory supported (SupportsMemory). The message starts with the backend's name
// and the op's index, e.g. "ucx: Post op 2 of 3 (send to peer 5, tag 7, 64 bytes of host
// memory): peer 5 is out of range [0, 4)".
Status ValidateOps(const Transport& transport, std::span<const TransferOp> ops);

// "send to peer 5, tag 7, 64 bytes of host memory": names an op in errors and logs.
std::string DescribeOp(const TransferOp& op);

// Wait by polling: calls transport.Test(id) until it reports done (ok) or an error, or
// `timeout` passes (kDeadlineExceeded "<backend>: transfer <id> of rank <r> not done within
// <timeout> ms"), sleeping `pause` between calls. For backends whose progress is a query.
Status WaitByTesting(Transport& transport, TransferId id, std::chrono::milliseconds timeout,
                     std::chrono::microseconds pause = std::chrono::microseconds(20));

// Wait for backends whose progress is a cheap query of the GPU (nccl, cuda_peer): polls Test,
// yielding the CPU between polls for the first `spin` (a small transfer completes within tens
// of microseconds, which a sleep would overshoot), then sleeping `pause` between polls. Same
// results as WaitByTesting.
Status WaitBySpinning(Transport& transport, TransferId id, std::chrono::milliseconds timeout,
                      std::chrono::microseconds spin = std::chrono::microseconds(2000),
                      std::chrono::microseconds pause = std::chrono::microseconds(20));

}  // namespace rubato::transport
