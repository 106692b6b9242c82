// Pre-tokenization: the Qwen / Llama-3 split regexes through PCRE2 (Oniguruma semantics), the
// ByteLevel step, Split behaviors and load errors.
#include "common/tokenizer/pre_tokenizer.h"

#include <gtest/gtest.h>

#include <string>
#include <vector>

namespace rubato {
namespace {

using Words = std::vector<std::string>;

constexpr const char* kQwenRegex =
    R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N})"
    R"(| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";
constexpr const char* kLlamaRegex =
    R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3})"
    R"(| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";

Result<PreTokenizer> Load(const nlohmann::json& spec) {
  return PreTokenizer::FromJson(&spec, JsonReader("tokenizer.json"), "pre_tokenizer");
}

nlohmann::json SplitSpec(const std::string& regex, const std::string& behavior = "Isolated",
                         bool invert = false) {
  return {{"type", "Split"},
          {"pattern", {{"Regex", regex}}},
          {"behavior", behavior},
          {"invert", invert}};
}

Words SplitWith(const nlohmann::json& spec, const std::string& text) {
  Result<PreTokenizer> pre = Load(spec);
  EXPECT_TRUE(pre.ok()) << pre.status().ToString();
  Words words;
  if (pre.ok()) pre->Split(text, &words);
  return words;
}

TEST(PreTokenizerTest, QwenRegexWordsAndContractions) {
  const nlohmann::json spec = SplitSpec(kQwenRegex);
  EXPECT_EQ(SplitWith(spec, "Hello world"), (Words{"Hello", " world"}));
  EXPECT_EQ(SplitWith(spec, "I'LL don't"), (Words{"I", "'LL", " don", "'t"}));
  EXPECT_EQ(SplitWith(spec, "You'Re"), (Words{"You", "'Re"}));
  // Case-insensitive with Unicode case folding: the long s folds to 's'.
  EXPECT_EQ(SplitWith(spec, "x'\u017F"), (Words{"x", "'\u017F"}));
}

TEST(PreTokenizerTest, QwenRegexWhitespaceRuns) {
  const nlohmann::json spec = SplitSpec(kQwenRegex);
  // \s+(?!\S) leaves the last space to the next word.
  EXPECT_EQ(SplitWith(spec, "a   b"), (Words{"a", "  ", " b"}));
  EXPECT_EQ(SplitWith(spec, "trailing  "), (Words{"trailing", "  "}));
  EXPECT_EQ(SplitWith(spec, "x\n\n  y"), (Words{"x", "\n\n", " ", " y"}));
  EXPECT_EQ(SplitWith(spec, "a\r\n\r\nb"), (Words{"a", "\r\n\r\n", "b"}));
  EXPECT_EQ(SplitWith(spec, "a \t\nb"), (Words{"a", " \t\n", "b"}));
  EXPECT_EQ(SplitWith(spec, "x!!\n\ny"), (Words{"x", "!!\n\n", "y"}));
  // U+0085 is white space for Oniguruma (and Rust); U+FEFF and U+180E are not.
  EXPECT_EQ(SplitWith(spec, "a \u0085b"), (Words{"a", " ", "\u0085b"}));
  EXPECT_EQ(SplitWith(spec, "x \uFEFFy"), (Words{"x", " \uFEFF", "y"}));
  EXPECT_EQ(SplitWith(spec, "a\u180E b"), (Words{"a", "\u180E", " b"}));
}

TEST(PreTokenizerTest, DigitGroupsDifferBetweenQwenAndLlama) {
  EXPECT_EQ(SplitWith(SplitSpec(kQwenRegex), "12345"), (Words{"1", "2", "3", "4", "5"}));
  EXPECT_EQ(SplitWith(SplitSpec(kLlamaRegex), "12345"), (Words{"123", "45"}));
  EXPECT_EQ(SplitWith(SplitSpec(kLlamaRegex), "x١٢٣٤"), (Words{"x", "١٢٣", "٤"}));
}

TEST(PreTokenizerTest, ByteLevelMapsBytesAndOptionallySplits) {
  const nlohmann::json plain = {
      {"type", "ByteLevel"}, {"add_prefix_space", false}, {"use_regex", false}};
  EXPECT_EQ(SplitWith(plain, "Hello world\n"), (Words{"HelloĠworldĊ"}));
  const nlohmann::json gpt2 = {
      {"type", "ByteLevel"}, {"add_prefix_space", true}, {"use_regex", true}};
  EXPECT_EQ(SplitWith(gpt2, "Hello world's 42"), (Words{"ĠHello", "Ġworld", "'s", "Ġ42"}));
  EXPECT_EQ(SplitWith(gpt2, "é"), (Words{"ĠÃ©"}));
  // Sequence: the prefix space is added to every piece the Split produced.
  const nlohmann::json sequence = {
      {"type", "Sequence"},
      {"pretokenizers",
       nlohmann::json::array(
           {SplitSpec(" ", "Removed"),
            {{"type", "ByteLevel"}, {"add_prefix_space", true}, {"use_regex", false}}})}};
  EXPECT_EQ(SplitWith(sequence, "a b"), (Words{"Ġa", "Ġb"}));
}

