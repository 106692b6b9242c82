// LongFlow on the CUDA model (evicting KV on the device): with a budget covering the context the
// logits equal the CUDA dense model's bit for bit and the engine gives the dense tokens; a prompt
// longer than the budget keeps, layer by layer, the positions the CPU reference ops keep on the
// same inputs, and every step of a scripted run writes and chooses the slots they choose, with
// outputs within bf16 tolerance; the counters match the CPU backend's; decode steps replay as
// CUDA graphs.
//
// Bit for bit needs the same launch shape: the slot launch sizes its splits for B keys, the
// dense launch for its bucket (DecodeSeqLenBucket: 4096 for short contexts), so B = 4096 here.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <memory>
#include <random>
#include <vector>

#include "inference_rank/model/cuda_slot_kv_storage.h"
#include "inference_rank/policies/longflow/longflow_policy.h"
#include "inference_rank/policies/longflow/longflow_test_steps.h"
#include "inference_rank/residency/evicting/evicting_residency.h"
#include "kernels/cpu/longflow_attention.h"
#include "kernels/cpu/snapkv_scores.h"
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
std::vector<int32_t> NextSlots(const SlotKvPool& pool, const SlotKvArrays& slots) {
  const SlotKvShape& s = pool.shape();
  std::vector<int32_t> next;
  for (int layer = 0; layer < s.num_layers; ++layer) {
    std::vector<int32_t> row(static_cast<size_t>(s.num_kv_heads));
    if (auto* device = dynamic_cast<DeviceSlotKvStorage*>(pool.storage())) {
      EXPECT_EQ(cudaMemcpy(row.data(),
                           device->layer_next_slot(layer) +
                               static_cast<size_t>(slots.array) * s.num_kv_heads,
                           row.size() * sizeof(int32_t), cudaMemcpyDeviceToHost),
                cudaSuccess);
    } else {
      const SlotKvView view = pool.LayerView(layer, slots);
      row.assign(view.next_slot, view.next_slot + s.num_kv_heads);
    }
    next.insert(next.end(), row.begin(), row.end());
  }
  return next;
}

// One layer's slot keys ([kv heads][B][head_dim]) as floats.
std::vector<float> SlotKeys(const SlotKvPool& pool, const SlotKvArrays& slots, int layer) {
  const SlotKvShape& s = pool.shape();
  const size_t count = static_cast<size_t>(s.num_kv_heads) * s.budget * s.head_dim;
  if (auto* device = dynamic_cast<DeviceSlotKvStorage*>(pool.storage())) {
    std::vector<__nv_bfloat16> raw(count);
    EXPECT_EQ(cudaMemcpy(raw.data(), device->layer_keys(layer) + slots.array * count,
                         count * sizeof(__nv_bfloat16), cudaMemcpyDeviceToHost),
              cudaSuccess);
    return gpu_test::FromBf16(raw);
  }
  const SlotKvView view = pool.LayerView(layer, slots);
  return std::vector<float>(view.keys, view.keys + count);
}

