// The CPU model with the offloaded residency's model half (offloaded_cpu_backend.h, its
// exchange kv_offload.h) against an in-test exchange that plays the
// cache rank: it stores every K/V the model hands over and answers CompactFor with every stored
// position before the recent segment (offload-dense).
//   * offloaded decoding gives the dense logits (every element, tight tolerance: the keys are
//     summed in another order), through chunked prefill, for recent segments of 1 and 5;
//   * the exchange sees every layer's K/V of every token, equal to what the model appended to
//     its own paged cache, and the last token's query;
//   * an exchange error ends the forward with that error; bad offloaded entries are refused.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <map>
#include <vector>

#include "common/test_temp_dir.h"
#include "inference_rank/model/cpu_model.h"
#include "inference_rank/model/tiny_test_models.h"
#include "inference_rank/residency/offloaded/kv_offload.h"
#include "inference_rank/residency/offloaded/offloaded_cpu_backend.h"
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

// Keeps a copy of every position's K/V per (session, layer) and serves all positions in
// [0, position + 1 - recent) as the compact segment.
class DenseTestExchange : public KvOffloadExchange {
 public:
  DenseTestExchange(const ModelConfig& config, int recent) : config_(config), recent_(recent) {}

  Status LayerComputed(int layer, std::span<const OffloadLayerKv> entries) override {
    ++layer_calls_;
    if (fail_layer_computed_) return UnavailableError("test exchange: cache rank gone");
    const size_t row = static_cast<size_t>(config_.kv_dim());
    for (const OffloadLayerKv& entry : entries) {
      Stored& stored = store_[{entry.session_id, layer}];
      const size_t end = static_cast<size_t>(entry.start_position + entry.tokens);
      if (stored.keys.size() < end * row) {
        stored.keys.resize(end * row);
        stored.values.resize(end * row);
      }
      // The CPU model hands over f32 host buffers.
      EXPECT_EQ(entry.dtype, DType::kF32);
      EXPECT_EQ(entry.memory, OffloadMemory::kHost);
      const auto* keys = static_cast<const float*>(entry.keys);
      const auto* values = static_cast<const float*>(entry.values);
      const auto* last_query = static_cast<const float*>(entry.last_query);
      std::copy(keys, keys + entry.tokens * row,
                stored.keys.begin() + static_cast<ptrdiff_t>(entry.start_position * row));
      std::copy(values, values + entry.tokens * row,
                stored.values.begin() + static_cast<ptrdiff_t>(entry.start_position * row));
      stored.last_query.assign(last_query, last_query + config_.q_dim());
    }
    return Status::Ok();
  }

  Result<OffloadCompactKv> CompactFor(int layer, uint64_t session_id, int position) override {
    const auto found = store_.find({session_id, layer});
    if (found == store_.end()) return NotFoundError("test exchange: no KV for the session");
    const int kv_heads = config_.num_kv_heads;
    const int head_dim = config_.head_dim;
    const int count = std::max(0, position + 1 - recent_);
    const int capacity = std::max(count, 1);
    // [kv_heads][capacity][head_dim] from the stored [position][kv_heads][head_dim]
    compact_keys_.assign(static_cast<size_t>(kv_heads) * capacity * head_dim, 0.f);
    compact_values_.assign(compact_keys_.size(), 0.f);
    for (int h = 0; h < kv_heads; ++h) {
      for (int j = 0; j < count; ++j) {
        const size_t from = (static_cast<size_t>(j) * kv_heads + h) * head_dim;
        const size_t to = (static_cast<size_t>(h) * capacity + j) * head_dim;
        std::memcpy(&compact_keys_[to], &found->second.keys[from], head_dim * sizeof(float));
        std::memcpy(&compact_values_[to], &found->second.values[from], head_dim * sizeof(float));
      }
    }
    counts_.assign(static_cast<size_t>(kv_heads), count);
    OffloadCompactKv compact;
    compact.compact = CompactKvView{compact_keys_.data(), compact_values_.data(), kv_heads,
                                    capacity, head_dim};
    compact.counts = counts_.data();
    compact.recent_begin = count;
    ++compact_calls_;
    return compact;
  }

  struct Stored {
    std::vector<float> keys;    // [positions][kv_heads][head_dim]
    std::vector<float> values;  // [positions][kv_heads][head_dim]
    std::vector<float> last_query;  // [heads][head_dim] of the last LayerComputed
  };

  const ModelConfig config_;
  const int recent_;
  std::map<std::pair<uint64_t, int>, Stored> store_;  // by (session, layer)
  std::vector<float> compact_keys_, compact_values_;
  std::vector<int> counts_;
  int layer_calls_ = 0;
  int compact_calls_ = 0;
  bool fail_layer_computed_ = false;
};

class CpuModelOffloadTest : public ::testing::TestWithParam<TinyModelKind> {
 protected:
  void SetUp() override {
    auto model = LoadTinyModel(GetParam(), dir_.path());
    ASSERT_TRUE(model.ok()) << model.status().ToString();
    model_ = std::move(model).value();
    ASSERT_TRUE(model_->SetResidencyBackend(MakeOffloadedCpuBackend(model_->config())).ok());
    auto cache = model_->CreateKvCache(16, 64);
    ASSERT_TRUE(cache.ok());
    cache_ = std::move(cache).value();
  }

