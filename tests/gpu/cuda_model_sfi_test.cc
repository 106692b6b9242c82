// SFI on the CUDA model (inference_rank/policies/sfi/sfi_cuda_backend.cc) against its twin, SFI on
// the CPU model (sfi_cpu_backend.cc), on identical random weights, in mixed batches with dense
// requests: a budget covering the context, a small budget (the CPU then given the CUDA
// selection), the key-norm prior, and the slot pool. The scenarios: docs/sfi.md "Tests".
// Bitwise properties, errors and the engine: cuda_model_sfi_system_test.cc.
#include <gtest/gtest.h>

#include <algorithm>
#include <random>
#include <string>
#include <vector>

#include "kernels/cpu/key_norms.h"
#include "tests/gpu/cuda_model_sfi_test_util.h"

namespace rubato {
namespace {

using namespace cuda_model_sfi_test;

struct ScenarioOptions {
  std::string json;
  int block_tokens = 16;
  SfiPolicyConfig config;
  std::vector<int> prompt_lens;  // one request each
  std::vector<bool> dense;       // which requests are dense (default: none)
  int chunk = 64;
  int decode_steps = 12;
  bool full_budget = false;  // the budget covers every J: selections identical
};

// The requests of `o` run step by step as one batch on the CPU model and the CUDA model (the
// CPU's greedy tokens fed to both).
void RunCpuVsCuda(const std::string& name, const ScenarioOptions& o) {
  Twins twins;
  const int prefill_steps =
      (*std::max_element(o.prompt_lens.begin(), o.prompt_lens.end()) + o.chunk - 1) / o.chunk;
  int blocks = 0;  // a request decodes at most every step after its first
  for (int len : o.prompt_lens) {
    blocks += (len + prefill_steps + o.decode_steps) / o.block_tokens + 1;
  }
  ASSERT_TRUE(
      twins.Init(o.json, o.config, static_cast<int>(o.prompt_lens.size()), o.block_tokens, blocks));
  const int vocab = twins.pair.cpu->config().vocab_size;
  std::mt19937_64 rng = gpu_test::FreshRng();
  std::vector<Request> requests(o.prompt_lens.size());
  for (size_t i = 0; i < requests.size(); ++i) {
    requests[i].prompt = RandomTokens(rng, o.prompt_lens[i], vocab);
    requests[i].sfi = i >= o.dense.size() || !o.dense[i];
    requests[i].period = 1 + static_cast<int>(i) % o.config.t_max;
  }
  for (int step = 0; step < prefill_steps + o.decode_steps; ++step) {
    std::vector<Job> jobs = NextJobs(requests, o.chunk, o.config);
    twins.Step(name + " step " + std::to_string(step), jobs, o.full_budget);
    if (::testing::Test::HasFatalFailure()) return;
  }
  EXPECT_GT(twins.slow, 0);
  EXPECT_GT(twins.fast, 0) << "the scenario ran no fast step";
  twins.ExpectSelectionsAgree(name, o.full_budget);
}

TEST(CudaSfiTest, BudgetCoveringTheContextMatchesCpu) {
  ScenarioOptions o;
  o.json = TinyQwen3();
  o.config = SfiConfig(/*sink=*/4, /*recent=*/16, /*budget=*/512, /*t_max=*/4, /*W=*/16);
  o.prompt_lens = {150, 37, 200};
  o.chunk = 64;
  o.full_budget = true;
  RunCpuVsCuda("tiny qwen3 full budget", o);
  o.json = Qwen3Hd128();
  o.block_tokens = 64;
  RunCpuVsCuda("qwen3 hd128 full budget", o);
}

TEST(CudaSfiTest, SmallBudgetSparseFastStepsMatchCpu) {
  ScenarioOptions o;
  o.json = TinyQwen3();
  o.config = SfiConfig(/*sink=*/4, /*recent=*/32, /*budget=*/32, /*t_max=*/6, /*W=*/16);
  o.prompt_lens = {400, 333, 450};
  o.chunk = 128;
  o.decode_steps = 16;
  RunCpuVsCuda("tiny qwen3 budget 32", o);
  o.config.selector.gamma = 1.0;  // the key-norm prior: norms of the paged keys on the GPU
  RunCpuVsCuda("tiny qwen3 budget 32 gamma 1", o);
  o.config.selector.gamma = 0.0;
  o.json = LlamaHd64Group8();
  o.block_tokens = 64;
  o.config = SfiConfig(4, 64, 64, 5, 8);
  o.prompt_lens = {700, 901};
  o.chunk = 256;
  RunCpuVsCuda("llama hd64 group 8 budget 64", o);
}

// The key-norm prior's inputs: after an SFI prompt's last chunk (its window selection) and after
// slow decode steps, the norms the CUDA model computed over J for every KV head of the last
// layers equal the norms of the CPU model's keys at the same positions (bf16 against f32 keys:
// 3 % relative). A norm read at the wrong position or for the wrong head would differ by the
// spread of the keys' norms, several times that.
TEST(CudaSfiTest, KeyNormPriorNormsMatchCpuKeys) {
  Twins twins;
  SfiPolicyConfig config = SfiConfig(/*sink=*/4, /*recent=*/16, /*budget=*/32, /*t_max=*/2, 16);
  config.selector.gamma = 1.0;
  ASSERT_TRUE(twins.Init(TinyQwen3(), config, /*max_batch=*/1, /*block_tokens=*/16, 32));
  std::mt19937_64 rng = gpu_test::FreshRng();
  std::vector<Request> requests(1);
  requests[0].prompt = RandomTokens(rng, 211, twins.pair.cpu->config().vocab_size);
  requests[0].period = 2;
  const ModelConfig& model = twins.pair.cuda->config();
  int checked = 0;
  for (int step = 0; step < 6; ++step) {
    std::vector<Job> jobs = NextJobs(requests, /*chunk=*/256, config);
    const bool slow = jobs[0].sfi && SfiStepOf(jobs[0].attention[0]) == SfiStepKind::kSlow;
    twins.Step("step " + std::to_string(step), jobs, /*full_budget=*/false);
    if (::testing::Test::HasFatalFailure() || !slow) continue;
    Request& r = requests[0];
    const int length = r.seq[0].num_tokens;
    const int sink_end = SfiSinkEnd(config, length);
    const int j_count = SfiAnchor(config, length) - sink_end;
    ASSERT_GT(j_count, 0);
    for (int layer = std::max(0, model.num_layers - SfiMaintenanceRing::kSlots);
         layer < model.num_layers; ++layer) {
      auto got = SfiBackendOf(*twins.pair.cuda)
                     .KeyNormsForTest(layer, /*selection=*/0, sink_end + j_count);
      ASSERT_STATUS_OK(got.status());
      std::vector<float> want(static_cast<size_t>(model.num_kv_heads) * j_count);
      ASSERT_STATUS_OK(KeyNorms(twins.cache[0]->LayerView(layer, r.seq[0]), sink_end, j_count,
                                want.data(), j_count));
      for (int h = 0; h < model.num_kv_heads; ++h) {
        for (int i = 0; i < j_count; ++i) {
          const float expected = want[static_cast<size_t>(h) * j_count + i];
          const float actual = (*got)[static_cast<size_t>(h) * (sink_end + j_count) + sink_end + i];
          ASSERT_NEAR(actual, expected, 0.03f * expected)
              << "step " << step << " layer " << layer << " KV head " << h << " position "
              << sink_end + i;
        }
      }
      ++checked;
    }
  }
  EXPECT_GE(checked, 3) << "the scenario checked too few slow steps";
  // Asking for what the ring no longer holds, or for a selection the step did not make, fails.
  EXPECT_FALSE(SfiBackendOf(*twins.pair.cuda).KeyNormsForTest(0, 5, 8).ok());
}

// SFI and dense requests in the same batches: prefill chunks (SFI and dense) next to decode rows
// of every kind, prompts ending on different steps.
TEST(CudaSfiTest, MixedBatchesWithDenseRequestsMatchCpu) {
  ScenarioOptions o;
  o.json = Qwen3Hd128();
  o.config = SfiConfig(4, 32, 48, 4, 16);
  o.prompt_lens = {300, 700, 450, 260, 520};
  o.dense = {false, false, true, false, true};
  o.chunk = 256;
  o.decode_steps = 10;
  RunCpuVsCuda("qwen3 hd128 mixed", o);
}

// The paper's defaults at a context of a few thousand (sink 4, recent 256, W 16).
TEST(CudaSfiLargeTest, DefaultShapesAtThousandsOfTokens) {
  ScenarioOptions o;
  o.json = Qwen3Hd128();
  o.block_tokens = 64;
  o.config = SfiConfig(4, 256, 512, 8, 16);
  o.prompt_lens = {3000, 4500, 1200};
  o.chunk = 1024;
  o.decode_steps = 12;
  RunCpuVsCuda("qwen3 hd128 budget 512 at 4.5K", o);
}

// ---- slots ----------------------------------------------------------------------------------

// A pool of two slots: two requests hold them, a third is refused without any change; when one
// request leaves, the third takes its slot, and every step still matches the CPU twin. Fast
// steps keep replaying one graph across the change (slots are step inputs).
TEST(CudaSfiTest, SlotsAreReusedAsRequestsComeAndGo) {
  Twins twins;
  const SfiPolicyConfig config = SfiConfig(4, 16, 16, 4, 8);
  ASSERT_TRUE(twins.Init(TinyQwen3(), config, /*max_batch=*/2, 16, 64));
  CudaModel& cuda = *twins.pair.cuda;
  std::mt19937_64 rng = gpu_test::FreshRng();
  std::vector<Request> requests(3);
  for (Request& r : requests) {
    r.prompt = RandomTokens(rng, 60 + static_cast<int>(rng() % 60), cuda.config().vocab_size);
    r.period = 100;  // fast after the first decode step
  }
  // One batch of the given requests: the whole prompt, or one decode token (slow first).
  auto step = [&](std::vector<Request*> which, const std::string& what) {
    std::vector<Job> all;
    for (Request* r : which) {
      Job job;
      job.request = r;
      job.sfi = true;
      const int left = static_cast<int>(r->prompt.size()) - r->prompt_done;
      SfiStepKind kind = SfiStepKind::kSlow;
      int window = 1;
      if (left > 0) {
        job.tokens.assign(r->prompt.begin() + r->prompt_done, r->prompt.end());
        job.start = r->prompt_done;
        window = std::min(left, config.prefill_window);
      } else {
        job.tokens = {r->next_token};
        job.start = r->prompt_done + r->decoded;
        if (r->decoded > 0 && r->fast_since_slow < r->period) kind = SfiStepKind::kFast;
      }
      for (int m = 0; m < 2; ++m) job.attention[m] = SfiStep(kind, &r->state[m], window);
      all.push_back(std::move(job));
    }
    twins.Step(what, all, /*full_budget=*/false);
  };
  step({&requests[0], &requests[1]}, "prefill 0, 1");
  EXPECT_EQ(SfiBackendOf(cuda).slots_in_use(), 2);

  // Request 2: no slot left; nothing reserved, its state untouched.
  {
    Request& r = requests[2];
    const EntryAttention slow = SfiStep(SfiStepKind::kSlow, &r.state[1], 8);
    ForwardEntry entry{&r.seq[1], r.prompt, 0, LogitsWanted::kLast, nullptr, &slow};
    const int free_blocks = twins.cache[1]->free_blocks();
    ForwardResult result;
    const Status status = cuda.Forward({&entry, 1}, *twins.cache[1], result);
    EXPECT_EQ(status.code(), StatusCode::kResourceExhausted) << status.message();
    std::printf("[ slots     ] %s\n", status.message().c_str());
    EXPECT_EQ(twins.cache[1]->free_blocks(), free_blocks);
    EXPECT_EQ(r.seq[1].num_tokens, 0);
    EXPECT_EQ(r.state[1].backend, nullptr);
    EXPECT_FALSE(r.state[1].has_selection);
  }
  for (int i = 0; i < 4; ++i) step({&requests[0], &requests[1]}, "decode 0, 1");
  const int64_t replays = cuda.graph_replays();
  EXPECT_GE(replays, 1);

  // Request 0 leaves: its states and sequences go (the CUDA handle returns the slot).
  for (int m = 0; m < 2; ++m) {
    requests[0].state[m] = SfiSequenceState();
    ASSERT_STATUS_OK(twins.cache[m]->Release(requests[0].seq[m]));
  }
  EXPECT_EQ(SfiBackendOf(cuda).slots_in_use(), 1);
  step({&requests[2]}, "prefill 2");
  EXPECT_EQ(SfiBackendOf(cuda).slots_in_use(), 2);
  for (int i = 0; i < 4; ++i) step({&requests[2], &requests[1]}, "decode 2, 1");
  EXPECT_GT(cuda.graph_replays(), replays) << "a new slot assignment must not need a new graph";
  twins.ExpectSelectionsAgree("slots", false);
}

}  // namespace
}  // namespace rubato
