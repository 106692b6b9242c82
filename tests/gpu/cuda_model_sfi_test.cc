// SFI on the CUDA model (inference_rank/model/cuda_model_sfi.cc) against its twin, SFI on the CPU
// model (cpu_model_sfi.cc), on identical random weights: prefill chunks whose last one selects
// from its W tail queries, slow and fast decode steps on their own schedules per request, in
// mixed batches with dense requests.
//   * Budget covering the context: both models keep all of J (the CUDA positions equal the
//     CPU's), the logits agree to bf16 tolerance, and on CUDA they equal dense attention's
//     (the SFI invariant).
//   * Small budget over a context of hundreds: the CUDA selection is a valid one (sink, then
//     positions of J ascending, sink + min(budget, |J|) rows) and overlaps the CPU's (bf16
//     logits may reorder near-ties only); the CPU state is then given the CUDA selection, so
//     that both attend the same working set and fast steps compare to bf16 tolerance.
//   * Bitwise: graph replay == eager, overlap on == off, two runs identical.
//   * Slots: a pool of N serves requests that come and go; the N+1st is ResourceExhausted and
//     changes nothing. Errors, and the engine on the CUDA model.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "inference_rank/engine/engine.h"
#include "inference_rank/model/tiny_test_models.h"
#include "kernels/cpu/compact_gather.h"
#include "tests/gpu/cuda_model_test_util.h"
#include "tests/gpu/gpu_test_util.h"

