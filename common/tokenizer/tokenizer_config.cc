// Reads chat_template and bos/eos tokens from tokenizer_config.json.
#include "common/tokenizer/tokenizer_config.h"

namespace rubato {

namespace {

Result<std::optional<std::string>> ReadTokenField(const nlohmann::json& config,
                                                  std::string_view key, const JsonReader& reader) {
  const nlohmann::json* field = reader.OptionalField(config, key);
  if (field == nullptr) return std::optional<std::string>();
  if (field->is_string()) return std::optional<std::string>(field->get<std::string>());
  if (field->is_object()) {
    RUBATO_ASSIGN_OR_RETURN(const nlohmann::json* content,
                            reader.Field(*field, "content", std::string(key)));
    RUBATO_ASSIGN_OR_RETURN(std::string text,
                            reader.String(*content, JsonPathJoin(key, "content")));
    return std::optional<std::string>(std::move(text));
  }
  return reader.TypeError(key, "a token string or {\"content\": ...}", *field);
}

Result<std::optional<std::string>> ReadChatTemplate(const nlohmann::json& config,
                                                    const JsonReader& reader) {
  const nlohmann::json* field = reader.OptionalField(config, "chat_template");
  if (field == nullptr) return std::optional<std::string>();
  if (field->is_string()) return std::optional<std::string>(field->get<std::string>());
  if (!field->is_array()) {
    return reader.TypeError("chat_template", "a string or a list of {name, template}", *field);
  }
  for (size_t i = 0; i < field->size(); ++i) {
    const nlohmann::json& entry = (*field)[i];
    const std::string path = JsonPathIndex("chat_template", i);
    RUBATO_ASSIGN_OR_RETURN(const nlohmann::json* name, reader.Field(entry, "name", path));
    RUBATO_ASSIGN_OR_RETURN(std::string name_text,
                            reader.String(*name, JsonPathJoin(path, "name")));
    if (name_text != "default") continue;
    RUBATO_ASSIGN_OR_RETURN(const nlohmann::json* text, reader.Field(entry, "template", path));
    RUBATO_ASSIGN_OR_RETURN(std::string template_text,
                            reader.String(*text, JsonPathJoin(path, "template")));
    return std::optional<std::string>(std::move(template_text));
  }
  return std::optional<std::string>();
}

}  // namespace

Result<TokenizerConfig> TokenizerConfig::FromJson(std::string_view text, const JsonReader& reader) {
  TokenizerConfig config;
  if (text.empty()) return config;
  config.present = true;
  RUBATO_ASSIGN_OR_RETURN(nlohmann::json json, reader.Parse(text));
  RUBATO_RETURN_IF_ERROR(reader.ExpectObject(json, ""));
  RUBATO_ASSIGN_OR_RETURN(config.chat_template, ReadChatTemplate(json, reader));
  RUBATO_ASSIGN_OR_RETURN(config.bos_token, ReadTokenField(json, "bos_token", reader));
  RUBATO_ASSIGN_OR_RETURN(config.eos_token, ReadTokenField(json, "eos_token", reader));
  return config;
}

}  // namespace rubato
