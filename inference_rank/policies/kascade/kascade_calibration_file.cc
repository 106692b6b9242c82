// The Kascade calibration file (JSON; see kascade_calibration.h and docs/kascade.md): writing,
// reading and the checks that refuse a file by name before any weight is used.
#include <fstream>
#include <limits>
#include <nlohmann/json.hpp>
#include <string_view>
#include <utility>

#include "common/json_limits.h"
#include "common/text_file.h"
#include "inference_rank/policies/calibration_reader.h"
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
  nlohmann::json json = CalibrationHeaderJson(c, kFormat, kVersion);
  json.update(nlohmann::json{
      {"anchors", c.anchors},
      {"head_map", c.head_map},
      {"importance", c.importance},
      {"similarity", similarity},
      {"head_similarity_layout", "((anchor_layer * H + anchor_head) * L + layer) * H + head"},
      {"head_similarity", c.head_similarity}});
  if (!c.known_loss.empty()) json["known_loss"] = c.known_loss;
  std::ofstream out(path);
  out << json.dump(1) << "\n";
  out.close();
  if (!out) return IoError("cannot write the kascade calibration '" + path + "'");
  return Status::Ok();
}

namespace {

using Json = nlohmann::json;

Result<KascadeCalibration> ReadCalibrationJson(const Json& json, const CalibrationReader& r) {
  KascadeCalibration c;
  RUBATO_RETURN_IF_ERROR(ReadCalibrationHeader(json, r, "kascade", kFormat, kVersion, &c));

  const int L = c.num_layers, H = c.num_kv_heads;
  RUBATO_ASSIGN_OR_RETURN(const Json* anchors, r.Field(json, "anchors", ""));
  RUBATO_ASSIGN_OR_RETURN(c.anchors, r.Ints(*anchors, "anchors", static_cast<size_t>(L), 0, L - 1));
  RUBATO_ASSIGN_OR_RETURN(const Json* head_map, r.Field(json, "head_map", ""));
  RUBATO_RETURN_IF_ERROR(r.Array(*head_map, "head_map", static_cast<size_t>(L)));
  for (size_t l = 0; l < head_map->size(); ++l) {
    RUBATO_ASSIGN_OR_RETURN(std::vector<int> row,
                            r.Ints((*head_map)[l], CalibrationReader::Index("head_map", l),
                                   static_cast<size_t>(H), 0, H - 1));
    c.head_map.push_back(std::move(row));
  }
  RUBATO_ASSIGN_OR_RETURN(const Json* importance, r.Field(json, "importance", ""));
  RUBATO_RETURN_IF_ERROR(
      r.AppendDoubles(*importance, "importance", static_cast<size_t>(L), &c.importance));
  RUBATO_ASSIGN_OR_RETURN(const Json* similarity, r.Field(json, "similarity", ""));
  RUBATO_RETURN_IF_ERROR(r.Array(*similarity, "similarity", static_cast<size_t>(L)));
  for (size_t a = 0; a < similarity->size(); ++a) {
    const std::string row = CalibrationReader::Index("similarity", a);
    const size_t before = c.similarity.size();
    RUBATO_RETURN_IF_ERROR(
        r.AppendDoubles((*similarity)[a], row, static_cast<size_t>(L), &c.similarity));
    if (c.similarity.size() - before != static_cast<size_t>(L)) {
      return r.Error(row, "holds " + std::to_string(c.similarity.size() - before) +
                              " values, not " + std::to_string(L) + " (layers)");
    }
  }
  const auto heads = json.find("head_similarity");
  if (heads != json.end()) {
    const size_t pairs = static_cast<size_t>(L) * H * L * H;
    RUBATO_RETURN_IF_ERROR(r.AppendDoubles(*heads, "head_similarity", pairs, &c.head_similarity));
  }
  const auto known_loss = json.find("known_loss");
  if (known_loss != json.end()) {
    RUBATO_ASSIGN_OR_RETURN(c.known_loss, r.String(*known_loss, "known_loss"));
  }
  return c;
}

}  // namespace

Result<KascadeCalibration> ParseCalibration(std::string_view text, const std::string& what) {
  if (text.size() > kMaxCalibrationFileBytes) {
    return InvalidArgumentError(what + ": more than " + std::to_string(kMaxCalibrationFileBytes) +
                                " bytes, the limit for a calibration file");
  }
  RUBATO_RETURN_IF_ERROR(CheckJsonNesting(text, what));
  Json json;
  try {
    json = Json::parse(text);
  } catch (const Json::parse_error& e) {
    return InvalidArgumentError(what + ": not valid JSON (truncated?): " + Excerpt(e.what(), 200));
  } catch (const Json::exception& e) {  // a number past a double (1e999)
    return InvalidArgumentError(what +
                                ": a value JSON numbers cannot hold: " + Excerpt(e.what(), 200));
  }
  if (!json.is_object()) return InvalidArgumentError(what + ": expected a JSON object");
  const CalibrationReader reader(what + ": ");
  RUBATO_ASSIGN_OR_RETURN(KascadeCalibration c, ReadCalibrationJson(json, reader));
  RUBATO_RETURN_IF_ERROR(ValidateCalibration(c).WithContext(what));
  return c;
}

Result<KascadeCalibration> LoadCalibration(const std::string& path) {
  Result<std::string> text = ReadTextFile(path, kMaxCalibrationFileBytes);
  if (!text.ok()) return text.status().WithContext("kascade calibration");
  return ParseCalibration(*text, "kascade calibration '" + DisplayPath(path) + "'");
}

Status CheckCalibrationFits(const KascadeCalibration& c, int num_layers, int num_heads,
                            int num_kv_heads, int head_dim) {
  return CheckCalibrationHeaderFits(c, "kascade", num_layers, num_heads, num_kv_heads, head_dim);
}

}  // namespace rubato
