// The Kascade calibration file (JSON; see kascade_calibration.h and docs/kascade.md): writing,
// reading and the checks that refuse a file by name before any weight is used.
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "common/json_limits.h"
#include "common/text_file.h"
#include "inference_rank/policies/kascade/kascade_calibration.h"

namespace rubato {
namespace {

constexpr const char* kFormat = "rubato-kascade-calibration";
constexpr int kVersion = 1;

Status FieldError(const std::string& field, const std::string& problem) {
  return InvalidArgumentError("kascade calibration: " + field + " " + problem);
}

}  // namespace

Status ValidateCalibration(const KascadeCalibration& c) {
  const int L = c.num_layers, H = c.num_kv_heads;
  if (L < 1) return FieldError("model.num_layers", "must be >= 1");
  if (H < 1) return FieldError("model.num_kv_heads", "must be >= 1");
  if (c.num_heads < H || c.num_heads % H != 0) {
    return FieldError("model.num_heads", "must be a multiple of num_kv_heads");
  }
  if (c.top_k < 1) return FieldError("top_k", "must be >= 1");
  if (c.anchors.empty() || c.anchors.front() != 0) {
    return FieldError("anchors", "must start with layer 0 (always an anchor, always dense)");
  }
  for (size_t i = 0; i < c.anchors.size(); ++i) {
    if (c.anchors[i] < 0 || c.anchors[i] >= L) {
      return FieldError("anchors", "holds layer " + std::to_string(c.anchors[i]) +
                                       ", outside [0, " + std::to_string(L) + ")");
    }
    if (i > 0 && c.anchors[i] <= c.anchors[i - 1]) {
      return FieldError("anchors", "must be strictly ascending");
    }
  }
  if (c.head_map.size() != static_cast<size_t>(L)) {
    return FieldError("head_map", "has " + std::to_string(c.head_map.size()) + " rows, not " +
                                      std::to_string(L) + " (layers)");
  }
  for (int l = 0; l < L; ++l) {
    const std::vector<int>& row = c.head_map[static_cast<size_t>(l)];
    if (row.size() != static_cast<size_t>(H)) {
      return FieldError("head_map[" + std::to_string(l) + "]",
                        "has " + std::to_string(row.size()) + " entries, not " + std::to_string(H) +
                            " (KV heads)");
    }
    for (int h = 0; h < H; ++h) {
      const int to = row[static_cast<size_t>(h)];
      if (to < 0 || to >= H) {
        return FieldError(
            "head_map[" + std::to_string(l) + "]",
            "maps to KV head " + std::to_string(to) + ", outside [0, " + std::to_string(H) + ")");
      }
      if (c.IsAnchor(l) && to != h) {
        return FieldError("head_map[" + std::to_string(l) + "]",
                          "must be the identity on an anchor layer");
      }
    }
  }
  if (c.importance.size() != static_cast<size_t>(L)) {
    return FieldError("importance", "must hold " + std::to_string(L) + " values");
  }
  if (c.similarity.size() != static_cast<size_t>(L) * L) {
    return FieldError("similarity", "must be " + std::to_string(L) + " x " + std::to_string(L));
  }
  const size_t pairs = static_cast<size_t>(L) * H * L * H;
  if (!c.head_similarity.empty() && c.head_similarity.size() != pairs) {
    return FieldError("head_similarity",
                      "must hold (layers x KV heads)^2 = " + std::to_string(pairs) + " values");
  }
  return Status::Ok();
}

Status SaveCalibration(const KascadeCalibration& c, const std::string& path) {
  RUBATO_RETURN_IF_ERROR(ValidateCalibration(c));
  const int L = c.num_layers;
  nlohmann::json similarity = nlohmann::json::array();
  for (int a = 0; a < L; ++a) {
    similarity.push_back(
        std::vector<double>(c.similarity.begin() + a * L, c.similarity.begin() + (a + 1) * L));
  }
  nlohmann::json json = {
      {"format", kFormat},
      {"version", kVersion},
      {"model",
       {{"path", c.model},
        {"num_layers", c.num_layers},
        {"num_heads", c.num_heads},
        {"num_kv_heads", c.num_kv_heads},
        {"head_dim", c.head_dim}}},
      {"dev_set", {{"path", c.dev_set}, {"fnv1a64", c.dev_set_fnv1a}, {"prompts", c.prompts}}},
      {"top_k", c.top_k},
      {"anchors", c.anchors},
      {"head_map", c.head_map},
      {"importance", c.importance},
      {"similarity", similarity},
      {"head_similarity_layout", "((anchor_layer * H + anchor_head) * L + layer) * H + head"},
      {"head_similarity", c.head_similarity}};
  if (!c.known_loss.empty()) json["known_loss"] = c.known_loss;
  std::ofstream out(path);
  out << json.dump(1) << "\n";
  out.close();
  if (!out) return IoError("cannot write the kascade calibration '" + path + "'");
  return Status::Ok();
}

Result<KascadeCalibration> LoadCalibration(const std::string& path) {
  Result<std::string> text = ReadTextFile(path);
  if (!text.ok()) return text.status().WithContext("kascade calibration");
  const std::string where = "kascade calibration '" + DisplayPath(path) + "': ";
  RUBATO_RETURN_IF_ERROR(
      CheckJsonNesting(*text, "kascade calibration '" + DisplayPath(path) + "'"));
  nlohmann::json json;
  try {
    json = nlohmann::json::parse(*text);
  } catch (const nlohmann::json::parse_error& e) {
    return InvalidArgumentError(where + "not valid JSON (truncated?): " + e.what());
  }
  KascadeCalibration c;
  try {
    if (json.value("format", "") != kFormat) {
      return InvalidArgumentError(where + "not a kascade calibration (format is not '" +
                                  std::string(kFormat) + "')");
    }
    if (json.at("version").get<int>() != kVersion) {
      return InvalidArgumentError(where + "version " + json.at("version").dump() +
                                  ", this rubato reads version " + std::to_string(kVersion));
    }
    const nlohmann::json& model = json.at("model");
    c.model = model.at("path").get<std::string>();
    c.num_layers = model.at("num_layers").get<int>();
    c.num_heads = model.at("num_heads").get<int>();
    c.num_kv_heads = model.at("num_kv_heads").get<int>();
    c.head_dim = model.at("head_dim").get<int>();
    const nlohmann::json& dev = json.at("dev_set");
    c.dev_set = dev.at("path").get<std::string>();
    c.dev_set_fnv1a = dev.at("fnv1a64").get<std::string>();
    c.prompts = dev.at("prompts").get<int>();
    c.top_k = json.at("top_k").get<int>();
    c.anchors = json.at("anchors").get<std::vector<int>>();
    c.head_map = json.at("head_map").get<std::vector<std::vector<int>>>();
    c.importance = json.at("importance").get<std::vector<double>>();
    for (const auto& row : json.at("similarity")) {
      const std::vector<double> values = row.get<std::vector<double>>();
      if (values.size() != static_cast<size_t>(c.num_layers)) {
        return InvalidArgumentError(where + "similarity: a row of " +
                                    std::to_string(values.size()) + " values, not " +
                                    std::to_string(c.num_layers));
      }
      c.similarity.insert(c.similarity.end(), values.begin(), values.end());
    }
    c.head_similarity = json.value("head_similarity", std::vector<double>());
    if (json.contains("known_loss")) c.known_loss = json.at("known_loss").get<std::string>();
  } catch (const nlohmann::json::exception& e) {
    return InvalidArgumentError(where + "missing or mistyped field: " + e.what());
  }
  RUBATO_RETURN_IF_ERROR(ValidateCalibration(c).WithContext(where.substr(0, where.size() - 2)));
  return c;
}

Status CheckCalibrationFits(const KascadeCalibration& c, int num_layers, int num_heads,
                            int num_kv_heads, int head_dim) {
  if (c.num_layers == num_layers && c.num_heads == num_heads && c.num_kv_heads == num_kv_heads &&
      c.head_dim == head_dim) {
    return Status::Ok();
  }
  auto shape = [](int layers, int heads, int kv_heads, int dim) {
    return std::to_string(layers) + " layers, " + std::to_string(heads) + " query / " +
           std::to_string(kv_heads) + " KV heads of dimension " + std::to_string(dim);
  };
  return InvalidArgumentError("kascade calibration made for '" + c.model + "' (" +
                              shape(c.num_layers, c.num_heads, c.num_kv_heads, c.head_dim) +
                              "), but the model has " +
                              shape(num_layers, num_heads, num_kv_heads, head_dim));
}

}  // namespace rubato
