// rubato's Hugging Face tokenizer: loads tokenizer.json (+ tokenizer_config.json) of byte-level
// BPE models (Qwen2/2.5/3, Llama-3, GPT-2 style) and encodes / decodes exactly as the Rust
// `tokenizers` library does. Encode never fails (invalid UTF-8 is repaired first); Decode skips
// unknown ids and replaces invalid UTF-8 by U+FFFD. Immutable after loading, safe to use from
// several threads. Pipeline and decisions: docs/common.md "The tokenizer".
#pragma once

#include <cstdint>
#include <filesystem>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "common/status.h"
#include "common/tokenizer/added_vocabulary.h"
#include "common/tokenizer/bpe_model.h"
#include "common/tokenizer/chat_template.h"
#include "common/tokenizer/normalizer.h"
#include "common/tokenizer/post_processor.h"
#include "common/tokenizer/pre_tokenizer.h"

namespace rubato {

class Tokenizer {
 public:
  // Reads `dir`/tokenizer.json and, when present, `dir`/tokenizer_config.json.
  static Result<std::unique_ptr<Tokenizer>> LoadFromDirectory(const std::filesystem::path& dir);
  // From file contents. `tokenizer_config_json` may be empty (no config file). `source` is
  // where they came from (a directory); errors read "{source}/tokenizer.json: ...".
  static Result<std::unique_ptr<Tokenizer>> LoadFromJson(std::string_view tokenizer_json,
                                                         std::string_view tokenizer_config_json,
                                                         const std::string& source);

  // Token ids of `text`. With add_special_tokens the post-processor's template is applied
  // (e.g. a BOS token); special tokens written in the text are always recognised.
  std::vector<int> Encode(std::string_view text, bool add_special_tokens = false) const;
  // Text of `ids`; skip_special_tokens drops added tokens marked special.
  std::string Decode(std::span<const int> ids, bool skip_special_tokens = false) const;

  int vocab_size() const { return vocab_size_; }
  std::optional<int> TokenToId(std::string_view token) const;
  // The token string of `id` (byte-level form for vocab tokens); "" when the id is unknown.
  std::string IdToToken(int id) const;
  bool IsSpecialToken(int id) const;

  // bos_token / eos_token of tokenizer_config.json, when present and known to the vocabulary.
  std::optional<int> bos_token_id() const { return bos_token_id_; }
  std::optional<int> eos_token_id() const { return eos_token_id_; }

  ChatTemplateKind chat_template_kind() const { return chat_template_.kind(); }
  // The prompt text for a conversation (the exact formats: docs/common.md "Chat templates").
  // Errors when there is no chat template or it is not one rubato knows; raw prompts need no
  // template.
  // enable_thinking=false asks Qwen3 for its non-thinking mode.
  Result<std::string> ApplyChatTemplate(std::span<const ChatMessage> messages,
                                        bool add_generation_prompt = true,
                                        bool enable_thinking = true) const {
    return chat_template_.Render(messages, add_generation_prompt, enable_thinking);
  }

 private:
  friend class StreamDecoder;
  Tokenizer() = default;

  Status Build(std::string_view tokenizer_json, std::string_view tokenizer_config_json,
               const std::string& source);
  Status CheckDecoder(const nlohmann::json* decoder, const JsonReader& reader) const;
  void BuildDecodeTable();
  // Appends the ids of text that contains no non-normalized added token.
  void EncodePlainText(std::string_view text, std::vector<int>* ids) const;
  // Appends the bytes `id` decodes to (nothing for unknown ids, or skipped special tokens).
  void AppendTokenBytes(int id, bool skip_special_tokens, std::string* bytes) const;

  std::unique_ptr<BpeModel> model_;
  Normalizer normalizer_;
  PreTokenizer pre_tokenizer_;
  AddedVocabulary added_vocabulary_;
  PostProcessor post_processor_;
  ChatTemplate chat_template_;
  int vocab_size_ = 0;
  std::optional<int> bos_token_id_;
  std::optional<int> eos_token_id_;

  // Decoding table, [id] -> bytes the id stands for, and what kind of id it is.
  enum class IdKind : uint8_t { kUnknown, kVocab, kAdded, kSpecial };
  std::vector<std::string> decoded_bytes_;
  std::vector<IdKind> id_kinds_;
};

}  // namespace rubato
