// SFI on the CUDA model against itself and as the engine runs it: graph replay == eager,
// maintenance overlapped == inline, and two runs identical, bit for bit; errors that name the
// problem; the engine on the CUDA model (slow and fast steps, slots reused as requests come and
// go, the dense tokens with a budget covering the context; the fidelity guard's redo). CPU twin
// comparisons: cuda_model_sfi_test.cc.
#include <gtest/gtest.h>

#include <algorithm>
#include <memory>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "inference_rank/engine/engine.h"
#include "inference_rank/policies/sfi/sfi_policy.h"
#include "tests/gpu/cuda_model_sfi_test_util.h"

namespace rubato {
namespace {

using namespace cuda_model_sfi_test;

// ---- CUDA against itself, bitwise ----------------------------------------------------------

struct CudaRun {
  std::vector<std::vector<float>> logits;  // per step
  std::vector<std::vector<int>> tokens;    // per step
  int64_t replays = 0;
};

// The scenario on `model` (a fresh SFI backend, its maintenance overlapped or inline, a fresh cache
// and states), greedy sampling on the device with every decode row's logits returned.
CudaRun RunCuda(CudaModel& model, const SfiPolicyConfig& config, bool overlap,
                const std::vector<int>& lens, int steps, uint64_t seed) {
  CudaRun run;
  EXPECT_TRUE(InstallSfi(model, config, static_cast<int>(lens.size())).ok());
  SfiBackendOf(model).SetOverlap(overlap);
  auto cache = NewCache(model, 16, 256);
  if (!cache) return run;
  std::mt19937_64 rng(seed);
  std::vector<Request> requests(lens.size());
  for (size_t i = 0; i < requests.size(); ++i) {
    requests[i].prompt = RandomTokens(rng, lens[i], model.config().vocab_size);
    requests[i].sfi = i != 1;  // one dense request
    requests[i].period = 1 + static_cast<int>(i) % config.t_max;
  }
  const int64_t replays_before = model.graph_replays();
  const TokenSampling greedy;
  ForwardResult result;
  for (int step = 0; step < steps; ++step) {
    std::vector<Job> jobs = NextJobs(requests, 128, config);
    const std::vector<ForwardEntry> batch = Entries(jobs, 1, &greedy, LogitsWanted::kAll);
    const Status status = model.Forward(batch, *cache, result);
    EXPECT_TRUE(status.ok()) << status.message();
    if (!status.ok()) return run;
    run.logits.push_back(result.logits);
    run.tokens.push_back(result.sampled_tokens);
    Advance(jobs, 1, result.sampled_tokens);
  }
  run.replays = model.graph_replays() - replays_before;
  return run;
}

TEST(CudaSfiTest, GraphEqualsEagerOverlapEqualsInlineAndRunsRepeatBitwise) {
  Result<ModelConfig> config = ParseModelConfig(Qwen3Hd128(), "test config.json");
  ASSERT_STATUS_OK(config.status());
  Result<ModelWeights> weights = RandomWeights(*config, 41);
  ASSERT_STATUS_OK(weights.status());
  auto make = [&](bool graph) {
    CudaModelOptions options;
    options.use_cuda_graph = graph;
    auto model = CudaModel::Create(*config, *weights, options);
    EXPECT_TRUE(model.ok()) << model.status().message();
    return model.ok() ? std::move(model).value() : nullptr;
  };
  auto graph_overlap = make(true);
  auto graph_inline = make(true);
  auto eager_overlap = make(false);
  ASSERT_TRUE(graph_overlap && graph_inline && eager_overlap);
  const SfiPolicyConfig sfi = SfiConfig(4, 32, 40, 3, 16);
  const std::vector<int> lens = {300, 200, 450, 129};
  const int steps = 30;
  const uint64_t seed = gpu_test::FreshRng()();
  const CudaRun a = RunCuda(*graph_overlap, sfi, /*overlap=*/true, lens, steps, seed);
  const CudaRun b = RunCuda(*graph_inline, sfi, /*overlap=*/false, lens, steps, seed);
  const CudaRun c = RunCuda(*eager_overlap, sfi, /*overlap=*/true, lens, steps, seed);
  // The same model again (a new backend).
  const CudaRun again = RunCuda(*graph_overlap, sfi, /*overlap=*/true, lens, steps, seed);
  ASSERT_EQ(a.logits.size(), static_cast<size_t>(steps));
  for (const CudaRun* other : {&b, &c, &again}) {
    ASSERT_EQ(other->logits.size(), a.logits.size());
    for (int step = 0; step < steps; ++step) {
      ASSERT_TRUE(BitwiseEqual(other->logits[static_cast<size_t>(step)],
                               a.logits[static_cast<size_t>(step)]))
          << "step " << step
          << (other == &b   ? ": overlap off"
              : other == &c ? ": eager"
                            : ": rerun");
      ASSERT_EQ(other->tokens[static_cast<size_t>(step)], a.tokens[static_cast<size_t>(step)])
          << "step " << step;
    }
  }
  // Decode steps of every mix (fast only, slow rows among fast ones) were replayed as graphs.
  EXPECT_GE(a.replays, 8);
  EXPECT_EQ(c.replays, 0);
  std::printf("[ graphs    ] %lld SFI decode steps replayed of %d steps\n",
              static_cast<long long>(a.replays), steps);
}

// ---- errors -----------------------------------------------------------------------------------

TEST(CudaSfiTest, ErrorsNameTheProblem) {
  ModelPair pair = MakeModelPair(TinyQwen3(), /*seed=*/9);
  ASSERT_TRUE(pair.cpu && pair.cuda);
  auto cache = NewCache(*pair.cuda, 16, 32);
  auto cpu_cache = NewCache(*pair.cpu, 16, 32);
  ASSERT_TRUE(cache && cpu_cache);
  SfiPolicyConfig config = SfiConfig(4, 16, 16, 4, 8);
  const std::vector<int> prompt = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17};
  ForwardResult result;
  KvSequence seq;
  SfiSequenceState state;
  const EntryAttention slow = SfiStep(SfiStepKind::kSlow, &state, 8);
  ForwardEntry entry{&seq, prompt, 0, LogitsWanted::kLast, nullptr, &slow};

