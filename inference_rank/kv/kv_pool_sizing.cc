// The KV pool's size from a memory snapshot, and the host's snapshot (see kv_pool_sizing.h).
#include "inference_rank/kv/kv_pool_sizing.h"

#include <fmt/format.h>
#include <unistd.h>

#include <algorithm>
#include <charconv>
#include <climits>
#include <cmath>
#include <fstream>
#include <optional>

namespace rubato {
namespace {

std::string GiB(double bytes) {
  return fmt::format("{:.2f} GiB", bytes / double(uint64_t{1} << 30));
}

// The number after `field` and `separator` on a line of `text` ("MemTotal:  123 kB",
// "inactive_file 4096"), times `unit`.
std::optional<uint64_t> FieldValue(std::string_view text, std::string_view field, char separator,
                                   uint64_t unit) {
  size_t at = 0;
  while (at < text.size()) {
    size_t end = text.find('\n', at);
    if (end == std::string_view::npos) end = text.size();
    const std::string_view line = text.substr(at, end - at);
    at = end + 1;
    if (line.size() <= field.size() || line.substr(0, field.size()) != field ||
        line[field.size()] != separator) {
      continue;
    }
    std::string_view rest = line.substr(field.size() + 1);
    while (!rest.empty() && rest.front() == ' ') rest.remove_prefix(1);
    uint64_t value = 0;
    const auto [ptr, ec] = std::from_chars(rest.data(), rest.data() + rest.size(), value);
    if (ec != std::errc() || value > UINT64_MAX / unit) return std::nullopt;
    return value * unit;
  }
  return std::nullopt;
}

// A cgroup v2 number ("123\n"); nullopt for "max", empty or unparsable text.
std::optional<uint64_t> CgroupBytes(std::string_view text) {
  while (!text.empty() && (text.back() == '\n' || text.back() == ' ')) text.remove_suffix(1);
  uint64_t value = 0;
  const auto [ptr, ec] = std::from_chars(text.data(), text.data() + text.size(), value);
  if (text.empty() || ec != std::errc() || ptr != text.data() + text.size()) return std::nullopt;
  return value;
}

// The first `limit` bytes of a file, or "" when it cannot be read.
std::string ReadSmallFile(const char* path, size_t limit = 64 << 10) {
  std::ifstream in(path);
  if (!in) return "";
  std::string text(limit, '\0');
  in.read(text.data(), static_cast<std::streamsize>(limit));
  text.resize(static_cast<size_t>(in.gcount()));
  return text;
}

}  // namespace

Status CheckMemoryUtilization(double utilization) {
  if (utilization > 0.0 && utilization <= 1.0) return Status::Ok();  // false for NaN
  return InvalidArgumentError(
      fmt::format("engine.gpu_memory_utilization must be in (0, 1], got {}", utilization));
}

Result<KvPoolSize> SizeKvPool(const KvPoolMemory& memory, double utilization,
                              int64_t useful_blocks) {
  RUBATO_RETURN_IF_ERROR(CheckMemoryUtilization(utilization));
  if (memory.bytes_per_block == 0 || useful_blocks < 1) {
    return InvalidArgumentError(
        fmt::format("KV pool: {} bytes per block and {} useful blocks; both must be positive",
                    memory.bytes_per_block, useful_blocks));
  }
  // Kept free: (1 - utilization) of the memory, and the workspaces still to come.
  const double keep = (1.0 - utilization) * static_cast<double>(memory.total_bytes) +
                      static_cast<double>(memory.pending_bytes);
  const double budget = std::max(0.0, static_cast<double>(memory.free_bytes) - keep);
  // floor() of a double may round a budget just under a block's multiple up: recompute in
  // integers from the clamped value and never pass free_bytes.
  const uint64_t budget_bytes =
      std::min(memory.free_bytes, static_cast<uint64_t>(std::floor(budget)));
  const uint64_t blocks = budget_bytes / memory.bytes_per_block;
  if (blocks == 0) {
    return ResourceExhaustedError(fmt::format(
        "KV pool: engine.gpu_memory_utilization {} of {} ({} total) leaves no room for one KV "
        "block ({} bytes): {} free now, {} to keep free ({} of it for workspaces still to come); "
        "raise engine.gpu_memory_utilization, free memory, or set engine.kv_pool_tokens",
        utilization, memory.where, GiB(static_cast<double>(memory.total_bytes)),
        memory.bytes_per_block, GiB(static_cast<double>(memory.free_bytes)), GiB(keep),
        GiB(static_cast<double>(memory.pending_bytes))));
  }
  KvPoolSize size;
  size.budget_bytes = budget_bytes;
  const uint64_t cap = std::min<uint64_t>(static_cast<uint64_t>(useful_blocks), INT32_MAX);
  size.capped = blocks > cap;
  size.num_blocks = static_cast<int>(std::min(blocks, cap));
  return size;
}

Result<KvPoolMemory> ParseHostMemory(std::string_view meminfo, std::string_view cgroup_max,
                                     std::string_view cgroup_current,
                                     std::string_view cgroup_stat) {
  const std::optional<uint64_t> total = FieldValue(meminfo, "MemTotal", ':', 1024);
  std::optional<uint64_t> available = FieldValue(meminfo, "MemAvailable", ':', 1024);
  if (!available) available = FieldValue(meminfo, "MemFree", ':', 1024);  // kernels before 3.14
  if (!total || !available) {
    return InvalidArgumentError(std::string("host memory: /proc/meminfo has no ") +
                                (total ? "MemAvailable or MemFree" : "MemTotal") + " field");
  }
  KvPoolMemory memory;
  memory.where = "host memory";
  memory.total_bytes = *total;
  memory.free_bytes = std::min(*available, *total);
  // A container's limit: what the process may still use under it.
  const std::optional<uint64_t> limit = CgroupBytes(cgroup_max);
  if (limit && *limit < memory.total_bytes) {
    const uint64_t current = CgroupBytes(cgroup_current).value_or(0);
    const uint64_t cache = FieldValue(cgroup_stat, "inactive_file", ' ', 1).value_or(0);
    const uint64_t used = current - std::min(current, cache);
    memory.where = "host memory (cgroup limit)";
    memory.total_bytes = *limit;
    memory.free_bytes = std::min(memory.free_bytes, *limit - std::min(used, *limit));
  }
  return memory;
}

Result<KvPoolMemory> ReadHostMemory() {
  const std::string meminfo = ReadSmallFile("/proc/meminfo");
  if (!meminfo.empty()) {
    return ParseHostMemory(meminfo, ReadSmallFile("/sys/fs/cgroup/memory.max"),
                           ReadSmallFile("/sys/fs/cgroup/memory.current"),
                           ReadSmallFile("/sys/fs/cgroup/memory.stat"));
  }
  const long page = sysconf(_SC_PAGESIZE);
  const long pages = sysconf(_SC_PHYS_PAGES);
  const long available = sysconf(_SC_AVPHYS_PAGES);
  if (page <= 0 || pages <= 0 || available < 0) {
    return UnavailableError(
        "host memory: neither /proc/meminfo nor sysconf says how much memory there is; set "
        "engine.kv_pool_tokens");
  }
  KvPoolMemory memory;
  memory.where = "host memory";
  memory.total_bytes = static_cast<uint64_t>(pages) * static_cast<uint64_t>(page);
  memory.free_bytes = static_cast<uint64_t>(available) * static_cast<uint64_t>(page);
  return memory;
}

}  // namespace rubato