  // Prefills `prompt` in chunks of `chunk`, then decodes `steps` greedy tokens, offloaded
  // through `exchange` when set; returns the last logits of every forward.
  std::vector<float> Run(const std::vector<int>& prompt, int chunk, int steps,
                         KvOffloadExchange* exchange, KvSequence& sequence) {
    const OffloadForward offload{exchange, /*session_id=*/42};
    ForwardResult result;
    std::vector<float> logits;
    int token = 0;
    for (int start = 0; start < static_cast<int>(prompt.size()) + steps;) {
      const bool prefill = start < static_cast<int>(prompt.size());
      const int n = prefill ? std::min<int>(chunk, static_cast<int>(prompt.size()) - start) : 1;
      const std::span<const int> tokens =
          prefill ? std::span<const int>(prompt).subspan(start, n) : std::span<const int>(&token, 1);
      ForwardEntry entry{&sequence, tokens, start, LogitsWanted::kLast};
      entry.residency = exchange != nullptr ? &offload : nullptr;
      const Status status = model_->Forward({&entry, 1}, *cache_, result);
      EXPECT_TRUE(status.ok()) << status.ToString();
      if (!status.ok()) return logits;
      const std::span<const float> row = result.LastLogits(0);
      logits.insert(logits.end(), row.begin(), row.end());
      token = ArgMax(row);
      start += n;
    }
    return logits;
  }

  TestTempDir dir_{"cpu_model_offload"};
  std::unique_ptr<CpuModel> model_;
  std::unique_ptr<PagedKvCache> cache_;
};

TEST_P(CpuModelOffloadTest, OffloadedDenseDecodingGivesTheDenseLogits) {
  const std::vector<int> prompt = TestPrompt(29, 3);
  KvSequence local;
  const std::vector<float> dense = Run(prompt, 8, 10, nullptr, local);
  ASSERT_EQ(dense.size(), (4u + 10u) * kVocab);  // 4 prefill chunks, 10 decode steps
  for (const int recent : {1, 5}) {
    DenseTestExchange exchange(model_->config(), recent);
    KvSequence offloaded;
    const std::vector<float> logits = Run(prompt, 8, 10, &exchange, offloaded);
    EXPECT_TRUE(AllClose("recent " + std::to_string(recent), std::span<const float>(logits),
                         std::span<const float>(dense), 2e-5, 2e-5));
    // Every layer of every forward handed its K/V over; every decode step's layers asked for
    // their compact KV.
    EXPECT_EQ(exchange.layer_calls_, 14 * model_->config().num_layers);
    EXPECT_EQ(exchange.compact_calls_, 10 * model_->config().num_layers);
  }
}

TEST_P(CpuModelOffloadTest, TheExchangeGetsWhatTheModelAppendedLocally) {
  const ModelConfig& config = model_->config();
  DenseTestExchange exchange(config, 1);
  KvSequence sequence;
  const std::vector<int> prompt = TestPrompt(21, 5);
  Run(prompt, 6, 3, &exchange, sequence);
  const int length = sequence.num_tokens;
  ASSERT_EQ(length, 24);
  for (int layer = 0; layer < config.num_layers; ++layer) {
    const DenseTestExchange::Stored& stored = exchange.store_.at({42, layer});
    ASSERT_EQ(stored.keys.size(), static_cast<size_t>(length) * config.kv_dim());
    ASSERT_EQ(stored.last_query.size(), static_cast<size_t>(config.q_dim()));
    const PagedKvView kv = cache_->LayerView(layer, sequence);
    for (int position = 0; position < length; ++position) {
      for (int h = 0; h < config.num_kv_heads; ++h) {
        const float* local_key = kv.keys + kv.Offset(position, h);
        const float* local_value = kv.values + kv.Offset(position, h);
        const size_t at = (static_cast<size_t>(position) * config.num_kv_heads + h) *
                          config.head_dim;
        ASSERT_TRUE(std::equal(local_key, local_key + config.head_dim, &stored.keys[at]))
            << "layer " << layer << " position " << position << " head " << h;
        ASSERT_TRUE(std::equal(local_value, local_value + config.head_dim, &stored.values[at]));
      }
    }
  }
}

TEST_P(CpuModelOffloadTest, ExchangeErrorsEndTheForwardAndBadEntriesAreRefused) {
  DenseTestExchange exchange(model_->config(), 1);
  exchange.fail_layer_computed_ = true;
  KvSequence sequence;
  const std::vector<int> prompt = TestPrompt(5, 1);
  const OffloadForward offload{&exchange, 7};
  ForwardEntry entry{&sequence, prompt, 0, LogitsWanted::kLast};
  entry.residency = &offload;
  ForwardResult result;
  Status status = model_->Forward({&entry, 1}, *cache_, result);
  EXPECT_EQ(status.code(), StatusCode::kUnavailable);
  EXPECT_NE(status.message().find("cache rank gone"), std::string::npos) << status.message();

  const OffloadForward no_exchange{nullptr, 7};
  entry.residency = &no_exchange;
  status = model_->Forward({&entry, 1}, *cache_, result);
  EXPECT_EQ(status.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(status.message().find("without an exchange"), std::string::npos);

  exchange.fail_layer_computed_ = false;
  entry.residency = &offload;
  status = model_->Forward({&entry, 1}, *cache_, result, AttentionWindow{4, 8});
  EXPECT_EQ(status.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(status.message().find("dense forward window"), std::string::npos);
}

INSTANTIATE_TEST_SUITE_P(TinyModels, CpuModelOffloadTest,
                         ::testing::Values(TinyModelKind::kQwen3, TinyModelKind::kQwen2,
                                           TinyModelKind::kLlama),
                         [](const auto& info) { return TinyModelName(info.param); });

}  // namespace
}  // namespace rubato
