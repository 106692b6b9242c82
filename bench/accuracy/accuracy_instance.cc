// Reading the accuracy suite's JSONL instances and scoring continuations (see
// accuracy_instance.h).
#include "bench/accuracy/accuracy_instance.h"

#include <nlohmann/json.hpp>
#include <sstream>

#include "common/text_file.h"

namespace rubato {
namespace {

// Python's str.strip() for the ASCII whitespace the tasks can produce.
std::string_view StripWhitespace(std::string_view text) {
  constexpr std::string_view kWhitespace = " \t\n\r\f\v";
  const size_t begin = text.find_first_not_of(kWhitespace);
  if (begin == std::string_view::npos) return {};
  const size_t end = text.find_last_not_of(kWhitespace);
  return text.substr(begin, end - begin + 1);
}

Result<AccuracyInstance> ParseInstance(const std::string& line, const std::string& where) {
  const nlohmann::json object = nlohmann::json::parse(line, nullptr, /*allow_exceptions=*/false);
  if (!object.is_object()) return InvalidArgumentError(where + ": not a JSON object");
  auto field = [&](const char* key, nlohmann::json::value_t type,
                   bool is_number = false) -> Result<const nlohmann::json*> {
    const auto it = object.find(key);
    if (it == object.end()) {
      return InvalidArgumentError(where + ": missing key '" + key + "'");
    }
    if (is_number ? !it->is_number() : it->type() != type) {
      return InvalidArgumentError(where + ": key '" + key + "' has the wrong type");
    }
    return &*it;
  };
  using Type = nlohmann::json::value_t;
  AccuracyInstance instance;
  RUBATO_ASSIGN_OR_RETURN(const nlohmann::json* id, field("id", Type::string));
  RUBATO_ASSIGN_OR_RETURN(const nlohmann::json* task, field("task", Type::string));
  RUBATO_ASSIGN_OR_RETURN(const nlohmann::json* length, field("length", Type::number_integer,
                                                              /*is_number=*/true));
  RUBATO_ASSIGN_OR_RETURN(const nlohmann::json* depth, field("depth", Type::number_float,
                                                             /*is_number=*/true));
  RUBATO_ASSIGN_OR_RETURN(const nlohmann::json* prompt, field("prompt", Type::string));
  RUBATO_ASSIGN_OR_RETURN(const nlohmann::json* answer, field("answer", Type::string));
  RUBATO_ASSIGN_OR_RETURN(const nlohmann::json* offset,
                          field("asked_char_offset", Type::number_integer, /*is_number=*/true));
  instance.id = id->get<std::string>();
  instance.task = task->get<std::string>();
  instance.length = length->get<int>();
  instance.depth = depth->get<double>();
  instance.prompt = prompt->get<std::string>();
  instance.answer = answer->get<std::string>();
  instance.asked_char_offset = offset->get<int64_t>();
  if (instance.prompt.empty()) return InvalidArgumentError(where + ": empty prompt");
  if (instance.length <= 0) return InvalidArgumentError(where + ": length must be positive");
  if (instance.depth < 0 || instance.depth > 1) {
    return InvalidArgumentError(where + ": depth must lie in [0, 1]");
  }
  if (!Utf8ByteOffset(instance.prompt, instance.asked_char_offset).ok()) {
    return InvalidArgumentError(where + ": asked_char_offset " +
                                std::to_string(instance.asked_char_offset) +
                                " lies outside the prompt");
  }
  return instance;
}

}  // namespace

Result<std::vector<AccuracyInstance>> LoadAccuracyInstances(const std::filesystem::path& path) {
  RUBATO_ASSIGN_OR_RETURN(std::string text, ReadTextFile(path));
  std::vector<AccuracyInstance> instances;
  std::istringstream lines(text);
  std::string line;
  for (int line_number = 1; std::getline(lines, line); ++line_number) {
    if (StripWhitespace(line).empty()) continue;
    RUBATO_ASSIGN_OR_RETURN(AccuracyInstance instance,
                            ParseInstance(line, path.string() + ":" + std::to_string(line_number)));
    instances.push_back(std::move(instance));
  }
  if (instances.empty()) {
    return InvalidArgumentError(path.string() +
                                ": no instances (expected one JSON object per "
                                "line, as bench/accuracy/generate.py writes)");
  }
  return instances;
}

std::string ExtractPrediction(std::string_view continuation) {
  const size_t end = continuation.find_first_of(".\n");
  return std::string(StripWhitespace(continuation.substr(0, end)));
}

bool ScoreContinuation(std::string_view continuation, std::string_view answer) {
  return ExtractPrediction(continuation) == StripWhitespace(answer);
}

Result<size_t> Utf8ByteOffset(std::string_view text, int64_t code_points) {
  if (code_points < 0) return OutOfRangeError("negative code point offset");
  size_t byte = 0;
  for (int64_t seen = 0; seen < code_points; ++seen) {
    if (byte >= text.size()) {
      return OutOfRangeError("code point offset " + std::to_string(code_points) +
                             " is past the end of the text");
    }
    // Skip the lead byte, then its continuation bytes (10xxxxxx).
    ++byte;
    while (byte < text.size() && (static_cast<unsigned char>(text[byte]) & 0xC0) == 0x80) ++byte;
  }
  return byte;
}

}  // namespace rubato
