// BPE merging (rank order, ties, stale queue entries), ignore_merges, unknown characters,
// byte_fallback, subword prefixes and load errors, on small hand-written models.
#include "common/tokenizer/bpe_model.h"

#include <gtest/gtest.h>

#include <string>
#include <vector>

namespace rubato {
namespace {

Result<std::unique_ptr<BpeModel>> Load(const nlohmann::json& model) {
  return BpeModel::FromJson(model, JsonReader("tokenizer.json"));
}

std::unique_ptr<BpeModel> MustLoad(const nlohmann::json& model) {
  Result<std::unique_ptr<BpeModel>> bpe = Load(model);
  EXPECT_TRUE(bpe.ok()) << bpe.status().ToString();
  return bpe.ok() ? std::move(bpe).value() : nullptr;
}

// The tokens (not ids) `word` becomes, to keep expectations readable.
std::vector<std::string> Tokens(const std::unique_ptr<BpeModel>& bpe, const std::string& word) {
  if (bpe == nullptr) return {"<model did not load>"};
  std::vector<int> ids;
  bpe->Tokenize(word, &ids);
  std::vector<std::string> tokens;
  for (const int id : ids) {
    const std::string* token = bpe->IdToToken(id);
    tokens.push_back(token == nullptr ? "<?>" : *token);
  }
  return tokens;
}

using Toks = std::vector<std::string>;

const nlohmann::json kAbcVocab = {{"a", 0}, {"b", 1}, {"c", 2}, {"ab", 3}, {"bc", 4}, {"abc", 5}};

TEST(BpeModelTest, MergesApplyInRankOrder) {
  auto bc_first =
      MustLoad({{"vocab", kAbcVocab}, {"merges", nlohmann::json::array({"b c", "a b", "a bc"})}});
  EXPECT_EQ(Tokens(bc_first, "abc"), (Toks{"abc"}));
  auto no_final =
      MustLoad({{"vocab", kAbcVocab}, {"merges", nlohmann::json::array({"b c", "a b"})}});
  EXPECT_EQ(Tokens(no_final, "abc"), (Toks{"a", "bc"}));
  auto ab_first =
      MustLoad({{"vocab", kAbcVocab}, {"merges", nlohmann::json::array({"a b", "b c"})}});
  EXPECT_EQ(Tokens(ab_first, "abc"), (Toks{"ab", "c"}));
  // The pair form of merges means the same.
  auto pairs = MustLoad({{"vocab", kAbcVocab},
                         {"merges", nlohmann::json::array({nlohmann::json::array({"a", "b"}),
                                                           nlohmann::json::array({"b", "c"})})}});
  EXPECT_EQ(Tokens(pairs, "abc"), (Toks{"ab", "c"}));
}

TEST(BpeModelTest, EqualRanksMergeLeftmostFirst) {
  auto bpe = MustLoad({{"vocab", {{"a", 0}, {"aa", 1}, {"aaaa", 2}}},
                       {"merges", nlohmann::json::array({"a a", "aa aa"})}});
  EXPECT_EQ(Tokens(bpe, "aaa"), (Toks{"aa", "a"}));
  EXPECT_EQ(Tokens(bpe, "aaaaa"), (Toks{"aaaa", "a"}));
  EXPECT_EQ(Tokens(bpe, "aaaaaa"), (Toks{"aaaa", "aa"}));
  // Cached words give the same answer the second time.
  EXPECT_EQ(Tokens(bpe, "aaaaaa"), (Toks{"aaaa", "aa"}));
}

TEST(BpeModelTest, IgnoreMergesTakesWholeVocabWords) {
  // "abc" is in the vocab but no merge reaches it from "ab" + "c".
  const nlohmann::json merges = nlohmann::json::array({"a b"});
  auto plain = MustLoad({{"vocab", kAbcVocab}, {"merges", merges}});
  EXPECT_EQ(Tokens(plain, "abc"), (Toks{"ab", "c"}));
  auto ignore = MustLoad({{"vocab", kAbcVocab}, {"merges", merges}, {"ignore_merges", true}});
  EXPECT_EQ(Tokens(ignore, "abc"), (Toks{"abc"}));
  EXPECT_EQ(Tokens(ignore, "abca"), (Toks{"ab", "c", "a"}));
}

TEST(BpeModelTest, UnknownCharacters) {
  const nlohmann::json vocab = {{"a", 0}, {"<unk>", 1}};
  // Without unk_token or byte_fallback HF drops the character.
  auto drop = MustLoad({{"vocab", vocab}, {"merges", nlohmann::json::array()}});
  EXPECT_EQ(Tokens(drop, "axya"), (Toks{"a", "a"}));
  auto unk =
      MustLoad({{"vocab", vocab}, {"merges", nlohmann::json::array()}, {"unk_token", "<unk>"}});
  EXPECT_EQ(Tokens(unk, "axya"), (Toks{"a", "<unk>", "<unk>", "a"}));
  auto fused = MustLoad({{"vocab", vocab},
                         {"merges", nlohmann::json::array()},
                         {"unk_token", "<unk>"},
                         {"fuse_unk", true}});
  EXPECT_EQ(Tokens(fused, "axya"), (Toks{"a", "<unk>", "a"}));
}

TEST(BpeModelTest, ByteFallback) {
  auto bpe = MustLoad({{"vocab", {{"a", 0}, {"<0xC3>", 1}, {"<0xA9>", 2}, {"<unk>", 3}}},
                       {"merges", nlohmann::json::array()},
                       {"byte_fallback", true},
                       {"unk_token", "<unk>"}});
  EXPECT_EQ(Tokens(bpe, "aé"), (Toks{"a", "<0xC3>", "<0xA9>"}));
  // 'ü' is C3 BC: no <0xBC> token, so the whole character is unknown.
  EXPECT_EQ(Tokens(bpe, "ü"), (Toks{"<unk>"}));
}

TEST(BpeModelTest, ContinuingSubwordPrefixAndSuffix) {
  auto bpe = MustLoad({{"vocab", {{"a", 0}, {"##b", 1}, {"ab", 2}, {"##c</w>", 3}}},
                       {"merges", nlohmann::json::array({"a ##b"})},
                       {"continuing_subword_prefix", "##"},
                       {"end_of_word_suffix", "</w>"}});
  EXPECT_EQ(Tokens(bpe, "abc"), (Toks{"ab", "##c</w>"}));
}

TEST(BpeModelTest, LoadErrorsNameTheMergeAndToken) {
  Result<std::unique_ptr<BpeModel>> unknown =
      Load({{"vocab", kAbcVocab}, {"merges", nlohmann::json::array({"a x"})}});
  ASSERT_FALSE(unknown.ok());
  EXPECT_EQ(unknown.status().message(),
            "tokenizer.json: model.merges[0]: merge of 'a' and 'x' refers to 'x', which is not "
            "in model.vocab");

  Result<std::unique_ptr<BpeModel>> product =
      Load({{"vocab", {{"a", 0}, {"c", 1}}}, {"merges", nlohmann::json::array({"a b", "a c"})}});
  ASSERT_FALSE(product.ok());
  EXPECT_NE(product.status().message().find("model.merges[0]"), std::string::npos);

  Result<std::unique_ptr<BpeModel>> no_result =
      Load({{"vocab", {{"a", 0}, {"c", 1}}}, {"merges", nlohmann::json::array({"a c"})}});
  ASSERT_FALSE(no_result.ok());
  EXPECT_EQ(no_result.status().message(),
            "tokenizer.json: model.merges[0]: merge of 'a' and 'c' makes 'ac', which is not in "
            "model.vocab");

  Result<std::unique_ptr<BpeModel>> malformed =
      Load({{"vocab", kAbcVocab}, {"merges", nlohmann::json::array({"abc"})}});
  ASSERT_FALSE(malformed.ok());
  EXPECT_NE(malformed.status().message().find("not two tokens separated by one space"),
            std::string::npos);

  Result<std::unique_ptr<BpeModel>> number =
      Load({{"vocab", kAbcVocab}, {"merges", nlohmann::json::array({1})}});
  ASSERT_FALSE(number.ok());
  EXPECT_EQ(number.status().message(),
            "tokenizer.json: model.merges[0]: expected a merge \"a b\" or a pair [\"a\", \"b\"], "
            "got a number");

  Result<std::unique_ptr<BpeModel>> vocab_array =
      Load({{"vocab", nlohmann::json::array({"a", "b"})}, {"merges", nlohmann::json::array()}});
  ASSERT_FALSE(vocab_array.ok());
  EXPECT_EQ(vocab_array.status().message(),
            "tokenizer.json: model.vocab: expected an object {token: id}, got an array");

  Result<std::unique_ptr<BpeModel>> bad_id =
      Load({{"vocab", {{"a", -3}}}, {"merges", nlohmann::json::array()}});
  ASSERT_FALSE(bad_id.ok());
  EXPECT_NE(bad_id.status().message().find("model.vocab[\"a\"]"), std::string::npos)
      << bad_id.status().message();

  Result<std::unique_ptr<BpeModel>> same_id =
      Load({{"vocab", {{"a", 0}, {"b", 0}}}, {"merges", nlohmann::json::array()}});
  ASSERT_FALSE(same_id.ok());
  EXPECT_NE(same_id.status().message().find("both have id 0"), std::string::npos);

  Result<std::unique_ptr<BpeModel>> dropout =
      Load({{"vocab", kAbcVocab}, {"merges", nlohmann::json::array()}, {"dropout", 0.1}});
  ASSERT_FALSE(dropout.ok());
  EXPECT_EQ(dropout.status().code(), StatusCode::kUnsupported);

  Result<std::unique_ptr<BpeModel>> unk =
      Load({{"vocab", kAbcVocab}, {"merges", nlohmann::json::array()}, {"unk_token", "<unk>"}});
  ASSERT_FALSE(unk.ok());
  EXPECT_NE(unk.status().message().find("unk_token '<unk>'"), std::string::npos);

  Result<std::unique_ptr<BpeModel>> missing = Load({{"vocab", kAbcVocab}});
  ASSERT_FALSE(missing.ok());
  EXPECT_EQ(missing.status().message(), "tokenizer.json: model: missing field 'merges'");
}

}  // namespace
}  // namespace rubato