  // No backend installed.
  Status status = pair.cuda->Forward({&entry, 1}, *cache, result);
  EXPECT_EQ(status.code(), StatusCode::kFailedPrecondition) << status.message();
  EXPECT_NE(status.message().find("SetAttentionBackend"), std::string::npos) << status.message();

  EXPECT_EQ(MakeSfiCudaBackend(*pair.cuda, config, 0).status().code(),
            StatusCode::kInvalidArgument);
  // The CPU model's half cannot serve the CUDA model.
  Result<std::unique_ptr<AttentionBackend>> cpu_half =
      MakeSfiCpuBackend(pair.cpu->config(), config);
  ASSERT_STATUS_OK(cpu_half.status());
  EXPECT_EQ(pair.cuda->SetAttentionBackend(std::move(cpu_half).value()).code(),
            StatusCode::kInvalidArgument);
  ASSERT_STATUS_OK(InstallSfi(*pair.cuda, config, 4));
  ASSERT_STATUS_OK(InstallSfi(*pair.cpu, config));

  // A plan SFI did not make (another policy's row group).
  EntryAttention foreign = slow;
  foreign.row_group = kSfiSlowRows + 1;
  ForwardEntry foreign_entry{&seq, prompt, 0, LogitsWanted::kLast, nullptr, &foreign};
  status = pair.cuda->Forward({&foreign_entry, 1}, *cache, result);
  EXPECT_EQ(status.code(), StatusCode::kInvalidArgument) << status.message();
  EXPECT_EQ(seq.num_tokens, 0);

