// Tests for the CPU model's attention window (StreamingLLM's sink + recent, docs/design.md §3/§4.7)
// on the tiny random Qwen3 / Qwen2 / Llama models:
//   * a window with sink + recent >= context gives exactly the logits of dense (docs/design.md §4),
//     through chunked prefill and decode;
//   * a long prompt with a small window differs from dense, and chunking the prompt does not
//     change the windowed logits (the window is per query position, not per chunk);
//   * an invalid window is an error.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "common/test_temp_dir.h"
#include "inference_rank/model/cpu_model.h"
#include "inference_rank/model/tiny_test_models.h"
#include "kernels/cpu/all_close_for_test.h"
#include "kernels/cpu/sampling.h"

namespace rubato {
namespace {

constexpr int kVocab = 97;  // of every tiny model

std::vector<int> TestPrompt(int length, int salt) {
  std::vector<int> ids;
  for (int i = 0; i < length; ++i) ids.push_back((i * 37 + salt * 11 + 2) % kVocab);
  return ids;
}

class CpuModelWindowTest : public ::testing::TestWithParam<TinyModelKind> {
 protected:
  void SetUp() override {
    Result<std::unique_ptr<CpuModel>> model = LoadTinyModel(GetParam(), dir_.path());
    ASSERT_TRUE(model.ok()) << model.status().ToString();
    model_ = std::move(model).value();
  }

  // Prefills `prompt` in chunks of `chunk` tokens through `window`, then decodes `steps` greedy
  // tokens; returns the logits of every prompt position followed by each decode step's logits,
  // [prompt + steps][vocab].
  std::vector<float> Run(const std::vector<int>& prompt, int chunk, int steps,
                         const AttentionWindow& window) {
    auto cache = model_->CreateKvCache(16, 64);
    EXPECT_TRUE(cache.ok()) << cache.status().ToString();
    KvSequence sequence;
    ForwardResult result;
    std::vector<float> logits;
    for (int start = 0; start < static_cast<int>(prompt.size()); start += chunk) {
      const int n = std::min<int>(chunk, static_cast<int>(prompt.size()) - start);
      const ForwardEntry entry{&sequence, std::span<const int>(prompt).subspan(start, n), start,
                               LogitsWanted::kAll};
      const Status status = model_->Forward({&entry, 1}, **cache, result, window);
      EXPECT_TRUE(status.ok()) << status.ToString();
      const std::span<const float> rows = result.EntryLogits(0);
      logits.insert(logits.end(), rows.begin(), rows.end());
    }
    int token = ArgMax(std::span<const float>(logits).last(kVocab));
    for (int step = 0; step < steps; ++step) {
      const ForwardEntry entry{&sequence, std::span<const int>(&token, 1), sequence.num_tokens,
                               LogitsWanted::kLast};
      const Status status = model_->Forward({&entry, 1}, **cache, result, window);
      EXPECT_TRUE(status.ok()) << status.ToString();
      const std::span<const float> row = result.LastLogits(0);
      logits.insert(logits.end(), row.begin(), row.end());
      token = ArgMax(row);
    }
    return logits;
  }

  TestTempDir dir_{"cpu_model_window"};
  std::unique_ptr<CpuModel> model_;
};

TEST_P(CpuModelWindowTest, WindowCoveringTheContextGivesExactlyDenseLogits) {
  // 45 prompt tokens in chunks of 7 (tiled attention path for 7-token chunks, rows path for the
  // last 3) and 12 decode steps: the last query sits at position 56, context 57.
  const std::vector<int> prompt = TestPrompt(45, 1);
  const std::vector<float> dense = Run(prompt, 7, 12, AttentionWindow());
  ASSERT_EQ(dense.size(), 57u * kVocab);
  for (const AttentionWindow window :
       {AttentionWindow{4, 53}, AttentionWindow{0, 57}, AttentionWindow{4, 256},
        AttentionWindow{57, 1}, AttentionWindow{30, 27}}) {
    EXPECT_EQ(Run(prompt, 7, 12, window), dense)
        << TinyModelName(GetParam()) << " sink " << window.sink_tokens << " recent "
        << window.recent_tokens;
  }
}

TEST_P(CpuModelWindowTest, SmallWindowDiffersFromDenseAndIgnoresChunking) {
  const std::vector<int> prompt = TestPrompt(150, 2);
  const AttentionWindow window{4, 16};
  const std::vector<float> dense = Run(prompt, 150, 6, AttentionWindow());
  const std::vector<float> one_shot = Run(prompt, 150, 6, window);
  const std::vector<float> chunked = Run(prompt, 13, 6, window);
  const std::vector<float> decoded = Run(prompt, 1, 6, window);  // every query on the rows path
  const std::string name = TinyModelName(GetParam());
  EXPECT_TRUE(AllClose(name + " window 4+16, prefill chunks of 13 vs one shot", chunked, one_shot,
                       1e-5, 1e-4));
  EXPECT_TRUE(AllClose(name + " window 4+16, prefill one token at a time vs one shot", decoded,
                       one_shot, 1e-5, 1e-4));

  // Positions [0, 20) attend everything either way: equal to dense (to rounding: a query tile
  // that also holds later positions cuts its key tiles at the sink). Later positions lose keys
  // and their logits move.
  const size_t covered = 20 * kVocab;
  EXPECT_TRUE(AllClose(name + " window 4+16, positions [0, 20) vs dense",
                       std::vector<float>(one_shot.begin(), one_shot.begin() + covered),
                       std::vector<float>(dense.begin(), dense.begin() + covered), 1e-5, 1e-4));
  double max_difference = 0;
  for (size_t i = covered; i < dense.size(); ++i) {
    max_difference = std::max(max_difference, double(std::fabs(one_shot[i] - dense[i])));
  }
  EXPECT_GT(max_difference, 1e-2) << name << ": a 4+16 window over 156 positions changed nothing";
}

TEST_P(CpuModelWindowTest, InvalidWindowIsAnError) {
  auto cache = model_->CreateKvCache(16, 4);
  ASSERT_TRUE(cache.ok());
  KvSequence sequence;
  ForwardResult result;
  const std::vector<int> tokens = {1, 2, 3};
  const ForwardEntry entry{&sequence, tokens, 0, LogitsWanted::kLast};
  for (const AttentionWindow window : {AttentionWindow{-1, 4}, AttentionWindow{4, 0}}) {
    const Status status = model_->Forward({&entry, 1}, **cache, result, window);
    EXPECT_EQ(status.code(), StatusCode::kInvalidArgument);
    EXPECT_NE(status.message().find("sink must be >= 0 and recent >= 1"), std::string::npos)
        << status.message();
  }
  EXPECT_EQ(sequence.num_tokens, 0);
  EXPECT_EQ((*cache)->free_blocks(), 4);
}

INSTANTIATE_TEST_SUITE_P(TinyModels, CpuModelWindowTest,
                         ::testing::Values(TinyModelKind::kQwen3, TinyModelKind::kQwen2,
                                           TinyModelKind::kLlama),
                         [](const auto& info) { return TinyModelName(info.param); });

}  // namespace
}  // namespace rubato
