// Tests for the CPU model's forward pass on tiny random Qwen3 / Qwen2 / Llama models: chunked
// prefill equals one-shot prefill, a batch equals its entries run alone, rewinding a sequence,
// checkpoint round trips, sampling after the forward (ForwardEntry::sampling), and bad batches /
// a full KV cache as errors.
#include "inference_rank/model/cpu_model.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <fstream>
#include <set>
#include <vector>

#include "common/safetensors_writer.h"
#include "common/test_temp_dir.h"
#include "inference_rank/model/tiny_test_models.h"
#include "kernels/cpu/all_close_for_test.h"
#include "kernels/cpu/sampling.h"

namespace rubato {
namespace {

constexpr double kAtol = 1e-5;
constexpr double kRtol = 1e-4;

std::vector<int> TestPrompt(int length, int salt) {
  std::vector<int> ids;
  for (int i = 0; i < length; ++i) ids.push_back((i * 31 + salt * 17 + 5) % 97);
  return ids;
}

class CpuModelTest : public ::testing::TestWithParam<TinyModelKind> {
 protected:
  void SetUp() override {
    Result<std::unique_ptr<CpuModel>> model = LoadTinyModel(GetParam(), dir_.path());
    ASSERT_TRUE(model.ok()) << model.status().ToString();
    model_ = std::move(model).value();
  }
  std::unique_ptr<PagedKvCache> NewCache(int blocks = 64) {
    Result<std::unique_ptr<PagedKvCache>> cache = model_->CreateKvCache(16, blocks);
    EXPECT_TRUE(cache.ok()) << cache.status().ToString();
    return std::move(cache).value();
  }
  // Prefills `prompt` in chunks of `chunk` tokens, returning the logits of every position.
  std::vector<float> PrefillAll(const std::vector<int>& prompt, int chunk, PagedKvCache& cache,
                                KvSequence& sequence) {
    std::vector<float> logits;
    ForwardResult result;
    for (int start = 0; start < static_cast<int>(prompt.size()); start += chunk) {
      const int n = std::min<int>(chunk, static_cast<int>(prompt.size()) - start);
      const ForwardEntry entry{&sequence, std::span<const int>(prompt).subspan(start, n), start,
                               LogitsWanted::kAll};
      const Status status = model_->Forward({&entry, 1}, cache, result);
      EXPECT_TRUE(status.ok()) << status.ToString();
      const std::span<const float> rows = result.EntryLogits(0);
      logits.insert(logits.end(), rows.begin(), rows.end());
    }
    return logits;
  }
  // Greedy decoding from a prefilled sequence: the tokens and each step's logits.
  std::vector<int> Decode(int first_token, int steps, PagedKvCache& cache, KvSequence& sequence,
                          std::vector<float>* logits) {
    std::vector<int> tokens = {first_token};
    ForwardResult result;
    for (int step = 0; step < steps; ++step) {
      const ForwardEntry entry{&sequence, std::span<const int>(&tokens.back(), 1),
                               sequence.num_tokens, LogitsWanted::kLast};
      const Status status = model_->Forward({&entry, 1}, cache, result);
      EXPECT_TRUE(status.ok()) << status.ToString();
      const std::span<const float> row = result.LastLogits(0);
      logits->insert(logits->end(), row.begin(), row.end());
      tokens.push_back(ArgMax(row));
    }
    return tokens;
  }

