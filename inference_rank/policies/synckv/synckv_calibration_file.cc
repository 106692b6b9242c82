// The SyncKV calibration file (JSON; see synckv_calibration.h and docs/synckv.md): writing,
// reading and the checks that refuse a file by name before any weight is used.
#include <cmath>
#include <fstream>
#include <nlohmann/json.hpp>

#include "common/json_limits.h"
#include "common/text_file.h"
#include "inference_rank/policies/calibration_reader.h"
#include "inference_rank/policies/synckv/synckv_calibration.h"

namespace rubato {
namespace {

using Json = nlohmann::json;

constexpr const char* kFormat = "rubato-synckv-calibration";
constexpr int kVersion = 1;
constexpr int64_t kMaxIntField = std::numeric_limits<int>::max();

Status FieldError(const std::string& field, const std::string& problem) {
  return InvalidArgumentError("synckv calibration: " + field + " " + problem);
}

std::string At(const std::string& field, int a, int b = -1, int c = -1) {
  std::string out = field + "[" + std::to_string(a) + "]";
  if (b >= 0) out += "[" + std::to_string(b) + "]";
  if (c >= 0) out += "[" + std::to_string(c) + "]";
  return out;
}

}  // namespace

Status ValidateSyncKvCalibration(const SyncKvCalibration& c) {
  const int L = c.num_layers, H = c.num_kv_heads;
  if (L < 1) return FieldError("model.num_layers", "must be >= 1");
  if (H < 1) return FieldError("model.num_kv_heads", "must be >= 1");
  if (c.num_heads < H || c.num_heads % H != 0) {
    return FieldError("model.num_heads", "must be a multiple of num_kv_heads");
  }
  if (c.top_k < 1) return FieldError("top_k", "must be >= 1");
  if (c.decode_steps < 1) return FieldError("decode_steps", "must be >= 1");
  if (c.similarity.size() != static_cast<size_t>(L) * H * H) {
    return FieldError("similarity", "must be " + std::to_string(L) + " x " + std::to_string(H) +
                                        " x " + std::to_string(H) + " (layers x KV heads^2)");
  }
  for (int l = 0; l < L; ++l) {
    for (int i = 0; i < H; ++i) {
      for (int j = 0; j < H; ++j) {
        const double s = c.S(l, i, j);
        if (!std::isfinite(s) || s < 0.0 || s > 1.0) {
          return FieldError(At("similarity", l, i, j), "must be a finite overlap in [0, 1]");
        }
        if (i == j && std::abs(s - 1.0) > 1e-9) {
          return FieldError(At("similarity", l, i, j), "must be 1 (a head overlaps itself)");
        }
      }
    }
  }
  for (int l = 0; l < L; ++l) {  // after the ranges, so that a bad value is named itself
    for (int i = 0; i < H; ++i) {
      for (int j = 0; j < H; ++j) {
        if (std::abs(c.S(l, i, j) - c.S(l, j, i)) > 1e-9) {
          return FieldError(At("similarity", l, i, j),
                            "differs from its transpose (Eq. 1 is "
                            "symmetric)");
        }
      }
    }
  }
  if (c.clusters < 1 || c.clusters > H) {
    return FieldError("clusters.count", "must lie in [1, " + std::to_string(H) + "]");
  }
  if (c.layers.size() != static_cast<size_t>(L)) {
    return FieldError("clusters.assignment", "must hold " + std::to_string(L) + " layers");
  }
  for (int l = 0; l < L; ++l) {
    const HeadClusters& layer = c.layers[static_cast<size_t>(l)];
    if (layer.cluster.size() != static_cast<size_t>(H)) {
      return FieldError(At("clusters.assignment", l), "must hold " + std::to_string(H) + " heads");
    }
    if (layer.representative.size() != static_cast<size_t>(c.clusters)) {
      return FieldError(At("clusters.representatives", l),
                        "must hold " + std::to_string(c.clusters) + " R-heads");
    }
    std::vector<int> members(static_cast<size_t>(c.clusters), 0);
    for (int h = 0; h < H; ++h) {
      const int g = layer.cluster[static_cast<size_t>(h)];
      if (g < 0 || g >= c.clusters) {
        return FieldError(At("clusters.assignment", l, h), "outside [0, clusters.count)");
      }
      ++members[static_cast<size_t>(g)];
    }
    for (int g = 0; g < c.clusters; ++g) {
      if (members[static_cast<size_t>(g)] == 0) {
        return FieldError(At("clusters.assignment", l),
                          "leaves cluster " + std::to_string(g) + " empty");
      }
      const int r = layer.representative[static_cast<size_t>(g)];
      if (r < 0 || r >= H || layer.cluster[static_cast<size_t>(r)] != g) {
        return FieldError(At("clusters.representatives", l, g),
                          "must be a KV head of cluster " + std::to_string(g));
      }
    }
  }
  return Status::Ok();
}

Status SaveSyncKvCalibration(const SyncKvCalibration& c, const std::string& path) {
  RUBATO_RETURN_IF_ERROR(ValidateSyncKvCalibration(c));
  const int L = c.num_layers, H = c.num_kv_heads;
  Json similarity = Json::array(), assignment = Json::array(), representatives = Json::array();
  for (int l = 0; l < L; ++l) {
    Json layer = Json::array();
    for (int i = 0; i < H; ++i) {
      std::vector<double> row;
      for (int j = 0; j < H; ++j) row.push_back(c.S(l, i, j));
      layer.push_back(row);
    }
    similarity.push_back(layer);
    assignment.push_back(c.layers[static_cast<size_t>(l)].cluster);
    representatives.push_back(c.layers[static_cast<size_t>(l)].representative);
  }
  Json json = CalibrationHeaderJson(c, kFormat, kVersion);
  json.update(Json{
      {"decode_steps", c.decode_steps},
      {"steps", c.steps},
      {"similarity", similarity},
      {"clusters",
       {{"count", c.clusters}, {"assignment", assignment}, {"representatives", representatives}}}});
  std::ofstream out(path);
  out << json.dump(1) << "\n";
  out.close();
  if (!out) return IoError("cannot write the synckv calibration '" + path + "'");
  return Status::Ok();
}

namespace {

Result<SyncKvCalibration> ReadJson(const Json& json, const CalibrationReader& r) {
  SyncKvCalibration c;
  RUBATO_RETURN_IF_ERROR(ReadCalibrationHeader(json, r, "synckv", kFormat, kVersion, &c));
  RUBATO_ASSIGN_OR_RETURN(const Json* decode_steps, r.Field(json, "decode_steps", ""));
  RUBATO_ASSIGN_OR_RETURN(c.decode_steps, r.Int(*decode_steps, "decode_steps", 1, kMaxIntField));
  RUBATO_ASSIGN_OR_RETURN(const Json* steps, r.Field(json, "steps", ""));
  RUBATO_ASSIGN_OR_RETURN(c.steps, r.Int(*steps, "steps", 0, kMaxIntField));

  const size_t L = static_cast<size_t>(c.num_layers), H = static_cast<size_t>(c.num_kv_heads);
  RUBATO_ASSIGN_OR_RETURN(const Json* similarity, r.Field(json, "similarity", ""));
  RUBATO_RETURN_IF_ERROR(r.Array(*similarity, "similarity", L));
  if (similarity->size() != L) {
    return r.Error("similarity", "holds " + std::to_string(similarity->size()) + " layers, not " +
                                     std::to_string(L));
  }
  for (size_t l = 0; l < L; ++l) {
    const std::string layer = CalibrationReader::Index("similarity", l);
    RUBATO_RETURN_IF_ERROR(r.Array((*similarity)[l], layer, H));
    if ((*similarity)[l].size() != H) {
      return r.Error(layer, "holds " + std::to_string((*similarity)[l].size()) + " rows, not " +
                                std::to_string(H) + " (KV heads)");
    }
    for (size_t i = 0; i < H; ++i) {
      const std::string row = CalibrationReader::Index(layer, i);
      const size_t before = c.similarity.size();
      RUBATO_RETURN_IF_ERROR(r.AppendDoubles((*similarity)[l][i], row, H, &c.similarity));
      if (c.similarity.size() - before != H) {
        return r.Error(row, "holds " + std::to_string(c.similarity.size() - before) +
                                " values, not " + std::to_string(H) + " (KV heads)");
      }
    }
  }
  RUBATO_ASSIGN_OR_RETURN(const Json* clusters, r.Field(json, "clusters", ""));
  RUBATO_ASSIGN_OR_RETURN(const Json* count, r.Field(*clusters, "count", "clusters"));
  RUBATO_ASSIGN_OR_RETURN(c.clusters, r.Int(*count, "clusters.count", 1, static_cast<int64_t>(H)));
  RUBATO_ASSIGN_OR_RETURN(const Json* assignment, r.Field(*clusters, "assignment", "clusters"));
  RUBATO_ASSIGN_OR_RETURN(const Json* representatives,
                          r.Field(*clusters, "representatives", "clusters"));
  RUBATO_RETURN_IF_ERROR(r.Array(*assignment, "clusters.assignment", L));
  RUBATO_RETURN_IF_ERROR(r.Array(*representatives, "clusters.representatives", L));
  if (assignment->size() != L || representatives->size() != L) {
    return r.Error("clusters", "must hold " + std::to_string(L) +
                                   " layers of assignment and "
                                   "representatives");
  }
  for (size_t l = 0; l < L; ++l) {
    HeadClusters layer;
    RUBATO_ASSIGN_OR_RETURN(
        layer.cluster, r.Ints((*assignment)[l], CalibrationReader::Index("clusters.assignment", l),
                              H, 0, c.clusters - 1));
    RUBATO_ASSIGN_OR_RETURN(
        layer.representative,
        r.Ints((*representatives)[l], CalibrationReader::Index("clusters.representatives", l),
               static_cast<size_t>(c.clusters), 0, static_cast<int64_t>(H) - 1));
    c.layers.push_back(std::move(layer));
  }
  return c;
}

}  // namespace

Result<SyncKvCalibration> ParseSyncKvCalibration(std::string_view text, const std::string& what) {
  if (text.size() > kMaxCalibrationFileBytes) {
    return InvalidArgumentError(what + ": more than " + std::to_string(kMaxCalibrationFileBytes) +
                                " bytes, the limit for a calibration file");
  }
  RUBATO_RETURN_IF_ERROR(CheckJsonNesting(text, what));
  Json json;
  try {
    json = Json::parse(text);
  } catch (const Json::parse_error& e) {
    return InvalidArgumentError(what +
                                ": not valid JSON (truncated, or a NaN written as a "
                                "bare word?): " +
                                Excerpt(e.what(), 200));
  } catch (const Json::exception& e) {  // a number past a double (1e999)
    return InvalidArgumentError(what +
                                ": a value JSON numbers cannot hold: " + Excerpt(e.what(), 200));
  }
  if (!json.is_object()) return InvalidArgumentError(what + ": expected a JSON object");
  const CalibrationReader reader(what + ": ");
  RUBATO_ASSIGN_OR_RETURN(SyncKvCalibration c, ReadJson(json, reader));
  RUBATO_RETURN_IF_ERROR(ValidateSyncKvCalibration(c).WithContext(what));
  return c;
}

Result<SyncKvCalibration> LoadSyncKvCalibration(const std::string& path) {
  Result<std::string> text = ReadTextFile(path, kMaxCalibrationFileBytes);
  if (!text.ok()) return text.status().WithContext("synckv calibration");
  return ParseSyncKvCalibration(*text, "synckv calibration '" + DisplayPath(path) + "'");
}

Status CheckSyncKvCalibrationFits(const SyncKvCalibration& c, int num_layers, int num_heads,
                                  int num_kv_heads, int head_dim) {
  return CheckCalibrationHeaderFits(c, "synckv", num_layers, num_heads, num_kv_heads, head_dim);
}

}  // namespace rubato
