// tokenizer.json post-processors for single sequences (ByteLevel, TemplateProcessing, Sequence).
#include "common/tokenizer/post_processor.h"

#include <fmt/format.h>

namespace rubato {

Result<PostProcessor::Template> PostProcessor::ParseTemplate(const nlohmann::json& spec,
                                                             const JsonReader& reader,
                                                             std::string_view path) {
  const std::string single_path = JsonPathJoin(path, "single");
  RUBATO_ASSIGN_OR_RETURN(const nlohmann::json* single, reader.Field(spec, "single", path));
  RUBATO_RETURN_IF_ERROR(reader.ExpectArray(*single, single_path));
  const std::string specials_path = JsonPathJoin(path, "special_tokens");
  const nlohmann::json* specials = reader.OptionalField(spec, "special_tokens");
  if (specials != nullptr) RUBATO_RETURN_IF_ERROR(reader.ExpectObject(*specials, specials_path));

  Template result;
  for (size_t i = 0; i < single->size(); ++i) {
    const nlohmann::json& item = (*single)[i];
    const std::string item_path = JsonPathIndex(single_path, i);
    RUBATO_RETURN_IF_ERROR(reader.ExpectObject(item, item_path));
    if (const nlohmann::json* sequence = reader.OptionalField(item, "Sequence")) {
      const std::string sequence_path = JsonPathJoin(item_path, "Sequence");
      RUBATO_ASSIGN_OR_RETURN(const nlohmann::json* id,
                              reader.Field(*sequence, "id", sequence_path));
      RUBATO_ASSIGN_OR_RETURN(std::string name,
                              reader.String(*id, JsonPathJoin(sequence_path, "id")));
      if (name != "A") {
        return reader.Error(StatusCode::kDataLoss, sequence_path,
                            fmt::format("the single-sequence template can only refer to "
                                        "sequence A, not '{}'",
                                        name));
      }
      result.push_back({true, {}});
      continue;
    }
    const nlohmann::json* special = reader.OptionalField(item, "SpecialToken");
    if (special == nullptr) {
      return reader.Error(StatusCode::kDataLoss, item_path,
                          "expected {\"Sequence\": ...} or {\"SpecialToken\": ...}");
    }
    const std::string special_path = JsonPathJoin(item_path, "SpecialToken");
    RUBATO_ASSIGN_OR_RETURN(const nlohmann::json* id, reader.Field(*special, "id", special_path));
    RUBATO_ASSIGN_OR_RETURN(std::string name, reader.String(*id, JsonPathJoin(special_path, "id")));
    const nlohmann::json* entry =
        specials == nullptr ? nullptr : reader.OptionalField(*specials, name);
    if (entry == nullptr) {
      return reader.Error(
          StatusCode::kDataLoss, special_path,
          fmt::format("special token '{}' is not defined in {}", name, specials_path));
    }
    const std::string entry_path = fmt::format("{}[\"{}\"]", specials_path, name);
    RUBATO_ASSIGN_OR_RETURN(const nlohmann::json* ids, reader.Field(*entry, "ids", entry_path));
    const std::string ids_path = JsonPathJoin(entry_path, "ids");
    RUBATO_RETURN_IF_ERROR(reader.ExpectArray(*ids, ids_path));
    TemplateItem token{false, {}};
    for (size_t k = 0; k < ids->size(); ++k) {
      RUBATO_ASSIGN_OR_RETURN(int token_id, reader.TokenId((*ids)[k], JsonPathIndex(ids_path, k)));
      token.special_ids.push_back(token_id);
    }
    result.push_back(std::move(token));
  }
  return result;
}

Status PostProcessor::AppendTemplates(const nlohmann::json& spec, const JsonReader& reader,
                                      std::string_view path, std::vector<Template>* templates) {
  RUBATO_ASSIGN_OR_RETURN(const nlohmann::json* type_field, reader.Field(spec, "type", path));
  RUBATO_ASSIGN_OR_RETURN(std::string type, reader.String(*type_field, JsonPathJoin(path, "type")));
  if (type == "ByteLevel") return Status::Ok();
  if (type == "TemplateProcessing") {
    RUBATO_ASSIGN_OR_RETURN(Template parsed, ParseTemplate(spec, reader, path));
    templates->push_back(std::move(parsed));
    return Status::Ok();
  }
  if (type == "Sequence") {
    const std::string list_path = JsonPathJoin(path, "processors");
    RUBATO_ASSIGN_OR_RETURN(const nlohmann::json* list, reader.Field(spec, "processors", path));
    RUBATO_RETURN_IF_ERROR(reader.ExpectArray(*list, list_path));
    for (size_t i = 0; i < list->size(); ++i) {
      RUBATO_RETURN_IF_ERROR(
          AppendTemplates((*list)[i], reader, JsonPathIndex(list_path, i), templates));
    }
    return Status::Ok();
  }
  return reader.Error(StatusCode::kUnsupported, path,
                      fmt::format("post_processor type '{}' is not supported (rubato supports "
                                  "ByteLevel, TemplateProcessing and Sequence)",
                                  type));
}

Result<PostProcessor> PostProcessor::FromJson(const nlohmann::json* spec, const JsonReader& reader,
                                              std::string_view path) {
  PostProcessor processor;
  if (spec == nullptr || spec->is_null()) return processor;
  RUBATO_RETURN_IF_ERROR(AppendTemplates(*spec, reader, path, &processor.templates_));
  return processor;
}

std::vector<int> PostProcessor::Apply(std::vector<int> ids, bool add_special_tokens) const {
  if (!add_special_tokens) return ids;
  for (const Template& tmpl : templates_) {
    std::vector<int> out;
    for (const TemplateItem& item : tmpl) {
      if (item.is_sequence) {
        out.insert(out.end(), ids.begin(), ids.end());
      } else {
        out.insert(out.end(), item.special_ids.begin(), item.special_ids.end());
      }
    }
    ids = std::move(out);
  }
  return ids;
}

}  // namespace rubato
