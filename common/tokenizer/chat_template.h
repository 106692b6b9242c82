// Chat prompts without a Jinja engine: the chat_template of tokenizer_config.json is recognised
// by its markers and rendered by a built-in formatter that reproduces it exactly.
//
// ChatML (template contains "<|im_start|>"; Qwen2/2.5/3), following the Qwen3 template:
//   [system first]  <|im_start|>system\n{content}<|im_end|>\n
//                   (if there is no system message and the template has a default system
//                    prompt literal, as Qwen2.5's "You are Qwen, ...", that one is used)
//   user, system    <|im_start|>{role}\n{content}<|im_end|>\n
//   assistant       <|im_start|>assistant\n{content}<|im_end|>\n ; when the template handles
//                   "</think>" (Qwen3): reasoning "<think>..</think>" is cut out of the content;
//                   for assistant turns after the last user query that are the last message or
//                   carry reasoning, it is written back as
//                   <think>\n{reasoning}\n</think>\n\n{content}
//   tool            <|im_start|>user\n<tool_response>\n{content}\n</tool_response><|im_end|>\n
//                   (consecutive tool messages share one user turn)
//   generation      <|im_start|>assistant\n, plus <think>\n\n</think>\n\n when enable_thinking is
//                   false and the template knows enable_thinking (Qwen3 non-thinking mode).
//   Other roles are an error (the template would drop them silently). Tools are not rendered.
// Llama-3 (template contains "<|start_header_id|>"), following Meta-Llama-3 Instruct:
//   {bos_token on the first message}<|start_header_id|>{role}<|end_header_id|>\n\n
//   {content stripped of surrounding white space}<|eot_id|>   per message, then
//   <|start_header_id|>assistant<|end_header_id|>\n\n   when add_generation_prompt, or always
//   when the template text does not mention add_generation_prompt (the original release).
//   Llama 3.1+ templates (tool calls, "Cutting Knowledge Date" system header) are rendered in
//   this plain Llama-3 form; a warning says so at load.
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
