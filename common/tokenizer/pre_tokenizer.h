// The `pre_tokenizer` section of tokenizer.json: cuts normalized text into the words that BPE
// encodes independently. Supported, with Hugging Face semantics:
//   * Split     {pattern: {Regex: ...} | {String: ...}, behavior, invert}; behaviors Isolated,
//               Removed, Contiguous, MergedWithPrevious, MergedWithNext.
//   * ByteLevel {add_prefix_space, use_regex}: optional leading space, optional GPT-2 regex split,
//               then every byte becomes its byte-level code point (see byte_level.h).
//   * Sequence  of the above, applied in order to every piece.
// Other types are rejected at load with an Unsupported error naming the type.
#pragma once

#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <string_view>
#include <variant>
#include <vector>

#include "common/status.h"
#include "common/tokenizer/json_reader.h"
#include "common/tokenizer/unicode_regex.h"

namespace rubato {

// How a Split pre-tokenizer treats the pieces its pattern matches (HF SplitDelimiterBehavior).
enum class SplitBehavior { kIsolated, kRemoved, kContiguous, kMergedWithPrevious, kMergedWithNext };

class PreTokenizer {
 public:
  // `spec` may be nullptr (JSON null or absent): the whole text is one word.
  static Result<PreTokenizer> FromJson(const nlohmann::json* spec, const JsonReader& reader,
                                       std::string_view path);

  // Appends the non-empty words of `text` (valid UTF-8) to `words`.
  void Split(std::string_view text, std::vector<std::string>* words) const;

 private:
  struct SplitStep {
    UnicodeRegex regex;
    SplitBehavior behavior;
    bool invert;
  };
  struct ByteLevelStep {
    bool add_prefix_space;
    std::optional<UnicodeRegex> gpt2_regex;  // set when use_regex is true
  };
  using Step = std::variant<SplitStep, ByteLevelStep>;

  static Status AppendSteps(const nlohmann::json& spec, const JsonReader& reader,
                            std::string_view path, std::vector<Step>* steps);
  static Result<SplitStep> ParseSplit(const nlohmann::json& spec, const JsonReader& reader,
                                      std::string_view path);
  static Result<ByteLevelStep> ParseByteLevel(const nlohmann::json& spec, const JsonReader& reader,
                                              std::string_view path);
  static void ApplySplit(const SplitStep& step, std::string_view piece,
                         std::vector<std::string>* out);
  static void ApplyByteLevel(const ByteLevelStep& step, std::string_view piece,
                             std::vector<std::string>* out);

  std::vector<Step> steps_;
};

// The regex GPT-2 (and ByteLevel with use_regex) splits text with.
inline constexpr std::string_view kGpt2SplitPattern =
    R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";

}  // namespace rubato
