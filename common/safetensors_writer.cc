// Safetensors writer (see safetensors_writer.h).
#include "common/safetensors_writer.h"

#include <cerrno>
#include <cstdint>
#include <cstring>
#include <fstream>
#include <nlohmann/json.hpp>
#include <set>

namespace rubato {

std::string_view SafetensorsDTypeTag(DType dtype) {
  switch (dtype) {
    case DType::kF32:
      return "F32";
    case DType::kBF16:
      return "BF16";
    case DType::kF16:
      return "F16";
  }
  return "?";
}

Status WriteSafetensors(const std::filesystem::path& path,
                        const std::vector<std::pair<std::string, TensorView>>& tensors,
                        const std::map<std::string, std::string>& metadata) {
  const std::string file = path.string();
  // ordered_json keeps the tensors in the caller's order, which is also the data order.
  nlohmann::ordered_json header = nlohmann::ordered_json::object();
  if (!metadata.empty()) header["__metadata__"] = metadata;
  std::set<std::string> names;
  uint64_t offset = 0;
  for (const auto& [name, view] : tensors) {
    if (name.empty() || name == "__metadata__") {
      return InvalidArgumentError(file + ": cannot write a tensor named '" + name + "'");
    }
    if (!names.insert(name).second) {
      return InvalidArgumentError(file + ": tensor '" + name + "' is given twice");
    }
    for (int64_t d : view.shape.dims) {
      if (d < 0) {
        return InvalidArgumentError(file + ": tensor '" + name + "' has a negative dimension " +
                                    view.shape.ToString());
      }
    }
    const uint64_t nbytes = view.nbytes();
    if (nbytes > 0 && view.data == nullptr) {
      return InvalidArgumentError(file + ": tensor '" + name + "' has " + std::to_string(nbytes) +
                                  " bytes but no data");
    }
    header[name] = {{"dtype", SafetensorsDTypeTag(view.dtype)},
                    {"shape", view.shape.dims},
                    {"data_offsets", {offset, offset + nbytes}}};
    offset += nbytes;
  }

  std::string header_text = header.dump();
  header_text.append((8 - header_text.size() % 8) % 8, ' ');
  unsigned char length_bytes[8];
  for (int i = 0; i < 8; ++i) {
    length_bytes[i] = static_cast<unsigned char>((uint64_t{header_text.size()} >> (8 * i)) & 0xff);
  }

  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  if (!out) return IoError(file + ": cannot create file: " + std::strerror(errno));
  out.write(reinterpret_cast<const char*>(length_bytes), sizeof(length_bytes));
  out.write(header_text.data(), static_cast<std::streamsize>(header_text.size()));
  for (const auto& [name, view] : tensors) {
    out.write(static_cast<const char*>(view.data), static_cast<std::streamsize>(view.nbytes()));
  }
  out.close();
  if (!out) return IoError(file + ": write failed: " + std::strerror(errno));
  return Status::Ok();
}

}  // namespace rubato