namespace rubato {
namespace {

using namespace cuda_model_test;

SfiPolicyConfig SfiConfig(int sink, int recent, int budget, int t_max, int prefill_window) {
  SfiPolicyConfig config;
  config.sink_tokens = sink;
  config.recent_window = recent;
  config.t_max = t_max;
  config.prefill_window = prefill_window;
  config.triggers.clear();
  config.selector.budget = budget;
  return config;
}

std::string TinyQwen3() { return TinyConfigJson(TinyModelKind::kQwen3); }
std::string Qwen3Hd128() {
  return SmallConfigJson("Qwen3ForCausalLM", 256, 8, 2, 128, 512, 2, 1000, false);
}
std::string LlamaHd64Group8() {
  return SmallConfigJson("LlamaForCausalLM", 512, 8, 1, 64, 512, 2, 515, false,
                         ", \"attention_bias\": true");
}

bool BitwiseEqual(std::span<const float> a, std::span<const float> b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size_bytes()) == 0;
}

// One request: its prompt, its schedule and its sequence + SFI state in each model it runs on.
struct Request {
  std::vector<int> prompt;
  bool sfi = true;  // false: a dense request in the same batches
  int period = 0;   // fast steps between slow ones (<= t_max)
  int prompt_done = 0;
  int decoded = 0;
  int fast_since_slow = 0;
  int next_token = 0;
  KvSequence seq[2];  // [0] CPU or first CUDA model, [1] CUDA
  SfiSequenceState state[2];
};

// The step a request takes next: a prompt chunk (the last one of an SFI prompt selects from its
// min(chunk, prefill_window) tail queries) or a decode token (the first slow, then `period`
// fast steps per slow one).
struct Job {
  Request* request = nullptr;
  std::vector<int> tokens;
  int start = 0;
  bool sfi = false;
  SfiForward forward[2];
};

std::vector<Job> NextJobs(std::vector<Request>& requests, int chunk,
                          const SfiPolicyConfig& config) {
  std::vector<Job> jobs;
  for (Request& r : requests) {
    Job job;
    job.request = &r;
    job.sfi = r.sfi;
    const int left = static_cast<int>(r.prompt.size()) - r.prompt_done;
    SfiStepKind kind = SfiStepKind::kSlow;
    int window = 1;
    if (left > 0) {
      const int n = std::min(chunk, left);
      job.tokens.assign(r.prompt.begin() + r.prompt_done, r.prompt.begin() + r.prompt_done + n);
      job.start = r.prompt_done;
      job.sfi = r.sfi && n == left;  // only the chunk that ends the prompt
      window = std::min(n, config.prefill_window);
    } else {
      job.tokens = {r.next_token};
      job.start = r.prompt_done + r.decoded;
      const bool slow = r.decoded == 0 || r.fast_since_slow >= r.period;
      kind = slow ? SfiStepKind::kSlow : SfiStepKind::kFast;
    }
    for (int m = 0; m < 2; ++m) job.forward[m] = SfiForward{kind, &r.state[m], &config, window};
    jobs.push_back(std::move(job));
  }
  return jobs;
}

// After a step ran on every model: the requests' progress and the token they decode next.
void Advance(std::vector<Job>& jobs, const ForwardResult& reference) {
  for (size_t e = 0; e < jobs.size(); ++e) {
    Request& r = *jobs[e].request;
    const bool prefill = r.prompt_done < static_cast<int>(r.prompt.size());
    if (prefill) {
      r.prompt_done += static_cast<int>(jobs[e].tokens.size());
    } else {
      ++r.decoded;
      const bool slow = jobs[e].sfi && jobs[e].forward[0].step == SfiStepKind::kSlow;
      r.fast_since_slow = slow ? 0 : r.fast_since_slow + 1;
    }
    const auto last = reference.LastLogits(static_cast<int>(e));
    if (!last.empty()) r.next_token = ArgMax(last);
  }
}

std::vector<ForwardEntry> Entries(std::vector<Job>& jobs, int m, const TokenSampling* sampling,
                                  LogitsWanted decode_logits) {
  std::vector<ForwardEntry> batch;
  for (Job& job : jobs) {
    Request& r = *job.request;
    const bool decode = r.prompt_done >= static_cast<int>(r.prompt.size());
    const bool last_chunk = !decode && job.start + static_cast<int>(job.tokens.size()) ==
                                           static_cast<int>(r.prompt.size());
    ForwardEntry entry{&r.seq[m], job.tokens, job.start,
                       decode       ? decode_logits
                       : last_chunk ? LogitsWanted::kLast
                                    : LogitsWanted::kNone};
    if (entry.logits != LogitsWanted::kNone) entry.sampling = sampling;
    if (job.sfi) entry.sfi = &job.forward[m];
    batch.push_back(entry);
  }
  return batch;
}

// Checks that `kept` (one layer of a CUDA state) is a valid selection of a sequence of `length`
// positions at its slow step, and returns its overlap with `cpu` (|A ∩ B| / |A ∪ B| over the
// selected parts, 1 when both are empty).
double CheckSelection(const std::vector<std::vector<int>>& kept,
                      const std::vector<std::vector<int>>& cpu, const SfiPolicyConfig& config,
                      int length, const std::string& what) {
  const int sink_end = SfiSinkEnd(config, length);
  const int anchor = SfiAnchor(config, length);
  const int expected = sink_end + std::min(config.selector.budget, anchor - sink_end);
  int64_t common = 0, either = 0;
  for (size_t h = 0; h < kept.size(); ++h) {
    const std::vector<int>& k = kept[h];
    EXPECT_EQ(static_cast<int>(k.size()), expected) << what << " head " << h;
    for (int i = 0; i < static_cast<int>(k.size()); ++i) {
      if (i < sink_end) {
        EXPECT_EQ(k[static_cast<size_t>(i)], i) << what << " head " << h << " sink row " << i;
      } else {
        EXPECT_GE(k[static_cast<size_t>(i)], sink_end) << what << " head " << h;
        EXPECT_LT(k[static_cast<size_t>(i)], anchor) << what << " head " << h;
        if (i > sink_end) {
          EXPECT_LT(k[static_cast<size_t>(i) - 1], k[static_cast<size_t>(i)]) << what;
        }
      }
    }
    std::vector<int> a(k.begin() + std::min<ptrdiff_t>(sink_end, ptrdiff_t(k.size())), k.end());
    std::vector<int> b(cpu[h].begin() + std::min<ptrdiff_t>(sink_end, ptrdiff_t(cpu[h].size())),
                       cpu[h].end());
    std::vector<int> both, any;
    std::set_intersection(a.begin(), a.end(), b.begin(), b.end(), std::back_inserter(both));
    std::set_union(a.begin(), a.end(), b.begin(), b.end(), std::back_inserter(any));
    common += static_cast<int64_t>(both.size());
    either += static_cast<int64_t>(any.size());
  }
  return either == 0 ? 1.0 : static_cast<double>(common) / static_cast<double>(either);
}

// Gives the CPU state the CUDA model's selection (positions, counts and the CPU compact rows
// gathered from the CPU cache), so that both attend the same working set from now on.
void PinCpuSelection(CudaModel& cuda, Request& r, PagedKvCache& cpu_cache,
                     const SfiPolicyConfig& config, bool expect_identical,
                     std::vector<double>& overlaps) {
  const ModelConfig& model = cuda.config();
  const int length = r.seq[0].num_tokens;
  for (int layer = 0; layer < model.num_layers; ++layer) {
    const std::string what =
        "layer " + std::to_string(layer) + " at length " + std::to_string(length);
    auto kept = cuda.SfiKeptPositions(r.state[1], layer);
    ASSERT_STATUS_OK(kept.status());
    SfiLayerState& cpu = r.state[0].layers[static_cast<size_t>(layer)];
    overlaps.push_back(CheckSelection(*kept, cpu.kept, config, length, what));
    if (expect_identical) {
      EXPECT_EQ(*kept, cpu.kept) << what;
    }
    EXPECT_EQ(r.state[1].layers[static_cast<size_t>(layer)].counts, cpu.counts) << what;
    cpu.kept = *kept;
    const CompactKvView compact{cpu.compact_keys.data(), cpu.compact_values.data(),
                                model.num_kv_heads, config.sink_tokens + config.selector.budget,
                                model.head_dim};
    ASSERT_STATUS_OK(GatherCompactKv(cpu_cache.LayerView(layer, r.seq[0]), length, cpu.kept,
                                     compact, cpu.counts));
  }
  EXPECT_EQ(r.state[1].anchor, r.state[0].anchor);
  EXPECT_EQ(r.state[1].has_selection, r.state[0].has_selection);
}

// A CPU model and a CUDA model with the same weights and SFI prepared for `max_batch` requests,
// with a cache each.
struct Twins {
  ModelPair pair;
  std::unique_ptr<PagedKvCache> cache[2];  // [0] CPU, [1] CUDA
  SfiPolicyConfig config;
  std::vector<double> overlaps;  // per (slow entry, layer): CUDA/CPU selection overlap
  int slow = 0, fast = 0;

