// cuda_peer: the in-process device transport for ranks on one or more GPUs of one process (the
// colocated mode's device path, and the one device transport a single GPU can test). A PeerHub
// (peer_transport.h) whose copier moves each matched pair's bytes with cudaMemcpyPeerAsync
// (cudaMemcpyAsync when both ranks share a device) on the receiver's copy stream, ordered after
// both posts by events and finished by an event, all pooled. Device memory only. Posts and
// StreamWait leave the rank's device current. Narrative and usage: docs/transport.md
// "cuda_peer".
#pragma once

#include <memory>
#include <span>

#include "common/status.h"
#include "transport/peer_transport.h"

namespace rubato::transport {

// A hub of devices.size() ranks, rank r's buffers and streams on CUDA device devices[r] (ranks
// may share a device). Enables peer access between every pair of distinct devices that allows
// it (copies between the others are staged by the CUDA runtime). BackendName "cuda_peer".
Result<std::unique_ptr<PeerHub>> CreateCudaPeerHub(std::span<const int> devices);

}  // namespace rubato::transport
