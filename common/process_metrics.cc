// Process metrics from /proc and rubato:build_info (see process_metrics.h).
#include "common/process_metrics.h"

#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>

namespace rubato {
namespace {

// Fields 14 and 15 of /proc/self/stat (utime, stime) in clock ticks. The command name (field 2)
// may hold spaces and parentheses: fields are counted after its last ')'.
double ReadCpuSeconds() {
  std::ifstream file("/proc/self/stat");
  std::string stat((std::istreambuf_iterator<char>(file)), std::istreambuf_iterator<char>());
  const size_t close = stat.rfind(')');
  if (close == std::string::npos) return -1;
  std::istringstream fields(stat.substr(close + 1));
  std::string field;
  // After ')': field 3 (state) is the first; utime is field 14, stime field 15.
  double ticks = 0;
  for (int index = 3; index <= 15 && (fields >> field); ++index) {
    if (index >= 14) ticks += std::stod(field);
  }
  const long per_second = sysconf(_SC_CLK_TCK);
  return per_second > 0 ? ticks / static_cast<double>(per_second) : -1;
}

double ReadResidentBytes() {
  std::ifstream file("/proc/self/status");
  std::string line;
  while (std::getline(file, line)) {
    if (line.rfind("VmRSS:", 0) == 0) return std::stod(line.substr(6)) * 1024.0;  // kB
  }
  return -1;
}

double CountOpenFds() {
  std::error_code error;
  double count = 0;
  for (std::filesystem::directory_iterator it("/proc/self/fd", error), end; !error && it != end;
       it.increment(error)) {
    ++count;
  }
  // The directory iterator's own descriptor is one of them.
  return error ? -1 : count - 1;
}

}  // namespace

ProcessSample ReadProcessSample() {
  ProcessSample sample;
  try {
    sample.cpu_seconds = ReadCpuSeconds();
    sample.resident_memory_bytes = ReadResidentBytes();
  } catch (const std::exception&) {  // std::stod on an unexpected format: leave it unknown
  }
  sample.open_fds = CountOpenFds();
  return sample;
}

Status RegisterProcessMetrics(MetricsRegistry& registry, std::string_view role) {
  RUBATO_ASSIGN_OR_RETURN(Counter * cpu,
                          registry.AddCounter("process_cpu_seconds_total",
                                              "Total user and system CPU time spent in seconds."));
  RUBATO_ASSIGN_OR_RETURN(Gauge * resident, registry.AddGauge("process_resident_memory_bytes",
                                                              "Resident memory size in bytes."));
  RUBATO_ASSIGN_OR_RETURN(
      Gauge * fds, registry.AddGauge("process_open_fds", "Number of open file descriptors."));
  RUBATO_ASSIGN_OR_RETURN(
      GaugeFamily * build_info,
      registry.AddGaugeFamily("rubato:build_info",
                              "Always 1; its labels say which rubato this process runs.",
                              {"version", "role"}));
  RUBATO_ASSIGN_OR_RETURN(Gauge * info,
                          build_info->WithLabels({RUBATO_VERSION, std::string(role)}));
  info->Set(1);
  registry.AddCollector([cpu, resident, fds] {
    const ProcessSample sample = ReadProcessSample();
    // A counter only goes up: add what the process used since the last scrape.
    if (sample.cpu_seconds > cpu->Value()) cpu->Increment(sample.cpu_seconds - cpu->Value());
    if (sample.resident_memory_bytes >= 0) resident->Set(sample.resident_memory_bytes);
    if (sample.open_fds >= 0) fds->Set(sample.open_fds);
  });
  return Status::Ok();
}

}  // namespace rubato