  TestTempDir dir_{"cpu_model"};
  std::unique_ptr<CpuModel> model_;
};

TEST_P(CpuModelTest, ChunkedPrefillMatchesOneShotAndDecodeContinues) {
  const std::vector<int> prompt = TestPrompt(45, 1);
  auto cache = NewCache();
  KvSequence one_shot, chunked;
  const std::vector<float> reference = PrefillAll(prompt, 45, *cache, one_shot);
  const std::vector<float> logits = PrefillAll(prompt, 7, *cache, chunked);
  ASSERT_EQ(reference.size(), 45u * 97);
  EXPECT_EQ(one_shot.num_tokens, 45);
  EXPECT_EQ(chunked.num_tokens, 45);
  EXPECT_TRUE(AllClose(TinyModelName(GetParam()) + " prefill chunks of 7 vs one shot", logits,
                       reference, kAtol, kRtol));

  // Decoding 10 greedy steps from either cache gives the same tokens and logits.
  const int first = ArgMax(std::span<const float>(reference).subspan(44 * 97, 97));
  std::vector<float> decode_reference, decode_chunked;
  const std::vector<int> a = Decode(first, 10, *cache, one_shot, &decode_reference);
  const std::vector<int> b = Decode(first, 10, *cache, chunked, &decode_chunked);
  EXPECT_EQ(a, b);
  EXPECT_TRUE(AllClose(TinyModelName(GetParam()) + " decode after chunked prefill", decode_chunked,
                       decode_reference, kAtol, kRtol));
  EXPECT_EQ(one_shot.num_tokens, 55);
}

TEST_P(CpuModelTest, BatchOfMixedEntriesMatchesEachEntryAlone) {
  // Three sequences: one mid-prompt (prefill chunk of 9 after 20), one decoding (1 token after
  // 33), one fresh prompt of 5 with logits for every position.
  const std::vector<int> p0 = TestPrompt(29, 2), p1 = TestPrompt(34, 3), p2 = TestPrompt(5, 4);
  auto alone_cache = NewCache();
  auto batch_cache = NewCache();
  KvSequence alone[3], batched[3];
  ForwardResult result;
  // History: 20 tokens of p0 and 33 of p1 in both caches.
  for (auto [cache, seqs] : {std::pair{alone_cache.get(), alone}, {batch_cache.get(), batched}}) {
    const ForwardEntry history[2] = {
        {&seqs[0], std::span<const int>(p0).first(20), 0, LogitsWanted::kNone},
        {&seqs[1], std::span<const int>(p1).first(33), 0, LogitsWanted::kNone}};
    ASSERT_TRUE(model_->Forward(history, *cache, result).ok());
  }
  const ForwardEntry step[3] = {
      {&batched[0], std::span<const int>(p0).subspan(20), 20, LogitsWanted::kLast},
      {&batched[1], std::span<const int>(p1).subspan(33), 33, LogitsWanted::kLast},
      {&batched[2], std::span<const int>(p2), 0, LogitsWanted::kAll}};
  ASSERT_TRUE(model_->Forward(step, *batch_cache, result).ok());
  ASSERT_EQ(result.logits.size(), (1u + 1u + 5u) * 97);
  for (int e = 0; e < 3; ++e) {
    ForwardEntry single = step[e];
    single.sequence = &alone[e];
    ForwardResult single_result;
    ASSERT_TRUE(model_->Forward({&single, 1}, *alone_cache, single_result).ok());
    const std::span<const float> got = result.EntryLogits(e);
    const std::span<const float> want = single_result.EntryLogits(0);
    EXPECT_TRUE(AllClose(TinyModelName(GetParam()) + " batch entry " + std::to_string(e), got, want,
                         kAtol, kRtol));
    EXPECT_EQ(ArgMax(result.LastLogits(e)), ArgMax(single_result.LastLogits(0)));
    EXPECT_EQ(batched[e].num_tokens, alone[e].num_tokens);
  }
}

TEST_P(CpuModelTest, RewindingOverwritesTheTail) {
  const std::vector<int> prompt = TestPrompt(20, 5);
  std::vector<int> edited = prompt;
  for (int i = 12; i < 20; ++i) edited[i] = (edited[i] + 40) % 97;
  auto cache = NewCache();
  KvSequence fresh, rewound;
  const std::vector<float> reference = PrefillAll(edited, 20, *cache, fresh);
  PrefillAll(prompt, 20, *cache, rewound);
  // Re-feed positions 12.. with the edited tokens.
  ForwardResult result;
  const ForwardEntry entry{&rewound, std::span<const int>(edited).subspan(12), 12,
                           LogitsWanted::kAll};
  ASSERT_TRUE(model_->Forward({&entry, 1}, *cache, result).ok());
  EXPECT_EQ(rewound.num_tokens, 20);
  EXPECT_TRUE(AllClose("rewound tail", result.EntryLogits(0),
                       std::span<const float>(reference).subspan(12 * 97), kAtol, kRtol));
}

INSTANTIATE_TEST_SUITE_P(TinyModels, CpuModelTest,
                         ::testing::Values(TinyModelKind::kQwen3, TinyModelKind::kQwen2,
                                           TinyModelKind::kLlama),
                         [](const auto& info) { return TinyModelName(info.param); });

TEST(CpuModel, ThreadCountDoesNotChangeLogits) {
  TestTempDir dir("cpu_model");
  auto one = LoadTinyModel(TinyModelKind::kQwen3, dir.path(), 1, /*num_threads=*/1);
  auto four = LoadTinyModel(TinyModelKind::kQwen3, dir.path(), 1, /*num_threads=*/4);
  ASSERT_TRUE(one.ok() && four.ok());
  const std::vector<int> prompt = TestPrompt(30, 6);
  std::vector<float> logits[2];
  for (int i = 0; i < 2; ++i) {
    CpuModel& model = i == 0 ? **one : **four;
    auto cache = model.CreateKvCache(16, 8);
    ASSERT_TRUE(cache.ok());
    KvSequence sequence;
    ForwardResult result;
    const ForwardEntry entry{&sequence, prompt, 0, LogitsWanted::kAll};
    ASSERT_TRUE(model.Forward({&entry, 1}, **cache, result).ok());
    logits[i] = result.logits;
  }
  EXPECT_EQ(logits[0], logits[1]);  // attention work items are independent of the thread
}

TEST(CpuModel, LoadingAWrittenCheckpointGivesTheSameLogits) {
  TestTempDir random_dir("cpu_model"), checkpoint_dir("cpu_model");
  auto random = LoadTinyModel(TinyModelKind::kLlama, random_dir.path(), 9);
  ASSERT_TRUE(random.ok());
  ModelWeights weights = (*random)->weights();
  std::vector<std::pair<std::string, TensorView>> tensors;
  for (const WeightSlot& slot : ListWeights((*random)->config(), &weights)) {
    tensors.push_back({slot.name, TensorView{slot.storage->data(), DType::kF32, slot.shape}});
  }
  ASSERT_TRUE(WriteSafetensors(checkpoint_dir.path() / "model.safetensors", tensors).ok());
  std::filesystem::copy_file(random_dir.path() / "config.json",
                             checkpoint_dir.path() / "config.json");
  auto loaded = CpuModel::Load(checkpoint_dir.path(), ModelLoadOptions{});
  ASSERT_TRUE(loaded.ok()) << loaded.status().ToString();

  const std::vector<int> prompt = TestPrompt(17, 7);
  std::vector<float> logits[2];
  for (int i = 0; i < 2; ++i) {
    CpuModel& model = i == 0 ? **random : **loaded;
    auto cache = model.CreateKvCache(64, 2);
    ASSERT_TRUE(cache.ok());
    KvSequence sequence;
    ForwardResult result;
    const ForwardEntry entry{&sequence, prompt, 0, LogitsWanted::kAll};
    ASSERT_TRUE(model.Forward({&entry, 1}, **cache, result).ok());
    logits[i] = result.logits;
  }
  EXPECT_EQ(logits[0], logits[1]);
}

TEST(CpuModel, LoadReportsMissingConfigAndCheckpoint) {
  TestTempDir dir("cpu_model");
  auto no_config = CpuModel::Load(dir.path(), ModelLoadOptions{});
  ASSERT_FALSE(no_config.ok());
  EXPECT_NE(no_config.status().message().find("loading model " + dir.path().string()),
            std::string::npos);
  std::ofstream(dir.path() / "config.json") << TinyConfigJson(TinyModelKind::kQwen2);
  auto no_weights = CpuModel::Load(dir.path(), ModelLoadOptions{});
  ASSERT_FALSE(no_weights.ok());
  EXPECT_NE(no_weights.status().message().find("loading model"), std::string::npos);
}

class CpuModelErrorsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto model = LoadTinyModel(TinyModelKind::kQwen3, dir_.path());
    ASSERT_TRUE(model.ok());
    model_ = std::move(model).value();
    cache_ = std::move(model_->CreateKvCache(16, 3)).value();  // 48 positions in all
  }
  TestTempDir dir_{"cpu_model"};
  std::unique_ptr<CpuModel> model_;
  std::unique_ptr<PagedKvCache> cache_;
  ForwardResult result_;
};

