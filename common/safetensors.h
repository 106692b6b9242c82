// Safetensors checkpoints: one file or a sharded set (model.safetensors.index.json), mmap'ed.
//
// Everything in the header is validated before any tensor is handed out: the 8-byte header
// length against the file size, the JSON, each dtype, shape x dtype size against the byte
// range, every range inside the data section, and no two ranges overlapping. Every error names
// the file and, where there is one, the tensor.
#pragma once

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "common/status.h"
#include "common/tensor.h"

namespace rubato {

// A read-only memory mapping of a whole file; unmapped on destruction.
class MappedFile {
 public:
  static Result<std::unique_ptr<MappedFile>> Open(const std::filesystem::path& path);
  ~MappedFile();
  MappedFile(const MappedFile&) = delete;
  MappedFile& operator=(const MappedFile&) = delete;

  const std::byte* data() const { return data_; }
  size_t size() const { return size_; }
  const std::filesystem::path& path() const { return path_; }

 private:
  MappedFile() = default;
  std::filesystem::path path_;
  const std::byte* data_ = nullptr;
  size_t size_ = 0;
};

// One tensor of a checkpoint. `view.data` points into the mapping of `file`. It is aligned only
// as far as the file makes it: the reference writer (and WriteSafetensors) start the data section
// at a multiple of 8 bytes, but a foreign file may not, so read through memcpy or ConvertToF32.
struct SafetensorsTensor {
  std::string name;
  TensorView view;
  std::string file;  // file name (no directory), for error messages
};

// One .safetensors file.
class SafetensorsFile {
 public:
  // Maps `path` and validates it as Parse does; the file owns the mapping.
  static Result<std::unique_ptr<SafetensorsFile>> Open(const std::filesystem::path& path);
  // Validates the whole file's bytes in memory (header length, header, tensors); `path` names it
  // in errors. The tensor views point into `bytes`, which must outlive the result.
  static Result<std::unique_ptr<SafetensorsFile>> Parse(std::span<const std::byte> bytes,
                                                        const std::filesystem::path& path);

  // Tensors in header order.
  const std::vector<SafetensorsTensor>& tensors() const { return tensors_; }
  // nullptr when absent.
  const SafetensorsTensor* Find(const std::string& name) const;
  // The optional "__metadata__" string map.
  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  const std::filesystem::path& path() const { return path_; }

 private:
  std::filesystem::path path_;
  std::unique_ptr<MappedFile> file_;  // null for a file parsed from the caller's bytes
  std::vector<SafetensorsTensor> tensors_;
  std::map<std::string, size_t> index_;  // name -> position in tensors_
  std::map<std::string, std::string> metadata_;
};

// All tensors of a Hugging Face model directory: `model.safetensors`, or the shards listed in
// `model.safetensors.index.json` (weight_map: tensor name -> shard file). A tensor the index
// names must exist in that shard; a tensor in two shards is an error.
class SafetensorsCheckpoint {
 public:
  static Result<SafetensorsCheckpoint> OpenDirectory(const std::filesystem::path& model_dir);

  // nullptr when absent.
  const SafetensorsTensor* Find(const std::string& name) const;
  // Every tensor name, sorted.
  std::vector<std::string> Names() const;
  // Sum of tensor sizes in bytes.
  size_t TotalBytes() const;

 private:
  std::vector<std::shared_ptr<SafetensorsFile>> files_;
  std::map<std::string, const SafetensorsTensor*> by_name_;
};

}  // namespace rubato
