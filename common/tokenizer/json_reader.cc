// Typed access to tokenizer JSON files with errors naming the file and the JSON path.
#include "common/tokenizer/json_reader.h"

#include <fmt/format.h>

#include <limits>

#include "common/json_limits.h"

namespace rubato {

namespace {

std::string_view TypeName(const nlohmann::json& value) {
  switch (value.type()) {
    case nlohmann::json::value_t::null:
      return "null";
    case nlohmann::json::value_t::object:
      return "an object";
    case nlohmann::json::value_t::array:
      return "an array";
    case nlohmann::json::value_t::string:
      return "a string";
    case nlohmann::json::value_t::boolean:
      return "a boolean";
    case nlohmann::json::value_t::number_integer:
    case nlohmann::json::value_t::number_unsigned:
    case nlohmann::json::value_t::number_float:
      return "a number";
    default:
      return "an unsupported JSON value";
  }
}

}  // namespace

std::string JsonPathJoin(std::string_view parent, std::string_view key) {
  if (parent.empty()) return std::string(key);
  return fmt::format("{}.{}", parent, key);
}

std::string JsonPathIndex(std::string_view parent, size_t index) {
  return fmt::format("{}[{}]", parent, index);
}

Result<nlohmann::json> JsonReader::Parse(std::string_view text) const {
  RUBATO_RETURN_IF_ERROR(CheckJsonNesting(text, file_));
  try {
    return nlohmann::json::parse(text.begin(), text.end());
  } catch (const nlohmann::json::parse_error& e) {
    return Error(StatusCode::kDataLoss, "",
                 fmt::format("not valid JSON (byte {}): {}", e.byte, e.what()));
  } catch (const std::exception& e) {
    return Error(StatusCode::kDataLoss, "", fmt::format("not valid JSON: {}", e.what()));
  }
}

Status JsonReader::Error(StatusCode code, std::string_view path, std::string_view problem) const {
  if (path.empty()) return Status(code, fmt::format("{}: {}", file_, problem));
  return Status(code, fmt::format("{}: {}: {}", file_, path, problem));
}

Status JsonReader::TypeError(std::string_view path, std::string_view expected,
                             const nlohmann::json& value) const {
  return Error(StatusCode::kDataLoss, path,
               fmt::format("expected {}, got {}", expected, TypeName(value)));
}

Result<const nlohmann::json*> JsonReader::Field(const nlohmann::json& object, std::string_view key,
                                                std::string_view path) const {
  RUBATO_RETURN_IF_ERROR(ExpectObject(object, path));
  auto it = object.find(key);
  if (it == object.end()) {
    return Error(StatusCode::kDataLoss, path, fmt::format("missing field '{}'", key));
  }
  return &*it;
}

const nlohmann::json* JsonReader::OptionalField(const nlohmann::json& object,
                                                std::string_view key) const {
  if (!object.is_object()) return nullptr;
  auto it = object.find(key);
  if (it == object.end() || it->is_null()) return nullptr;
  return &*it;
}

Result<std::string> JsonReader::String(const nlohmann::json& value, std::string_view path) const {
  if (!value.is_string()) return TypeError(path, "a string", value);
  return value.get<std::string>();
}

Result<bool> JsonReader::OptionalBool(const nlohmann::json& object, std::string_view key,
                                      std::string_view path, bool fallback) const {
  const nlohmann::json* field = OptionalField(object, key);
  if (field == nullptr) return fallback;
  if (!field->is_boolean()) return TypeError(JsonPathJoin(path, key), "a boolean", *field);
  return field->get<bool>();
}

Result<std::string> JsonReader::OptionalString(const nlohmann::json& object, std::string_view key,
                                               std::string_view path,
                                               std::string_view fallback) const {
  const nlohmann::json* field = OptionalField(object, key);
  if (field == nullptr) return std::string(fallback);
  return String(*field, JsonPathJoin(path, key));
}

Result<int> JsonReader::TokenId(const nlohmann::json& value, std::string_view path) const {
  if (!value.is_number_integer()) return TypeError(path, "a token id (integer)", value);
  const int64_t id = value.get<int64_t>();
  if (id < 0 || id > std::numeric_limits<int>::max()) {
    return Error(
        StatusCode::kDataLoss, path,
        fmt::format("token id {} is outside [0, {}]", id, std::numeric_limits<int>::max()));
  }
  return static_cast<int>(id);
}

Status JsonReader::ExpectObject(const nlohmann::json& value, std::string_view path) const {
  if (!value.is_object()) return TypeError(path.empty() ? "top level" : path, "an object", value);
  return Status::Ok();
}

Status JsonReader::ExpectArray(const nlohmann::json& value, std::string_view path) const {
  if (!value.is_array()) return TypeError(path, "an array", value);
  return Status::Ok();
}

}  // namespace rubato
