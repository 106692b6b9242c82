// The `normalizer` section of tokenizer.json: null, "NFC", or a "Sequence" of those. NFC comes
// from utf8proc. Any other normalizer type is rejected at load with an Unsupported error that
// names it, so that a tokenizer rubato cannot reproduce never loads silently.
#pragma once

#include <nlohmann/json.hpp>
#include <string>
#include <string_view>
#include <vector>

#include "common/status.h"
#include "common/tokenizer/json_reader.h"

namespace rubato {

class Normalizer {
 public:
  // `spec` may be nullptr (JSON null or absent): no normalization.
  static Result<Normalizer> FromJson(const nlohmann::json* spec, const JsonReader& reader,
                                     std::string_view path);

  bool empty() const { return steps_.empty(); }
  // `text` must be valid UTF-8.
  std::string Apply(std::string_view text) const;

 private:
  enum class Step { kNfc };
  static Status AppendSteps(const nlohmann::json& spec, const JsonReader& reader,
                            std::string_view path, std::vector<Step>* steps);

  std::vector<Step> steps_;
};

// Unicode NFC of valid UTF-8 `text` (utf8proc).
std::string NfcNormalize(std::string_view text);

}  // namespace rubato
