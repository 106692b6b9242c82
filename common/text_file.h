// Reads a whole (small) file into a string: config.json, the safetensors index, YAML configs.
#pragma once

#include <filesystem>
#include <string>

#include "common/status.h"

namespace rubato {

// The bytes of `path`. NotFound when it does not exist, IoError when it cannot be read (a
// directory, no permission); the message names the path.
Result<std::string> ReadTextFile(const std::filesystem::path& path);

}  // namespace rubato