  bool Init(const std::string& json, const SfiPolicyConfig& sfi, int max_batch, int block_tokens,
            int blocks) {
    pair = MakeModelPair(json, /*seed=*/31);
    if (!pair.cpu || !pair.cuda) return false;
    config = sfi;
    EXPECT_TRUE(pair.cpu->PrepareSfi(config, max_batch).ok());
    const Status prepared = pair.cuda->PrepareSfi(config, max_batch);
    EXPECT_TRUE(prepared.ok()) << prepared.message();
    cache[0] = NewCache(*pair.cpu, block_tokens, blocks);
    cache[1] = NewCache(*pair.cuda, block_tokens, blocks);
    return prepared.ok() && cache[0] && cache[1];
  }

  // One step of `jobs` on both models; every entry's last-token logits compared; each slow SFI
  // entry's CUDA selection checked and given to the CPU state (identical when full_budget).
  void Step(const std::string& name, std::vector<Job>& jobs, bool full_budget) {
    const std::vector<ForwardEntry> cpu_batch = Entries(jobs, 0, nullptr, LogitsWanted::kLast);
    const std::vector<ForwardEntry> cuda_batch = Entries(jobs, 1, nullptr, LogitsWanted::kLast);
    ASSERT_STATUS_OK(pair.cpu->Forward(cpu_batch, *cache[0], cpu_result));
    ASSERT_STATUS_OK(pair.cuda->Forward(cuda_batch, *cache[1], cuda_result));
    const int vocab = pair.cpu->config().vocab_size;
    for (size_t e = 0; e < jobs.size(); ++e) {
      const bool is_slow = jobs[e].sfi && jobs[e].forward[0].step == SfiStepKind::kSlow;
      const std::string what = name + " entry " + std::to_string(e) +
                               (!jobs[e].sfi ? " dense"
                                : is_slow    ? " slow"
                                             : " fast");
      if (jobs[e].sfi) ++(is_slow ? slow : fast);
      const auto cpu_logits = cpu_result.LastLogits(static_cast<int>(e));
      if (!cpu_logits.empty()) {  // not a chunk in the middle of a prompt
        ExpectRowsClose(what, cuda_result.LastLogits(static_cast<int>(e)), cpu_logits, vocab);
      }
      EXPECT_EQ(jobs[e].request->seq[1].num_tokens, jobs[e].request->seq[0].num_tokens);
      if (is_slow) {
        PinCpuSelection(*pair.cuda, *jobs[e].request, *cache[0], config, full_budget, overlaps);
      }
    }
    Advance(jobs, cpu_result);
  }

