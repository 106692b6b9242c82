// The in-process Transport (DESIGN §1 "colocated mode": the cache service runs in the same
// process as the engine). A LoopbackHub connects N ranks; each rank gets one Transport from
// Endpoint(rank). A send is matched with the receive its peer posts for the same (source, tag),
// in posting order, whichever of the two is posted first; the bytes are copied with memcpy at
// the moment the second of the pair is posted, and both ops complete then. Host memory only;
// ops with a ready_event are refused (kUnsupported: there is no CUDA here to wait on it).
//
//   RUBATO_ASSIGN_OR_RETURN(auto hub, LoopbackHub::Create(/*world_size=*/2));
//   RUBATO_ASSIGN_OR_RETURN(auto engine_side, hub->Endpoint(0));
//   RUBATO_ASSIGN_OR_RETURN(auto cache_side, hub->Endpoint(1));
//
// Thread safety: each endpoint is driven by one thread (transport.h), and different endpoints
// may be driven from different threads: all matching state lives in the hub behind one mutex.
// Endpoints and the hub may be destroyed in any order. Destroying an endpoint cancels its own
// posted transfers and fails (kUnavailable) the transfers other ranks still have pending with it.
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
