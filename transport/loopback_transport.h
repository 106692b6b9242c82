// The in-process Transport (colocated mode: the cache service in the engine's process): a
// LoopbackHub connects N ranks, Endpoint(rank) gives each its Transport; a send and its peer's
// receive for the same (source, tag) are matched in posting order and copied with memcpy when the
// second is posted. Host memory only; ready_event is refused. One thread per endpoint, endpoints
// on any threads (the hub's mutex); destroying an endpoint fails its peers' pending transfers.
// Narrative and usage: docs/transport.md "Loopback".
#pragma once

#include <memory>

#include "common/status.h"
#include "transport/transport.h"

namespace rubato::transport {

struct LoopbackHubState;  // the queues and groups of all ranks (loopback_transport.cc)

class LoopbackHub {
 public:
  // world_size in [1, 65536] (the same rank limit as UCX, so configs move between backends).
  static Result<std::unique_ptr<LoopbackHub>> Create(int world_size);

  // The transport of `rank`, in [0, world_size). One endpoint per rank may be alive at a time:
  // a second one for the same rank is kFailedPrecondition until the first is destroyed.
  Result<std::unique_ptr<Transport>> Endpoint(int rank);

  int WorldSize() const;

 private:
  explicit LoopbackHub(std::shared_ptr<LoopbackHubState> state);
  std::shared_ptr<LoopbackHubState> state_;
};

}  // namespace rubato::transport