  // Prints the selection overlaps and checks them: bf16 logits move near-tied scores only, while
  // a selection of unrelated positions (wrong scores, J or window rows) would share about
  // budget / |J| of its positions with the CPU's.
  void ExpectSelectionsAgree(const std::string& name, bool full_budget) {
    double worst = 1.0, sum = 0.0;
    for (double v : overlaps) {
      worst = std::min(worst, v);
      sum += v;
    }
    std::printf(
        "[ sfi       ] %s: %d slow, %d fast entries; selection overlap CUDA/CPU mean "
        "%.3f, worst %.3f over %zu (slow entry, layer)s\n",
        name.c_str(), slow, fast, overlaps.empty() ? 1.0 : sum / overlaps.size(), worst,
        overlaps.size());
    EXPECT_GE(worst, 0.5) << "the CUDA Selector chose other positions than the CPU's";
    if (full_budget) {
      EXPECT_EQ(worst, 1.0);
    }
  }

  ForwardResult cpu_result, cuda_result;
};

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
  int blocks = 0;
  for (int len : o.prompt_lens) blocks += (len + o.decode_steps) / o.block_tokens + 2;
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
  const int prefill_steps =
      (*std::max_element(o.prompt_lens.begin(), o.prompt_lens.end()) + o.chunk - 1) / o.chunk;
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
  o.json = LlamaHd64Group8();
  o.block_tokens = 64;
  o.config = SfiConfig(4, 64, 64, 5, 8);
  o.prompt_lens = {700, 901};
  o.chunk = 256;
  RunCpuVsCuda("llama hd64 group 8 budget 64", o);
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

// ---- CUDA against itself, bitwise ----------------------------------------------------------

struct CudaRun {
  std::vector<std::vector<float>> logits;  // per step
  std::vector<std::vector<int>> tokens;    // per step
  int64_t replays = 0;
};

// The scenario on `model` (fresh cache and states), greedy sampling on the device with every
// decode row's logits returned.
CudaRun RunCuda(CudaModel& model, const SfiPolicyConfig& config, const std::vector<int>& lens,
                int steps, uint64_t seed) {
  CudaRun run;
  EXPECT_TRUE(model.PrepareSfi(config, static_cast<int>(lens.size())).ok());
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
    for (size_t e = 0; e < jobs.size(); ++e) {
      Request& r = *jobs[e].request;
      const bool prefill = r.prompt_done < static_cast<int>(r.prompt.size());
      if (prefill) {
        r.prompt_done += static_cast<int>(jobs[e].tokens.size());
      } else {
        ++r.decoded;
        const bool slow = jobs[e].sfi && jobs[e].forward[1].step == SfiStepKind::kSlow;
        r.fast_since_slow = slow ? 0 : r.fast_since_slow + 1;
      }
      if (result.sampled_tokens[e] >= 0) r.next_token = result.sampled_tokens[e];
    }
  }
  run.replays = model.graph_replays() - replays_before;
  return run;
}

