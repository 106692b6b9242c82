// Chat prompts without a Jinja engine: the chat_template of tokenizer_config.json is recognised by
// its markers (ChatML as Qwen3's template; Llama-3 Instruct) and rendered by a built-in formatter
// that reproduces it exactly. Unknown roles are an error; tools are not rendered.
// What each form renders: docs/common.md "Chat templates".
#pragma once

#include <optional>
#include <span>
#include <string>

#include "common/status.h"
#include "common/tokenizer/tokenizer_config.h"

namespace rubato {

struct ChatMessage {
  std::string role;  // "system", "user", "assistant", "tool"
  std::string content;
};

enum class ChatTemplateKind {
  kNone,          // no chat_template (or no tokenizer_config.json)
  kChatMl,        // <|im_start|> ... <|im_end|>
  kLlama3,        // <|start_header_id|> ... <|eot_id|>
  kUnrecognized,  // a template rubato has no formatter for
};

class ChatTemplate {
 public:
  ChatTemplate() = default;
  // From the parsed tokenizer_config.json; `config_file` names the file in errors.
  ChatTemplate(const TokenizerConfig& config, std::string config_file);

  ChatTemplateKind kind() const { return kind_; }

  // The prompt text for `messages` (special tokens appear as text; Encode turns them into ids).
  Result<std::string> Render(std::span<const ChatMessage> messages, bool add_generation_prompt,
                             bool enable_thinking) const;

 private:
  Result<std::string> RenderChatMl(std::span<const ChatMessage> messages,
                                   bool add_generation_prompt, bool enable_thinking) const;
  std::string RenderLlama3(std::span<const ChatMessage> messages, bool add_generation_prompt) const;

  ChatTemplateKind kind_ = ChatTemplateKind::kNone;
  std::string bos_token_;
  std::string config_file_ = "tokenizer_config.json";
  bool config_present_ = false;
  std::optional<std::string> default_system_prompt_;  // ChatML: used when no system message
  bool handles_think_ = false;                        // ChatML: template processes </think> (Qwen3)
  bool knows_enable_thinking_ = false;                // ChatML: template reads enable_thinking
  bool generation_prompt_always_ = false;  // Llama-3: template ignores add_generation_prompt
};

// Python's str.strip() (Jinja's `trim`): removes leading/trailing characters for which
// str.isspace() is true.
std::string StripPythonWhitespace(std::string_view text);

}  // namespace rubato
