// Reads a whole (small) file into a string: config.json, the safetensors index, YAML configs,
// tokenizer files. Only regular files, each read bounded by a size limit.
#pragma once

#include <cstddef>
#include <filesystem>
#include <string>

#include "common/status.h"

namespace rubato {

// Limits of the files rubato reads whole, per kind; docs/security.md "Bounded input" lists them.
// A parsed JSON document costs up to ~20x its text in memory (a node per value, a map node per
// key), so each kind is bounded by what real files need, not by one large limit for all.
inline constexpr size_t kMaxConfigFileBytes = size_t{1} << 20;  // config.json, YAML configs
// tokenizer_config.json (chat templates; the largest public ones are a few hundred KB).
inline constexpr size_t kMaxTokenizerConfigBytes = size_t{16} << 20;
// tokenizer.json: the largest public ones (Gemma 3, 262k tokens) are ~33 MB.
inline constexpr size_t kMaxTokenizerJsonBytes = size_t{64} << 20;
// model.safetensors.index.json: one line per tensor, ~2 MB for the largest models.
inline constexpr size_t kMaxSafetensorsIndexBytes = size_t{16} << 20;
// A Kascade calibration file: (layers x KV heads)^2 similarities, ~25 MB for 126 x 8.
inline constexpr size_t kMaxCalibrationFileBytes = size_t{64} << 20;
// A development or evaluation set of JSON lines (prompts).
inline constexpr size_t kMaxPromptSetBytes = size_t{256} << 20;
inline constexpr size_t kMaxTextFileBytes = size_t{64} << 20;  // any other file read whole

// The bytes of `path`. NotFound when it does not exist; InvalidArgument when it is not a regular
// file (a directory, a device, a FIFO) or holds more than `max_bytes` (refused from its size
// before any byte is read, and again if it grows while read); IoError when it cannot be read
// (permissions, a symlink loop). Messages name the path (shortened when very long).
Result<std::string> ReadTextFile(const std::filesystem::path& path,
                                 size_t max_bytes = kMaxTextFileBytes);

// `path` for an error message: whole when short, else its first and last characters.
std::string DisplayPath(const std::filesystem::path& path);

}  // namespace rubato