TEST(CudaSfiTest, GraphEqualsEagerOverlapEqualsInlineAndRunsRepeatBitwise) {
  Result<ModelConfig> config = ParseModelConfig(Qwen3Hd128(), "test config.json");
  ASSERT_STATUS_OK(config.status());
  Result<ModelWeights> weights = RandomWeights(*config, 41);
  ASSERT_STATUS_OK(weights.status());
  auto make = [&](bool graph, bool overlap) {
    CudaModelOptions options;
    options.use_cuda_graph = graph;
    options.sfi_overlap = overlap;
    auto model = CudaModel::Create(*config, *weights, options);
    EXPECT_TRUE(model.ok()) << model.status().message();
    return model.ok() ? std::move(model).value() : nullptr;
  };
  auto graph_overlap = make(true, true);
  auto graph_inline = make(true, false);
  auto eager_overlap = make(false, true);
  ASSERT_TRUE(graph_overlap && graph_inline && eager_overlap);
  const SfiPolicyConfig sfi = SfiConfig(4, 32, 40, 3, 16);
  const std::vector<int> lens = {300, 200, 450, 129};
  const int steps = 30;
  const uint64_t seed = gpu_test::FreshRng()();
  const CudaRun a = RunCuda(*graph_overlap, sfi, lens, steps, seed);
  const CudaRun b = RunCuda(*graph_inline, sfi, lens, steps, seed);
  const CudaRun c = RunCuda(*eager_overlap, sfi, lens, steps, seed);
  const CudaRun again = RunCuda(*graph_overlap, sfi, lens, steps, seed);  // the same model again
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
      for (int m = 0; m < 2; ++m) job.forward[m] = SfiForward{kind, &r->state[m], &config, window};
      all.push_back(std::move(job));
    }
    twins.Step(what, all, /*full_budget=*/false);
  };
  step({&requests[0], &requests[1]}, "prefill 0, 1");
  EXPECT_EQ(cuda.sfi_slots_in_use(), 2);

  // Request 2: no slot left; nothing reserved, its state untouched.
  {
    Request& r = requests[2];
    SfiForward slow{SfiStepKind::kSlow, &r.state[1], &config, 8};
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
  EXPECT_EQ(cuda.sfi_slots_in_use(), 1);
  step({&requests[2]}, "prefill 2");
  EXPECT_EQ(cuda.sfi_slots_in_use(), 2);
  for (int i = 0; i < 4; ++i) step({&requests[2], &requests[1]}, "decode 2, 1");
  EXPECT_GT(cuda.graph_replays(), replays) << "a new slot assignment must not need a new graph";
  twins.ExpectSelectionsAgree("slots", false);
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
  SfiForward slow{SfiStepKind::kSlow, &state, &config, 8};
  ForwardEntry entry{&seq, prompt, 0, LogitsWanted::kLast, nullptr, &slow};

  Status status = pair.cuda->Forward({&entry, 1}, *cache, result);
  EXPECT_EQ(status.code(), StatusCode::kFailedPrecondition) << status.message();
  EXPECT_NE(status.message().find("PrepareSfi"), std::string::npos) << status.message();

  SfiPolicyConfig gamma = config;
  gamma.selector.gamma = 0.5;
  status = pair.cuda->PrepareSfi(gamma, 4);
  EXPECT_EQ(status.code(), StatusCode::kUnsupported) << status.message();
  EXPECT_EQ(pair.cuda->PrepareSfi(config, 0).code(), StatusCode::kInvalidArgument);
  ASSERT_STATUS_OK(pair.cuda->PrepareSfi(config, 4));

  // A bigger budget than the pool was sized for.
  SfiPolicyConfig bigger = config;
  bigger.selector.budget = 17;
  SfiForward slow_bigger{SfiStepKind::kSlow, &state, &bigger, 8};
  ForwardEntry bigger_entry{&seq, prompt, 0, LogitsWanted::kLast, nullptr, &slow_bigger};
  status = pair.cuda->Forward({&bigger_entry, 1}, *cache, result);
  EXPECT_EQ(status.code(), StatusCode::kInvalidArgument) << status.message();

  // A selection the CPU model made cannot serve a CUDA fast step; nor can a state without one.
  KvSequence cpu_seq;
  SfiSequenceState cpu_state;
  SfiForward cpu_slow{SfiStepKind::kSlow, &cpu_state, &config, 8};
  ForwardEntry cpu_entry{&cpu_seq, prompt, 0, LogitsWanted::kLast, nullptr, &cpu_slow};
  ASSERT_STATUS_OK(pair.cpu->Forward({&cpu_entry, 1}, *cpu_cache, result));
  KvSequence cuda_seq;
  ForwardEntry cuda_prefill{&cuda_seq, prompt, 0, LogitsWanted::kLast};
  ASSERT_STATUS_OK(pair.cuda->Forward({&cuda_prefill, 1}, *cache, result));
  const int token = 3;
  SfiForward fast{SfiStepKind::kFast, &cpu_state, &config, 1};
  ForwardEntry fast_entry{&cuda_seq, {&token, 1}, 17, LogitsWanted::kLast, nullptr, &fast};
  status = pair.cuda->Forward({&fast_entry, 1}, *cache, result);
  EXPECT_EQ(status.code(), StatusCode::kFailedPrecondition) << status.message();
  EXPECT_EQ(cuda_seq.num_tokens, 17);
  SfiSequenceState fresh;
  SfiForward fast_fresh{SfiStepKind::kFast, &fresh, &config, 1};
  ForwardEntry fresh_entry{&cuda_seq, {&token, 1}, 17, LogitsWanted::kLast, nullptr, &fast_fresh};
  EXPECT_EQ(pair.cuda->Forward({&fresh_entry, 1}, *cache, result).code(),
            StatusCode::kInvalidArgument);

  // Two configs in one forward.
  SfiPolicyConfig other = config;
  KvSequence a, b;
  SfiSequenceState sa, sb;
  SfiForward fa{SfiStepKind::kSlow, &sa, &config, 8};
  SfiForward fb{SfiStepKind::kSlow, &sb, &other, 8};
  std::vector<ForwardEntry> two = {{&a, prompt, 0, LogitsWanted::kLast, nullptr, &fa},
                                   {&b, prompt, 0, LogitsWanted::kLast, nullptr, &fb}};
  status = pair.cuda->Forward(two, *cache, result);
  EXPECT_EQ(status.code(), StatusCode::kUnsupported) << status.message();
  std::printf("[ errors    ] %s\n", status.message().c_str());
  EXPECT_EQ(a.num_tokens + b.num_tokens, 0);
}

