// Environment access (see env.h).
#include "common/env.h"

#include <cstdlib>

namespace rubato {

std::optional<std::string> GetEnv(std::string_view name) {
  const char* value = std::getenv(std::string(name).c_str());
  if (value == nullptr || *value == '\0') return std::nullopt;
  return std::string(value);
}

}  // namespace rubato
