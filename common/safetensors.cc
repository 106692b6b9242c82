// Safetensors reading (see safetensors.h): mmap, header validation, sharded checkpoints.
//
// File layout: [u64 little-endian N][N bytes of JSON header][data section]. The header maps each
// tensor name to {"dtype", "shape", "data_offsets": [begin, end]} with offsets relative to the
// start of the data section, plus an optional "__metadata__" string map.
#include "common/safetensors.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <limits>
#include <nlohmann/json.hpp>
#include <optional>
#include <set>
#include <tuple>
#include <utility>

#include "common/json_limits.h"
#include "common/text_file.h"

namespace rubato {
namespace {

using OrderedJson = nlohmann::ordered_json;

// The reference implementation refuses headers above 100 MB; a real header is a few MB at most
// (~150 bytes per tensor), and the parsed header costs ~20x its text: 32 MiB, ~200k tensors.
constexpr uint64_t kMaxHeaderBytes = uint64_t{32} << 20;

// A tensor entry of the header once its fields are checked; offsets are in the data section.
struct HeaderEntry {
  std::string name;
  DType dtype;
  Shape shape;
  uint64_t begin;
  uint64_t end;
};

// "[1, 2]" or a shortened dump of any JSON value, for error messages.
std::string ShortJson(const OrderedJson& value) {
  std::string text = value.dump();
  if (text.size() > 80) text = text.substr(0, 77) + "...";
  return text;
}

// Parses `text` as JSON; parse errors come back as a Status. Duplicate keys at the top level (two
// entries for one tensor) are an error: the JSON library would silently keep the last one.
Result<OrderedJson> ParseHeaderJson(std::string_view text, const std::string& file) {
  RUBATO_RETURN_IF_ERROR(CheckJsonNesting(text, file + ": the header"));
  std::string duplicate;
  auto reject_duplicates = [&, seen = std::set<std::string>()](int depth,
                                                               OrderedJson::parse_event_t event,
                                                               OrderedJson& parsed) mutable {
    if (event == OrderedJson::parse_event_t::key && depth == 1 && duplicate.empty() &&
        !seen.insert(parsed.get<std::string>()).second) {
      duplicate = parsed.get<std::string>();
    }
    return true;
  };
  OrderedJson root;
  try {
    root = OrderedJson::parse(text, reject_duplicates);
  } catch (const OrderedJson::exception& e) {
    return DataLossError(file + ": the header is not valid JSON: " + e.what());
  }
  if (!duplicate.empty()) {
    return DataLossError(file + ": the header lists '" + duplicate + "' twice");
  }
  if (!root.is_object()) {
    return DataLossError(file + ": the header must be a JSON object, got " +
                         std::string(root.type_name()));
  }
  return root;
}

// A non-negative integer JSON value, or nullopt.
std::optional<uint64_t> AsUnsigned(const OrderedJson& value) {
  if (!value.is_number_unsigned()) return std::nullopt;
  return value.get<uint64_t>();
}

Result<HeaderEntry> ParseEntry(const std::string& file, const std::string& name,
                               const OrderedJson& value, uint64_t data_bytes) {
  const std::string where = file + ": tensor '" + name + "'";
  if (name.empty()) return DataLossError(file + ": the header has a tensor with an empty name");
  if (!value.is_object()) {
    return DataLossError(where + ": expected an object with dtype, shape and data_offsets, got " +
                         std::string(value.type_name()));
  }
  for (const char* key : {"dtype", "shape", "data_offsets"}) {
    if (!value.contains(key)) return DataLossError(where + ": missing '" + key + "'");
  }
  HeaderEntry entry;
  entry.name = name;

  const OrderedJson& dtype = value["dtype"];
  if (!dtype.is_string()) {
    return DataLossError(where + ": dtype: expected a string, got " + ShortJson(dtype));
  }
  Result<DType> parsed_dtype = ParseSafetensorsDType(dtype.get<std::string>());
  if (!parsed_dtype.ok()) return parsed_dtype.status().WithContext(where);
  entry.dtype = *parsed_dtype;

  const OrderedJson& shape = value["shape"];
  if (!shape.is_array()) {
    return DataLossError(where + ": shape: expected a list of non-negative integers, got " +
                         ShortJson(shape));
  }
  // Element count with overflow detection: a lying header must not wrap around to a small size.
  // Shape::numel multiplies the dims from the left in int64, so every partial product must fit
  // there, even where a later dim is 0 ([2^32, 2^31, 0] has no elements but overflowed).
  constexpr uint64_t kMaxElements = std::numeric_limits<int64_t>::max();
  uint64_t numel = 1;
  for (const OrderedJson& dim : shape) {
    std::optional<uint64_t> d = AsUnsigned(dim);
    if (!d || *d > kMaxElements) {
      return DataLossError(where + ": shape: expected a list of non-negative integers, got " +
                           ShortJson(shape));
    }
    entry.shape.dims.push_back(static_cast<int64_t>(*d));
    if (*d != 0 && numel > kMaxElements / *d) {
      return DataLossError(where + ": shape " + ShortJson(shape) +
                           ": the product of the dimensions passes 2^63 - 1");
    }
    numel *= *d;
  }

  const OrderedJson& offsets = value["data_offsets"];
  std::optional<uint64_t> begin, end;
  if (offsets.is_array() && offsets.size() == 2) {
    begin = AsUnsigned(offsets[0]);
    end = AsUnsigned(offsets[1]);
  }
  if (!begin || !end) {
    return DataLossError(where +
                         ": data_offsets: expected [begin, end] (non-negative integers), "
                         "got " +
                         ShortJson(offsets));
  }
  entry.begin = *begin;
  entry.end = *end;
  if (entry.begin > entry.end) {
    return DataLossError(where + ": data_offsets [" + std::to_string(entry.begin) + ", " +
                         std::to_string(entry.end) + "]: begin is after end");
  }
  if (entry.end > data_bytes) {
    return DataLossError(where + " ends at byte " + std::to_string(entry.end) +
                         " but the data section has " + std::to_string(data_bytes) + " bytes");
  }
  const uint64_t element_bytes = DTypeSize(entry.dtype);
  const uint64_t span = entry.end - entry.begin;
  if (numel > std::numeric_limits<uint64_t>::max() / element_bytes ||
      numel * element_bytes != span) {
    const std::string needed = numel > std::numeric_limits<uint64_t>::max() / element_bytes
                                   ? std::string("more than 2^64 bytes")
                                   : std::to_string(numel * element_bytes) + " bytes (" +
                                         std::to_string(numel) + " x " +
                                         std::to_string(element_bytes) + ")";
    return DataLossError(where + ": shape " + entry.shape.ToString() + " of " +
                         dtype.get<std::string>() + " needs " + needed + " but data_offsets [" +
                         std::to_string(entry.begin) + ", " + std::to_string(entry.end) +
                         "] span " + std::to_string(span) + " bytes");
  }
  return entry;
}

// No two non-empty byte ranges may share a byte (gaps between tensors are allowed).
Status CheckNoOverlap(const std::string& file, std::vector<const HeaderEntry*> entries) {
  std::sort(entries.begin(), entries.end(), [](const HeaderEntry* a, const HeaderEntry* b) {
    return std::tie(a->begin, a->end) < std::tie(b->begin, b->end);
  });
  const HeaderEntry* furthest = nullptr;  // the entry seen so far that ends last
  for (const HeaderEntry* entry : entries) {
    if (entry->begin == entry->end) continue;
    if (furthest != nullptr && entry->begin < furthest->end) {
      auto range = [](const HeaderEntry* e) {
        return "[" + std::to_string(e->begin) + ", " + std::to_string(e->end) + ")";
      };
      return DataLossError(file + ": tensors '" + furthest->name + "' (bytes " + range(furthest) +
                           ") and '" + entry->name + "' (bytes " + range(entry) + ") overlap");
    }
    if (furthest == nullptr || entry->end > furthest->end) furthest = entry;
  }
  return Status::Ok();
}

// A weight_map shard name must be a plain file name inside the model directory.
bool IsPlainFileName(const std::string& name) {
  return !name.empty() && name != "." && name != ".." && name.find('/') == std::string::npos;
}

}  // namespace

// ---- MappedFile ------------------------------------------------------------------------------

Result<std::unique_ptr<MappedFile>> MappedFile::Open(const std::filesystem::path& path) {
  const std::string file = path.string();
  const int fd = ::open(file.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    if (errno == ENOENT) return NotFoundError(file + ": no such file");
    return IoError(file + ": cannot open: " + std::strerror(errno));
  }
  struct stat info;
  if (::fstat(fd, &info) != 0) {
    const int error = errno;
    ::close(fd);
    return IoError(file + ": cannot stat: " + std::strerror(error));
  }
  if (!S_ISREG(info.st_mode)) {
    ::close(fd);
    return IoError(file + ": not a regular file");
  }
  std::unique_ptr<MappedFile> mapped(new MappedFile());
  mapped->path_ = path;
  mapped->size_ = static_cast<size_t>(info.st_size);
  if (mapped->size_ > 0) {  // mmap of length 0 is an error; an empty file maps to nothing
    void* address = ::mmap(nullptr, mapped->size_, PROT_READ, MAP_PRIVATE, fd, 0);
    if (address == MAP_FAILED) {
      const int error = errno;
      ::close(fd);
      return IoError(file + ": mmap of " + std::to_string(mapped->size_) +
                     " bytes failed: " + std::strerror(error));
    }
    mapped->data_ = static_cast<const std::byte*>(address);
  }
  ::close(fd);  // the mapping stays valid without the descriptor
  return mapped;
}

MappedFile::~MappedFile() {
  if (data_ != nullptr) ::munmap(const_cast<std::byte*>(data_), size_);
}

// ---- SafetensorsFile -------------------------------------------------------------------------

Result<std::unique_ptr<SafetensorsFile>> SafetensorsFile::Open(const std::filesystem::path& path) {
  RUBATO_ASSIGN_OR_RETURN(std::unique_ptr<MappedFile> mapped, MappedFile::Open(path));
  RUBATO_ASSIGN_OR_RETURN(std::unique_ptr<SafetensorsFile> result,
                          Parse({mapped->data(), mapped->size()}, path));
  result->file_ = std::move(mapped);
  return result;
}

Result<std::unique_ptr<SafetensorsFile>> SafetensorsFile::Parse(std::span<const std::byte> bytes,
                                                                const std::filesystem::path& path) {
  const std::string file = path.string();
  const uint64_t file_bytes = bytes.size();
  if (file_bytes < 8) {
    return DataLossError(file + ": the file has " + std::to_string(file_bytes) +
                         " bytes, too few for a safetensors header length (8 bytes)");
  }
  uint64_t header_bytes = 0;
  for (int i = 0; i < 8; ++i) {
    header_bytes |= static_cast<uint64_t>(bytes[i]) << (8 * i);
  }
  if (header_bytes > kMaxHeaderBytes) {
    return DataLossError(file + ": the header length is " + std::to_string(header_bytes) +
                         " bytes, above the " + std::to_string(kMaxHeaderBytes) +
                         "-byte limit; the file is corrupt or not a safetensors file");
  }
  if (header_bytes > file_bytes - 8) {
    return DataLossError(file + ": the header length is " + std::to_string(header_bytes) +
                         " bytes but only " + std::to_string(file_bytes - 8) +
                         " bytes follow it; the file is truncated");
  }
  const uint64_t data_bytes = file_bytes - 8 - header_bytes;
  const std::byte* data_section = bytes.data() + 8 + header_bytes;

  RUBATO_ASSIGN_OR_RETURN(
      OrderedJson header,
      ParseHeaderJson(
          std::string_view(reinterpret_cast<const char*>(bytes.data() + 8), header_bytes), file));

  auto result = std::make_unique<SafetensorsFile>();
  std::vector<HeaderEntry> entries;
  for (const auto& [name, value] : header.items()) {
    if (name == "__metadata__") {
      if (!value.is_object()) {
        return DataLossError(file + ": __metadata__: expected an object of strings, got " +
                             ShortJson(value));
      }
      for (const auto& [key, text] : value.items()) {
        if (!text.is_string()) {
          return DataLossError(file + ": __metadata__." + key + ": expected a string, got " +
                               ShortJson(text));
        }
        result->metadata_[key] = text.get<std::string>();
      }
      continue;
    }
    RUBATO_ASSIGN_OR_RETURN(HeaderEntry entry, ParseEntry(file, name, value, data_bytes));
    entries.push_back(std::move(entry));
  }
  std::vector<const HeaderEntry*> by_offset;
  for (const HeaderEntry& entry : entries) by_offset.push_back(&entry);
  RUBATO_RETURN_IF_ERROR(CheckNoOverlap(file, std::move(by_offset)));

  const std::string file_name = path.filename().string();
  for (HeaderEntry& entry : entries) {
    result->index_[entry.name] = result->tensors_.size();
    result->tensors_.push_back(
        {entry.name, TensorView{data_section + entry.begin, entry.dtype, std::move(entry.shape)},
         file_name});
  }
  result->path_ = path;
  return result;
}

const SafetensorsTensor* SafetensorsFile::Find(const std::string& name) const {
  auto it = index_.find(name);
  return it == index_.end() ? nullptr : &tensors_[it->second];
}

// ---- SafetensorsCheckpoint -------------------------------------------------------------------

Result<SafetensorsCheckpoint> SafetensorsCheckpoint::OpenDirectory(
    const std::filesystem::path& model_dir) {
  const std::string dir = model_dir.string();
  std::error_code ec;
  if (!std::filesystem::is_directory(model_dir, ec)) {
    return NotFoundError(dir + ": model directory does not exist or is not a directory");
  }
  const std::filesystem::path single = model_dir / "model.safetensors";
  const std::filesystem::path index = model_dir / "model.safetensors.index.json";
  SafetensorsCheckpoint checkpoint;

  if (std::filesystem::exists(single, ec)) {
    RUBATO_ASSIGN_OR_RETURN(std::shared_ptr<SafetensorsFile> file, SafetensorsFile::Open(single));
    for (const SafetensorsTensor& tensor : file->tensors()) {
      checkpoint.by_name_[tensor.name] = &tensor;
    }
    checkpoint.files_.push_back(std::move(file));
    return checkpoint;
  }
  if (!std::filesystem::exists(index, ec)) {
    return NotFoundError(dir +
                         ": neither model.safetensors nor model.safetensors.index.json "
                         "found in the model directory");
  }

  const std::string index_file = index.string();
  RUBATO_ASSIGN_OR_RETURN(std::string index_text, ReadTextFile(index, kMaxSafetensorsIndexBytes));
  RUBATO_RETURN_IF_ERROR(CheckJsonNesting(index_text, index_file));
  OrderedJson index_json;
  try {
    index_json = OrderedJson::parse(index_text);
  } catch (const OrderedJson::exception& e) {
    return DataLossError(index_file + ": not valid JSON: " + e.what());
  }
  if (!index_json.is_object() || !index_json.contains("weight_map") ||
      !index_json["weight_map"].is_object()) {
    return DataLossError(index_file + ": expected an object with a 'weight_map' object");
  }
  std::map<std::string, std::vector<std::string>> names_by_shard;
  for (const auto& [name, shard] : index_json["weight_map"].items()) {
    if (!shard.is_string() || !IsPlainFileName(shard.get<std::string>())) {
      return DataLossError(index_file + ": weight_map entry for tensor '" + name +
                           "' must be a file name in the model directory, got " + ShortJson(shard));
    }
    names_by_shard[shard.get<std::string>()].push_back(name);
  }
  if (names_by_shard.empty()) return DataLossError(index_file + ": weight_map is empty");

  for (const auto& [shard, names] : names_by_shard) {
    const std::filesystem::path shard_path = model_dir / shard;
    if (!std::filesystem::exists(shard_path, ec)) {
      return NotFoundError(index_file + ": shard '" + shard + "' (listed for tensor '" +
                           names.front() + "') does not exist in " + dir);
    }
    RUBATO_ASSIGN_OR_RETURN(std::shared_ptr<SafetensorsFile> file,
                            SafetensorsFile::Open(shard_path));
    for (const std::string& name : names) {
      if (file->Find(name) == nullptr) {
        return DataLossError(index_file + ": tensor '" + name + "' is mapped to shard '" + shard +
                             "' but that shard does not contain it");
      }
    }
    for (const SafetensorsTensor& tensor : file->tensors()) {
      auto [it, inserted] = checkpoint.by_name_.emplace(tensor.name, &tensor);
      if (!inserted) {
        return DataLossError(dir + ": tensor '" + tensor.name + "' is present in two shards, '" +
                             it->second->file + "' and '" + shard + "'");
      }
    }
    checkpoint.files_.push_back(std::move(file));
  }
  return checkpoint;
}

const SafetensorsTensor* SafetensorsCheckpoint::Find(const std::string& name) const {
  auto it = by_name_.find(name);
  return it == by_name_.end() ? nullptr : it->second;
}

std::vector<std::string> SafetensorsCheckpoint::Names() const {
  std::vector<std::string> names;
  names.reserve(by_name_.size());
  for (const auto& [name, tensor] : by_name_) names.push_back(name);
  return names;
}

size_t SafetensorsCheckpoint::TotalBytes() const {
  size_t total = 0;
  for (const auto& [name, tensor] : by_name_) total += tensor->view.nbytes();
  return total;
}

}  // namespace rubato