// ---- the engine -------------------------------------------------------------------------------

std::vector<std::vector<int>> Generate(std::unique_ptr<Model> model,
                                       const std::optional<SfiPolicyConfig>& sfi,
                                       const std::vector<std::vector<int>>& prompts,
                                       EngineCounters* counters, double* min_retained) {
  EngineOptions options;
  options.max_batch = 3;
  options.prefill_chunk = 96;
  options.max_context = 512;
  options.sfi = sfi;
  auto engine = Engine::Create(std::move(model), options);
  EXPECT_TRUE(engine.ok()) << engine.status().message();
  if (!engine.ok()) return {};
  std::map<uint64_t, size_t> index;
  for (size_t i = 0; i < prompts.size(); ++i) {
    GenerationRequest request;
    request.prompt_ids = prompts[i];
    request.max_new_tokens = 40;
    auto id = (*engine)->Submit(request);
    EXPECT_TRUE(id.ok()) << id.status().message();
    if (id.ok()) index[*id] = i;
  }
  std::vector<std::vector<int>> tokens(prompts.size());
  *min_retained = 1.0;
  while ((*engine)->HasWork()) {
    auto events = (*engine)->Step();
    EXPECT_TRUE(events.ok()) << events.status().message();
    if (!events.ok()) break;
    for (const TokenEvent& event : *events) {
      tokens[index[event.request_id]].push_back(event.token);
      *min_retained = std::min(*min_retained, event.retained_kv_ratio);
    }
  }
  *counters = (*engine)->counters();
  return tokens;
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

  EngineCounters dense_counters, sfi_counters, sparse_counters;
  double dense_retained = 0, sfi_retained = 0, sparse_retained = 0;
  const auto dense = Generate(make(), std::nullopt, prompts, &dense_counters, &dense_retained);
  const auto full =
      Generate(make(), SfiConfig(4, 16, 512, 5, 16), prompts, &sfi_counters, &sfi_retained);
  const auto sparse =
      Generate(make(), SfiConfig(4, 16, 16, 5, 16), prompts, &sparse_counters, &sparse_retained);
  EXPECT_EQ(dense_counters.sfi_slow_steps + dense_counters.sfi_fast_steps, 0);
  EXPECT_GT(sfi_counters.sfi_slow_steps, 0);
  EXPECT_GT(sfi_counters.sfi_fast_steps, sfi_counters.sfi_slow_steps);
  EXPECT_GT(sparse_counters.sfi_fast_steps, 0);
  EXPECT_LT(sparse_retained, 0.5) << "a budget of 16 over 100+ positions attends a fraction";
  ASSERT_EQ(full.size(), dense.size());
  auto model = make();
  ASSERT_TRUE(model);
  for (size_t r = 0; r < prompts.size(); ++r) {
    ASSERT_FALSE(sparse[r].empty());
    const size_t shorter = std::min(full[r].size(), dense[r].size());
    size_t k = 0;
    while (k < shorter && full[r][k] == dense[r][k]) ++k;
    std::printf("[ engine    ] request %zu: SFI (full budget) = dense for %zu of %zu tokens\n", r,
                k, dense[r].size());
    if (k == full[r].size() && k == dense[r].size()) continue;
    ASSERT_LT(k, shorter) << "request " << r << ": one run stopped without diverging";
    // The first divergence must be a near-tie of the dense logits at that prefix.
    std::vector<int> context = prompts[r];
    context.insert(context.end(), dense[r].begin(), dense[r].begin() + static_cast<ptrdiff_t>(k));
    auto cache = NewCache(*model, 16, static_cast<int>(context.size()) / 16 + 2);
    KvSequence seq;
    const std::vector<float> rows = FeedAll(*model, *cache, seq, context, 0, 64);
    const auto last = std::span<const float>(rows).last(static_cast<size_t>(config->vocab_size));
    EXPECT_LE(Top2Margin(last), 0.1 * Rms(last))
        << "request " << r << " diverges from dense at token " << k << " with a clear margin";
  }
}

}  // namespace
}  // namespace rubato
