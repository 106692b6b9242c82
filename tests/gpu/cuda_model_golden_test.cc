// The CUDA model on real checkpoints: golden parity with transformers and with the CPU model on
// the committed tiny checkpoints (tests/golden_parity_test.cc has the file format; the CPU
// model's own bound there is 1e-3 x max|logit|, the CUDA model's is bf16's), the clear error on
// a head_dim the kernels do not support, and the engine generating the CPU engine's greedy
// tokens on the trained tiny-qwen3-longctx.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "common/text_file.h"
#include "common/tokenizer/tokenizer.h"
#include "inference_rank/engine/engine.h"
#include "tests/golden_reference.h"
#include "tests/gpu/cuda_model_test_util.h"
#include "tests/gpu/gpu_test_util.h"

namespace rubato {
namespace {

namespace fs = std::filesystem;
using namespace cuda_model_test;

// The golden checkpoints are random-weight models whose logits rows are nearly flat (max|logit|
// ~4.6 over 832-1024 entries), so bf16's per-rounding 2^-9 error compounds into a larger
// relative error than on the shapes of cuda_model_test.cc: measured on an H200, worst row
// 0.018-0.0255 over 238 prefill and 32 decode rows (identical against the CPU model and against
// transformers, whose fp32 logits agree to 2e-6). 3e-2 keeps ~15 % headroom; the argmax check
// still applies wherever the reference's top-2 margin is clear.
constexpr double kGoldenRowRelL2 = 3e-2;
// Per logit: |cuda - transformers| <= 0.05 x max|logit| (bf16 is ~2^-8 relative per rounding;
// see the measured values where it is checked).
constexpr double kGoldenMaxAbsError = 0.05;

struct GoldenCase {
  const char* name;
  const char* model_dir;
};

void PrintTo(const GoldenCase& c, std::ostream* os) { *os << c.name; }

const GoldenCase kGoldenCases[] = {
    {"tiny-qwen3-random", "models/tiny-qwen3-random"},               // bf16 checkpoint, tied
    {"tiny-llama3-random", "tests/data/models/tiny-llama3-random"},  // f16, sharded, llama3 RoPE
};

class CudaGoldenTest : public ::testing::TestWithParam<GoldenCase> {};

// The prompt in chunks of 37 (kAll), then the 32 reference decode tokens fed back one at a time
// (teacher forcing, so the rows stay comparable even where a near-tie flips an argmax).
TEST_P(CudaGoldenTest, MatchesTransformersAndCpuModel) {
  const GoldenCase& c = GetParam();
  const golden::GoldenReference ref = golden::LoadGoldenReference(c.name);
  const std::vector<int>& prompt = ref.prompt_ids;
  const std::vector<int>& decode_ids = ref.decode_ids;
  const int vocab = ref.vocab;
  const int prompt_len = static_cast<int>(prompt.size());
  const int steps = static_cast<int>(decode_ids.size());
  const std::vector<float>& ref_prefill = ref.prefill_logits;
  const std::vector<float>& ref_decode = ref.decode_logits;

  auto cpu = CpuModel::Load(c.model_dir, {});
  ASSERT_STATUS_OK(cpu.status());
  auto cuda = LoadCudaModel(c.model_dir, {});  // the checkpoint path: bf16 / f16 -> bf16
  ASSERT_STATUS_OK(cuda.status());
  ASSERT_EQ((*cuda)->config().vocab_size, vocab);
  EXPECT_EQ((*cuda)->backend_name(), "cuda");
  const int blocks = (prompt_len + steps) / 16 + 2;
  auto cpu_cache = NewCache(**cpu, 16, blocks);
  auto cuda_cache = NewCache(**cuda, 16, blocks);
  ASSERT_TRUE(cpu_cache && cuda_cache);

  KvSequence cpu_seq, cuda_seq;
  std::vector<float> cpu_rows = FeedAll(**cpu, *cpu_cache, cpu_seq, prompt, 0, 37);
  std::vector<float> cuda_rows = FeedAll(**cuda, *cuda_cache, cuda_seq, prompt, 0, 37);
  ExpectRowsClose(std::string(c.name) + " prefill vs CPU", cuda_rows, cpu_rows, vocab,
                  kGoldenRowRelL2);
  ExpectRowsClose(std::string(c.name) + " prefill vs transformers", cuda_rows, ref_prefill, vocab,
                  kGoldenRowRelL2);

  // Decode row 0 is the last prompt position; row s the logits after feeding decode_ids[s - 1].
  std::vector<float> cpu_decode(cpu_rows.end() - vocab, cpu_rows.end());
  std::vector<float> cuda_decode(cuda_rows.end() - vocab, cuda_rows.end());
  const TokenSampling greedy;
  ForwardResult cpu_result, cuda_result;
  for (int s = 1; s < steps; ++s) {
    const int position = prompt_len + s - 1;
    const int token = decode_ids[size_t(s - 1)];
    ForwardEntry cpu_entry{&cpu_seq, {&token, 1}, position, LogitsWanted::kLast};
    ForwardEntry cuda_entry{&cuda_seq, {&token, 1}, position, LogitsWanted::kAll, &greedy};
    ASSERT_STATUS_OK((*cpu)->Forward({&cpu_entry, 1}, *cpu_cache, cpu_result));
    ASSERT_STATUS_OK((*cuda)->Forward({&cuda_entry, 1}, *cuda_cache, cuda_result));
    const auto cpu_row = cpu_result.LastLogits(0);
    const auto cuda_row = cuda_result.LastLogits(0);
    cpu_decode.insert(cpu_decode.end(), cpu_row.begin(), cpu_row.end());
    cuda_decode.insert(cuda_decode.end(), cuda_row.begin(), cuda_row.end());
    EXPECT_EQ(cuda_result.sampled_tokens[0], ArgMax(cuda_row)) << "step " << s;
  }
  ExpectRowsClose(std::string(c.name) + " decode vs CPU", cuda_decode, cpu_decode, vocab,
                  kGoldenRowRelL2);
  ExpectRowsClose(std::string(c.name) + " decode vs transformers", cuda_decode, ref_decode, vocab,
                  kGoldenRowRelL2);
  double max_abs = 0, worst = 0;
  for (float v : ref_prefill) max_abs = std::max(max_abs, double(std::fabs(v)));
  worst = std::max(MaxAbsDiff(cuda_rows, ref_prefill), MaxAbsDiff(cuda_decode, ref_decode));
  std::printf(
      "[golden] %s (CUDA, bf16): max|logit| %.3f, max|dlogit| vs transformers %.3g = "
      "%.3g x max|logit|\n",
      c.name, max_abs, worst, worst / max_abs);
  // Every logit too, not only every row: one bad logit could hide in a good row's L2 error.
  // Measured on an H200: 0.0175 (tiny-qwen3) and 0.0216 (tiny-llama3) x max|logit|.
  EXPECT_LE(worst, kGoldenMaxAbsError * max_abs) << c.name << ": worst logit error vs transformers";
}

INSTANTIATE_TEST_SUITE_P(Models, CudaGoldenTest, ::testing::ValuesIn(kGoldenCases),
                         [](const auto& info) {
                           std::string name = info.param.name;
                           std::replace(name.begin(), name.end(), '-', '_');
                           return name;
                         });

TEST(CudaGoldenUnsupportedTest, Qwen2HeadDim12IsAClearError) {
  auto model = LoadCudaModel("tests/data/models/tiny-qwen2-random", {});
  EXPECT_EQ(model.status().code(), StatusCode::kUnsupported);
  EXPECT_NE(model.status().message().find("head_dim 12"), std::string::npos)
      << model.status().message();
  std::printf("[ error     ] %s\n", model.status().message().c_str());
}

// ---- the engine on the CUDA model ---------------------------------------------------------------

constexpr const char* kLongctxDir = "models/tiny-qwen3-longctx";

// Greedy tokens per request of `model` under the engine (three requests, batched together).
std::vector<std::vector<int>> GenerateGreedy(std::unique_ptr<Model> model,
                                             const std::vector<std::vector<int>>& prompts) {
  EngineOptions options;
  options.max_batch = 4;
  options.max_context = 1024;
  options.block_size = 16;
  options.prefill_chunk = 64;
  return EngineGreedyTokens(std::move(model), options, prompts);
}

// The engine on the CUDA model generates the CPU engine's greedy tokens. bf16 rounding may only
// change a token where the CPU's top-2 margin at that step is within what bf16 moves the
// logits: at the first divergence, the CPU margin must be below four times the largest
// |CPU - CUDA| logit difference at that position, measured on the same prefix fed alone (a flip
// needs margin <= 2 x the difference in the engine's own batched run, whose bf16 noise is of the
// same size but not the same values), and the two rows must agree to 5e-2 relative L2 (a trained
// model's logits move more under bf16 than the random test models'). Everything after a
// legitimate divergence is a different continuation and is not compared.
TEST(CudaEngineTest, GreedyTokensMatchTheCpuEngine) {
  auto tokenizer = Tokenizer::LoadFromDirectory(kLongctxDir);
  ASSERT_STATUS_OK(tokenizer.status());
  const std::vector<std::string> texts = {
      "The passkey is 71432. Remember it. The grass is green. The sky is blue. The passkey is",
      "Alice has 3 apples. Bob has 5 apples. Who has more apples?",
      "Once upon a time",
  };
  std::vector<std::vector<int>> prompts;
  for (const std::string& text : texts) prompts.push_back((*tokenizer)->Encode(text));

  auto cpu_model = CpuModel::Load(kLongctxDir, {});
  ASSERT_STATUS_OK(cpu_model.status());
  auto cuda_model = LoadCudaModel(kLongctxDir, {});
  ASSERT_STATUS_OK(cuda_model.status());
  const std::vector<std::vector<int>> cpu_tokens =
      GenerateGreedy(std::move(cpu_model).value(), prompts);
  const std::vector<std::vector<int>> cuda_tokens =
      GenerateGreedy(std::move(cuda_model).value(), prompts);
  ASSERT_EQ(cpu_tokens.size(), prompts.size());
  ASSERT_EQ(cuda_tokens.size(), prompts.size());

  // Fresh models for the teacher-forced look at a divergence.
  auto cpu = CpuModel::Load(kLongctxDir, {});
  auto cuda = LoadCudaModel(kLongctxDir, {});
  ASSERT_STATUS_OK(cpu.status());
  ASSERT_STATUS_OK(cuda.status());
  for (size_t r = 0; r < prompts.size(); ++r) {
    const std::vector<int>& a = cpu_tokens[r];
    const std::vector<int>& b = cuda_tokens[r];
    ASSERT_FALSE(a.empty());
    size_t k = 0;
    while (k < a.size() && k < b.size() && a[k] == b[k]) ++k;
    std::printf("[ engine    ] request %zu: %zu CPU tokens, %zu CUDA tokens, identical for %zu\n",
                r, a.size(), b.size(), k);
    if (k == a.size() && k == b.size()) continue;
    ASSERT_TRUE(k < a.size() && k < b.size()) << "one engine stopped early without diverging";
    // The logits token k was chosen from: prompt + the k shared tokens, last position.
    std::vector<int> context = prompts[r];
    context.insert(context.end(), a.begin(), a.begin() + static_cast<ptrdiff_t>(k));
    const int blocks = static_cast<int>(context.size()) / 16 + 2;
    auto cpu_cache = NewCache(**cpu, 16, blocks);
    auto cuda_cache = NewCache(**cuda, 16, blocks);
    KvSequence cpu_seq, cuda_seq;
    const std::vector<float> cpu_rows = FeedAll(**cpu, *cpu_cache, cpu_seq, context, 0, 64);
    const std::vector<float> cuda_rows = FeedAll(**cuda, *cuda_cache, cuda_seq, context, 0, 64);
    const size_t vocab = static_cast<size_t>((*cpu)->config().vocab_size);
    const auto cpu_row = std::span<const float>(cpu_rows).last(vocab);
    const auto cuda_row = std::span<const float>(cuda_rows).last(vocab);
    const double margin = Top2Margin(cpu_row);
    const double diff = MaxAbsDiff(cpu_row, cuda_row);
    std::printf(
        "[ engine    ] request %zu diverges at token %zu: CPU %d, CUDA %d, CPU top-2 margin "
        "%.4g, max |CPU - CUDA| logit %.4g\n",
        r, k, a[k], b[k], margin, diff);
    EXPECT_EQ(ArgMax(cpu_row), a[k]);
    EXPECT_LE(margin, 4 * diff) << "request " << r << ": tokens diverge at " << k
                                << " although the CPU's choice was clear";
    EXPECT_LE(RelL2(cuda_row, cpu_row), 5e-2) << "request " << r;
  }
}

}  // namespace
}  // namespace rubato
