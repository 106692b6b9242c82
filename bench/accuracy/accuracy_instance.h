// The instances of the long-context accuracy suite (written by bench/accuracy/generate.py, one
// JSON object per line) and their scoring, which matches tasks.score in tasks.py exactly.
#pragma once

#include <cstdint>
#include <filesystem>
#include <string>
#include <string_view>
#include <vector>

#include "common/status.h"

namespace rubato {

struct AccuracyInstance {
  std::string id;                 // "passkey/4096/0.5/3": task/length/depth/index
  std::string task;               // passkey | multikey | kv_recall | vartrack
  int length = 0;                 // length bucket in tokens (the prompt is a little shorter)
  double depth = 0;               // where the asked fact sits, 0 = start of the context, 1 = end
  std::string prompt;             // UTF-8, ends with the question
  std::string answer;             // the string the continuation must start with, before '.'
  int64_t asked_char_offset = 0;  // code points into prompt where the asked fact starts
};

// Reads a .jsonl file of instances. Errors name the file and line ("tasks.jsonl:7: missing
// key 'answer'"); an empty file is an error too (an empty suite would score nothing).
Result<std::vector<AccuracyInstance>> LoadAccuracyInstances(const std::filesystem::path& path);

// The continuation up to its first '.' or newline, without surrounding whitespace: what
// tasks.score compares with the answer.
std::string ExtractPrediction(std::string_view continuation);

// tasks.score: ExtractPrediction(continuation) equals the stripped answer.
bool ScoreContinuation(std::string_view continuation, std::string_view answer);

// The byte offset in UTF-8 `text` of code point `code_points` (Python's string index), or
// OutOfRange when the text is shorter.
Result<size_t> Utf8ByteOffset(std::string_view text, int64_t code_points);

}  // namespace rubato
