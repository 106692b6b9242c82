// The device data plane of attention on a GPU cache rank in its own process: the wire format of
// its one step descriptor and the sizes of its per-layer messages. Per step the inference rank
// sends one descriptor (the step's rows as runs of one session's consecutive positions, decode
// rows first); per layer it sends the step's q|k|v rows as the model has them ([rows][q_dim +
// 2 kv_dim] bf16) and receives the decode rows' attention output ([decode rows][q_dim] bf16).
// Every message has a size both sides know before it arrives (NCCL needs that): the descriptor
// is DeviceStepBytes(max_runs) whatever it holds, the layer messages follow from it. Little-
// endian, validated completely before use. docs/disaggregated.md "A GPU cache rank in its own
// process".
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "common/status.h"

namespace rubato {

inline constexpr char kDeviceStepMagic[4] = {'R', 'B', 'D', 'S'};
inline constexpr uint16_t kDeviceStepVersion = 2;
// The most key splits a descriptor may ask for (the attention kernel caps them further by its
// workspace).
inline constexpr uint32_t kMaxDeviceStepSplits = 1024;

// Tags of the device data plane's messages (matched in order per tag).
inline constexpr uint64_t kDeviceStepTag = 11;
inline constexpr uint64_t kDeviceRowsTag = 12;
inline constexpr uint64_t kDeviceOutputTag = 13;

// What both ranks agree on when the data plane connects (the RPC Hello, or the caller of an
// in-process pair): the sizes of every buffer.
struct DevicePlaneLimits {
  int max_runs = 0;  // runs (requests) of one step, >= 1
  int max_rows = 0;  // rows (tokens) of one step, >= max_runs
  Status Check() const;
};

// Positions [first_position, first_position + tokens) of one session: that many rows.
struct DeviceStepRun {
  uint64_t session_id = 0;
  uint32_t first_position = 0;
  uint32_t tokens = 1;  // >= 1
};

struct DeviceStep {
  enum class Kind : uint16_t { kStep = 1, kStop = 2 };  // kStop: the inference rank is leaving
  Kind kind = Kind::kStep;
  uint64_t step = 0;
  // The first decode_rows rows are decode tokens (each a run of one token): attended, their
  // output sent back; the other rows are only appended.
  int decode_rows = 0;
  // The decode rows' key bound that fixes the attention's launch shape (the inference rank's
  // own, so that the output has local dense's bits), >= every decode row's position + 1.
  int max_seq_len = 0;
  // The attention's key splits per decode row (0: the cache rank's choice for its rows). An
  // inference rank whose batch is attended by several cache ranks passes the whole batch's
  // (DecodeAttentionDefaultSplits), so that each row has the bits of one launch.
  int num_splits = 0;
  std::vector<DeviceStepRun> runs;

  int rows() const;
};

// The descriptor on the wire: a 40-byte header, then max_runs run slots of 16 bytes (the first
// header.runs are read).
struct DeviceStepHeader {
  char magic[4];     // "RBDS"
  uint16_t version;  // kDeviceStepVersion
  uint16_t kind;     // DeviceStep::Kind
  uint64_t step;
  uint32_t runs;         // <= max_runs (0 for kStop)
  uint32_t rows;         // the runs' tokens summed
  uint32_t decode_rows;  // <= rows
  uint32_t max_seq_len;  // 0 when decode_rows is 0
  uint32_t num_splits;   // 0: the cache rank's choice
  uint32_t reserved;     // 0
};
static_assert(sizeof(DeviceStepHeader) == 40, "DeviceStepHeader is 40 bytes on the wire");

struct DeviceStepRunEntry {
  uint64_t session_id;
  uint32_t first_position;
  uint32_t tokens;
};
static_assert(sizeof(DeviceStepRunEntry) == 16, "DeviceStepRunEntry is 16 bytes on the wire");

size_t DeviceStepBytes(const DevicePlaneLimits& limits);
// The prefix of the descriptor a step fills (the header and its runs): what must be copied.
size_t DeviceStepUsedBytes(const DeviceStep& step);

// Writes `step` into `out` (DeviceStepBytes(limits) bytes; only the used prefix is written).
// InvalidArgument when the step breaks a rule Decode checks.
Status EncodeDeviceStep(const DeviceStep& step, const DevicePlaneLimits& limits,
                        std::span<std::byte> out);
// Reads and validates a descriptor: magic, version, kind, runs <= max_runs, tokens >= 1 and
// positions within 32 bits, rows (the runs' sum) <= max_rows, decode rows the first runs, one
// token each, max_seq_len >= every decode row's position + 1 (0 without decode rows).
Result<DeviceStep> DecodeDeviceStep(std::span<const std::byte> in, const DevicePlaneLimits& limits);

// Bytes of one layer's messages: q|k|v rows out, attention rows back (bf16).
size_t DeviceRowsBytes(int rows, int q_dim, int kv_dim);
size_t DeviceOutputBytes(int decode_rows, int q_dim);

}  // namespace rubato