  // A selection the CPU model made cannot serve a CUDA fast step; nor can a state without one.
  KvSequence cpu_seq;
  SfiSequenceState cpu_state;
  const EntryAttention cpu_slow = SfiStep(SfiStepKind::kSlow, &cpu_state, 8);
  ForwardEntry cpu_entry{&cpu_seq, prompt, 0, LogitsWanted::kLast, nullptr, &cpu_slow};
  ASSERT_STATUS_OK(pair.cpu->Forward({&cpu_entry, 1}, *cpu_cache, result));
  KvSequence cuda_seq;
  ForwardEntry cuda_prefill{&cuda_seq, prompt, 0, LogitsWanted::kLast};
  ASSERT_STATUS_OK(pair.cuda->Forward({&cuda_prefill, 1}, *cache, result));
  const int token = 3;
  const EntryAttention fast = SfiStep(SfiStepKind::kFast, &cpu_state, 1);
  ForwardEntry fast_entry{&cuda_seq, {&token, 1}, 17, LogitsWanted::kLast, nullptr, &fast};
  status = pair.cuda->Forward({&fast_entry, 1}, *cache, result);
  EXPECT_EQ(status.code(), StatusCode::kFailedPrecondition) << status.message();
  EXPECT_EQ(cuda_seq.num_tokens, 17);
  SfiSequenceState fresh;
  const EntryAttention fast_fresh = SfiStep(SfiStepKind::kFast, &fresh, 1);
  ForwardEntry fresh_entry{&cuda_seq, {&token, 1}, 17, LogitsWanted::kLast, nullptr, &fast_fresh};
  EXPECT_EQ(pair.cuda->Forward({&fresh_entry, 1}, *cache, result).code(),
            StatusCode::kInvalidArgument);

  // Two entries of one forward sharing one state.
  KvSequence a, b;
  SfiSequenceState shared;
  const EntryAttention fa = SfiStep(SfiStepKind::kSlow, &shared, 8);
  const EntryAttention fb = SfiStep(SfiStepKind::kSlow, &shared, 8);
  std::vector<ForwardEntry> two = {{&a, prompt, 0, LogitsWanted::kLast, nullptr, &fa},
                                   {&b, prompt, 0, LogitsWanted::kLast, nullptr, &fb}};
  status = pair.cuda->Forward(two, *cache, result);
  EXPECT_EQ(status.code(), StatusCode::kInvalidArgument) << status.message();
  std::printf("[ errors    ] %s\n", status.message().c_str());
  EXPECT_EQ(a.num_tokens + b.num_tokens, 0);
  EXPECT_EQ(shared.backend, nullptr);

