// Built-in ChatML and Llama-3 chat formatters (chat_template.h; the exact rendering:
// docs/common.md "Chat templates").
#include "common/tokenizer/chat_template.h"

#include <fmt/format.h>

#include "common/logging.h"
#include "common/tokenizer/utf8_text.h"

namespace rubato {

namespace {

constexpr std::string_view kChatMlMarker = "<|im_start|>";
constexpr std::string_view kLlama3Marker = "<|start_header_id|>";

bool IsPythonSpace(char32_t cp) {
  return (cp >= 0x9 && cp <= 0xD) || (cp >= 0x1C && cp <= 0x20) || cp == 0x85 || cp == 0xA0 ||
         cp == 0x1680 || (cp >= 0x2000 && cp <= 0x200A) || cp == 0x2028 || cp == 0x2029 ||
         cp == 0x202F || cp == 0x205F || cp == 0x3000;
}

std::string_view StripChar(std::string_view text, char c, bool left, bool right) {
  while (left && !text.empty() && text.front() == c) text.remove_prefix(1);
  while (right && !text.empty() && text.back() == c) text.remove_suffix(1);
  return text;
}

bool Contains(std::string_view text, std::string_view part) {
  return text.find(part) != std::string_view::npos;
}

// Python text.split(separator)[0] and [-1].
std::string_view BeforeFirst(std::string_view text, std::string_view separator) {
  const size_t pos = text.find(separator);
  return pos == std::string_view::npos ? text : text.substr(0, pos);
}
std::string_view AfterLast(std::string_view text, std::string_view separator) {
  const size_t pos = text.rfind(separator);
  return pos == std::string_view::npos ? text : text.substr(pos + separator.size());
}

// A default system prompt written as a literal in a ChatML template, e.g. Qwen2.5's
//   '<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. ...<|im_end|>\n'
// Returns the prompt with Jinja string escapes (\n, \', \", \\) resolved.
std::optional<std::string> FindDefaultSystemPrompt(std::string_view text) {
  constexpr std::string_view kOpen = "<|im_start|>system\\n";
  constexpr std::string_view kClose = "<|im_end|>";
  for (size_t pos = text.find(kOpen); pos != std::string_view::npos;
       pos = text.find(kOpen, pos + 1)) {
    const size_t body = pos + kOpen.size();
    const size_t close = text.find(kClose, body);
    if (close == std::string_view::npos) break;
    const std::string_view literal = text.substr(body, close - body);
    // The literal must be plain text: no end of the Jinja string in between.
    if (literal.empty() || Contains(literal, "' +") || Contains(literal, "\" +") ||
        Contains(literal, "{{") || Contains(literal, "'}") || Contains(literal, "' }")) {
      continue;
    }
    std::string prompt;
    for (size_t i = 0; i < literal.size(); ++i) {
      if (literal[i] == '\\' && i + 1 < literal.size()) {
        const char next = literal[++i];
        prompt.push_back(next == 'n' ? '\n' : next == 't' ? '\t' : next);
      } else {
        prompt.push_back(literal[i]);
      }
    }
    return prompt;
  }
  return std::nullopt;
}

}  // namespace

std::string StripPythonWhitespace(std::string_view text) {
  size_t begin = 0;
  while (begin < text.size()) {
    const size_t length = Utf8SequenceLength(static_cast<uint8_t>(text[begin]));
    if (!IsPythonSpace(DecodeUtf8CodePoint(text.substr(begin)))) break;
    begin += length;
  }
  size_t end = text.size();
  while (end > begin) {
    size_t start = end - 1;
    while (start > begin && (static_cast<uint8_t>(text[start]) & 0xC0) == 0x80) --start;
    if (!IsPythonSpace(DecodeUtf8CodePoint(text.substr(start)))) break;
    end = start;
  }
  return std::string(text.substr(begin, end - begin));
}

ChatTemplate::ChatTemplate(const TokenizerConfig& config, std::string config_file)
    : bos_token_(config.bos_token.value_or("")),
      config_file_(std::move(config_file)),
      config_present_(config.present) {
  if (!config.chat_template.has_value()) {
    kind_ = ChatTemplateKind::kNone;
    return;
  }
  const std::string& text = *config.chat_template;
  if (Contains(text, kChatMlMarker)) {
    kind_ = ChatTemplateKind::kChatMl;
    default_system_prompt_ = FindDefaultSystemPrompt(text);
    handles_think_ = Contains(text, "</think>");
    knows_enable_thinking_ = Contains(text, "enable_thinking");
  } else if (Contains(text, kLlama3Marker)) {
    kind_ = ChatTemplateKind::kLlama3;
    generation_prompt_always_ = !Contains(text, "add_generation_prompt");
    if (Contains(text, "Cutting Knowledge Date")) {
      RUBATO_LOG_WARN("tokenizer",
                      "{}: this looks like a Llama 3.1+ chat template; rubato renders the plain "
                      "Llama-3 format (no date system header, no tools)",
                      config_file_);
    }
  } else {
    kind_ = ChatTemplateKind::kUnrecognized;
  }
}

Result<std::string> ChatTemplate::Render(std::span<const ChatMessage> messages,
                                         bool add_generation_prompt, bool enable_thinking) const {
  switch (kind_) {
    case ChatTemplateKind::kChatMl:
      return RenderChatMl(messages, add_generation_prompt, enable_thinking);
    case ChatTemplateKind::kLlama3:
      return RenderLlama3(messages, add_generation_prompt);
    case ChatTemplateKind::kUnrecognized:
      return UnsupportedError(fmt::format(
          "{}: chat template not recognised (rubato knows ChatML and Llama-3); use a raw prompt",
          config_file_));
    case ChatTemplateKind::kNone:
      break;
  }
  if (!config_present_) {
    return FailedPreconditionError(fmt::format(
        "{} does not exist, so there is no chat template; use a raw prompt", config_file_));
  }
  return FailedPreconditionError(
      fmt::format("{} has no chat_template; use a raw prompt", config_file_));
}

Result<std::string> ChatTemplate::RenderChatMl(std::span<const ChatMessage> messages,
                                               bool add_generation_prompt,
                                               bool enable_thinking) const {
  for (size_t i = 0; i < messages.size(); ++i) {
    const std::string& role = messages[i].role;
    if (role != "system" && role != "user" && role != "assistant" && role != "tool") {
      return InvalidArgumentError(fmt::format(
          "chat message {} has role '{}'; the ChatML template of {} knows system, user, "
          "assistant and tool",
          i, role, config_file_));
    }
  }
  std::string out;
  const bool first_is_system = !messages.empty() && messages[0].role == "system";
  if (first_is_system) {
    out += fmt::format("<|im_start|>system\n{}<|im_end|>\n", messages[0].content);
  } else if (default_system_prompt_.has_value()) {
    out += fmt::format("<|im_start|>system\n{}<|im_end|>\n", *default_system_prompt_);
  }

  // Index of the last real user query (tool results sent as user messages do not count).
  int last_query_index = static_cast<int>(messages.size()) - 1;
  for (int i = static_cast<int>(messages.size()) - 1; i >= 0; --i) {
    const std::string& content = messages[i].content;
    const bool tool_response =
        content.starts_with("<tool_response>") && content.ends_with("</tool_response>");
    if (messages[i].role == "user" && !tool_response) {
      last_query_index = i;
      break;
    }
  }

  for (size_t i = 0; i < messages.size(); ++i) {
    const ChatMessage& message = messages[i];
    const bool is_last = i + 1 == messages.size();
    if (message.role == "user" || (message.role == "system" && i != 0)) {
      out += fmt::format("<|im_start|>{}\n{}<|im_end|>\n", message.role, message.content);
    } else if (message.role == "assistant") {
      std::string_view content = message.content;
      std::string_view reasoning;
      if (handles_think_ && Contains(content, "</think>")) {
        reasoning = StripChar(
            AfterLast(StripChar(BeforeFirst(content, "</think>"), '\n', false, true), "<think>"),
            '\n', true, false);
        content = StripChar(AfterLast(content, "</think>"), '\n', true, false);
      }
      const bool after_last_query = static_cast<int>(i) > last_query_index;
      if (handles_think_ && after_last_query && (is_last || !reasoning.empty())) {
        out += fmt::format("<|im_start|>assistant\n<think>\n{}\n</think>\n\n{}",
                           StripChar(reasoning, '\n', true, true),
                           StripChar(content, '\n', true, false));
      } else {
        out += fmt::format("<|im_start|>assistant\n{}", content);
      }
      out += "<|im_end|>\n";
    } else if (message.role == "tool") {
      if (i == 0 || messages[i - 1].role != "tool") out += "<|im_start|>user";
      out += fmt::format("\n<tool_response>\n{}\n</tool_response>", message.content);
      if (is_last || messages[i + 1].role != "tool") out += "<|im_end|>\n";
    }
  }
  if (add_generation_prompt) {
    out += "<|im_start|>assistant\n";
    if (knows_enable_thinking_ && !enable_thinking) out += "<think>\n\n</think>\n\n";
  }
  return out;
}

std::string ChatTemplate::RenderLlama3(std::span<const ChatMessage> messages,
                                       bool add_generation_prompt) const {
  std::string out;
  for (size_t i = 0; i < messages.size(); ++i) {
    if (i == 0) out += bos_token_;
    out += fmt::format("<|start_header_id|>{}<|end_header_id|>\n\n{}<|eot_id|>", messages[i].role,
                       StripPythonWhitespace(messages[i].content));
  }
  if (add_generation_prompt || generation_prompt_always_) {
    out += "<|start_header_id|>assistant<|end_header_id|>\n\n";
  }
  return out;
}

}  // namespace rubato
