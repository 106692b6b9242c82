// The standard process metrics every rubato process exports (the names of Prometheus' client
// libraries: process_cpu_seconds_total, process_resident_memory_bytes, process_open_fds), read
// from /proc at each scrape, and rubato:build_info, a constant 1 labelled with the version and
// the process' role. Usage: docs/common.md "Metrics".
#pragma once

#include <string_view>

#include "common/metrics.h"
#include "common/status.h"

namespace rubato {

// What /proc says about this process; a field that cannot be read is negative.
struct ProcessSample {
  double cpu_seconds = -1;            // user + system time
  double resident_memory_bytes = -1;  // VmRSS
  double open_fds = -1;               // entries of /proc/self/fd
};
ProcessSample ReadProcessSample();

// Registers the process metrics (refreshed by a collector at every scrape) and
// rubato:build_info{version, role}. role: "inference" or "cache". `registry` owns everything.
Status RegisterProcessMetrics(MetricsRegistry& registry, std::string_view role);

}  // namespace rubato
