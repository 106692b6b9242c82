// Peer access between two GPUs of this process, enabled once per ordered pair: every component
// that copies or loads across GPUs (the in-process GPU cache rank, the cuda_peer transport) asks
// here, so that no call meets "peer access is already enabled" (an API error compute-sanitizer
// reports) and the error state stays clean for the next launch check.
#pragma once

#include "common/status.h"

namespace rubato::cuda {

// Enables `from`'s access to `to`'s memory when the hardware allows it and this process has not
// yet; false (and ok) when the pair cannot access each other directly (copies then go through
// the host). Leaves `from` current on success. Thread-safe.
Result<bool> EnablePeerAccessOnce(int from, int to);

}  // namespace rubato::cuda
