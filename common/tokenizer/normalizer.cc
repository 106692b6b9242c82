// tokenizer.json normalizers (NFC via utf8proc, Sequence).
#include "common/tokenizer/normalizer.h"

#include <fmt/format.h>
#include <utf8proc.h>

#include <cstdlib>

namespace rubato {

std::string NfcNormalize(std::string_view text) {
  // Pure ASCII is already in NFC; this skips utf8proc for most text.
  bool ascii = true;
  for (const char c : text) {
    if (static_cast<unsigned char>(c) >= 0x80) {
      ascii = false;
      break;
    }
  }
  if (ascii) return std::string(text);
  utf8proc_uint8_t* output = nullptr;
  // No UTF8PROC_NULLTERM: the length is explicit, so NUL bytes inside the text are kept.
  const utf8proc_ssize_t length =
      utf8proc_map(reinterpret_cast<const utf8proc_uint8_t*>(text.data()),
                   static_cast<utf8proc_ssize_t>(text.size()), &output,
                   static_cast<utf8proc_option_t>(UTF8PROC_STABLE | UTF8PROC_COMPOSE));
  if (length < 0) {
    // Only possible for invalid UTF-8 or out of memory; the tokenizer never passes invalid
    // UTF-8, and leaving the text as it is keeps Encode total.
    std::free(output);
    return std::string(text);
  }
  std::string result(reinterpret_cast<const char*>(output), static_cast<size_t>(length));
  std::free(output);
  return result;
}

Status Normalizer::AppendSteps(const nlohmann::json& spec, const JsonReader& reader,
                               std::string_view path, std::vector<Step>* steps) {
  RUBATO_ASSIGN_OR_RETURN(const nlohmann::json* type_field, reader.Field(spec, "type", path));
  RUBATO_ASSIGN_OR_RETURN(std::string type, reader.String(*type_field, JsonPathJoin(path, "type")));
  if (type == "NFC") {
    steps->push_back(Step::kNfc);
    return Status::Ok();
  }
  if (type == "Sequence") {
    const std::string list_path = JsonPathJoin(path, "normalizers");
    RUBATO_ASSIGN_OR_RETURN(const nlohmann::json* list, reader.Field(spec, "normalizers", path));
    RUBATO_RETURN_IF_ERROR(reader.ExpectArray(*list, list_path));
    for (size_t i = 0; i < list->size(); ++i) {
      RUBATO_RETURN_IF_ERROR(AppendSteps((*list)[i], reader, JsonPathIndex(list_path, i), steps));
    }
    return Status::Ok();
  }
  return reader.Error(StatusCode::kUnsupported, path,
                      fmt::format("normalizer type '{}' is not supported (rubato supports NFC "
                                  "and Sequence)",
                                  type));
}

Result<Normalizer> Normalizer::FromJson(const nlohmann::json* spec, const JsonReader& reader,
                                        std::string_view path) {
  Normalizer normalizer;
  if (spec == nullptr || spec->is_null()) return normalizer;
  RUBATO_RETURN_IF_ERROR(AppendSteps(*spec, reader, path, &normalizer.steps_));
  return normalizer;
}

std::string Normalizer::Apply(std::string_view text) const {
  std::string current(text);
  for (const Step step : steps_) {
    switch (step) {
      case Step::kNfc:
        current = NfcNormalize(current);
        break;
    }
  }
  return current;
}

}  // namespace rubato
