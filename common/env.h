// Settings read from the environment, through one helper so that every knob is named in one
// place and reported when malformed (NCCL's param.h pattern).
#pragma once

#include <optional>
#include <string>
#include <string_view>

namespace rubato {

// The value of environment variable `name`, or nullopt when unset or empty.
std::optional<std::string> GetEnv(std::string_view name);

}  // namespace rubato
