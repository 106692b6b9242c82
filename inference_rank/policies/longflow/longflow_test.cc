// Tests for LongFlow's config and its decode step: every YAML value read and every bad one
// refused by its key path, the shipped presets, the plans, and the eviction sequence of a
// scripted run against a brute-force reference written here (full attention recomputed each
// step in double, Eq. 6 scores with the GQA group's mean weight, argmin past the sinks with ties
// to the lower slot, overwrite), with the attention output checked on every step.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <random>
#include <string>
#include <vector>

#include "inference_rank/kv/slot_kv_pool.h"
#include "inference_rank/policies/longflow/longflow_cpu_backend.h"
#include "inference_rank/policies/longflow/longflow_policy.h"
#include "inference_rank/policies/policy_registry.h"
#include "kernels/cpu/all_close_for_test.h"

namespace rubato {
namespace {

Result<LongFlowConfig> Parse(const std::string& params) {
  auto config = ParseConfig("policy:\n  name: longflow\n" + params, "p.yaml");
  if (!config.ok()) return config.status();
  return ParseLongFlowConfig(config->policy);
}

TEST(LongFlowConfig, DefaultsAreThePapersAndEveryValueIsRead) {
  auto defaults = Parse("");
  ASSERT_TRUE(defaults.ok()) << defaults.status().message();
  EXPECT_EQ(defaults->budget, 3200);
  EXPECT_EQ(defaults->sink_tokens, 4);
  EXPECT_EQ(defaults->snapkv_window, 32);
  EXPECT_EQ(defaults->snapkv_pool_kernel, 7);
  auto set =
      Parse("  budget: 2400\n  sink_tokens: 0\n  snapkv_window: 16\n  snapkv_pool_kernel: 5\n");
  ASSERT_TRUE(set.ok()) << set.status().message();
  EXPECT_EQ(set->budget, 2400);
  EXPECT_EQ(set->sink_tokens, 0);
  EXPECT_EQ(set->snapkv_window, 16);
  EXPECT_EQ(set->snapkv_pool_kernel, 5);
}

TEST(LongFlowConfig, BadValuesAreRefusedByName) {
  const std::pair<std::string, std::string> cases[] = {
      {"  budget: 0\n", "p.yaml: policy.budget: "},
      {"  budget: 36\n", "p.yaml: policy.budget: must exceed sink_tokens + snapkv_window (4 + 32)"},
      {"  budget: many\n", "p.yaml: policy.budget: "},
      {"  sink_tokens: -1\n", "p.yaml: policy.sink_tokens: "},
      {"  snapkv_window: 0\n", "p.yaml: policy.snapkv_window: "},
      {"  snapkv_pool_kernel: 6\n", "p.yaml: policy.snapkv_pool_kernel: must be odd"},
      {"  snapkv_pool_kernel: 0\n", "p.yaml: policy.snapkv_pool_kernel: "},
      {"  recent_window: 8\n", "p.yaml: policy.recent_window"},
  };
  for (const auto& [params, expected] : cases) {
    auto parsed = Parse(params);
    ASSERT_FALSE(parsed.ok()) << params;
    EXPECT_NE(parsed.status().message().find(expected), std::string::npos)
        << parsed.status().message();
  }
}

TEST(LongFlowConfig, ShippedPresetsAndResidency) {
  for (const auto& [file, budget] : {std::pair{"configs/policies/longflow.yaml", 3200},
                                     {"configs/policies/longflow_2400.yaml", 2400}}) {
    auto config = LoadConfigFile(file);
    ASSERT_TRUE(config.ok()) << config.status().message();
    auto choice = ResolvePolicy(*config);
    ASSERT_TRUE(choice.ok()) << choice.status().message();
    EXPECT_EQ(choice->residency, KvResidency::kEvicting);
    const auto& policy = dynamic_cast<const LongFlowPolicy&>(*choice->policy);
    EXPECT_EQ(policy.config().budget, budget);
    EXPECT_EQ(policy.traits().evicting_slots, budget);
  }
  // No residency given: the one LongFlow supports.
  auto automatic = ParseConfig("policy:\n  name: longflow\n", "p.yaml");
  ASSERT_TRUE(automatic.ok());
  auto chosen = ResolvePolicy(*automatic);
  ASSERT_TRUE(chosen.ok()) << chosen.status().message();
  EXPECT_EQ(chosen->residency, KvResidency::kEvicting);
  // Local asked for by name: refused by name.
  auto local = ParseConfig("engine:\n  kv_residency: local\npolicy:\n  name: longflow\n", "p.yaml");
  ASSERT_TRUE(local.ok());
  auto refused = ResolvePolicy(*local);
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().message(),
            "policy 'longflow' does not support local KV (supported: evicting)");
}

TEST(LongFlowPolicy, PlansDensePrefillThenFixedBudgetDecode) {
  LongFlowConfig config;
  config.budget = 64;
  LongFlowPolicy policy(config);
  auto request = policy.Admit(KvResidency::kEvicting);
  ASSERT_NE(request, nullptr);
  const EntryAttention* chunk = request->PlanPrefill(0, 30, false);
  ASSERT_NE(chunk, nullptr);
  EXPECT_EQ(chunk->action.op, AttentionOp::kDense);
  EXPECT_EQ(static_cast<LongFlowRequestState*>(chunk->state)->prompt_end, -1);
  chunk = request->PlanPrefill(30, 10, true);
  EXPECT_EQ(static_cast<LongFlowRequestState*>(chunk->state)->prompt_end, 40);
  const EntryAttention* decode = request->PlanDecode(40);
  EXPECT_EQ(decode->action.op, AttentionOp::kFixedBudget);
  EXPECT_EQ(decode->row_group, kLongFlowRows);
  EXPECT_EQ(static_cast<LongFlowRequestState*>(decode->state)->prompt_end, -1);
  EXPECT_EQ(policy.counters().live_requests, 1);
  request.reset();
  EXPECT_EQ(policy.counters().live_requests, 0);
}

// The brute force of one KV head: its own copy of every slot, recomputed in double each step.
struct ReferenceHead {
  std::vector<std::vector<double>> keys, values;  // [budget][head_dim]
  std::vector<int> position;                      // [budget], -1: free
};

struct Scripted {
  int heads = 4, kv_heads = 2, head_dim = 8, budget = 12, sinks = 2;
};

// Attention of the group's query heads over the valid slots (double), its output, and the next
// write slot: the lowest free one, else the argmin of mean(alpha) * |v|_1 past the sinks.
int ReferenceStep(const Scripted& s, const ReferenceHead& head, const float* group_queries,
                  std::vector<double>& output) {
  const int group = s.heads / s.kv_heads;
  std::vector<double> alpha(s.budget, 0.0);
  output.assign(static_cast<size_t>(group) * s.head_dim, 0.0);
  for (int g = 0; g < group; ++g) {
    std::vector<double> score(s.budget, -INFINITY);
    double max = -INFINITY;
    for (int i = 0; i < s.budget; ++i) {
      if (head.position[i] < 0) continue;
      double dot = 0;
      for (int e = 0; e < s.head_dim; ++e)
        dot += group_queries[g * s.head_dim + e] * head.keys[i][e];
      score[i] = dot / std::sqrt(double(s.head_dim));
      max = std::max(max, score[i]);
    }
    double sum = 0;
    for (int i = 0; i < s.budget; ++i) sum += head.position[i] < 0 ? 0 : std::exp(score[i] - max);
    for (int i = 0; i < s.budget; ++i) {
      if (head.position[i] < 0) continue;
      const double a = std::exp(score[i] - max) / sum;
      alpha[i] += a / group;
      for (int e = 0; e < s.head_dim; ++e) output[g * s.head_dim + e] += a * head.values[i][e];
    }
  }
  int best = -1;
  double best_score = INFINITY;
  for (int i = 0; i < s.budget; ++i) {
    if (head.position[i] < 0) return i;  // the lowest free slot
    if (i < s.sinks) continue;
    double norm = 0;
    for (double x : head.values[i]) norm += std::fabs(x);
    if (alpha[i] * norm < best_score) {
      best_score = alpha[i] * norm;
      best = i;
    }
  }
  return best;
}

TEST(LongFlowDecodeStep, ScriptedEvictionsMatchTheBruteForce) {
  const Scripted s;
  const int steps = 60;
  auto pool = SlotKvPool::Create(SlotKvShape{1, s.kv_heads, s.head_dim, s.budget, 1}).value();
  SlotKvArrays slots;
  ASSERT_TRUE(pool->Reserve(slots).ok());
  const SlotKvView view = pool->LayerView(0, slots);
  ThreadPool threads(2);
  LongFlowScratch scratch;
  std::vector<ReferenceHead> reference(static_cast<size_t>(s.kv_heads));
  for (ReferenceHead& head : reference) {
    head.keys.assign(s.budget, std::vector<double>(s.head_dim));
    head.values.assign(s.budget, std::vector<double>(s.head_dim));
    head.position.assign(s.budget, -1);
  }
  std::vector<int> ref_next(static_cast<size_t>(s.kv_heads), 0);
  std::mt19937 rng(11);
  std::normal_distribution<float> normal(0.f, 1.f);
  std::vector<float> k(s.kv_heads * s.head_dim), v(k.size()), q(s.heads * s.head_dim),
      out(q.size());
  std::vector<std::vector<int>> evicted(static_cast<size_t>(s.kv_heads)), ref_evicted = evicted;
  int occupied = 0, evictions = 0;
  for (int t = 0; t < steps; ++t) {
    for (float& x : k) x = normal(rng);
    for (float& x : v) x = normal(rng) * (1.f + 0.5f * std::sin(float(t)));
    for (float& x : q) x = 1.5f * normal(rng);
    // The runtime: write where the last step chose, attend, choose.
    for (int h = 0; h < s.kv_heads; ++h) {
      ASSERT_EQ(view.next_slot[h], ref_next[h]) << "step " << t << " head " << h;
    }
    ASSERT_TRUE(WriteToNextSlots(view, k.data(), v.data()).ok());
    auto was_eviction = LongFlowDecodeStep(view, occupied, s.sinks, s.heads, q.data(), out.data(),
                                           threads, scratch);
    ASSERT_TRUE(was_eviction.ok()) << was_eviction.status().message();
    EXPECT_EQ(*was_eviction, occupied == s.budget);
    if (*was_eviction) ++evictions;
    occupied = std::min(occupied + 1, s.budget);
    // The brute force: overwrite its own slot, recompute everything, take the argmin.
    const int group = s.heads / s.kv_heads;
    for (int h = 0; h < s.kv_heads; ++h) {
      ReferenceHead& head = reference[h];
      const int slot = ref_next[h];
      if (head.position[slot] >= 0) ref_evicted[h].push_back(head.position[slot]);
      head.position[slot] = t;
      for (int e = 0; e < s.head_dim; ++e) {
        head.keys[slot][e] = k[h * s.head_dim + e];
        head.values[slot][e] = v[h * s.head_dim + e];
      }
      std::vector<double> ref_out;
      ref_next[h] = ReferenceStep(s, head, q.data() + h * group * s.head_dim, ref_out);
      EXPECT_TRUE(AllClose<double>(
          "step " + std::to_string(t) + " head " + std::to_string(h),
          std::span<const float>(out).subspan(size_t(h) * group * s.head_dim, ref_out.size()),
          ref_out, 1e-5, 1e-4));
      EXPECT_EQ(view.next_slot[h], ref_next[h]) << "step " << t << " head " << h;
    }
  }
  EXPECT_EQ(evictions, steps - s.budget);
  // The sinks are the first tokens, never evicted; the heads evicted different tokens.
  for (int h = 0; h < s.kv_heads; ++h) {
    EXPECT_EQ(reference[h].position[0], 0);
    EXPECT_EQ(reference[h].position[1], 1);
    EXPECT_EQ(ref_evicted[h].size(), static_cast<size_t>(steps - s.budget));
  }
  EXPECT_NE(ref_evicted[0], ref_evicted[1]);
}

}  // namespace
}  // namespace rubato
