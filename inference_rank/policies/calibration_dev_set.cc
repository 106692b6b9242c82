// The development set and progress bar of the offline calibrations (see calibration_dev_set.h).
#include "inference_rank/policies/calibration_dev_set.h"

#include <filesystem>
#include <nlohmann/json.hpp>
#include <sstream>

#include "common/text_file.h"

namespace rubato {

Result<std::vector<std::string>> ReadCalibrationDevSet(const std::string& path,
                                                       std::string& bytes) {
  // Bounded, and only a regular file: /dev/zero or a FIFO is refused by kind, never read.
  Result<std::string> text = ReadTextFile(path, kMaxPromptSetBytes);
  if (!text.ok()) return text.status().WithContext("--dev-set");
  bytes = std::move(text).value();
  std::vector<std::string> prompts;
  std::istringstream lines(bytes);
  std::string line;
  for (int number = 1; std::getline(lines, line); ++number) {
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
    const nlohmann::json json = nlohmann::json::parse(line, nullptr, false);
    if (!json.is_object() || !json.contains("prompt") || !json["prompt"].is_string()) {
      return InvalidArgumentError("--dev-set " + DisplayPath(path) + ":" + std::to_string(number) +
                                  ": not a JSON object with a string \"prompt\"");
    }
    prompts.push_back(json["prompt"].get<std::string>());
  }
  if (prompts.empty())
    return InvalidArgumentError("--dev-set " + DisplayPath(path) + ": no prompts");
  return prompts;
}

void CalibrationProgress(std::FILE* out, const char* what, int done, int total, double seconds) {
  if (out == nullptr) return;
  const int width = 30;
  const int filled = total > 0 ? done * width / total : width;
  std::fprintf(out, "\r%s [%s%s] %d/%d prompts, %.0f s", what, std::string(filled, '#').c_str(),
               std::string(width - filled, '.').c_str(), done, total, seconds);
  if (done == total) std::fprintf(out, "\n");
  std::fflush(out);
}

Status CheckCalibrateArgs(const std::string& out, int top_k, int max_prompt_tokens) {
  if (out.empty()) return InvalidArgumentError("--out: empty; name the calibration file to write");
  const std::filesystem::path out_dir = std::filesystem::path(out).parent_path();
  std::error_code error;  // a path too long for the OS is an answer, not an exception
  if (!out_dir.empty() && !std::filesystem::is_directory(out_dir, error)) {
    return NotFoundError("--out " + DisplayPath(out) + ": the directory " + DisplayPath(out_dir) +
                         " does not exist");
  }
  if (top_k < 1) return InvalidArgumentError("--top-k must be >= 1");
  if (max_prompt_tokens < 2) return InvalidArgumentError("--max-tokens must be >= 2");
  if (top_k > max_prompt_tokens) {
    return InvalidArgumentError("--top-k " + std::to_string(top_k) + " exceeds --max-tokens " +
                                std::to_string(max_prompt_tokens) +
                                ": a top-k set holds at most a prompt's positions");
  }
  return Status::Ok();
}

}  // namespace rubato
