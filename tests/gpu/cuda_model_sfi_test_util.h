// Helpers of the CUDA model's SFI tests (cuda_model_sfi_test.cc, cuda_model_sfi_system_test.cc):
// requests with a prompt and a slow/fast schedule, run step by step as one batch on a CPU model
// and a CUDA model with the same weights (or on CUDA models alone); the check that a CUDA
// selection is a valid one and how much it overlaps the CPU's; and giving the CPU state the CUDA
// selection, so that both models attend the same working set.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <iterator>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "inference_rank/model/tiny_test_models.h"
#include "inference_rank/policies/sfi/sfi_cpu_backend.h"
#include "inference_rank/policies/sfi/sfi_cuda_backend.h"
#include "inference_rank/policies/sfi/sfi_state.h"
#include "kernels/cpu/compact_gather.h"
#include "tests/gpu/cuda_model_test_util.h"
#include "tests/gpu/gpu_test_util.h"

namespace rubato::cuda_model_sfi_test {

using namespace cuda_model_test;

inline SfiPolicyConfig SfiConfig(int sink, int recent, int budget, int t_max, int prefill_window) {
  SfiPolicyConfig config;
  config.sink_tokens = sink;
  config.recent_window = recent;
  config.t_max = t_max;
  config.prefill_window = prefill_window;
  config.triggers.clear();
  config.selector.budget = budget;
  return config;
}

inline std::string TinyQwen3() { return TinyConfigJson(TinyModelKind::kQwen3); }
inline std::string Qwen3Hd128() {
  return SmallConfigJson("Qwen3ForCausalLM", 256, 8, 2, 128, 512, 2, 1000, false);
}
inline std::string LlamaHd64Group8() {
  return SmallConfigJson("LlamaForCausalLM", 512, 8, 1, 64, 512, 2, 515, false,
                         ", \"attention_bias\": true");
}

inline bool BitwiseEqual(std::span<const float> a, std::span<const float> b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size_bytes()) == 0;
}

// Installs SFI's backend half for `config` and up to `max_batch` requests in `model`.
inline Status InstallSfi(CudaModel& model, const SfiPolicyConfig& config, int max_batch) {
  Result<std::unique_ptr<AttentionBackend>> backend = MakeSfiCudaBackend(model, config, max_batch);
  if (!backend.ok()) return backend.status();
  return model.SetAttentionBackend(std::move(backend).value());
}
inline Status InstallSfi(CpuModel& model, const SfiPolicyConfig& config) {
  Result<std::unique_ptr<AttentionBackend>> backend = MakeSfiCpuBackend(model.config(), config);
  if (!backend.ok()) return backend.status();
  return model.SetAttentionBackend(std::move(backend).value());
}
// The SFI backend InstallSfi put in `model` (its test hooks).
inline SfiCudaBackend& SfiBackendOf(CudaModel& model) {
  auto* backend = dynamic_cast<SfiCudaBackend*>(model.attention_backend());
  EXPECT_NE(backend, nullptr) << "no SFI backend installed";
  return *backend;
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
  EntryAttention attention[2];  // SfiStep of the request's state in each model
};

inline std::vector<Job> NextJobs(std::vector<Request>& requests, int chunk,
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
    for (int m = 0; m < 2; ++m) job.attention[m] = SfiStep(kind, &r.state[m], window);
    jobs.push_back(std::move(job));
  }
  return jobs;
}

// After a step ran: the requests' progress, and the token they decode next (next_tokens[e]; -1
// for a prefill chunk that does not end its prompt). `model` is the index of the forward that
// ran (its EntryAttention says whether the step was slow).
inline void Advance(std::vector<Job>& jobs, int model, std::span<const int> next_tokens) {
  for (size_t e = 0; e < jobs.size(); ++e) {
    Request& r = *jobs[e].request;
    const bool prefill = r.prompt_done < static_cast<int>(r.prompt.size());
    if (prefill) {
      r.prompt_done += static_cast<int>(jobs[e].tokens.size());
    } else {
      ++r.decoded;
      const bool slow = jobs[e].sfi && SfiStepOf(jobs[e].attention[model]) == SfiStepKind::kSlow;
      r.fast_since_slow = slow ? 0 : r.fast_since_slow + 1;
    }
    if (next_tokens[e] >= 0) r.next_token = next_tokens[e];
  }
}

// Advance with the CPU model's greedy tokens (forward 0).
inline void Advance(std::vector<Job>& jobs, const ForwardResult& reference) {
  std::vector<int> next(jobs.size(), -1);
  for (size_t e = 0; e < jobs.size(); ++e) {
    const auto last = reference.LastLogits(static_cast<int>(e));
    if (!last.empty()) next[e] = ArgMax(last);
  }
  Advance(jobs, 0, next);
}

inline std::vector<ForwardEntry> Entries(std::vector<Job>& jobs, int m,
                                         const TokenSampling* sampling,
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
    if (job.sfi) entry.attention = &job.attention[m];
    batch.push_back(entry);
  }
  return batch;
}

// Checks that `kept` (one layer of a CUDA state) is a valid selection of a sequence of `length`
// positions at its slow step, and returns its overlap with `cpu` (|A ∩ B| / |A ∪ B| over the
// selected parts, 1 when both are empty).
inline double CheckSelection(const std::vector<std::vector<int>>& kept,
                             const std::vector<std::vector<int>>& cpu,
                             const SfiPolicyConfig& config, int length, const std::string& what) {
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
inline void PinCpuSelection(CudaModel& cuda, Request& r, PagedKvCache& cpu_cache,
                            const SfiPolicyConfig& config, bool expect_identical,
                            std::vector<double>& overlaps) {
  const ModelConfig& model = cuda.config();
  SfiCudaBackend& backend = SfiBackendOf(cuda);
  const int length = r.seq[0].num_tokens;
  for (int layer = 0; layer < model.num_layers; ++layer) {
    const std::string what =
        "layer " + std::to_string(layer) + " at length " + std::to_string(length);
    auto kept = backend.KeptPositions(r.state[1], layer);
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

// A CPU model and a CUDA model with the same weights and SFI's backend halves installed (the
// CUDA one for `max_batch` requests), with a cache each.
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
    const Status cpu_prepared = InstallSfi(*pair.cpu, config);
    EXPECT_TRUE(cpu_prepared.ok()) << cpu_prepared.message();
    const Status prepared = InstallSfi(*pair.cuda, config, max_batch);
    EXPECT_TRUE(prepared.ok()) << prepared.message();
    cache[0] = NewCache(*pair.cpu, block_tokens, blocks);
    cache[1] = NewCache(*pair.cuda, block_tokens, blocks);
    return cpu_prepared.ok() && prepared.ok() && cache[0] && cache[1];
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
      const bool is_slow = jobs[e].sfi && SfiStepOf(jobs[e].attention[0]) == SfiStepKind::kSlow;
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

}  // namespace rubato::cuda_model_sfi_test
