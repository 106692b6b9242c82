// A fresh temporary directory for one test, removed with everything in it on destruction.
// Tests fabricate checkpoints, config.json and YAML files in it.
#pragma once

#include <stdlib.h>

#include <filesystem>
#include <fstream>
#include <string>
#include <string_view>

namespace rubato {

class TestTempDir {
 public:
  // Creates $TMPDIR/rubato_<prefix>_XXXXXX. path() is empty if creation failed, so that a test
  // using it fails on its first file operation instead of writing elsewhere.
  explicit TestTempDir(std::string_view prefix = "test") {
    std::string pattern =
        (std::filesystem::temp_directory_path() / ("rubato_" + std::string(prefix) + "_XXXXXX"))
            .string();
    if (mkdtemp(pattern.data()) != nullptr) path_ = pattern;
  }
  ~TestTempDir() {
    std::error_code ignored;
    if (!path_.empty()) std::filesystem::remove_all(path_, ignored);
  }
  TestTempDir(const TestTempDir&) = delete;
  TestTempDir& operator=(const TestTempDir&) = delete;

  const std::filesystem::path& path() const { return path_; }

  // Writes `bytes` to path()/name (creating parent directories) and returns the full path.
  std::filesystem::path WriteFile(const std::string& name, std::string_view bytes) const {
    const std::filesystem::path file = path_ / name;
    std::error_code ignored;
    std::filesystem::create_directories(file.parent_path(), ignored);
    std::ofstream out(file, std::ios::binary | std::ios::trunc);
    out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
    return file;
  }

 private:
  std::filesystem::path path_;
};

}  // namespace rubato