// Prefill in two chunks, then `steps` teacher-forced decode tokens (`forced`, else greedy),
// through Model::Forward; with `policy`, on evicting KV as the engine runs it (prompt blocks
// released after prefill).
LongFlowRun Forward(Model& model, LongFlowPolicy* policy, const std::vector<int>& prompt, int steps,
                    const std::vector<int>& forced = {},
                    std::unique_ptr<AttentionBackend> backend_override = nullptr) {
  LongFlowRun run;
  const int length = static_cast<int>(prompt.size());
  auto cache = NewCache(model, 16, 512);  // 8192 positions: a dense bucket of 4096
  std::unique_ptr<SlotKvPool> pool;
  std::unique_ptr<PolicyRequest> request;
  SlotKvForward evicting;
  if (policy != nullptr) {
    auto backend = backend_override != nullptr
                       ? Result<std::unique_ptr<AttentionBackend>>(std::move(backend_override))
                       : policy->MakeBackend(model, 1);
    EXPECT_TRUE(backend.ok()) << backend.status().ToString();
    if (!backend.ok()) return run;
    EXPECT_TRUE(model.SetAttentionBackend(std::move(backend).value()).ok());
    auto made = model.CreateSlotKvPool(policy->config().budget, 2);
    EXPECT_TRUE(made.ok()) << made.status().ToString();
    if (!made.ok()) return run;
    pool = std::move(made).value();
    evicting.pool = pool.get();
    SlotKvArrays unused;  // array 0 stays free: the request writes array 1
    EXPECT_TRUE(pool->Reserve(unused).ok());
    EXPECT_TRUE(pool->Reserve(evicting.arrays).ok());
    request = policy->Admit(KvResidency::kEvicting);
  }
  KvSequence sequence;
  ForwardResult result;
  int next_token = -1;
  for (int start = 0, step = 0; step <= steps; ++step) {
    const ForwardEntry entry =
        longflow_test::StepEntry(sequence, prompt, start, &next_token, request.get(), &evicting);
    step -= entry.logits == LogitsWanted::kNone;  // the first chunk is not a step
    const Status status = model.Forward(std::span<const ForwardEntry>(&entry, 1), *cache, result);
    EXPECT_TRUE(status.ok()) << status.ToString();
    if (!status.ok()) break;
    start += static_cast<int>(entry.tokens.size());
    if (request && start == length && entry.tokens.size() > 1) {
      EXPECT_TRUE(cache->Release(sequence).ok());  // as the engine does: the prompt is in slots
      sequence.num_tokens = length;
      for (int layer = 0; layer < kLayers; ++layer) {
        run.prompt_keys.push_back(SlotKeys(*pool, evicting.arrays, layer));
      }
    }
    if (entry.logits == LogitsWanted::kNone) continue;
    const std::span<const float> last = result.LastLogits(0);
    run.logits.emplace_back(last.begin(), last.end());
    if (pool != nullptr) run.next.push_back(NextSlots(*pool, evicting.arrays));
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
  options.residency = std::make_shared<EvictingResidency>();
  const auto longflow_tokens = EngineGreedyTokens(std::move(longflow.cuda), options, prompts);
  EXPECT_EQ(longflow_tokens, dense_tokens);
  EXPECT_EQ(policy->counters().evictions, 0);
}

// Device memory of `count` elements at `source`, on the host.
template <typename T>
std::vector<T> Fetch(const T* source, size_t count) {
  std::vector<T> host(count);
  EXPECT_EQ(cudaMemcpy(host.data(), source, count * sizeof(T), cudaMemcpyDeviceToHost),
            cudaSuccess);
  return host;
}

std::vector<float> FetchBf16(const __nv_bfloat16* source, size_t count) {
  return gpu_test::FromBf16(Fetch(source, count));
}

// Wraps the CUDA backend half and checks every layer of every step in lockstep against the CPU
// reference ops on the very inputs the GPU had (its queries, its paged keys, its slots, all bf16
// values as f32): the prompt's kept set (SnapKvScores + SnapKvKeep), the slots after the move and
// after each token's write, every next slot (LongFlowAttention's choice) and the fused output.
// Same inputs: the choices can differ only where two scores tie to fp32 rounding; the output by
// bf16 rounding of P in P V (the op test's tolerance). Runs eagerly (it synchronizes per layer).
class LockstepBackend final : public CudaAttentionBackend {
 public:
  LockstepBackend(std::unique_ptr<CudaAttentionBackend> inner, const ModelConfig& model,
                  const LongFlowConfig& config)
      : inner_(std::move(inner)), model_(model), config_(config) {}

  int checked_prompts = 0, checked_steps = 0, evictions = 0;

  const Model* made_for_model() const override { return inner_->made_for_model(); }
  bool graph_replayable() const override { return false; }
  Status CheckBatch(std::span<const ForwardEntry> batch) const override {
    return inner_->CheckBatch(batch);
  }
  Status Reserve(std::span<const ForwardEntry> batch, const ForwardPlan& plan,
                 const std::function<void()>& drop_graphs) override {
    EXPECT_EQ(batch.size(), 1u);
    entry_ = &batch[0];
    first_row_ = plan.entry_first_row[0];
    return inner_->Reserve(batch, plan, drop_graphs);
  }
  size_t StepInputBytes() const override { return inner_->StepInputBytes(); }
  size_t DecodeWorkspaceBytes(const ForwardPlan& plan) const override {
    return inner_->DecodeWorkspaceBytes(plan);
  }
  void FillStepInputs(std::span<const ForwardEntry> batch, const ForwardPlan& plan,
                      const KvCacheShape& shape, std::byte* region) override {
    inner_->FillStepInputs(batch, plan, shape, region);
  }
  Status FinishStep(std::span<const ForwardEntry> batch) override {
    return inner_->FinishStep(batch);
  }

  Status Attend(const CudaLayerContext& layer) override {
    EXPECT_EQ(cudaStreamSynchronize(layer.stream), cudaSuccess);
    const Slots before = FetchSlots(layer.layer);
    const std::vector<float> qkv = FetchRows(layer);
    RUBATO_RETURN_IF_ERROR(inner_->Attend(layer));
    EXPECT_EQ(cudaStreamSynchronize(layer.stream), cudaSuccess);
    const Slots after = FetchSlots(layer.layer);
    if (IsFixedBudgetEntry(*entry_)) {
      CheckDecode(layer, before, after, qkv);
    } else if (static_cast<const LongFlowRequestState*>(entry_->attention->state)->prompt_end ==
               entry_->start_position + static_cast<int>(entry_->tokens.size())) {
      CheckPrompt(layer, after, qkv);
    }
    return Status::Ok();
  }

 private:
  struct Slots {
    std::vector<float> keys, values;  // [kv heads][B][head_dim]
    std::vector<uint8_t> valid;       // [B]
    std::vector<int32_t> next;        // [kv heads]
  };

  Slots FetchSlots(int layer) const {
    auto* storage = static_cast<DeviceSlotKvStorage*>(entry_->slots->pool->storage());
    const size_t array = static_cast<size_t>(entry_->slots->arrays.array);
    const size_t B = static_cast<size_t>(config_.budget);
    const size_t kv = static_cast<size_t>(model_.num_kv_heads);
    const size_t elements = kv * B * model_.head_dim;
    Slots s;
    s.keys = FetchBf16(storage->layer_keys(layer) + array * elements, elements);
    s.values = FetchBf16(storage->layer_values(layer) + array * elements, elements);
    s.valid = Fetch(storage->layer_valid(layer) + array * B, B);
    s.next = Fetch(storage->layer_next_slot(layer) + array * kv, kv);
    return s;
  }

  // The entry's rows of q | k | v (after RoPE), as f32.
  std::vector<float> FetchRows(const CudaLayerContext& layer) const {
    const size_t qkv_dim = static_cast<size_t>(model_.q_dim() + 2 * model_.kv_dim());
    return FetchBf16(layer.qkv + static_cast<size_t>(first_row_) * qkv_dim,
                     entry_->tokens.size() * qkv_dim);
  }

  // The CPU fused op over `slots` for `query`: its output and next slots.
  void Reference(const Slots& slots, const float* query, std::vector<float>& output,
                 std::vector<int32_t>& next) const {
    output.assign(static_cast<size_t>(model_.q_dim()), 0.f);
    next.assign(static_cast<size_t>(model_.num_kv_heads), -2);
    LongFlowAttentionArgs a;
    a.query = query;
    a.output = output.data();
    a.num_heads = model_.num_heads;
    a.keys = slots.keys.data();
    a.values = slots.values.data();
    a.valid = slots.valid.data();
    a.num_kv_heads = model_.num_kv_heads;
    a.budget = config_.budget;
    a.head_dim = model_.head_dim;
    a.sink_slots = config_.sink_tokens;
    a.next_slot = next.data();
    std::vector<float> scratch(static_cast<size_t>(LongFlowAttentionScratchSize(a)));
    EXPECT_TRUE(LongFlowAttention(a, scratch).ok());
  }

  void CheckDecode(const CudaLayerContext& layer, const Slots& before, const Slots& after,
                   const std::vector<float>& qkv) {
    SCOPED_TRACE("decode step at position " + std::to_string(entry_->start_position) + ", layer " +
                 std::to_string(layer.layer));
    // The write: the token's K/V into the slots `before.next` named.
    Slots want = before;
    const int d = model_.head_dim, B = config_.budget;
    const float* key = qkv.data() + model_.q_dim();
    const float* value = key + model_.kv_dim();
    bool evicted = false;
    for (int h = 0; h < model_.num_kv_heads; ++h) {
      const int slot = before.next[static_cast<size_t>(h)];
      ASSERT_GE(slot, config_.sink_tokens);
      ASSERT_LT(slot, B);
      evicted |= before.valid[static_cast<size_t>(slot)] != 0;
      std::copy_n(key + h * d, d, want.keys.begin() + (static_cast<ptrdiff_t>(h) * B + slot) * d);
      std::copy_n(value + h * d, d,
                  want.values.begin() + (static_cast<ptrdiff_t>(h) * B + slot) * d);
      want.valid[static_cast<size_t>(slot)] = 1;
    }
    evictions += evicted ? model_.num_kv_heads : 0;
    EXPECT_EQ(after.keys, want.keys);
    EXPECT_EQ(after.values, want.values);
    EXPECT_EQ(after.valid, want.valid);
    std::vector<float> output;
    std::vector<int32_t> next;
    Reference(want, qkv.data(), output, next);
    EXPECT_EQ(after.next, next);
    const std::vector<float> got =
        FetchBf16(layer.attention + static_cast<size_t>(first_row_) * model_.q_dim(),
                  static_cast<size_t>(model_.q_dim()));
    float ref_max = 0.f;
    for (float v : output) ref_max = std::max(ref_max, std::fabs(v));
    EXPECT_TRUE(gpu_test::Bf16Close("fused output", got, output, 0.02 * ref_max + 1e-6, 0.02));
    ++checked_steps;
  }

  void CheckPrompt(const CudaLayerContext& layer, const Slots& after,
                   const std::vector<float>& qkv) {
    SCOPED_TRACE("prompt end, layer " + std::to_string(layer.layer));
    const int length = entry_->start_position + static_cast<int>(entry_->tokens.size());
    const int window = config_.snapkv_window, d = model_.head_dim, B = config_.budget;
    const int chunk = static_cast<int>(entry_->tokens.size());
    ASSERT_GT(length, B);
    ASSERT_GE(chunk, window);  // the window's queries are this chunk's (the test's chunks)
    // The paged keys and values of the prompt, as the GPU holds them.
    const KvCacheShape& shape = layer.kv->shape();
    const size_t block_elements = static_cast<size_t>(shape.num_kv_heads) * shape.block_tokens * d;
    const size_t pool_elements = block_elements * shape.num_blocks;
    std::vector<float> keys = FetchBf16(layer.kv->layer_keys(layer.layer), pool_elements);
    std::vector<float> values = FetchBf16(layer.kv->layer_values(layer.layer), pool_elements);
    const std::vector<int32_t>& table = entry_->sequence->block_table;
    const PagedKvView view{keys.data(),        values.data(),      table.data(),
                           shape.block_tokens, shape.num_kv_heads, d};
    const size_t qkv_dim = static_cast<size_t>(model_.q_dim() + 2 * model_.kv_dim());
    std::vector<float> queries;
    for (int t = chunk - window; t < chunk; ++t) {
      const float* q = qkv.data() + static_cast<size_t>(t) * qkv_dim;
      queries.insert(queries.end(), q, q + model_.q_dim());
    }
    const int prefix = length - window;
    std::vector<float> scores(static_cast<size_t>(model_.num_kv_heads) * prefix);
    const SnapKvScoreArgs args{queries.data(), window, model_.num_heads,
                               view,           length, config_.snapkv_pool_kernel,
                               scores.data()};
    std::vector<float> scratch(static_cast<size_t>(SnapKvScoresScratchSize(args)));
    ASSERT_TRUE(SnapKvScores(args, scratch).ok());
    Slots want;
    want.keys.assign(after.keys.size(), 0.f);
    want.values.assign(after.values.size(), 0.f);
    want.valid.assign(static_cast<size_t>(B), 1);
    for (int h = 0; h < model_.num_kv_heads; ++h) {
      std::vector<int> kept;
      SnapKvKeep(scores.data() + static_cast<size_t>(h) * prefix, length, window,
                 config_.sink_tokens, B, kept);
      ASSERT_EQ(kept.size(), static_cast<size_t>(B));
      for (int i = 0; i < B; ++i) {
        const size_t at = view.Offset(kept[static_cast<size_t>(i)], h);
        std::copy_n(keys.begin() + static_cast<ptrdiff_t>(at), d,
                    want.keys.begin() + (static_cast<ptrdiff_t>(h) * B + i) * d);
        std::copy_n(values.begin() + static_cast<ptrdiff_t>(at), d,
                    want.values.begin() + (static_cast<ptrdiff_t>(h) * B + i) * d);
      }
    }
    EXPECT_EQ(after.keys, want.keys) << "the kept sets differ";
    EXPECT_EQ(after.values, want.values);
    EXPECT_EQ(after.valid, want.valid);
    // The first decode slot: the fused op's choice for the prompt's last query.
    std::vector<float> output;
    std::vector<int32_t> next;
    Reference(want, qkv.data() + static_cast<size_t>(chunk - 1) * qkv_dim, output, next);
    EXPECT_EQ(after.next, next);
    ++checked_prompts;
  }

  std::unique_ptr<CudaAttentionBackend> inner_;
  ModelConfig model_;
  LongFlowConfig config_;
  const ForwardEntry* entry_ = nullptr;
  int first_row_ = 0;
};

// Prompt 200 > B = 96 (window 8, kernel 3, 4 sinks) in chunks of 103 and 97, then 16
// teacher-forced steps, every one evicting, checked layer by layer in lockstep (above).
TEST(CudaLongFlow, LongPromptKeepsAndEvictsAsTheCpuOpsOnTheSameInputs) {
  ModelPair pair = MakeModelPair(Config(), 21);
  ASSERT_NE(pair.cuda, nullptr);
  const ModelConfig model = pair.cuda->config();
  std::mt19937_64 rng(5);
  const std::vector<int> prompt = RandomTokens(rng, 200, model.vocab_size);
  const std::vector<int> forced = RandomTokens(rng, 17, model.vocab_size);
  constexpr int kSteps = 16;
  LongFlowPolicy policy(SmallConfig(96));
  auto inner = policy.MakeBackend(*pair.cuda, 1);
  ASSERT_TRUE(inner.ok()) << inner.status().ToString();
  std::unique_ptr<CudaAttentionBackend> cuda_inner(
      dynamic_cast<CudaAttentionBackend*>(std::move(inner).value().release()));
  ASSERT_NE(cuda_inner, nullptr);
  auto lockstep = std::make_unique<LockstepBackend>(std::move(cuda_inner), model, policy.config());
  LockstepBackend* checks = lockstep.get();
  const LongFlowRun run = Forward(*pair.cuda, &policy, prompt, kSteps, forced, std::move(lockstep));
  EXPECT_EQ(run.logits.size(), static_cast<size_t>(kSteps + 1));
  EXPECT_EQ(checks->checked_prompts, kLayers);
  EXPECT_EQ(checks->checked_steps, kSteps * kLayers);
  EXPECT_EQ(checks->evictions, kSteps * kLayers * kKvHeads);
  EXPECT_EQ(run.counters.evictions, int64_t{kSteps} * kLayers * kKvHeads);
  EXPECT_EQ(run.counters.prompt_evictions, int64_t{200 - 96} * kLayers * kKvHeads);
}

// The same run on the CPU and CUDA models (each its own trajectory): the counters agree, the
// first logits (the prompt's, before any eviction choice) are within the CUDA model's bf16
// tolerance, and the CUDA run replays its decode steps as graphs.
TEST(CudaLongFlow, LongPromptCountsAsTheCpuBackend) {
  ModelPair pair = MakeModelPair(Config(), 21);
  ASSERT_NE(pair.cuda, nullptr);
  const int vocab = pair.cuda->config().vocab_size;
  std::mt19937_64 rng(5);
  const std::vector<int> prompt = RandomTokens(rng, 200, vocab);
  const std::vector<int> forced = RandomTokens(rng, 17, vocab);
  LongFlowPolicy cpu_policy(SmallConfig(96));
  LongFlowPolicy cuda_policy(SmallConfig(96));
  const LongFlowRun cpu = Forward(*pair.cpu, &cpu_policy, prompt, 16, forced);
  const LongFlowRun gpu = Forward(*pair.cuda, &cuda_policy, prompt, 16, forced);
  ASSERT_EQ(gpu.logits.size(), cpu.logits.size());
  ExpectRowsClose("prompt logits, CUDA vs CPU", gpu.logits[0], cpu.logits[0], vocab);
  EXPECT_EQ(gpu.counters.evictions, cpu.counters.evictions);
  EXPECT_EQ(gpu.counters.prompt_evictions, cpu.counters.prompt_evictions);
  EXPECT_GT(pair.cuda->graph_replays(), 0);
}

TEST(CudaLongFlow, AHostPoolIsRefusedByTheCudaModel) {
  ModelPair pair = MakeModelPair(Config(), 3);
  ASSERT_NE(pair.cuda, nullptr);
  LongFlowPolicy policy(SmallConfig(96));
  ASSERT_TRUE(pair.cuda->SetAttentionBackend(policy.MakeBackend(*pair.cuda, 1).value()).ok());
  auto host_pool = pair.cpu->CreateSlotKvPool(96, 1).value();
  SlotKvForward evicting{host_pool.get(), {}};
  ASSERT_TRUE(host_pool->Reserve(evicting.arrays).ok());
  auto request = policy.Admit(KvResidency::kEvicting);
  auto cache = NewCache(*pair.cuda, 16, 64);
  KvSequence sequence;
  const std::vector<int> prompt(20, 7);
  ForwardEntry entry{&sequence, prompt, 0, LogitsWanted::kLast};
  entry.attention = request->PlanPrefill(0, 20, true);
  entry.slots = &evicting;
  ForwardResult result;
  EXPECT_TRUE(gpu_test::FailsWith(pair.cuda->Forward({&entry, 1}, *cache, result),
                                  StatusCode::kInvalidArgument, "not created by a CUDA model"));
}

}  // namespace
}  // namespace rubato
