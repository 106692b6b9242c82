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

// What every calibration file opens with, for a calibration struct with the fields model,
// num_layers, num_heads, num_kv_heads, head_dim, dev_set, dev_set_fnv1a, prompts and top_k:
// format, version, the model's path and shape, the dev set (path, FNV-1a hash, prompts), top_k.
template <typename Calibration>
nlohmann::json CalibrationHeaderJson(const Calibration& c, const char* format, int version) {
  return {{"format", format},
          {"version", version},
          {"model",
           {{"path", c.model},
            {"num_layers", c.num_layers},
            {"num_heads", c.num_heads},
            {"num_kv_heads", c.num_kv_heads},
            {"head_dim", c.head_dim}}},
          {"dev_set", {{"path", c.dev_set}, {"fnv1a64", c.dev_set_fnv1a}, {"prompts", c.prompts}}},
          {"top_k", c.top_k}};
}

// Reads CalibrationHeaderJson's fields into `c`, refusing another format ("not a `kind`
// calibration") or version by name.
template <typename Calibration>
Status ReadCalibrationHeader(const nlohmann::json& json, const CalibrationReader& r,
                             const std::string& kind, const std::string& format, int version,
                             Calibration* c) {
  // Bounds far above any released model (common/hf_config.cc bounds a model's config.json alike).
  constexpr int64_t kMaxShape = 1 << 10;  // layers, heads, head_dim
  constexpr int64_t kMaxIntField = (int64_t{1} << 31) - 1;
  RUBATO_ASSIGN_OR_RETURN(const nlohmann::json* format_field, r.Field(json, "format", ""));
  if (!format_field->is_string() || format_field->get<std::string>() != format) {
    return r.Error("format", "not a " + kind + " calibration (format is not '" + format + "')");
  }
  RUBATO_ASSIGN_OR_RETURN(const nlohmann::json* version_field, r.Field(json, "version", ""));
  RUBATO_ASSIGN_OR_RETURN(const int v, r.Int(*version_field, "version", 0, kMaxIntField));
  if (v != version) {
    return r.Error("version",
                   std::to_string(v) + ", this rubato reads version " + std::to_string(version));
  }
  RUBATO_ASSIGN_OR_RETURN(const nlohmann::json* model, r.Field(json, "model", ""));
  RUBATO_ASSIGN_OR_RETURN(const nlohmann::json* path, r.Field(*model, "path", "model"));
  RUBATO_ASSIGN_OR_RETURN(c->model, r.String(*path, "model.path"));
  const std::pair<const char*, int*> shape[] = {{"num_layers", &c->num_layers},
                                                {"num_heads", &c->num_heads},
                                                {"num_kv_heads", &c->num_kv_heads},
                                                {"head_dim", &c->head_dim}};
  for (const auto& [key, target] : shape) {
    RUBATO_ASSIGN_OR_RETURN(const nlohmann::json* value, r.Field(*model, key, "model"));
    RUBATO_ASSIGN_OR_RETURN(*target, r.Int(*value, std::string("model.") + key, 1, kMaxShape));
  }
  RUBATO_ASSIGN_OR_RETURN(const nlohmann::json* dev, r.Field(json, "dev_set", ""));
  RUBATO_ASSIGN_OR_RETURN(const nlohmann::json* dev_path, r.Field(*dev, "path", "dev_set"));
  RUBATO_ASSIGN_OR_RETURN(c->dev_set, r.String(*dev_path, "dev_set.path"));
  RUBATO_ASSIGN_OR_RETURN(const nlohmann::json* hash, r.Field(*dev, "fnv1a64", "dev_set"));
  RUBATO_ASSIGN_OR_RETURN(c->dev_set_fnv1a, r.String(*hash, "dev_set.fnv1a64"));
  RUBATO_ASSIGN_OR_RETURN(const nlohmann::json* prompts, r.Field(*dev, "prompts", "dev_set"));
  RUBATO_ASSIGN_OR_RETURN(c->prompts, r.Int(*prompts, "dev_set.prompts", 0, kMaxIntField));
  RUBATO_ASSIGN_OR_RETURN(const nlohmann::json* top_k, r.Field(json, "top_k", ""));
  RUBATO_ASSIGN_OR_RETURN(c->top_k, r.Int(*top_k, "top_k", 1, kMaxIntField));
  return Status::Ok();
}

// Ok when the header's model shape is the model's, else "`kind` calibration made for 'MODEL'
// (its shape), but the model has (this shape)".
template <typename Calibration>
Status CheckCalibrationHeaderFits(const Calibration& c, const std::string& kind, int num_layers,
                                  int num_heads, int num_kv_heads, int head_dim) {
  if (c.num_layers == num_layers && c.num_heads == num_heads && c.num_kv_heads == num_kv_heads &&
      c.head_dim == head_dim) {
    return Status::Ok();
  }
  auto shape = [](int layers, int heads, int kv_heads, int dim) {
    return std::to_string(layers) + " layers, " + std::to_string(heads) + " query / " +
           std::to_string(kv_heads) + " KV heads of dimension " + std::to_string(dim);
  };
  return InvalidArgumentError(kind + " calibration made for '" + Excerpt(c.model, 200) + "' (" +
                              shape(c.num_layers, c.num_heads, c.num_kv_heads, c.head_dim) +
                              "), but the model has " +
                              shape(num_layers, num_heads, num_kv_heads, head_dim));
}

}  // namespace rubato
