// Runs the `rubato` binary as a child process for integration tests, capturing stdout and
// stderr separately and reporting how it ended (exit code or signal).
#pragma once

#include <sys/types.h>

#include <chrono>
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

// A child process that runs while the test goes on (a cache rank, a generation to interrupt):
// stdout and stderr go to temporary files the test can poll. The destructor kills (SIGKILL)
// and reaps it if it still runs, so a failing assertion leaves no process behind.
class BackgroundProcess {
 public:
  // Starts `binary args...` with stdin from /dev/null and this process's environment. A spawn
  // failure shows as a process that has already exited with code 127.
  BackgroundProcess(const std::string& binary, const std::vector<std::string>& args);
  ~BackgroundProcess();
  BackgroundProcess(const BackgroundProcess&) = delete;
  BackgroundProcess& operator=(const BackgroundProcess&) = delete;

  // Waits until stdout contains `text` (true) or `timeout` passes or the process exits (false).
  bool WaitForOutput(const std::string& text, std::chrono::milliseconds timeout);
  // Waits until stdout holds at least `bytes` bytes (false on timeout or exit).
  bool WaitForOutputBytes(size_t bytes, std::chrono::milliseconds timeout);
  std::string Out() const;
  std::string Err() const;
  void Signal(int signal);
  // Waits for the exit; after `timeout` it kills the process and reports SIGKILL.
  ProcessResult Wait(std::chrono::milliseconds timeout);
  pid_t pid() const { return pid_; }

 private:
  bool Exited();

  pid_t pid_ = -1;
  bool reaped_ = false;
  int status_ = 0;
  std::string out_path_;
  std::string err_path_;
};

// Non-empty lines of `text`.
std::vector<std::string> NonEmptyLines(const std::string& text);

}  // namespace rubato::testing
