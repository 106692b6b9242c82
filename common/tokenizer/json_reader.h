// Typed access to the fields of a parsed tokenizer.json / tokenizer_config.json, with errors that
// name the file and the JSON path of the offending value, e.g.
//   "models/qwen3/tokenizer.json: model.merges[12]: expected a string \"a b\" or a pair of
//    strings, got a number".
// Parsing itself uses nlohmann::json internally; no exception leaves this file's functions.
#pragma once

#include <nlohmann/json.hpp>
#include <string>
#include <string_view>

#include "common/status.h"

namespace rubato {

class JsonReader {
 public:
  // `file` is how errors name the file ("/models/qwen3/tokenizer.json").
  explicit JsonReader(std::string file) : file_(std::move(file)) {}

  const std::string& file() const { return file_; }

  // Parses `text`; a syntax error names the byte offset nlohmann reports.
  Result<nlohmann::json> Parse(std::string_view text) const;

  // "{file}: {path}: {problem}" with the given code (path may be empty).
  Status Error(StatusCode code, std::string_view path, std::string_view problem) const;
  // A type error: "{file}: {path}: expected {expected}, got {type of value}".
  Status TypeError(std::string_view path, std::string_view expected,
                   const nlohmann::json& value) const;

  // `object[key]`, which must exist. `path` is the path of `object`.
  Result<const nlohmann::json*> Field(const nlohmann::json& object, std::string_view key,
                                      std::string_view path) const;
  // `object[key]` or nullptr when absent or JSON null.
  const nlohmann::json* OptionalField(const nlohmann::json& object, std::string_view key) const;

  Result<std::string> String(const nlohmann::json& value, std::string_view path) const;
  // A boolean field that may be absent or null (then `fallback`).
  Result<bool> OptionalBool(const nlohmann::json& object, std::string_view key,
                            std::string_view path, bool fallback) const;
  // A string field that may be absent or null (then `fallback`).
  Result<std::string> OptionalString(const nlohmann::json& object, std::string_view key,
                                     std::string_view path, std::string_view fallback) const;
  // A non-negative integer that fits in an int (token ids).
  Result<int> TokenId(const nlohmann::json& value, std::string_view path) const;
  // Checks that `value` is an object / array.
  Status ExpectObject(const nlohmann::json& value, std::string_view path) const;
  Status ExpectArray(const nlohmann::json& value, std::string_view path) const;

 private:
  std::string file_;
};

// "a.b" from ("a", "b"); "b" when `parent` is empty.
std::string JsonPathJoin(std::string_view parent, std::string_view key);
// "a[3]".
std::string JsonPathIndex(std::string_view parent, size_t index);

}  // namespace rubato