TEST(PreTokenizerTest, SplitBehaviors) {
  auto literal = [](const std::string& behavior, bool invert = false) {
    return nlohmann::json{{"type", "Split"},
                          {"pattern", {{"String", " "}}},
                          {"behavior", behavior},
                          {"invert", invert}};
  };
  const std::string text = "a b  c";
  EXPECT_EQ(SplitWith(literal("Isolated"), text), (Words{"a", " ", "b", " ", " ", "c"}));
  EXPECT_EQ(SplitWith(literal("Removed"), text), (Words{"a", "b", "c"}));
  EXPECT_EQ(SplitWith(literal("Contiguous"), text), (Words{"a", " ", "b", "  ", "c"}));
  EXPECT_EQ(SplitWith(literal("MergedWithPrevious"), text), (Words{"a ", "b ", " ", "c"}));
  EXPECT_EQ(SplitWith(literal("MergedWithNext"), text), (Words{"a", " b", " ", " c"}));
  EXPECT_EQ(SplitWith(literal("Removed", /*invert=*/true), text), (Words{" ", " ", " "}));
  // A literal pattern is not a regex.
  const nlohmann::json dot = {
      {"type", "Split"}, {"pattern", {{"String", "."}}}, {"behavior", "Removed"}};
  EXPECT_EQ(SplitWith(dot, "a.b-c"), (Words{"a", "b-c"}));
}

TEST(PreTokenizerTest, NullPreTokenizerKeepsTheText) {
  Result<PreTokenizer> pre = PreTokenizer::FromJson(nullptr, JsonReader("t.json"), "p");
  ASSERT_TRUE(pre.ok());
  Words words;
  pre->Split("a b", &words);
  pre->Split("", &words);
  EXPECT_EQ(words, (Words{"a b"}));
}

TEST(PreTokenizerTest, TranslatesOnigurumaWhitespace) {
  const std::string set = TranslateOnigurumaWhitespace("\\s");
  EXPECT_EQ(set.front(), '[');
  EXPECT_NE(set.find("\\x{85}"), std::string::npos);
  EXPECT_EQ(set.find("\\x{180E}"), std::string::npos);
  // Inside a class the set is spliced in; an escaped backslash followed by 's' is left alone.
  const std::string in_class = TranslateOnigurumaWhitespace("[^\\s\\p{L}]");
  EXPECT_EQ(in_class.rfind("[^\\x{9}", 0), 0u) << in_class;
  EXPECT_EQ(TranslateOnigurumaWhitespace("\\\\s"), "\\\\s");
  EXPECT_EQ(TranslateOnigurumaWhitespace("[]\\s]").find("[]\\x{9}"), 0u);
  EXPECT_EQ(TranslateOnigurumaWhitespace("\\S").rfind("[^", 0), 0u);
}

TEST(PreTokenizerTest, ErrorsNameTheProblem) {
  Result<PreTokenizer> bad_regex = Load(SplitSpec("(unclosed"));
  ASSERT_FALSE(bad_regex.ok());
  EXPECT_NE(bad_regex.status().message().find("tokenizer.json: pre_tokenizer.pattern: regex "
                                              "'(unclosed' does not compile"),
            std::string::npos)
      << bad_regex.status().message();

  Result<PreTokenizer> unknown_type = Load({{"type", "Whitespace"}});
  ASSERT_FALSE(unknown_type.ok());
  EXPECT_EQ(unknown_type.status().code(), StatusCode::kUnsupported);
  EXPECT_NE(unknown_type.status().message().find("'Whitespace'"), std::string::npos);

  Result<PreTokenizer> bad_behavior = Load(SplitSpec("a", "Sideways"));
  ASSERT_FALSE(bad_behavior.ok());
  EXPECT_NE(bad_behavior.status().message().find("pre_tokenizer.behavior: Split behavior "
                                                 "'Sideways'"),
            std::string::npos)
      << bad_behavior.status().message();

  Result<PreTokenizer> nested = Load(
      {{"type", "Sequence"},
       {"pretokenizers", nlohmann::json::array({{{"type", "Split"}, {"behavior", "Isolated"}}})}});
  ASSERT_FALSE(nested.ok());
  EXPECT_EQ(nested.status().message(),
            "tokenizer.json: pre_tokenizer.pretokenizers[0]: missing field 'pattern'");
}

}  // namespace
}  // namespace rubato
