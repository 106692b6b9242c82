// LongFlow on the CUDA model (evicting KV on the device): with a budget covering the context the
// logits equal the CUDA dense model's bit for bit and the engine gives the dense tokens; a prompt
// longer than the budget keeps the same positions (SnapKV scoring on the GPU) and a scripted run
// evicts the same slots as the CPU backend, with outputs within bf16 tolerance; decode steps
// replay as CUDA graphs.
//
// Bit for bit needs the same launch shape: the slot launch sizes its splits for B keys, the
// dense launch for its bucket (DecodeSeqLenBucket: 4096 for short contexts), so B = 4096 here.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <cstring>
#include <random>
#include <vector>

#include "inference_rank/model/cuda_evicting_kv_storage.h"
#include "inference_rank/policies/longflow/longflow_policy.h"
#include "tests/gpu/cuda_model_test_util.h"
#include "tests/gpu/gpu_test_util.h"

namespace rubato {
namespace {

using namespace cuda_model_test;

constexpr int kLayers = 3;
constexpr int kKvHeads = 2;
constexpr int kHeadDim = 64;

std::string Config() {
  return SmallConfigJson("Qwen3ForCausalLM", 256, 8, kKvHeads, kHeadDim, 512, kLayers, 300, true);
}

LongFlowConfig SmallConfig(int budget) {
  LongFlowConfig config;
  config.budget = budget;
  config.sink_tokens = 4;
  config.snapkv_window = 8;
  config.snapkv_pool_kernel = 3;
  return config;
}

struct LongFlowRun {
  std::vector<std::vector<float>> logits;       // [steps + 1][vocab]: the prompt's last, decode
  std::vector<std::vector<int32_t>> next;       // [steps + 1][layers x kv heads] after each
  std::vector<std::vector<float>> prompt_keys;  // [layers][kv heads x B x head_dim] after prefill
  LongFlowCounters counters;
};

// Every layer's next slots of `slots` (host or device pool).
std::vector<int32_t> NextSlots(const EvictingKvPool& pool, const EvictingKvSlots& slots) {
  const EvictingKvShape& s = pool.shape();
  std::vector<int32_t> next;
  for (int layer = 0; layer < s.num_layers; ++layer) {
    std::vector<int32_t> row(static_cast<size_t>(s.num_kv_heads));
    if (auto* device = dynamic_cast<DeviceEvictingKvStorage*>(pool.storage())) {
      EXPECT_EQ(cudaMemcpy(row.data(),
                           device->layer_next_slot(layer) +
                               static_cast<size_t>(slots.array) * s.num_kv_heads,
                           row.size() * sizeof(int32_t), cudaMemcpyDeviceToHost),
                cudaSuccess);
    } else {
      const EvictingKvView view = pool.LayerView(layer, slots);
      row.assign(view.next_slot, view.next_slot + s.num_kv_heads);
    }
    next.insert(next.end(), row.begin(), row.end());
  }
  return next;
}

// One layer's slot keys ([kv heads][B][head_dim]) as floats.
std::vector<float> SlotKeys(const EvictingKvPool& pool, const EvictingKvSlots& slots, int layer) {
  const EvictingKvShape& s = pool.shape();
  const size_t count = static_cast<size_t>(s.num_kv_heads) * s.budget * s.head_dim;
  if (auto* device = dynamic_cast<DeviceEvictingKvStorage*>(pool.storage())) {
    std::vector<__nv_bfloat16> raw(count);
    EXPECT_EQ(cudaMemcpy(raw.data(), device->layer_keys(layer) + slots.array * count,
                         count * sizeof(__nv_bfloat16), cudaMemcpyDeviceToHost),
              cudaSuccess);
    return gpu_test::FromBf16(raw);
  }
  const EvictingKvView view = pool.LayerView(layer, slots);
  return std::vector<float>(view.keys, view.keys + count);
}

// Prefill in two chunks, then `steps` teacher-forced decode tokens (`forced`, else greedy),
// through Model::Forward; with `policy`, on evicting KV as the engine runs it (prompt blocks
// released after prefill).
LongFlowRun Forward(Model& model, LongFlowPolicy* policy, const std::vector<int>& prompt, int steps,
                    const std::vector<int>& forced = {}) {
  LongFlowRun run;
  const int length = static_cast<int>(prompt.size());
  auto cache = NewCache(model, 16, 512);  // 8192 positions: a dense bucket of 4096
  std::unique_ptr<EvictingKvPool> pool;
  std::unique_ptr<PolicyRequest> request;
  EvictingForward evicting;
  if (policy != nullptr) {
    auto backend = policy->MakeBackend(model, 1);
    EXPECT_TRUE(backend.ok()) << backend.status().ToString();
    if (!backend.ok()) return run;
    EXPECT_TRUE(model.SetAttentionBackend(std::move(backend).value()).ok());
    auto made = model.CreateEvictingKvPool(policy->config().budget, 2);
    EXPECT_TRUE(made.ok()) << made.status().ToString();
    if (!made.ok()) return run;
    pool = std::move(made).value();
    evicting.pool = pool.get();
    EvictingKvSlots unused;  // array 0 stays free: the request writes array 1
    EXPECT_TRUE(pool->Reserve(unused).ok());
    EXPECT_TRUE(pool->Reserve(evicting.slots).ok());
    request = policy->Admit(KvResidency::kEvicting);
  }
  KvSequence sequence;
  ForwardResult result;
  const int first_chunk = length / 2 + 3;
  int next_token = -1;
  for (int start = 0, step = 0; step <= steps; ++step) {
    ForwardEntry entry;
    entry.sequence = &sequence;
    entry.start_position = start;
    if (start < length) {
      const int end = start == 0 ? first_chunk : length;
      entry.tokens = std::span<const int>(prompt).subspan(start, end - start);
      entry.logits = end == length ? LogitsWanted::kLast : LogitsWanted::kNone;
      if (request) entry.attention = request->PlanPrefill(start, end - start, end == length);
      step -= end != length;  // the first chunk is not a step
    } else {
      entry.tokens = std::span<const int>(&next_token, 1);
      if (request) entry.attention = request->PlanDecode(start);
    }
    if (request) entry.evicting = &evicting;
    const Status status = model.Forward(std::span<const ForwardEntry>(&entry, 1), *cache, result);
    EXPECT_TRUE(status.ok()) << status.ToString();
    if (!status.ok()) break;
    start += static_cast<int>(entry.tokens.size());
    if (request && start == length && entry.tokens.size() > 1) {
      EXPECT_TRUE(cache->Release(sequence).ok());  // as the engine does: the prompt is in slots
      sequence.num_tokens = length;
      for (int layer = 0; layer < kLayers; ++layer) {
        run.prompt_keys.push_back(SlotKeys(*pool, evicting.slots, layer));
      }
    }
    if (entry.logits == LogitsWanted::kNone) continue;
    const std::span<const float> last = result.LastLogits(0);
    run.logits.emplace_back(last.begin(), last.end());
    if (pool != nullptr) run.next.push_back(NextSlots(*pool, evicting.slots));
    const size_t taken = run.logits.size() - 1;
    next_token = taken < forced.size() ? forced[taken] : ArgMax(last);
    if (request) request->Observe(start > length, next_token, -1.f);
  }
  if (policy != nullptr) run.counters = policy->counters();
  return run;
}

TEST(CudaLongFlow, BudgetCoveringTheContextEqualsDenseBitForBit) {
  ModelPair dense = MakeModelPair(Config(), /*seed=*/9);
  ModelPair longflow = MakeModelPair(Config(), /*seed=*/9);
  ASSERT_NE(dense.cuda, nullptr);
  std::mt19937_64 rng(11);
  const std::vector<int> prompt = RandomTokens(rng, 300, dense.cuda->config().vocab_size);
  const LongFlowRun want = Forward(*dense.cuda, nullptr, prompt, 24);
  LongFlowPolicy policy(SmallConfig(4096));
  const LongFlowRun got = Forward(*longflow.cuda, &policy, prompt, 24);
  ASSERT_EQ(got.logits.size(), want.logits.size());
  for (size_t step = 0; step < want.logits.size(); ++step) {
    ASSERT_EQ(got.logits[step].size(), want.logits[step].size());
    EXPECT_EQ(std::memcmp(got.logits[step].data(), want.logits[step].data(),
                          want.logits[step].size() * sizeof(float)),
              0)
        << "step " << step << ": max |diff| " << MaxAbsDiff(got.logits[step], want.logits[step]);
  }
  // The slots fill in order: after the prompt and each token, every head's next slot is the
  // next position.
  for (size_t step = 0; step < got.next.size(); ++step) {
    for (int32_t next : got.next[step]) EXPECT_EQ(next, 300 + static_cast<int>(step));
  }
  EXPECT_EQ(got.counters.evictions, 0);
  EXPECT_EQ(got.counters.prompt_evictions, 0);
  EXPECT_GT(longflow.cuda->graph_replays(), 0);
}

TEST(CudaLongFlow, EngineWithBudgetCoveringTheContextGivesTheDenseTokens) {
  ModelPair dense = MakeModelPair(Config(), /*seed=*/9);
  ModelPair longflow = MakeModelPair(Config(), /*seed=*/9);
  ASSERT_NE(dense.cuda, nullptr);
  const int vocab = dense.cuda->config().vocab_size;
  std::mt19937_64 rng(17);
  const std::vector<std::vector<int>> prompts = {
      RandomTokens(rng, 600, vocab), RandomTokens(rng, 333, vocab), RandomTokens(rng, 901, vocab)};
  EngineOptions options;
  options.max_batch = 3;
  const auto dense_tokens = EngineGreedyTokens(std::move(dense.cuda), options, prompts);
  auto policy = std::make_shared<LongFlowPolicy>(SmallConfig(4096));
  options.policy = policy;
  options.kv_residency = KvResidency::kEvicting;
  const auto longflow_tokens = EngineGreedyTokens(std::move(longflow.cuda), options, prompts);
  EXPECT_EQ(longflow_tokens, dense_tokens);
  EXPECT_EQ(policy->counters().evictions, 0);
}

// q/k-norm weights scaled so that attention is peaked and the scores that decide kept sets and
// evictions stand far above bf16 rounding.
ModelPair SharpModelPair(uint64_t seed) {
  return MakeModelPair(Config(), seed, /*use_cuda_graph=*/true, [](ModelWeights& w) {
    for (LayerWeights& layer : w.layers) {
      for (float& x : layer.q_norm) x *= 2.f;
      for (float& x : layer.k_norm) x *= 2.f;
    }
  });
}

// Prompt 200 > B = 96 (window 8, kernel 3, 4 sinks), then 16 teacher-forced steps (every one
// evicts). Kept sets: the slot keys after prefill (a differing position shows as a different key
// row; bf16 against f32 keys otherwise). Evictions: every step's next slot of every (layer, KV
// head). Outputs: logits within the CUDA model's usual bf16 tolerance of the CPU backend's
// (kRowRelL2 = 2e-2 relative L2 per row, cuda_model_test_util.h).
TEST(CudaLongFlow, LongPromptKeepsAndEvictsAsTheCpuBackend) {
  ModelPair pair = SharpModelPair(21);
  ASSERT_NE(pair.cuda, nullptr);
  const int vocab = pair.cuda->config().vocab_size;
  std::mt19937_64 rng(5);
  const std::vector<int> prompt = RandomTokens(rng, 200, vocab);
  const std::vector<int> forced = RandomTokens(rng, 17, vocab);
  constexpr int kSteps = 16;
  LongFlowPolicy cpu_policy(SmallConfig(96));
  LongFlowPolicy cuda_policy(SmallConfig(96));
  const LongFlowRun cpu = Forward(*pair.cpu, &cpu_policy, prompt, kSteps, forced);
  const LongFlowRun cuda = Forward(*pair.cuda, &cuda_policy, prompt, kSteps, forced);
  ASSERT_EQ(cuda.logits.size(), cpu.logits.size());
  ASSERT_EQ(cuda.prompt_keys.size(), cpu.prompt_keys.size());
  for (size_t layer = 0; layer < cpu.prompt_keys.size(); ++layer) {
    EXPECT_TRUE(gpu_test::Bf16Close("slot keys after the prompt, layer " + std::to_string(layer),
                                    cuda.prompt_keys[layer], cpu.prompt_keys[layer], 2e-2, 1e-2));
  }
  ASSERT_EQ(cuda.next.size(), cpu.next.size());
  for (size_t step = 0; step < cpu.next.size(); ++step) {
    EXPECT_EQ(cuda.next[step], cpu.next[step]) << "next slots after step " << step;
  }
  std::vector<float> cpu_rows, cuda_rows;
  for (size_t s = 0; s < cpu.logits.size(); ++s) {
    cpu_rows.insert(cpu_rows.end(), cpu.logits[s].begin(), cpu.logits[s].end());
    cuda_rows.insert(cuda_rows.end(), cuda.logits[s].begin(), cuda.logits[s].end());
  }
  ExpectRowsClose("longflow CUDA vs CPU", cuda_rows, cpu_rows, vocab);
  EXPECT_EQ(cuda.counters.evictions, cpu.counters.evictions);
  EXPECT_EQ(cuda.counters.prompt_evictions, cpu.counters.prompt_evictions);
  EXPECT_EQ(cuda.counters.evictions, int64_t{kSteps} * kLayers * kKvHeads);
  EXPECT_EQ(cuda.counters.prompt_evictions, int64_t{200 - 96} * kLayers * kKvHeads);
  EXPECT_GT(pair.cuda->graph_replays(), 0);
}

TEST(CudaLongFlow, AHostPoolIsRefusedByTheCudaModel) {
  ModelPair pair = MakeModelPair(Config(), 3);
  ASSERT_NE(pair.cuda, nullptr);
  LongFlowPolicy policy(SmallConfig(96));
  ASSERT_TRUE(pair.cuda->SetAttentionBackend(policy.MakeBackend(*pair.cuda, 1).value()).ok());
  auto host_pool = pair.cpu->CreateEvictingKvPool(96, 1).value();
  EvictingForward evicting{host_pool.get(), {}};
  ASSERT_TRUE(host_pool->Reserve(evicting.slots).ok());
  auto request = policy.Admit(KvResidency::kEvicting);
  auto cache = NewCache(*pair.cuda, 16, 64);
  KvSequence sequence;
  const std::vector<int> prompt(20, 7);
  ForwardEntry entry{&sequence, prompt, 0, LogitsWanted::kLast};
  entry.attention = request->PlanPrefill(0, 20, true);
  entry.evicting = &evicting;
  ForwardResult result;
  EXPECT_TRUE(gpu_test::FailsWith(pair.cuda->Forward({&entry, 1}, *cache, result),
                                  StatusCode::kInvalidArgument, "not created by a CUDA model"));
}

}  // namespace
}  // namespace rubato
