// Reads a whole (small) file into a string: config.json, the safetensors index, YAML configs,
// tokenizer files. Only regular files, each read bounded by a size limit.
#pragma once

#include <cstddef>
#include <filesystem>
#include <string>

#include "common/status.h"

namespace rubato {

// Limits of the files rubato reads whole; docs/security.md "Bounded input" lists them.
inline constexpr size_t kMaxConfigFileBytes = size_t{1} << 20;  // config.json, YAML configs
inline constexpr size_t kMaxTextFileBytes = size_t{256} << 20;  // tokenizer.json and the like

// The bytes of `path`. NotFound when it does not exist; InvalidArgument when it is not a regular
// file (a directory, a device, a FIFO) or holds more than `max_bytes`; IoError when it cannot be
// read (permissions, a symlink loop). Messages name the path (shortened when very long).
Result<std::string> ReadTextFile(const std::filesystem::path& path,
                                 size_t max_bytes = kMaxTextFileBytes);

// `path` for an error message: whole when short, else its first and last characters.
std::string DisplayPath(const std::filesystem::path& path);

}  // namespace rubato
