// Whole-file reads (see text_file.h).
#include "common/text_file.h"

#include <cerrno>
#include <cstring>
#include <fstream>
#include <sstream>
#include <system_error>

namespace rubato {

Result<std::string> ReadTextFile(const std::filesystem::path& path) {
  std::error_code ec;
  const auto status = std::filesystem::status(path, ec);
  if (!std::filesystem::exists(status)) return NotFoundError(path.string() + ": no such file");
  if (std::filesystem::is_directory(status)) {
    return IoError(path.string() + ": is a directory, expected a file");
  }
  std::ifstream in(path, std::ios::binary);
  if (!in) return IoError(path.string() + ": cannot open: " + std::strerror(errno));
  std::ostringstream text;
  text << in.rdbuf();
  if (in.bad()) return IoError(path.string() + ": read failed: " + std::strerror(errno));
  return std::move(text).str();
}

}  // namespace rubato
