// The device data plane's step descriptor (device_step.h): encode, and a decode that checks
// every field before the cache rank plans anything from it.
#include "transport/device_step.h"

#include <fmt/format.h>

#include <algorithm>
#include <bit>
#include <cstring>
#include <limits>

namespace rubato {
namespace {

static_assert(std::endian::native == std::endian::little,
              "the device step descriptor is little-endian and read by memcpy");

Status Invalid(const std::string& what) {
  return InvalidArgumentError("device step descriptor: " + what);
}

// The rules both Encode and Decode enforce, on the decoded form.
Status CheckStep(const DeviceStep& step, const DevicePlaneLimits& limits) {
  if (step.kind == DeviceStep::Kind::kStop) {
    if (!step.runs.empty() || step.decode_rows != 0 || step.max_seq_len != 0 ||
        step.num_splits != 0) {
      return Invalid("a stop descriptor carries no runs");
    }
    return Status::Ok();
  }
  if (step.kind != DeviceStep::Kind::kStep) {
    return Invalid(
        fmt::format("kind {} is neither step (1) nor stop (2)", static_cast<int>(step.kind)));
  }
  if (step.runs.empty() || step.runs.size() > static_cast<size_t>(limits.max_runs)) {
    return Invalid(
        fmt::format("{} runs; need 1 to max_runs {}", step.runs.size(), limits.max_runs));
  }
  int64_t rows = 0;
  int decode_runs = 0;
  int64_t longest_decode = 0;
  for (size_t r = 0; r < step.runs.size(); ++r) {
    const DeviceStepRun& run = step.runs[r];
    if (run.tokens < 1 ||
        uint64_t{run.first_position} + run.tokens > std::numeric_limits<int32_t>::max()) {
      return Invalid(fmt::format("run {}: {} tokens at position {} (need >= 1, within int32)", r,
                                 run.tokens, run.first_position));
    }
    if (rows < step.decode_rows) {
      if (run.tokens != 1) {
        return Invalid(
            fmt::format("run {} holds decode row {} but has {} tokens (decode runs "
                        "have one)",
                        r, rows, run.tokens));
      }
      ++decode_runs;
      longest_decode = std::max<int64_t>(longest_decode, int64_t{run.first_position} + 1);
    }
    rows += run.tokens;
  }
  if (rows > limits.max_rows) {
    return Invalid(fmt::format("{} rows; max_rows is {}", rows, limits.max_rows));
  }
  if (step.decode_rows < 0 || step.decode_rows > rows || decode_runs != step.decode_rows) {
    return Invalid(fmt::format("decode_rows {} of {} rows is not a whole number of leading runs",
                               step.decode_rows, rows));
  }
  if (step.num_splits < 0 || step.num_splits > static_cast<int>(kMaxDeviceStepSplits) ||
      (step.decode_rows == 0 && step.num_splits != 0)) {
    return Invalid(fmt::format("num_splits {} with {} decode rows (0 to {}, 0 without)",
                               step.num_splits, step.decode_rows, kMaxDeviceStepSplits));
  }
  if (step.decode_rows == 0 ? step.max_seq_len != 0
                            : step.max_seq_len < longest_decode || step.max_seq_len < 1) {
    return Invalid(fmt::format("max_seq_len {} with {} decode rows whose longest has {} keys",
                               step.max_seq_len, step.decode_rows, longest_decode));
  }
  return Status::Ok();
}

}  // namespace

Status DevicePlaneLimits::Check() const {
  if (max_runs < 1 || max_rows < max_runs || max_runs > (1 << 20) || max_rows > (1 << 24)) {
    return InvalidArgumentError(fmt::format(
        "device data plane: max_runs {} and max_rows {}: need 1 <= max_runs <= max_rows, "
        "max_runs <= 2^20, max_rows <= 2^24",
        max_runs, max_rows));
  }
  return Status::Ok();
}

int DeviceStep::rows() const {
  int total = 0;
  for (const DeviceStepRun& run : runs) total += static_cast<int>(run.tokens);
  return total;
}

size_t DeviceStepBytes(const DevicePlaneLimits& limits) {
  return sizeof(DeviceStepHeader) +
         static_cast<size_t>(std::max(limits.max_runs, 0)) * sizeof(DeviceStepRunEntry);
}

size_t DeviceStepUsedBytes(const DeviceStep& step) {
  return sizeof(DeviceStepHeader) + step.runs.size() * sizeof(DeviceStepRunEntry);
}

Status EncodeDeviceStep(const DeviceStep& step, const DevicePlaneLimits& limits,
                        std::span<std::byte> out) {
  RUBATO_RETURN_IF_ERROR(limits.Check());
  RUBATO_RETURN_IF_ERROR(CheckStep(step, limits));
  if (out.size() < DeviceStepBytes(limits)) {
    return Invalid(fmt::format("a buffer of {} bytes; the descriptor has {}", out.size(),
                               DeviceStepBytes(limits)));
  }
  DeviceStepHeader header{};
  std::memcpy(header.magic, kDeviceStepMagic, sizeof(header.magic));
  header.version = kDeviceStepVersion;
  header.kind = static_cast<uint16_t>(step.kind);
  header.step = step.step;
  header.runs = static_cast<uint32_t>(step.runs.size());
  header.rows = static_cast<uint32_t>(step.rows());
  header.decode_rows = static_cast<uint32_t>(step.decode_rows);
  header.max_seq_len = static_cast<uint32_t>(step.max_seq_len);
  header.num_splits = static_cast<uint32_t>(step.num_splits);
  std::memcpy(out.data(), &header, sizeof(header));
  for (size_t r = 0; r < step.runs.size(); ++r) {
    const DeviceStepRunEntry entry{step.runs[r].session_id, step.runs[r].first_position,
                                   step.runs[r].tokens};
    std::memcpy(out.data() + sizeof(header) + r * sizeof(entry), &entry, sizeof(entry));
  }
  return Status::Ok();
}

Result<DeviceStep> DecodeDeviceStep(std::span<const std::byte> in,
                                    const DevicePlaneLimits& limits) {
  RUBATO_RETURN_IF_ERROR(limits.Check());
  if (in.size() < DeviceStepBytes(limits)) {
    return Invalid(
        fmt::format("{} bytes; the descriptor has {}", in.size(), DeviceStepBytes(limits)));
  }
  DeviceStepHeader header;
  std::memcpy(&header, in.data(), sizeof(header));
  if (std::memcmp(header.magic, kDeviceStepMagic, sizeof(header.magic)) != 0) {
    return Invalid("bad magic (not a step descriptor: the two ranks' messages are out of step)");
  }
  if (header.version != kDeviceStepVersion) {
    return Invalid(
        fmt::format("version {}; this rank speaks {}", header.version, kDeviceStepVersion));
  }
  if (header.runs > static_cast<uint32_t>(limits.max_runs)) {
    return Invalid(fmt::format("{} runs; max_runs is {}", header.runs, limits.max_runs));
  }
  if (header.num_splits > kMaxDeviceStepSplits) {
    return Invalid(
        fmt::format("num_splits {} (at most {})", header.num_splits, kMaxDeviceStepSplits));
  }
  if (header.decode_rows > static_cast<uint32_t>(limits.max_rows) ||
      header.max_seq_len > static_cast<uint32_t>(std::numeric_limits<int32_t>::max())) {
    return Invalid(fmt::format("decode_rows {} / max_seq_len {} out of range", header.decode_rows,
                               header.max_seq_len));
  }
  DeviceStep step;
  step.kind = static_cast<DeviceStep::Kind>(header.kind);
  step.step = header.step;
  step.decode_rows = static_cast<int>(header.decode_rows);
  step.max_seq_len = static_cast<int>(header.max_seq_len);
  step.num_splits = static_cast<int>(header.num_splits);
  step.runs.resize(header.runs);
  for (size_t r = 0; r < step.runs.size(); ++r) {
    DeviceStepRunEntry entry;
    std::memcpy(&entry, in.data() + sizeof(header) + r * sizeof(entry), sizeof(entry));
    step.runs[r] = {entry.session_id, entry.first_position, entry.tokens};
  }
  RUBATO_RETURN_IF_ERROR(CheckStep(step, limits));
  if (static_cast<uint32_t>(step.rows()) != header.rows) {
    return Invalid(fmt::format("header says {} rows, the runs hold {}", header.rows, step.rows()));
  }
  return step;
}

size_t DeviceRowsBytes(int rows, int q_dim, int kv_dim) {
  return static_cast<size_t>(rows) * static_cast<size_t>(q_dim + 2 * kv_dim) * 2;
}

size_t DeviceOutputBytes(int decode_rows, int q_dim) {
  return static_cast<size_t>(decode_rows) * static_cast<size_t>(q_dim) * 2;
}

}  // namespace rubato