TEST_F(CpuModelErrorsTest, FullKvCacheIsResourceExhaustedAndChangesNothing) {
  const std::vector<int> prompt = TestPrompt(40, 8);
  KvSequence a, b;
  const ForwardEntry first{&a, prompt, 0, LogitsWanted::kLast};  // 3 blocks: all of them
  ASSERT_TRUE(model_->Forward({&first, 1}, *cache_, result_).ok());
  EXPECT_EQ(cache_->free_blocks(), 0);
  const ForwardEntry second[2] = {
      {&a, std::span<const int>(prompt).first(9), 40, LogitsWanted::kLast},  // needs 1 block
      {&b, std::span<const int>(prompt).first(3), 0, LogitsWanted::kLast}};  // needs 1 block
  const Status status = model_->Forward(second, *cache_, result_);
  EXPECT_EQ(status.code(), StatusCode::kResourceExhausted);
  EXPECT_NE(status.message().find("needs 2 more KV blocks but only 0 of 3 are free"),
            std::string::npos)
      << status.message();
  EXPECT_EQ(a.num_tokens, 40);
  EXPECT_EQ(a.block_table.size(), 3u);
  EXPECT_TRUE(b.block_table.empty());
  // Freeing a makes room for b.
  ASSERT_TRUE(cache_->Release(a).ok());
  EXPECT_TRUE(model_->Forward({&second[1], 1}, *cache_, result_).ok());
}