  // The backend cannot be replaced while a request holds a slot of its pool.
  KvSequence held_seq;
  SfiSequenceState held;
  const EntryAttention held_slow = SfiStep(SfiStepKind::kSlow, &held, 8);
  ForwardEntry held_entry{&held_seq, prompt, 0, LogitsWanted::kLast, nullptr, &held_slow};
  ASSERT_STATUS_OK(pair.cuda->Forward({&held_entry, 1}, *cache, result));
  EXPECT_EQ(SfiBackendOf(*pair.cuda).slots_in_use(), 1);
  status = pair.cuda->SetAttentionBackend(nullptr);
  EXPECT_EQ(status.code(), StatusCode::kFailedPrecondition) << status.message();
  held = SfiSequenceState();  // the request ends: its slot goes back
  ASSERT_STATUS_OK(pair.cuda->SetAttentionBackend(nullptr));
  EXPECT_EQ(pair.cuda->attention_backend(), nullptr);
}

// ---- the engine -------------------------------------------------------------------------------

// The engine's greedy tokens under the SFI policy of `sfi` (dense without), with the policy's
// counters.
std::vector<std::vector<int>> Generate(std::unique_ptr<Model> model,
                                       const std::optional<SfiPolicyConfig>& sfi,
                                       const std::vector<std::vector<int>>& prompts,
                                       SfiCounters* counters, double* min_retained) {
  EngineOptions options;
  options.max_batch = 3;
  options.prefill_chunk = 96;
  options.max_context = 512;
  std::shared_ptr<SfiPolicy> policy;
  if (sfi.has_value()) {
    Result<std::unique_ptr<SfiPolicy>> created = SfiPolicy::Create(*sfi);
    EXPECT_TRUE(created.ok()) << created.status().message();
    if (!created.ok()) return {};
    policy = std::move(created).value();
  }
  options.policy = policy;
  std::vector<std::vector<int>> tokens =
      EngineGreedyTokens(std::move(model), options, prompts, min_retained);
  *counters = policy != nullptr ? policy->counters() : SfiCounters();
  return tokens;
}

// `tokens` equal `dense` request by request, or first diverge where the dense logits of that
// prefix (recomputed on `model`) have their top two within bf16 rounding of each other.
void ExpectDenseTokensUpToNearTies(const ModelConfig& config, std::unique_ptr<Model> model,
                                   const std::vector<std::vector<int>>& prompts,
                                   const std::vector<std::vector<int>>& dense,
                                   const std::vector<std::vector<int>>& tokens, const char* what) {
  ASSERT_TRUE(model);
  ASSERT_EQ(tokens.size(), dense.size());
  for (size_t r = 0; r < prompts.size(); ++r) {
    const size_t shorter = std::min(tokens[r].size(), dense[r].size());
    size_t k = 0;
    while (k < shorter && tokens[r][k] == dense[r][k]) ++k;
    std::printf("[ engine    ] request %zu: SFI (%s) = dense for %zu of %zu tokens\n", r, what, k,
                dense[r].size());
    if (k == tokens[r].size() && k == dense[r].size()) continue;
    ASSERT_LT(k, shorter) << "request " << r << ": one run stopped without diverging";
    // The first divergence must be a near-tie of the dense logits at that prefix.
    std::vector<int> context = prompts[r];
    context.insert(context.end(), dense[r].begin(), dense[r].begin() + static_cast<ptrdiff_t>(k));
    auto cache = NewCache(*model, 16, static_cast<int>(context.size()) / 16 + 2);
    KvSequence seq;
    const std::vector<float> rows = FeedAll(*model, *cache, seq, context, 0, 64);
    const auto last = std::span<const float>(rows).last(static_cast<size_t>(config.vocab_size));
    EXPECT_LE(Top2Margin(last), 0.1 * Rms(last))
        << "request " << r << " diverges from dense at token " << k << " with a clear margin";
  }
}

// The engine on the CUDA model runs SFI's schedule (first decode step slow, t_max, more requests
// than fit at once so that slots are reused); with a budget covering the context it generates
// the dense engine's greedy tokens on the same CUDA weights, up to a flip where bf16 leaves the
// top two logits within rounding of each other.
TEST(CudaSfiEngineTest, EngineRunsSlowAndFastStepsAndKeepsTheDenseTokens) {
  Result<ModelConfig> config = ParseModelConfig(TinyQwen3(), "test config.json");
  ASSERT_STATUS_OK(config.status());
  Result<ModelWeights> weights = RandomWeights(*config, 13);
  ASSERT_STATUS_OK(weights.status());
  auto make = [&]() -> std::unique_ptr<Model> {
    auto model = CudaModel::Create(*config, *weights, CudaModelOptions{});
    EXPECT_TRUE(model.ok()) << model.status().message();
    return model.ok() ? std::move(model).value() : nullptr;
  };
  std::mt19937_64 rng = gpu_test::FreshRng();
  std::vector<std::vector<int>> prompts;
  for (int len : {120, 45, 200, 77, 160})
    prompts.push_back(RandomTokens(rng, len, config->vocab_size));

  SfiCounters dense_counters, sfi_counters, sparse_counters;
  double dense_retained = 0, sfi_retained = 0, sparse_retained = 0;
  const auto dense = Generate(make(), std::nullopt, prompts, &dense_counters, &dense_retained);
  const auto full =
      Generate(make(), SfiConfig(4, 16, 512, 5, 16), prompts, &sfi_counters, &sfi_retained);
  const auto sparse =
      Generate(make(), SfiConfig(4, 16, 16, 5, 16), prompts, &sparse_counters, &sparse_retained);
  EXPECT_EQ(dense_counters.slow_steps + dense_counters.fast_steps, 0);
  EXPECT_GT(sfi_counters.slow_steps, 0);
  EXPECT_GT(sfi_counters.fast_steps, sfi_counters.slow_steps);
  EXPECT_GT(sparse_counters.fast_steps, 0);
  EXPECT_LT(sparse_retained, 0.5) << "a budget of 16 over 100+ positions attends a fraction";
  ExpectDenseTokensUpToNearTies(*config, make(), prompts, dense, full, "full budget");
  for (size_t r = 0; r < prompts.size(); ++r) ASSERT_FALSE(sparse[r].empty());

  // The confidence trigger at a threshold no token of the random model reaches: every fast step
  // is thrown away and recomputed by a slow (dense) one, so a budget of 16 gives the dense tokens.
  SfiPolicyConfig redo_config = SfiConfig(4, 16, 16, 5, 16);
  redo_config.confidence_threshold = 0.999;
  SfiCounters redo_counters;
  double redo_retained = 0;
  const auto redo = Generate(make(), redo_config, prompts, &redo_counters, &redo_retained);
  EXPECT_GT(redo_counters.discarded_steps, 0);
  EXPECT_EQ(redo_counters.discarded_steps, redo_counters.fast_steps);
  EXPECT_EQ(redo_retained, 1.0) << "every token came from a slow step";
  ExpectDenseTokensUpToNearTies(*config, make(), prompts, dense, redo, "confidence trigger");
}

// ---- the fidelity guard on the CUDA model ---------------------------------------------------

// One request's tokens and retained ratios through the engine on `model` under `sfi`, and the
// policy (its counters and stats line).
struct GuardRun {
  std::vector<int> tokens;
  std::vector<double> retained;
  std::shared_ptr<SfiPolicy> policy;
};

GuardRun RunGuarded(std::unique_ptr<Model> model, const SfiPolicyConfig& sfi,
                    const std::vector<int>& prompt) {
  GuardRun run;
  Result<std::unique_ptr<SfiPolicy>> created = SfiPolicy::Create(sfi);
  EXPECT_TRUE(created.ok()) << created.status().message();
  if (!created.ok() || !model) return run;
  run.policy = std::move(created).value();
  EngineOptions options;
  options.max_batch = 1;
  options.prefill_chunk = 96;
  options.max_context = 512;
  options.policy = run.policy;
  auto engine = Engine::Create(std::move(model), options);
  EXPECT_TRUE(engine.ok()) << engine.status().message();
  if (!engine.ok()) return run;
  GenerationRequest request;
  request.prompt_ids = prompt;
  request.max_new_tokens = 40;
  request.ignore_eos = true;
  EXPECT_TRUE((*engine)->Submit(request).ok());
  for (int step = 0; (*engine)->HasWork() && step < 10000; ++step) {
    auto events = (*engine)->Step();
    EXPECT_TRUE(events.ok()) << events.status().message();
    if (!events.ok()) break;
    for (const TokenEvent& event : *events) {
      run.tokens.push_back(event.token);
      run.retained.push_back(event.retained_kv_ratio);
    }
  }
  return run;
}

// policy.fidelity_guard on the CUDA model, as sfi_engine_test.cc on the CPU: at 1 it fires on
// every fast step, each recomputed as a slow step, so the tokens are the confidence trigger's
// redo run's (the same steps, the same kernels: bit for bit) and the dense ones up to bf16 ties;
// at lower thresholds every token before the guard's first firing is the unguarded run's, and
// the step it fires on is a slow one. Decode steps replay as graphs, so the guard's launches are
// captured too.
TEST(CudaSfiEngineTest, FidelityGuardRedoesTheStepsItFiresOnAsSlowSteps) {
  Result<ModelConfig> config = ParseModelConfig(TinyQwen3(), "test config.json");
  ASSERT_STATUS_OK(config.status());
  Result<ModelWeights> weights = RandomWeights(*config, 13);
  ASSERT_STATUS_OK(weights.status());
  auto make = [&]() -> std::unique_ptr<Model> {
    auto model = CudaModel::Create(*config, *weights, CudaModelOptions{});
    EXPECT_TRUE(model.ok()) << model.status().message();
    return model.ok() ? std::move(model).value() : nullptr;
  };
  std::mt19937_64 rng = gpu_test::FreshRng();
  std::vector<std::vector<int>> prompts;
  for (int len : {120, 45, 200}) prompts.push_back(RandomTokens(rng, len, config->vocab_size));

  SfiCounters counters;
  double retained = 0;
  const auto dense = Generate(make(), std::nullopt, prompts, &counters, &retained);
  SfiPolicyConfig redo_config = SfiConfig(4, 16, 16, 5, 16);
  redo_config.confidence_threshold = 0.999;
  const auto redo = Generate(make(), redo_config, prompts, &counters, &retained);

  // Forced: every fast step fires.
  SfiPolicyConfig forced_config = SfiConfig(4, 16, 16, 5, 16);
  forced_config.fidelity_guard = 1.0;
  EngineOptions options;
  options.max_batch = 3;
  options.prefill_chunk = 96;
  options.max_context = 512;
  Result<std::unique_ptr<SfiPolicy>> created = SfiPolicy::Create(forced_config);
  ASSERT_STATUS_OK(created.status());
  std::shared_ptr<SfiPolicy> forced_policy = std::move(created).value();
  options.policy = forced_policy;
  double forced_retained = 0;
  const auto forced = EngineGreedyTokens(make(), options, prompts, &forced_retained);
  EXPECT_EQ(forced, redo) << "a firing must redo the step exactly as the confidence trigger does";
  ExpectDenseTokensUpToNearTies(*config, make(), prompts, dense, forced, "guard forced");
  EXPECT_EQ(forced_retained, 1.0) << "every token came from a slow step";
  const SfiCounters& forced_counters = forced_policy->counters();
  EXPECT_GT(forced_counters.fast_steps, 0);
  EXPECT_EQ(forced_counters.discarded_steps, forced_counters.fast_steps);
  EXPECT_EQ(forced_policy->guard_counters().firings, forced_counters.fast_steps);
  EXPECT_EQ(forced_policy->guard_counters().checks, forced_counters.fast_steps);
  EXPECT_NE(forced_policy->StatsLine().find(" sfi_guard_firings_per_100_steps="), std::string::npos)
      << forced_policy->StatsLine();

  // Lower thresholds: unchanged until the first firing.
  const SfiPolicyConfig sparse = SfiConfig(4, 16, 16, 5, 16);
  const GuardRun off = RunGuarded(make(), sparse, prompts[2]);
  ASSERT_FALSE(off.tokens.empty());
  bool tested = false;
  // The random weights' queries stay close (seen on an H200: a mean cosine above 0.9 on every
  // fast step, below 0.95 on one or two of ~33), hence thresholds near 1.
  for (double threshold : {0.999, 0.998, 0.995, 0.99, 0.98, 0.95, 0.9, 0.7, 0.5}) {
    SCOPED_TRACE("fidelity_guard " + std::to_string(threshold));
    SfiPolicyConfig guarded = sparse;
    guarded.fidelity_guard = threshold;
    const GuardRun on = RunGuarded(make(), guarded, prompts[2]);
    ASSERT_EQ(on.tokens.size(), off.tokens.size());
    size_t first_firing = off.tokens.size();
    for (size_t i = 0; i < off.tokens.size(); ++i) {
      if (on.retained[i] != off.retained[i]) {
        EXPECT_EQ(on.retained[i], 1.0) << "token " << i;  // a slow step now
        first_firing = i;
        break;
      }
      EXPECT_EQ(on.tokens[i], off.tokens[i]) << "token " << i;
    }
    const int64_t firings = on.policy->guard_counters().firings;
    const int64_t checks = on.policy->guard_counters().checks;
    std::printf(
        "[ guard     ] threshold %.3f: %lld firings of %lld fast steps, first at token "
        "%zu of %zu\n",
        threshold, static_cast<long long>(firings), static_cast<long long>(checks), first_firing,
        off.tokens.size());
    const bool changed = first_firing < off.tokens.size();
    EXPECT_EQ(changed, firings > 0);
    tested = tested || (firings > 0 && checks > firings);
  }
  EXPECT_TRUE(tested) << "no threshold both fired and let fast steps through: nothing tested";
}

}  // namespace
}  // namespace rubato
