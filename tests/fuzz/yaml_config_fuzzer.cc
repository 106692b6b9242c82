// libFuzzer target: rubato's YAML config file through ParseConfig. A config it accepts from valid
// UTF-8 must come back equal from FormatConfigYaml + ParseConfig (what startup logs is what
// runs); if not, the fuzzer prints the formatted text and aborts. (yaml-cpp reads invalid UTF-8
// as it is but its emitter writes U+FFFD for it, so such input is only parsed.)
// Seeds: corpus/yaml_config (configs/).
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <nlohmann/json.hpp>
#include <string>
#include <string_view>

#include "common/config.h"

namespace {

bool IsValidUtf8(std::string_view text) {
  try {
    static_cast<void>(nlohmann::json(std::string(text)).dump());  // throws on invalid UTF-8
    return true;
  } catch (const nlohmann::json::exception&) {
    return false;
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  const auto config = rubato::ParseConfig(text, "fuzz.yaml");
  if (!config.ok() || !IsValidUtf8(text)) return 0;
  const std::string formatted = rubato::FormatConfigYaml(*config);
  const auto again = rubato::ParseConfig(formatted, "formatted.yaml");
  if (!again.ok() || !(*again == *config)) {
    std::fprintf(stderr, "FormatConfigYaml wrote a config that %s:\n%s\n",
                 again.ok() ? "reads back different" : again.status().message().c_str(),
                 formatted.c_str());
    std::abort();
  }
  return 0;
}
