// Golden parity with Hugging Face transformers (docs/design.md §7 "Golden").
//
// For each tiny checkpoint, tests/data/golden/<model>/ holds what transformers computed in fp32
// on the CPU (tools/golden/hf_golden.py, run on the GPU machine by scripts/gpu/golden.sh): the
// prompt ids from HF `tokenizers`, the logits of every prompt position, and 32 greedy decode
// steps with their logits. rubato's tokenizer must produce the same prompt ids, and the CPU
// model -- fed the prompt in chunks of 37 tokens through the paged KV cache -- must produce
// every logit within 1e-3 * max|logit| and the identical greedy tokens.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "common/text_file.h"
#include "common/tokenizer/tokenizer.h"
#include "inference_rank/model/cpu_model.h"
#include "tests/golden_reference.h"

namespace rubato {
namespace {

namespace fs = std::filesystem;

struct GoldenCase {
  const char* name;
  const char* model_dir;
};

const GoldenCase kCases[] = {
    {"tiny-qwen3-random", "models/tiny-qwen3-random"},
    {"tiny-llama3-random", "tests/data/models/tiny-llama3-random"},
    {"tiny-qwen2-random", "tests/data/models/tiny-qwen2-random"},
};

void PrintTo(const GoldenCase& c, std::ostream* os) { *os << c.name; }

constexpr int kPrefillChunk = 37;
constexpr double kRelativeTolerance = 1e-3;

int Argmax(std::span<const float> row) {
  return static_cast<int>(std::max_element(row.begin(), row.end()) - row.begin());
}

// Largest |a - b| over a row.
double MaxAbsDiff(std::span<const float> a, std::span<const float> b) {
  double worst = 0;
  for (size_t i = 0; i < a.size(); ++i) worst = std::max(worst, std::fabs(double(a[i]) - b[i]));
  return worst;
}

class GoldenParityTest : public ::testing::TestWithParam<GoldenCase> {};

TEST_P(GoldenParityTest, MatchesTransformers) {
  const GoldenCase& c = GetParam();
  const golden::GoldenReference ref = golden::LoadGoldenReference(c.name);
  const nlohmann::json& meta = ref.meta;
  const std::vector<int>& prompt_ids = ref.prompt_ids;
  const std::vector<int>& decode_ids = ref.decode_ids;
  const int vocab = ref.vocab;
  const int prompt_len = static_cast<int>(prompt_ids.size());
  const int decode_steps = static_cast<int>(decode_ids.size());
  ASSERT_GE(prompt_len, 100);
  ASSERT_EQ(decode_steps, 32);

  // Tokenizer parity on the model's own tokenizer.json.
  auto tokenizer = Tokenizer::LoadFromDirectory(c.model_dir);
  ASSERT_TRUE(tokenizer.ok()) << tokenizer.status().message();
  EXPECT_EQ((*tokenizer)->Encode(meta["prompt"].get<std::string>()), prompt_ids);
  EXPECT_EQ((*tokenizer)->Decode(decode_ids), meta["decode_text"].get<std::string>());

  const std::vector<float>& ref_prefill = ref.prefill_logits;
  const std::vector<float>& ref_decode = ref.decode_logits;
  double max_abs_logit = 0;
  for (float v : ref_prefill) max_abs_logit = std::max(max_abs_logit, double(std::fabs(v)));
  for (float v : ref_decode) max_abs_logit = std::max(max_abs_logit, double(std::fabs(v)));
  const double tolerance = kRelativeTolerance * max_abs_logit;

  auto model = CpuModel::Load(c.model_dir, {});
  ASSERT_TRUE(model.ok()) << model.status().message();
  ASSERT_EQ((*model)->config().vocab_size, vocab);
  const int blocks = (prompt_len + decode_steps) / 16 + 2;
  auto cache = (*model)->CreateKvCache(16, blocks);
  ASSERT_TRUE(cache.ok()) << cache.status().message();

  KvSequence sequence;
  ForwardResult result;
  double prefill_error = 0;
  for (int start = 0; start < prompt_len; start += kPrefillChunk) {
    const int n = std::min(kPrefillChunk, prompt_len - start);
    ForwardEntry chunk{&sequence, std::span<const int>(prompt_ids).subspan(start, n), start,
                       LogitsWanted::kAll};
    ASSERT_TRUE((*model)->Forward({&chunk, 1}, **cache, result).ok());
    std::span<const float> rows = result.EntryLogits(0);
    ASSERT_EQ(rows.size(), size_t(n) * vocab);
    for (int r = 0; r < n; ++r) {
      const double err =
          MaxAbsDiff(rows.subspan(size_t(r) * vocab, vocab),
                     std::span<const float>(ref_prefill).subspan(size_t(start + r) * vocab, vocab));
      prefill_error = std::max(prefill_error, err);
      EXPECT_LE(err, tolerance) << c.name << ": prefill position " << start + r;
    }
  }

  // Greedy decode: row i of the reference is the distribution token i was taken from; row 0 is
  // the last prompt position.
  std::vector<float> last(result.EntryLogits(0).end() - vocab, result.EntryLogits(0).end());
  double decode_error = 0;
  std::vector<int> tokens;
  for (int step = 0; step < decode_steps; ++step) {
    const std::span<const float> ref_row =
        std::span<const float>(ref_decode).subspan(size_t(step) * vocab, vocab);
    const double err = MaxAbsDiff(last, ref_row);
    decode_error = std::max(decode_error, err);
    EXPECT_LE(err, tolerance) << c.name << ": decode step " << step;
    const int token = Argmax(last);
    tokens.push_back(token);
    if (step + 1 == decode_steps) break;
    const int position = prompt_len + step;
    ForwardEntry entry{&sequence, std::span<const int>(&tokens.back(), 1), position,
                       LogitsWanted::kLast};
    ASSERT_TRUE((*model)->Forward({&entry, 1}, **cache, result).ok());
    const std::span<const float> row = result.LastLogits(0);
    last.assign(row.begin(), row.end());
  }
  EXPECT_EQ(tokens, decode_ids) << c.name << ": greedy tokens differ from transformers";

  std::printf(
      "[golden] %s: prompt %d tokens (chunks of %d), max|logit| %.3f, max|dlogit| "
      "prefill %.3g decode %.3g = %.3g x max|logit| (limit 1e-3)\n",
      c.name, prompt_len, kPrefillChunk, max_abs_logit, prefill_error, decode_error,
      std::max(prefill_error, decode_error) / max_abs_logit);
}

INSTANTIATE_TEST_SUITE_P(Models, GoldenParityTest, ::testing::ValuesIn(kCases),
                         [](const auto& info) {
                           std::string name = info.param.name;
                           std::replace(name.begin(), name.end(), '-', '_');
                           return name;
                         });

}  // namespace
}  // namespace rubato