TEST_F(CpuModelErrorsTest, BadEntriesAreNamed) {
  KvSequence a;
  const std::vector<int> bad_token = {1, 97};
  const std::vector<int> ok_tokens = {1, 2};
  const ForwardEntry out_of_vocab{&a, bad_token, 0, LogitsWanted::kLast};
  Status status = model_->Forward({&out_of_vocab, 1}, *cache_, result_);
  EXPECT_EQ(status.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(status.message().find("token id 97 at index 1 is outside the vocabulary [0, 97)"),
            std::string::npos)
      << status.message();

  const ForwardEntry past_end{&a, ok_tokens, 5, LogitsWanted::kLast};
  status = model_->Forward({&past_end, 1}, *cache_, result_);
  EXPECT_NE(status.message().find("starts at position 5 but its sequence holds 0 tokens"),
            std::string::npos)
      << status.message();

  const ForwardEntry twice[2] = {{&a, ok_tokens, 0, LogitsWanted::kLast},
                                 {&a, ok_tokens, 0, LogitsWanted::kLast}};
  status = model_->Forward(twice, *cache_, result_);
  EXPECT_NE(status.message().find("batch entry 1 uses the same sequence as entry 0"),
            std::string::npos)
      << status.message();

  const ForwardEntry empty{&a, {}, 0, LogitsWanted::kLast};
  EXPECT_EQ(model_->Forward({&empty, 1}, *cache_, result_).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(cache_->free_blocks(), 3);  // nothing reserved by failed calls

  auto wrong_cache = PagedKvCache::Create(KvCacheShape{1, 2, 16, 16, 4});
  ASSERT_TRUE(wrong_cache.ok());
  const ForwardEntry entry{&a, ok_tokens, 0, LogitsWanted::kLast};
  status = model_->Forward({&entry, 1}, **wrong_cache, result_);
  EXPECT_NE(status.message().find("not for this model"), std::string::npos) << status.message();
}

TEST_F(CpuModelErrorsTest, SamplesTheEntriesThatAskFromTheirLastLogits) {
  const std::vector<int> prompt_a = TestPrompt(7, 3), prompt_b = TestPrompt(5, 4);
  const std::vector<int> prompt_c = TestPrompt(4, 5);
  KvSequence a, b, c;
  const TokenSampling greedy;  // temperature 0
  const TokenSampling hot{/*temperature=*/1.5f, /*top_k=*/20, /*top_p=*/0.9f, /*uniform=*/0.73};
  const ForwardEntry batch[3] = {{&a, prompt_a, 0, LogitsWanted::kLast, &greedy},
                                 {&b, prompt_b, 0, LogitsWanted::kAll, &hot},
                                 {&c, prompt_c, 0, LogitsWanted::kLast}};
  ASSERT_TRUE(model_->Forward(batch, *cache_, result_).ok());
  ASSERT_EQ(result_.sampled_tokens.size(), 3u);
  EXPECT_EQ(result_.sampled_tokens[0], ArgMax(result_.LastLogits(0)));
  SamplingWorkspace workspace;
  EXPECT_EQ(result_.sampled_tokens[1],
            SampleTokenWithUniform(result_.LastLogits(1), SamplingFilter{1.5f, 20, 0.9f}, 0.73,
                                   workspace));
  EXPECT_EQ(result_.sampled_tokens[2], -1);                        // no sampling asked
  EXPECT_EQ(result_.EntryLogits(1).size(), prompt_b.size() * 97);  // kAll keeps every row
  // Different uniforms reach different tokens of a flat enough distribution.
  std::set<int> tokens;
  for (double u : {0.01, 0.3, 0.6, 0.99}) {
    tokens.insert(SampleOnHost(result_.LastLogits(1), TokenSampling{5.f, 0, 1.f, u}, workspace));
  }
  EXPECT_GT(tokens.size(), 1u);
}

TEST_F(CpuModelErrorsTest, BadSamplingIsNamedAndReservesNothing) {
  KvSequence a;
  const std::vector<int> tokens = {1, 2};
  const TokenSampling greedy;
  const ForwardEntry no_logits{&a, tokens, 0, LogitsWanted::kNone, &greedy};
  Status status = model_->Forward({&no_logits, 1}, *cache_, result_);
  EXPECT_EQ(status.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(status.message().find("batch entry 0 asks for sampling but wants no logits"),
            std::string::npos)
      << status.message();
  const TokenSampling bad[] = {{-1.f, 0, 1.f, 0.5}, {1.f, -2, 1.f, 0.5}, {1.f, 0, 0.f, 0.5},
                               {1.f, 0, 1.5f, 0.5}, {1.f, 0, 1.f, 1.0},  {1.f, 0, 1.f, -0.1}};
  for (const TokenSampling& sampling : bad) {
    const ForwardEntry entry{&a, tokens, 0, LogitsWanted::kLast, &sampling};
    status = model_->Forward({&entry, 1}, *cache_, result_);
    EXPECT_EQ(status.code(), StatusCode::kInvalidArgument);
    EXPECT_NE(status.message().find("sampling"), std::string::npos) << status.message();
  }
  // Greedy ignores the uniform.
  const TokenSampling greedy_any_uniform{0.f, 0, 1.f, 7.0};
  const ForwardEntry entry{&a, tokens, 0, LogitsWanted::kLast, &greedy_any_uniform};
  EXPECT_TRUE(model_->Forward({&entry, 1}, *cache_, result_).ok());
  EXPECT_EQ(result_.sampled_tokens[0], ArgMax(result_.LastLogits(0)));
}

}  // namespace
}  // namespace rubato
