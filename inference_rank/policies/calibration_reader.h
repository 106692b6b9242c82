// Strict typed reads of a policy calibration file's JSON (kascade_calibration_file.cc,
// synckv/synckv_calibration_file.cc): a value of the wrong kind (2.7 for an integer, null for
// a number) or out of range (4294967298) is refused naming its field, never converted.
#pragma once

#include <cmath>
#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>
#include <utility>
#include <vector>

#include "common/json_limits.h"
#include "common/status.h"

namespace rubato {

// Reads fields of one calibration file; errors read "<where><field>: <problem>".
class CalibrationReader {
 public:
  explicit CalibrationReader(std::string where) : where_(std::move(where)) {}

  Status Error(const std::string& field, const std::string& problem) const {
    return InvalidArgumentError(where_ + field + ": " + problem);
  }
  Result<const nlohmann::json*> Field(const nlohmann::json& object, const std::string& key,
                                      const std::string& field) const {
    if (!object.is_object()) return Error(field, "expected an object, got " + Kind(object));
    const auto it = object.find(key);
    if (it == object.end()) return Error(JoinKey(field, key), "missing");
    return &*it;
  }
  Result<int> Int(const nlohmann::json& value, const std::string& field, int64_t min,
                  int64_t max) const {
    if (!value.is_number_integer()) {
      return Error(field, "expected an integer, got " + Kind(value));
    }
    bool in_range = false;
    if (value.is_number_unsigned()) {
      const uint64_t u = value.get<uint64_t>();
      in_range = u <= static_cast<uint64_t>(max) && (min <= 0 || u >= static_cast<uint64_t>(min));
    } else {
      const int64_t i = value.get<int64_t>();
      in_range = i >= min && i <= max;
    }
    if (!in_range) {
      return Error(field, "must be in [" + std::to_string(min) + ", " + std::to_string(max) +
                              "], got " + Excerpt(value.dump()));
    }
    return static_cast<int>(value.get<int64_t>());
  }
  Result<double> Double(const nlohmann::json& value, const std::string& field) const {
    if (!value.is_number()) return Error(field, "expected a number, got " + Kind(value));
    const double v = value.get<double>();
    if (!std::isfinite(v)) return Error(field, "must be finite, got " + Excerpt(value.dump()));
    return v;
  }
  Result<std::string> String(const nlohmann::json& value, const std::string& field) const {
    if (!value.is_string()) return Error(field, "expected a string, got " + Kind(value));
    return value.get<std::string>();
  }
  // An array of at most `max_size` elements.
  Status Array(const nlohmann::json& value, const std::string& field, size_t max_size) const {
    if (!value.is_array()) return Error(field, "expected an array, got " + Kind(value));
    if (value.size() > max_size) {
      return Error(field, "holds " + std::to_string(value.size()) + " entries, more than " +
                              std::to_string(max_size));
    }
    return Status::Ok();
  }
  Result<std::vector<int>> Ints(const nlohmann::json& value, const std::string& field,
                                size_t max_size, int64_t min, int64_t max) const {
    RUBATO_RETURN_IF_ERROR(Array(value, field, max_size));
    std::vector<int> out;
    for (size_t i = 0; i < value.size(); ++i) {
      RUBATO_ASSIGN_OR_RETURN(const int v, Int(value[i], Index(field, i), min, max));
      out.push_back(v);
    }
    return out;
  }
  Status AppendDoubles(const nlohmann::json& value, const std::string& field, size_t max_size,
                       std::vector<double>* out) const {
    RUBATO_RETURN_IF_ERROR(Array(value, field, max_size));
    for (size_t i = 0; i < value.size(); ++i) {
      RUBATO_ASSIGN_OR_RETURN(const double v, Double(value[i], Index(field, i)));
      out->push_back(v);
    }
    return Status::Ok();
  }

  static std::string JoinKey(const std::string& field, const std::string& key) {
    return field.empty() ? key : field + "." + key;
  }
  static std::string Index(const std::string& field, size_t i) {
    return field + "[" + std::to_string(i) + "]";
  }

 private:
  static std::string Kind(const nlohmann::json& value) {
    if (value.is_number_float()) return "the number " + Excerpt(value.dump());
    if (value.is_number()) return "the integer " + Excerpt(value.dump());
    if (value.is_string()) return "a string";
    if (value.is_boolean()) return "a boolean";
    if (value.is_null()) return "null";
    return value.is_array() ? "an array" : "an object";
  }

  std::string where_;
};

}  // namespace rubato
