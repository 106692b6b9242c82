// Runs the `rubato` binary as a child process for integration tests, capturing stdout and
// stderr separately and reporting how it ended (exit code or signal).
#pragma once

#include <string>
#include <vector>

namespace rubato::testing {

struct ProcessResult {
  int exit_code = -1;   // valid when !signaled
  bool signaled = false;  // killed by a signal (a crash)
  int signal = 0;
  std::string out;        // stdout
  std::string err;        // stderr
};

// Runs `binary args...` with stdin from /dev/null. Kills it after `timeout_s` seconds
// (reported as signaled with SIGKILL), so a hang fails the test instead of blocking CI.
ProcessResult RunProcess(const std::string& binary, const std::vector<std::string>& args,
                         int timeout_s = 120);

// Non-empty lines of `text`.
std::vector<std::string> NonEmptyLines(const std::string& text);

}  // namespace rubato::testing
