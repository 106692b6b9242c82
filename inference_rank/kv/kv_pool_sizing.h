// How many KV blocks the paged pool gets (docs/engine_and_models.md "The KV pool"): vLLM's
// gpu_memory_utilization rule, shared by the backends. The pool takes what is left of
// `utilization` x the memory's total once the weights, workspaces and everything else already
// allocated are in place (and the workspaces a backend will still allocate), never more than is
// free now, and never more blocks than max_batch x max_context can use. Pure arithmetic over a
// memory snapshot (a test injects one); the host snapshot reads /proc/meminfo and the cgroup.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

#include "common/status.h"

namespace rubato {

// The memory a backend's KV pool lives in, as the sizing reads it: a CUDA device
// (cudaMemGetInfo) or host memory (ReadHostMemory).
struct KvPoolMemory {
  std::string where;             // "host memory", "CUDA device 0": for messages
  uint64_t total_bytes = 0;      // the memory's size
  uint64_t free_bytes = 0;       // free now, after the weights and workspaces in place
  uint64_t bytes_per_block = 0;  // K and V of one block in every layer, in the pool's dtype
  // Workspaces the backend allocates on first need (the largest step's activations), counted
  // as if already in place.
  uint64_t pending_bytes = 0;
};

struct KvPoolSize {
  int num_blocks = 0;
  uint64_t budget_bytes = 0;  // what the utilization rule left for the pool
  bool capped = false;        // num_blocks is the max_batch x max_context cap, not the budget
};

// Blocks of the pool: budget = free - (1 - utilization) x total - pending (vLLM's rule: the
// process may use `utilization` of the memory in all, everything in it so far counted, other
// processes' use included), blocks = min(budget / bytes_per_block, useful_blocks). `utilization`
// in (0, 1] (InvalidArgument naming engine.gpu_memory_utilization otherwise); ResourceExhausted,
// with the numbers, when the budget holds less than one block. Whatever the inputs, the pool's
// bytes never exceed free_bytes.
Result<KvPoolSize> SizeKvPool(const KvPoolMemory& memory, double utilization,
                              int64_t useful_blocks);

// Checks engine.gpu_memory_utilization: InvalidArgument naming it outside (0, 1] (NaN included).
Status CheckMemoryUtilization(double utilization);

// Host memory from the text of /proc/meminfo (MemTotal, MemAvailable; MemFree when the kernel
// has no MemAvailable), bounded by a cgroup v2 limit when `cgroup_max` (memory.max: a number
// or "max") is one: then what the cgroup uses is `cgroup_current` (memory.current) less the
// page cache it could drop (inactive_file of `cgroup_stat`, memory.stat), as Kubernetes counts
// a container's working set. Empty texts: no cgroup. InvalidArgument naming the missing field.
Result<KvPoolMemory> ParseHostMemory(std::string_view meminfo, std::string_view cgroup_max = "",
                                     std::string_view cgroup_current = "",
                                     std::string_view cgroup_stat = "");

// ParseHostMemory of this machine's /proc/meminfo and /sys/fs/cgroup/memory.{max,current,stat};
// falls back to sysconf (physical and available pages) where /proc/meminfo cannot be read.
Result<KvPoolMemory> ReadHostMemory();

}  // namespace rubato
