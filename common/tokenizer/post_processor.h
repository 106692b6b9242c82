// The `post_processor` section of tokenizer.json, for single sequences: what Encode adds around
// the ids when add_special_tokens is true. Supported:
//   * ByteLevel          (changes offsets only, so nothing here),
//   * TemplateProcessing ("single" template of SpecialToken and Sequence "A" items; the official
//                         Llama-3 tokenizer.json uses it to prepend <|begin_of_text|>),
//   * Sequence           of the above.
// Other types (BertProcessing, RobertaProcessing, ...) are rejected at load, naming the type.
#pragma once

#include <nlohmann/json.hpp>
#include <string_view>
#include <vector>

#include "common/status.h"
#include "common/tokenizer/json_reader.h"

namespace rubato {

class PostProcessor {
 public:
  // `spec` may be nullptr (JSON null or absent): nothing is ever added.
  static Result<PostProcessor> FromJson(const nlohmann::json* spec, const JsonReader& reader,
                                        std::string_view path);

  // The final ids of one sequence; returns `ids` unchanged when !add_special_tokens.
  std::vector<int> Apply(std::vector<int> ids, bool add_special_tokens) const;

 private:
  // A "single" template: ids to insert, with the sequence itself at the slots marked kSequence.
  struct TemplateItem {
    bool is_sequence;
    std::vector<int> special_ids;  // when !is_sequence
  };
  using Template = std::vector<TemplateItem>;

  static Status AppendTemplates(const nlohmann::json& spec, const JsonReader& reader,
                                std::string_view path, std::vector<Template>* templates);
  static Result<Template> ParseTemplate(const nlohmann::json& spec, const JsonReader& reader,
                                        std::string_view path);

  std::vector<Template> templates_;  // applied in order
};

}  // namespace rubato
