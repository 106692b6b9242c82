// The parts of Hugging Face tokenizer_config.json that rubato uses: the chat template text and
// the bos/eos token strings. Token fields may be a string, null, or an AddedToken object
// {"content": "...", ...}. chat_template may be a string or a list of {name, template}; from a
// list the entry named "default" is used (none: no template).
#pragma once

#include <optional>
#include <string>
#include <string_view>

#include "common/status.h"
#include "common/tokenizer/json_reader.h"

namespace rubato {

struct TokenizerConfig {
  bool present = false;  // false when there was no tokenizer_config.json
  std::optional<std::string> chat_template;
  std::optional<std::string> bos_token;
  std::optional<std::string> eos_token;

  // `text` is the file content; empty text means the file does not exist.
  static Result<TokenizerConfig> FromJson(std::string_view text, const JsonReader& reader);
};

}  // namespace rubato
