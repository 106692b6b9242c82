// SyncKV on the CUDA engine (split_by_head KV with its device storage): with Mem% = 100 % the
// tokens equal dense's (m = 1 and m = 5); at Mem% 30 the CUDA tokens against the CPU engine's,
// each divergence listed with the CPU engine's top-2 log-probability margin there (a divergence
// must be a near tie of the CPU engine's logits); a fetch
// delayed on its copy stream changes no token and shows as exposed wait; the store on a second
// GPU gives the tokens of the host store; the device bytes of the residency are the Mem% share
// of the full KV, measured with cudaMemGetInfo.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <cstdio>
#include <map>
#include <random>
#include <vector>

#include "inference_rank/policies/synckv/synckv_policy.h"
#include "inference_rank/residency/split_by_head/split_by_head_residency.h"
#include "tests/gpu/cuda_model_test_util.h"

namespace rubato {
namespace {

using namespace cuda_model_test;

constexpr int kContext = 4096;  // engine.max_context and the residency's device capacity

// 2 layers, 8 query / 2 KV heads of 64 (kv_heads = 8: the Qwen3-8B share of R-heads).
std::string Config(int kv_heads = 2) {
  return SmallConfigJson("Qwen3ForCausalLM", 256, 8, kv_heads, 64, 512, 2, 300, true);
}

SyncKvCalibration Calibration(int kv_heads) {
  SyncKvCalibration c;
  c.model = "small qwen3 (test)";
  c.num_layers = 2;
  c.num_heads = 8;
  c.num_kv_heads = kv_heads;
  c.head_dim = 64;
  for (int l = 0; l < 2; ++l) {
    for (int i = 0; i < kv_heads; ++i) {
      for (int j = 0; j < kv_heads; ++j) c.similarity.push_back(i == j ? 1.0 : 0.5 - 0.05 * l);
    }
  }
  EXPECT_TRUE(ClusterCalibration(c, 1).ok());
  return c;
}

std::shared_ptr<SyncKvPolicy> Policy(double mem_percent, int stride, int kv_heads = 2,
                                     int fetch_delay_us = 0, const std::string& store = "host") {
  SyncKvConfig config;
  config.calibration = "(in memory)";
  config.mem_percent = mem_percent;
  config.mem_basis = kv_heads == 2 ? "nr_heads" : "total";
  config.stride = stride;
  config.fetch_delay_us = fetch_delay_us;
  config.store = store;
  auto policy = SyncKvPolicy::Create(config, Calibration(kv_heads));
  EXPECT_TRUE(policy.ok()) << policy.status().ToString();
  return std::shared_ptr<SyncKvPolicy>(std::move(policy).value());
}

std::vector<std::vector<int>> Prompts(int vocab) {
  std::mt19937_64 rng(23);
  return {RandomTokens(rng, 700, vocab), RandomTokens(rng, 333, vocab),
          RandomTokens(rng, 1201, vocab)};
}

struct EngineRun {
  std::vector<std::vector<int>> tokens;
  std::vector<std::vector<float>> margins;  // top-2 log-probability margin of each token
};

// Greedy, 40 new tokens per prompt, every prompt at once.
EngineRun Generate(std::unique_ptr<Model> model, std::shared_ptr<AttentionPolicy> policy,
                   std::shared_ptr<Residency> residency) {
  EngineOptions options;
  options.max_batch = 3;
  options.max_context = kContext;
  options.prefill_chunk = 512;
  options.policy = std::move(policy);
  options.residency = std::move(residency);
  EngineRun run;
  const bool cpu = model->backend_name() == "cpu";
  auto engine = Engine::Create(std::move(model), options);
  EXPECT_TRUE(engine.ok()) << engine.status().message();
  if (!engine.ok()) return run;
  const auto prompts = Prompts(300);
  std::map<uint64_t, size_t> index;
  for (size_t i = 0; i < prompts.size(); ++i) {
    GenerationRequest request;
    request.prompt_ids = prompts[i];
    request.max_new_tokens = 40;
    request.ignore_eos = true;
    if (cpu) request.sampling.logprobs = 2;  // the CUDA engine samples on the device only
    auto id = (*engine)->Submit(request);
    EXPECT_TRUE(id.ok()) << id.status().message();
    if (id.ok()) index[*id] = i;
  }
  run.tokens.resize(prompts.size());
  run.margins.resize(prompts.size());
  for (int step = 0; (*engine)->HasWork() && step < 10000; ++step) {
    auto events = (*engine)->Step();
    EXPECT_TRUE(events.ok()) << events.status().message();
    if (!events.ok()) break;
    for (const TokenEvent& event : *events) {
      EXPECT_NE(event.finish, FinishReason::kError) << event.error.ToString();
      const size_t i = index[event.request_id];
      run.tokens[i].push_back(event.token);
      const auto& top = event.logprobs.top;
      run.margins[i].push_back(top.size() >= 2 ? top[0].second - top[1].second : -1.0f);
    }
  }
  return run;
}

// The first divergence of each prompt of `a` and `b`, with the top-2 log-probability margin
// there of `cpu` (a CPU engine's run: the CUDA engine reports no log-probabilities); returns the
// prompts that diverge.
int ListDivergences(const char* what, const EngineRun& a, const EngineRun& b,
                    const EngineRun& cpu) {
  int diverging = 0;
  for (size_t i = 0; i < a.tokens.size() && i < b.tokens.size(); ++i) {
    for (size_t t = 0; t < a.tokens[i].size() && t < b.tokens[i].size(); ++t) {
      if (a.tokens[i][t] == b.tokens[i][t]) continue;
      const bool known = i < cpu.margins.size() && t < cpu.margins[i].size();
      std::printf("%s: prompt %zu diverges at token %zu (%d vs %d), CPU top-2 margin %.4f\n", what,
                  i, t, a.tokens[i][t], b.tokens[i][t], known ? cpu.margins[i][t] : -1.0f);
      ++diverging;
      break;
    }
  }
  return diverging;
}

TEST(CudaSyncKv, MemPercent100GivesTheDenseTokens) {
  const EngineRun dense = Generate(MakeModelPair(Config(), 9).cuda, nullptr, nullptr);
  const EngineRun cpu_dense = Generate(MakeModelPair(Config(), 9).cpu, nullptr, nullptr);
  ASSERT_EQ(dense.tokens.size(), 3u);
  for (int stride : {1, 5}) {
    auto policy = Policy(100.0, stride);
    auto residency = std::make_shared<SplitByHeadResidency>(nullptr, kContext);
    const EngineRun synckv = Generate(MakeModelPair(Config(), 9).cuda, policy, residency);
    ListDivergences(stride == 1 ? "Mem 100 %, m = 1, vs dense" : "Mem 100 %, m = 5, vs dense",
                    synckv, dense, cpu_dense);
    // Every position is attended, but with m > 1 the NR-heads read their pool in slot order and
    // the recent rows in place, where dense reads the paged cache in position order: a prompt
    // may part at a near tie only (the bound of the CPU comparison below).
    ASSERT_EQ(synckv.tokens.size(), dense.tokens.size());
    for (size_t i = 0; i < dense.tokens.size(); ++i) {
      ASSERT_EQ(synckv.tokens[i].size(), dense.tokens[i].size()) << "prompt " << i;
      for (size_t t = 0; t < dense.tokens[i].size(); ++t) {
        if (synckv.tokens[i][t] == dense.tokens[i][t]) continue;
        EXPECT_LT(cpu_dense.margins[i][t], 0.25f)
            << "stride " << stride << ": prompt " << i << " parts at token " << t
            << " where the CPU engine's top-2 margin is " << cpu_dense.margins[i][t];
        break;
      }
    }
    EXPECT_GT(policy->counters().anticipation_steps, 0);
    EXPECT_EQ(residency->counters().local_kv_bytes, residency->counters().full_kv_bytes);
  }
}

TEST(CudaSyncKv, TokensAgainstTheCpuEngine) {
  // q/k-norm weights x2: attention logits x4, so that the R-heads' top-k is decided by margins
  // far above bf16 rounding (random weights attend almost uniformly otherwise).
  ModelPair pair = MakeModelPair(Config(), 11, /*use_cuda_graph=*/true, [](ModelWeights& w) {
    for (LayerWeights& layer : w.layers) {
      for (float& x : layer.q_norm) x *= 2.0f;
      for (float& x : layer.k_norm) x *= 2.0f;
    }
  });
  auto cpu_policy = Policy(30.0, 5);
  auto cuda_policy = Policy(30.0, 5);
  const EngineRun cpu =
      Generate(std::move(pair.cpu), cpu_policy, std::make_shared<SplitByHeadResidency>());
  auto residency = std::make_shared<SplitByHeadResidency>(nullptr, kContext);
  const EngineRun cuda = Generate(std::move(pair.cuda), cuda_policy, residency);
  ListDivergences("CUDA vs CPU synckv, Mem 30 %", cuda, cpu, cpu);
  // bf16 against f32: a prompt may part only at a near tie of the CPU engine's logits.
  for (size_t i = 0; i < cpu.tokens.size(); ++i) {
    ASSERT_EQ(cuda.tokens[i].size(), cpu.tokens[i].size()) << "prompt " << i;
    for (size_t t = 0; t < cpu.tokens[i].size(); ++t) {
      if (cuda.tokens[i][t] == cpu.tokens[i][t]) continue;
      EXPECT_LT(cpu.margins[i][t], 0.25f)
          << "prompt " << i << " parts at token " << t << " where the CPU engine's top-2 margin is "
          << cpu.margins[i][t];
      break;
    }
  }
  EXPECT_EQ(cuda_policy->counters().anticipation_steps, cpu_policy->counters().anticipation_steps);
  const SplitByHeadCounters& counters = residency->counters();
  EXPECT_GT(counters.rows_fetched, 0);
  EXPECT_EQ(counters.bytes_fetched, counters.rows_fetched * 2 * 64 * 2);
  EXPECT_LT(counters.local_kv_bytes, counters.full_kv_bytes);
}

TEST(CudaSyncKv, ALateFetchChangesNoToken) {
  auto prompt_policy = Policy(30.0, 5);
  auto residency = std::make_shared<SplitByHeadResidency>(nullptr, kContext);
  const EngineRun on_time = Generate(MakeModelPair(Config(), 13).cuda, prompt_policy, residency);
  // 20 ms per fetch block on the copy stream: far longer than the rest of a step here.
  auto late_residency = std::make_shared<SplitByHeadResidency>(nullptr, kContext);
  const EngineRun late =
      Generate(MakeModelPair(Config(), 13).cuda, Policy(30.0, 5, 2, 20000), late_residency);
  EXPECT_EQ(late.tokens, on_time.tokens);
  // The delayed fetches were waited for (a step that read its pool before them would not wait),
  // and rows were fetched at all. Whether the sets change the tokens here is printed: on this
  // model at 30 % they need not (the first device run saw dense's tokens).
  EXPECT_GT(late_residency->counters().exposed_wait_ns, 0);
  EXPECT_GT(late_residency->counters().rows_fetched, 0);
  const EngineRun dense = Generate(MakeModelPair(Config(), 13).cuda, nullptr, nullptr);
  std::printf("at 30 %% the sets %s the tokens\n",
              on_time.tokens == dense.tokens ? "do not change" : "change");
  std::printf("exposed fetch wait: %.3f s on time, %.3f s delayed\n",
              residency->counters().exposed_wait_ns * 1e-9,
              late_residency->counters().exposed_wait_ns * 1e-9);
}

TEST(CudaSyncKv, TheStoreOnASecondGpuGivesTheHostStoresTokens) {
  int devices = 0;
  ASSERT_EQ(cudaGetDeviceCount(&devices), cudaSuccess);
  if (devices < 2) GTEST_SKIP() << "one GPU: run on nvidia-h200-x2";
  const EngineRun host = Generate(MakeModelPair(Config(), 15).cuda, Policy(30.0, 5),
                                  std::make_shared<SplitByHeadResidency>(nullptr, kContext));
  const EngineRun device =
      Generate(MakeModelPair(Config(), 15).cuda, Policy(30.0, 5, 2, 0, "device"),
               std::make_shared<SplitByHeadResidency>(nullptr, kContext));
  EXPECT_EQ(device.tokens, host.tokens);
}

TEST(CudaSyncKv, DeviceKvBytesAreTheMemPercentShare) {
  // Qwen3-8B's share of R-heads (1 of 8 KV heads), Mem 20 % of the whole KV.
  constexpr int kSlots = 4, kCapacity = 16384;
  for (double mem : {20.0, 30.0, 50.0}) {
    ModelPair pair = MakeModelPair(Config(8), 17);
    ASSERT_NE(pair.cuda, nullptr);
    auto policy = Policy(mem, 5, 8);
    SplitByHeadResidency residency(nullptr, kCapacity);
    size_t free_before = 0, free_after = 0, total = 0;
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    ASSERT_EQ(cudaMemGetInfo(&free_before, &total), cudaSuccess);
    ASSERT_TRUE(residency.Attach(*pair.cuda, policy.get(), kSlots).ok());
    ASSERT_EQ(cudaMemGetInfo(&free_after, &total), cudaSuccess);
    const double full = 2.0 * kSlots * kCapacity * 8 * 64 * 2 * 2;  // layers, K and V, bf16
    const double held = static_cast<double>(residency.device_bytes());
    const double measured = static_cast<double>(free_before - free_after);
    std::printf("Mem %.0f %%: residency device bytes %.0f (cudaMemGetInfo %.0f) = %.4f of full\n",
                mem, held, measured, held / full);
    // R-heads whole (1 of 8), every KV head's pool rows (the R-head's unused: the two-segment
    // kernel's layout), the books: 4 bytes per position and slot per layer, 1/512 of the KV.
    const double pool_share = static_cast<double>(policy->Budget(kCapacity)) / kCapacity;
    const double expected = (1.0 + 8.0 * pool_share) / 8.0;
    EXPECT_GE(held / full, expected);
    EXPECT_LE(held / full, expected + 0.003);
    if (mem == 20.0) {
      EXPECT_LE(held / full, 0.22) << "the issue's bound at Mem 20 %";
    }
    EXPECT_LE(measured, held * 1.05 + (64 << 20)) << "no other device allocation";
    ASSERT_TRUE(pair.cuda->SetResidencyBackend(nullptr).ok());
  }
}

}  // namespace
}  // namespace rubato
