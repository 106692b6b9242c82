// The whole tokenizer on the small fixture tests/data/tokenizer/tiny_bpe (byte-level BPE with an
// NFC normalizer, the Qwen split regex, added tokens with every flag, a BOS template), plus
// malformed tokenizer.json files.
#include "common/tokenizer/tokenizer.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <random>
#include <string>
#include <vector>

#include "common/text_file.h"
#include "common/tokenizer/normalizer.h"
#include "common/tokenizer/utf8_text.h"

namespace rubato {
namespace {

constexpr const char* kTinyDir = "tests/data/tokenizer/tiny_bpe";

class TinyTokenizerTest : public ::testing::Test {
 protected:
  void SetUp() override {
    Result<std::unique_ptr<Tokenizer>> loaded = Tokenizer::LoadFromDirectory(kTinyDir);
    ASSERT_TRUE(loaded.ok()) << loaded.status().ToString();
    tokenizer_ = std::move(loaded).value();
  }
  int Id(const std::string& token) const {
    const std::optional<int> id = tokenizer_->TokenToId(token);
    EXPECT_TRUE(id.has_value()) << "no token '" << token << "'";
    return id.value_or(-1);
  }
  std::vector<int> Ids(const std::vector<std::string>& tokens) const {
    std::vector<int> ids;
    for (const std::string& token : tokens) ids.push_back(Id(token));
    return ids;
  }
  std::unique_ptr<Tokenizer> tokenizer_;
};

TEST_F(TinyTokenizerTest, EncodesWithMergesAndSplitRegex) {
  EXPECT_EQ(tokenizer_->Encode("the"), Ids({"the"}));
  EXPECT_EQ(tokenizer_->Encode(" the cat"), Ids({"Ġthe", "Ġcat"}));
  EXPECT_EQ(tokenizer_->Encode("hello and"), Ids({"hello", "Ġand"}));
  // "Ġ t" has the lowest rank but the regex keeps the space with the word.
  EXPECT_EQ(tokenizer_->Encode("a  the"), Ids({"a", "Ġ", "Ġthe"}));
  EXPECT_EQ(tokenizer_->Encode("12"), Ids({"1", "2"}));
  EXPECT_EQ(tokenizer_->Encode(""), std::vector<int>{});
}

TEST_F(TinyTokenizerTest, NormalizesToNfc) {
  // "café" arrives decomposed and is encoded as the composed word (é = C3 A9 -> "Ã©").
  EXPECT_EQ(tokenizer_->Encode("cafe\u0301s"), tokenizer_->Encode("cafés"));
  EXPECT_EQ(tokenizer_->Encode("Ġé"), Ids({"Ä", "ł", "Ã©"}));
}

TEST_F(TinyTokenizerTest, AddedTokensLongestMatchFirst) {
  const int eot = Id("<|endoftext|>");
  const int end = Id("<|end|>");
  EXPECT_EQ(tokenizer_->Encode("<|endoftext|>"), std::vector<int>{eot});
  EXPECT_EQ(tokenizer_->Encode("<|end|>oftext|>").front(), end);
  EXPECT_EQ(tokenizer_->Encode("the<|endoftext|>the"),
            (std::vector<int>{Id("the"), eot, Id("the")}));
  // Special tokens in the text are recognised also without add_special_tokens; near misses are
  // ordinary text.
  const std::vector<int> near_miss = tokenizer_->Encode("<|endoftext|", false);
  EXPECT_EQ(std::count(near_miss.begin(), near_miss.end(), eot), 0);
  EXPECT_EQ(tokenizer_->Decode(near_miss), "<|endoftext|");
  // Non-special added token.
  EXPECT_EQ(tokenizer_->Encode("<think>the"), (std::vector<int>{Id("<think>"), Id("the")}));
}

TEST_F(TinyTokenizerTest, AddedTokenStripAndSingleWord) {
  const int mask = Id("<mask>");
  // lstrip + rstrip: the spaces around <mask> belong to it.
  EXPECT_EQ(tokenizer_->Encode("the <mask>  the"), (std::vector<int>{Id("the"), mask, Id("the")}));
  // single_word "hi": only where no word character touches it.
  const int hi = Id("hi");
  EXPECT_EQ(tokenizer_->Encode("hi the").front(), hi);
  EXPECT_EQ(tokenizer_->Encode("a hi!"), (std::vector<int>{Id("a"), Id("Ġ"), hi, Id("!")}));
  for (const int id : tokenizer_->Encode("this high chi")) EXPECT_NE(id, hi);
}

TEST_F(TinyTokenizerTest, NormalizedAddedTokenMatchesAfterNormalization) {
  // The added token "cafe\u0301" has normalized=true: it matches the NFC text, whichever form
  // the input uses (and decodes to its content, as in HF).
  const int cafe = Id("cafe\u0301");
  EXPECT_EQ(tokenizer_->Encode("café"), std::vector<int>{cafe});
  EXPECT_EQ(tokenizer_->Encode("cafe\u0301 the"), (std::vector<int>{cafe, Id("Ġthe")}));
  EXPECT_EQ(tokenizer_->Decode(tokenizer_->Encode("café")), "cafe\u0301");
}

TEST_F(TinyTokenizerTest, TemplateAddsBosOnlyWithSpecialTokens) {
  const int bos = Id("<bos>");
  EXPECT_EQ(tokenizer_->Encode("the", true), (std::vector<int>{bos, Id("the")}));
  EXPECT_EQ(tokenizer_->Encode("the", false), Ids({"the"}));
  EXPECT_EQ(tokenizer_->Encode("", true), std::vector<int>{bos});
}

TEST_F(TinyTokenizerTest, DecodeRoundTripsAndSkipsSpecialTokens) {
  const std::string text = "<bos>the <think>naïve<|endoftext|> 😀\n\t";
  const std::vector<int> ids = tokenizer_->Encode(text);
  EXPECT_EQ(tokenizer_->Decode(ids), text);
  EXPECT_EQ(tokenizer_->Decode(ids, /*skip_special_tokens=*/true), "the <think>naïve 😀\n\t");
  // Unknown ids are skipped, as HF does.
  std::vector<int> with_unknown = ids;
  with_unknown.insert(with_unknown.begin() + 1, -5);
  with_unknown.push_back(tokenizer_->vocab_size());
  EXPECT_EQ(tokenizer_->Decode(with_unknown), text);
  // Half of a character decodes to U+FFFD.
  const std::vector<int> euro = tokenizer_->Encode("€");  // three byte tokens
  ASSERT_EQ(euro.size(), 3u);
  EXPECT_EQ(tokenizer_->Decode(std::vector<int>{euro[0], euro[1]}), "\uFFFD");
  EXPECT_EQ(tokenizer_->Decode(std::vector<int>{euro[1], Id("a")}), "\uFFFDa");
}

TEST_F(TinyTokenizerTest, InvalidUtf8InputIsRepairedFirst) {
  EXPECT_EQ(tokenizer_->Encode("a\xFF"
                               "b"),
            tokenizer_->Encode("a\uFFFDb"));
  EXPECT_EQ(tokenizer_->Decode(tokenizer_->Encode("x\xE2\x82")), "x\uFFFD");
}

TEST_F(TinyTokenizerTest, ArbitraryBytesRoundTripThroughTheRepairedText) {
  std::mt19937 rng(11);
  const std::string alphabet = "ab \t\n\r'1<|>\x80\xC3\xA9\xE2\x82\xAC\xF0\x9F\x98\x80\xFF";
  for (int trial = 0; trial < 1500; ++trial) {
    std::string bytes;
    const int length = static_cast<int>(rng() % 16);
    for (int i = 0; i < length; ++i) bytes.push_back(alphabet[rng() % alphabet.size()]);
    const std::vector<int> ids = tokenizer_->Encode(bytes);
    for (const int id : ids) ASSERT_TRUE(id >= 0 && id < tokenizer_->vocab_size());
    // The fixture normalizes to NFC (e.g. U+2000 EN QUAD becomes U+2002 EN SPACE).
    ASSERT_EQ(tokenizer_->Decode(ids), NfcNormalize(Utf8Lossy(bytes))) << "trial " << trial;
  }
}

TEST_F(TinyTokenizerTest, VocabularyQueries) {
  EXPECT_EQ(tokenizer_->vocab_size(), 283);  // 276 vocab tokens + 7 added
  EXPECT_EQ(tokenizer_->IdToToken(Id("Ġthe")), "Ġthe");
  EXPECT_EQ(tokenizer_->IdToToken(Id("<think>")), "<think>");
  EXPECT_EQ(tokenizer_->IdToToken(-1), "");
  EXPECT_EQ(tokenizer_->IdToToken(100000), "");
  EXPECT_FALSE(tokenizer_->TokenToId("not a token").has_value());
  EXPECT_TRUE(tokenizer_->IsSpecialToken(Id("<|endoftext|>")));
  EXPECT_FALSE(tokenizer_->IsSpecialToken(Id("<think>")));
  EXPECT_FALSE(tokenizer_->IsSpecialToken(Id("the")));
  EXPECT_EQ(tokenizer_->bos_token_id(), Id("<bos>"));  // {"content": "<bos>"} form
  EXPECT_EQ(tokenizer_->eos_token_id(), Id("<|endoftext|>"));
}

TEST_F(TinyTokenizerTest, ChatTemplateThroughTheTokenizer) {
  EXPECT_EQ(tokenizer_->chat_template_kind(), ChatTemplateKind::kChatMl);
  Result<std::string> prompt = tokenizer_->ApplyChatTemplate({{{"user", "the"}}});
  ASSERT_TRUE(prompt.ok()) << prompt.status().ToString();
  EXPECT_EQ(*prompt, "<|im_start|>user\nthe<|im_end|>\n<|im_start|>assistant\n");
}

// ---- loading errors ----------------------------------------------------------------------

std::string TinyJson() {
  Result<std::string> text = ReadTextFile(std::string(kTinyDir) + "/tokenizer.json");
  EXPECT_TRUE(text.ok()) << text.status().ToString();
  return text.ok() ? *text : std::string();
}

// Loads the tiny tokenizer.json after `edit`; returns the error message ("" when it loads).
template <typename Edit>
std::string LoadEdited(Edit edit, StatusCode* code = nullptr) {
  nlohmann::json json = nlohmann::json::parse(TinyJson());
  edit(json);
  Result<std::unique_ptr<Tokenizer>> loaded = Tokenizer::LoadFromJson(json.dump(), "", "m");
  if (code != nullptr) *code = loaded.status().code();
  return loaded.ok() ? std::string() : loaded.status().message();
}

TEST(TokenizerLoadTest, NotJson) {
  Result<std::unique_ptr<Tokenizer>> loaded =
      Tokenizer::LoadFromJson("{\"model\": [1, 2", "", "models/x");
  ASSERT_FALSE(loaded.ok());
  EXPECT_EQ(loaded.status().message().rfind("models/x/tokenizer.json: not valid JSON", 0), 0u)
      << loaded.status().message();
  Result<std::unique_ptr<Tokenizer>> top = Tokenizer::LoadFromJson("[1]", "", "m");
  ASSERT_FALSE(top.ok());
  EXPECT_EQ(top.status().message(),
            "m/tokenizer.json: top level: expected an object, got an array");
}

TEST(TokenizerLoadTest, ModelProblems) {
  EXPECT_EQ(LoadEdited([](nlohmann::json& j) { j.erase("model"); }),
            "m/tokenizer.json: missing field 'model'");
  StatusCode code;
  EXPECT_EQ(LoadEdited([](nlohmann::json& j) { j["model"]["type"] = "WordPiece"; }, &code),
            "m/tokenizer.json: model.type: model type 'WordPiece' is not supported (rubato "
            "supports BPE)");
  EXPECT_EQ(code, StatusCode::kUnsupported);
  EXPECT_EQ(LoadEdited([](nlohmann::json& j) { j["model"]["merges"].push_back("Ġthe zzz"); }),
            "m/tokenizer.json: model.merges[19]: merge of 'Ġthe' and 'zzz' refers to 'zzz', "
            "which is not in model.vocab");
  EXPECT_EQ(LoadEdited([](nlohmann::json& j) { j["model"]["vocab"] = "none"; }),
            "m/tokenizer.json: model.vocab: expected an object {token: id}, got a string");
}

TEST(TokenizerLoadTest, PipelineProblems) {
  EXPECT_EQ(LoadEdited([](nlohmann::json& j) {
              j["pre_tokenizer"]["pretokenizers"][0]["pattern"]["Regex"] = "[a-";
            })
                .rfind("m/tokenizer.json: pre_tokenizer.pretokenizers[0].pattern: regex '[a-' "
                       "does not compile",
                       0),
            0u);
  EXPECT_EQ(LoadEdited([](nlohmann::json& j) {
              j["normalizer"] = {{"type", "Lowercase"}};
            }),
            "m/tokenizer.json: normalizer: normalizer type 'Lowercase' is not supported (rubato "
            "supports NFC and Sequence)");
  EXPECT_EQ(LoadEdited([](nlohmann::json& j) { j["decoder"] = nullptr; }),
            "m/tokenizer.json: decoder: the decoder is null; rubato needs a ByteLevel decoder "
            "to turn ids back into text");
  EXPECT_EQ(LoadEdited([](nlohmann::json& j) {
              j["decoder"] = {{"type", "WordPiece"}};
            }).find("decoder type 'WordPiece' is not supported"),
            std::string("m/tokenizer.json: decoder: ").size());
  EXPECT_EQ(LoadEdited([](nlohmann::json& j) {
              j["post_processor"] = {{"type", "BertProcessing"}};
            }),
            "m/tokenizer.json: post_processor: post_processor type 'BertProcessing' is not "
            "supported (rubato supports ByteLevel, TemplateProcessing and Sequence)");
  EXPECT_EQ(LoadEdited([](nlohmann::json& j) {
              j["post_processor"]["processors"][1]["special_tokens"].erase("<bos>");
            }),
            "m/tokenizer.json: post_processor.processors[1].single[0].SpecialToken: special "
            "token '<bos>' is not defined in post_processor.processors[1].special_tokens");
}

TEST(TokenizerLoadTest, AddedTokenProblems) {
  EXPECT_EQ(LoadEdited([](nlohmann::json& j) { j["added_tokens"][0]["id"] = "276"; }),
            "m/tokenizer.json: added_tokens[0].id: expected a token id (integer), got a string");
  EXPECT_EQ(LoadEdited([](nlohmann::json& j) { j["added_tokens"][1]["content"] = 7; }),
            "m/tokenizer.json: added_tokens[1].content: expected a string, got a number");
  EXPECT_EQ(LoadEdited([](nlohmann::json& j) { j["added_tokens"][1]["id"] = 276; }),
            "m/tokenizer.json: added_tokens[1]: token '<|end|>' has id 276, which an earlier "
            "added token has");
  EXPECT_EQ(LoadEdited([](nlohmann::json& j) {
              j["added_tokens"] = {{"id", 1}};
            }),
            "m/tokenizer.json: added_tokens: expected an array, got an object");
}

TEST(TokenizerLoadTest, DirectoryErrors) {
  Result<std::unique_ptr<Tokenizer>> missing =
      Tokenizer::LoadFromDirectory("tests/data/tokenizer/no_such_model");
  ASSERT_FALSE(missing.ok());
  EXPECT_EQ(missing.status().code(), StatusCode::kNotFound);
  EXPECT_EQ(missing.status().message(),
            "tests/data/tokenizer/no_such_model/tokenizer.json: not found; a model directory "
            "needs the Hugging Face tokenizer.json");

  // Without tokenizer_config.json everything works except chat templates and bos/eos.
  Result<std::unique_ptr<Tokenizer>> no_config = Tokenizer::LoadFromJson(TinyJson(), "", "m");
  ASSERT_TRUE(no_config.ok()) << no_config.status().ToString();
  EXPECT_FALSE((*no_config)->eos_token_id().has_value());
  EXPECT_EQ((*no_config)->chat_template_kind(), ChatTemplateKind::kNone);
  EXPECT_FALSE((*no_config)->ApplyChatTemplate({{{"user", "x"}}}).ok());

  Result<std::unique_ptr<Tokenizer>> bad_config =
      Tokenizer::LoadFromJson(TinyJson(), "{\"bos_token\": [", "m");
  ASSERT_FALSE(bad_config.ok());
  EXPECT_EQ(bad_config.status().message().rfind("m/tokenizer_config.json: not valid JSON", 0), 0u)
      << bad_config.status().message();
}

}  // namespace
}  // namespace rubato
