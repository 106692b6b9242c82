// A gtest fixture for `rubato generate` with bad input: a copy of a bundled model in a temporary
// directory for the test to break, the command run against it, and the check that a run failed
// cleanly (one stderr line naming the problem, a non-zero exit, no signal).
#pragma once

#include <gtest/gtest.h>

#include <filesystem>
#include <string>
#include <vector>

#include "common/test_temp_dir.h"
#include "tests/cli_runner.h"

namespace rubato::testing {

class CliModelTest : public ::testing::Test {
 protected:
  explicit CliModelTest(const char* model = "models/tiny-qwen3-random") : source_model_(model) {}

  void SetUp() override {
    ASSERT_FALSE(dir_.path().empty());
    model_ = dir_.path() / "model";
    std::filesystem::create_directories(model_);
    for (const auto& entry : std::filesystem::directory_iterator(source_model_)) {
      std::filesystem::copy_file(entry.path(), model_ / entry.path().filename());
    }
  }

  // Runs `rubato generate --model <copy> --prompt hello --max-tokens 2 extra...`.
  ProcessResult Generate(const std::vector<std::string>& extra) {
    std::vector<std::string> args = {
        "generate", "--model", model_.string(), "--prompt", "hello", "--max-tokens", "2"};
    args.insert(args.end(), extra.begin(), extra.end());
    return RunProcess(RUBATO_BINARY, args);
  }

  // Asserts the process failed cleanly with one stderr line (shorter than `max_line`, so that no
  // input is echoed whole) containing every `needle`.
  static void ExpectCleanFailure(const ProcessResult& r, const std::vector<std::string>& needles,
                                 size_t max_line = 600) {
    ASSERT_FALSE(r.signaled) << "rubato was killed by signal " << r.signal << "\n"
                             << r.err.substr(0, 2000);
    EXPECT_NE(r.exit_code, 0);
    const std::vector<std::string> lines = NonEmptyLines(r.err);
    ASSERT_EQ(lines.size(), 1u) << "expected one line on stderr, got " << r.err.size()
                                << " bytes:\n"
                                << r.err.substr(0, 2000);
    EXPECT_LT(lines[0].size(), max_line)
        << "the message echoes input: " << lines[0].substr(0, max_line);
    for (const std::string& needle : needles) {
      EXPECT_NE(lines[0].find(needle), std::string::npos)
          << "stderr line does not mention '" << needle << "': " << lines[0];
    }
  }

  const char* source_model_;
  TestTempDir dir_{"cli"};
  std::filesystem::path model_;
};

}  // namespace rubato::testing
