// Whole-file reads (see text_file.h).
#include "common/text_file.h"

#include <cerrno>
#include <cstring>
#include <fstream>
#include <system_error>

namespace rubato {

namespace {

std::string_view KindOf(std::filesystem::file_type type) {
  switch (type) {
    case std::filesystem::file_type::directory:
      return "a directory";
    case std::filesystem::file_type::character:
      return "a character device";
    case std::filesystem::file_type::block:
      return "a block device";
    case std::filesystem::file_type::fifo:
      return "a FIFO";
    case std::filesystem::file_type::socket:
      return "a socket";
    default:
      return "not a regular file";
  }
}

}  // namespace

std::string DisplayPath(const std::filesystem::path& path) {
  const std::string text = path.string();
  constexpr size_t kKeep = 96;
  if (text.size() <= 2 * kKeep) return text;
  return text.substr(0, kKeep) + "...(" + std::to_string(text.size()) + " characters)..." +
         text.substr(text.size() - kKeep);
}

Result<std::string> ReadTextFile(const std::filesystem::path& path, size_t max_bytes) {
  std::error_code ec;
  const auto status = std::filesystem::status(path, ec);
  if (ec && ec != std::errc::no_such_file_or_directory && ec != std::errc::not_a_directory) {
    return IoError(DisplayPath(path) + ": " + ec.message());
  }
  if (!std::filesystem::exists(status)) return NotFoundError(DisplayPath(path) + ": no such file");
  if (!std::filesystem::is_regular_file(status)) {
    return InvalidArgumentError(DisplayPath(path) + ": is " + std::string(KindOf(status.type())) +
                                ", expected a file");
  }
  auto too_large = [&] {
    return InvalidArgumentError(DisplayPath(path) + ": more than " + std::to_string(max_bytes) +
                                " bytes, the limit for this file");
  };
  // Refused from its size before anything is read or allocated.
  const uintmax_t size = std::filesystem::file_size(path, ec);
  if (!ec && size > max_bytes) return too_large();
  std::ifstream in(path, std::ios::binary);
  if (!in) return IoError(DisplayPath(path) + ": cannot open: " + std::strerror(errno));
  // Read at most max_bytes + 1 whatever the size says (/proc files report 0, files grow).
  std::string text;
  char buffer[1 << 16];
  while (in) {
    in.read(buffer, sizeof(buffer));
    text.append(buffer, static_cast<size_t>(in.gcount()));
    if (text.size() > max_bytes) return too_large();
  }
  if (in.bad()) return IoError(DisplayPath(path) + ": read failed: " + std::strerror(errno));
  return text;
}

}  // namespace rubato
