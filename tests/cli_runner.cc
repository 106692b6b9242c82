// Child-process runner for CLI integration tests (see cli_runner.h).
#include "tests/cli_runner.h"

#include <fcntl.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <sstream>
#include <thread>

#include "common/text_file.h"

extern char** environ;

namespace rubato::testing {
namespace {

// The captured output; empty when the file cannot be read.
std::string ReadAll(const std::string& path) {
  Result<std::string> bytes = ReadTextFile(path);
  return bytes.ok() ? *bytes : std::string();
}

}  // namespace

BackgroundProcess::BackgroundProcess(const std::string& binary,
                                     const std::vector<std::string>& args) {
  char out_path[] = "/tmp/rubato_bg_out_XXXXXX";
  char err_path[] = "/tmp/rubato_bg_err_XXXXXX";
  const int out_fd = mkstemp(out_path);
  const int err_fd = mkstemp(err_path);
  out_path_ = out_path;
  err_path_ = err_path;
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_addopen(&actions, 0, "/dev/null", O_RDONLY, 0);
  posix_spawn_file_actions_adddup2(&actions, out_fd, 1);
  posix_spawn_file_actions_adddup2(&actions, err_fd, 2);
  std::vector<std::string> argv_storage = {binary};
  argv_storage.insert(argv_storage.end(), args.begin(), args.end());
  std::vector<char*> argv;
  for (std::string& a : argv_storage) argv.push_back(a.data());
  argv.push_back(nullptr);
  const int rc = out_fd < 0 || err_fd < 0
                     ? -1
                     : posix_spawn(&pid_, binary.c_str(), &actions, nullptr, argv.data(), environ);
  posix_spawn_file_actions_destroy(&actions);
  if (out_fd >= 0) close(out_fd);
  if (err_fd >= 0) close(err_fd);
  if (rc != 0) {
    pid_ = -1;
    reaped_ = true;
    status_ = 127 << 8;  // "exited with 127"
  }
}

BackgroundProcess::~BackgroundProcess() {
  if (!reaped_) {
    kill(pid_, SIGKILL);
    kill(pid_, SIGCONT);  // a stopped process dies only once it runs
    waitpid(pid_, &status_, 0);
  }
  std::remove(out_path_.c_str());
  std::remove(err_path_.c_str());
}

bool BackgroundProcess::Exited() {
  if (reaped_) return true;
  if (waitpid(pid_, &status_, WNOHANG) == pid_) reaped_ = true;
  return reaped_;
}

std::string BackgroundProcess::Out() const { return ReadAll(out_path_); }
std::string BackgroundProcess::Err() const { return ReadAll(err_path_); }

void BackgroundProcess::Signal(int signal) {
  if (!reaped_) kill(pid_, signal);
}

bool BackgroundProcess::WaitForOutput(const std::string& text, std::chrono::milliseconds timeout) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  while (std::chrono::steady_clock::now() < deadline) {
    if (Out().find(text) != std::string::npos) return true;
    if (Exited()) return Out().find(text) != std::string::npos;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  return false;
}

bool BackgroundProcess::WaitForOutputBytes(size_t bytes, std::chrono::milliseconds timeout) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  while (std::chrono::steady_clock::now() < deadline) {
    if (Out().size() >= bytes) return true;
    if (Exited()) return Out().size() >= bytes;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  return false;
}

ProcessResult BackgroundProcess::Wait(std::chrono::milliseconds timeout) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  while (!Exited()) {
    if (std::chrono::steady_clock::now() > deadline) {
      kill(pid_, SIGKILL);
      kill(pid_, SIGCONT);
      waitpid(pid_, &status_, 0);
      reaped_ = true;
      break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  ProcessResult result;
  if (WIFSIGNALED(status_)) {
    result.signaled = true;
    result.signal = WTERMSIG(status_);
  } else {
    result.exit_code = WEXITSTATUS(status_);
  }
  result.out = Out();
  result.err = Err();
  return result;
}

ProcessResult RunProcess(const std::string& binary, const std::vector<std::string>& args,
                         int timeout_s) {
  BackgroundProcess process(binary, args);
  ProcessResult result = process.Wait(std::chrono::seconds(timeout_s));
  if (process.pid() < 0) result.err = "posix_spawn failed for " + binary;
  return result;
}

std::vector<std::string> NonEmptyLines(const std::string& text) {
  std::vector<std::string> lines;
  std::stringstream ss(text);
  std::string line;
  while (std::getline(ss, line)) {
    if (!line.empty()) lines.push_back(line);
  }
  return lines;
}

}  // namespace rubato::testing
