// Tests for oracle_topk on the CPU: its selection against a brute-force double-precision
// reference of the same rule (GQA-pooled softmax over the candidates, top-k, ties low), its
// attention over sink + selected + recent against a double reference, the two-segment path with
// k covering every candidate bit for bit equal to dense attention, the plans (dense when k covers
// the candidates, none on offloaded KV), and the engine: k >= context gives the dense tokens.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <numeric>
#include <random>
#include <vector>

#include "common/test_temp_dir.h"
#include "inference_rank/engine/engine.h"
#include "inference_rank/engine/engine_test_requests.h"
#include "inference_rank/model/tiny_test_models.h"
#include "inference_rank/policies/oracle_topk/oracle_topk_cpu_backend.h"
#include "inference_rank/policies/oracle_topk/oracle_topk_policy.h"
#include "kernels/cpu/attention.h"
#include "kernels/cpu/two_segment_attention.h"

namespace rubato {
namespace {

// One layer of random K/V for one sequence of `length` positions, and one random query.
struct Fixture {
  ModelConfig config;
  std::unique_ptr<PagedKvCache> cache;
  KvSequence sequence;
  std::vector<float> q;  // [num_heads][head_dim]
  ThreadPool pool{2};

  Fixture(int heads, int kv_heads, int head_dim, int length, uint32_t seed) {
    config.num_layers = 1;
    config.num_heads = heads;
    config.num_kv_heads = kv_heads;
    config.head_dim = head_dim;
    config.hidden_size = heads * head_dim;
    cache = PagedKvCache::Create(KvCacheShape{1, kv_heads, head_dim, 16, length / 16 + 2}).value();
    EXPECT_TRUE(cache->Reserve(sequence, length).ok());
    sequence.num_tokens = length;
    std::mt19937 rng(seed);
    std::normal_distribution<float> normal(0.f, 1.f);
    const PagedKvView kv = cache->LayerView(0, sequence);
    for (int p = 0; p < length; ++p) {
      for (int h = 0; h < kv_heads; ++h) {
        for (int d = 0; d < head_dim; ++d) {
          kv.keys[kv.Offset(p, h) + d] = normal(rng);
          kv.values[kv.Offset(p, h) + d] = normal(rng);
        }
      }
    }
    q.resize(static_cast<size_t>(heads) * head_dim);
    for (float& x : q) x = 1.5f * normal(rng);
  }
  PagedKvView View() const { return cache->LayerView(0, sequence); }
};

// The rule of oracle_topk_policy.h in double precision, per KV head.
std::vector<std::vector<int>> ReferenceKept(const Fixture& f, const OracleTopKConfig& config) {
  const int length = f.sequence.num_tokens;
  const OracleCandidates c = OracleCandidatesFor(config, length);
  const int group = f.config.num_heads / f.config.num_kv_heads;
  const int d = f.config.head_dim;
  const PagedKvView kv = f.View();
  std::vector<std::vector<int>> kept(static_cast<size_t>(f.config.num_kv_heads));
  for (int h = 0; h < f.config.num_kv_heads; ++h) {
    std::vector<double> pooled(static_cast<size_t>(c.count()), 0.0);
    for (int g = 0; g < group; ++g) {
      const float* q = f.q.data() + static_cast<size_t>(h * group + g) * d;
      std::vector<double> logits(static_cast<size_t>(c.count()));
      for (int j = 0; j < c.count(); ++j) {
        double dot = 0;
        for (int i = 0; i < d; ++i) dot += double(q[i]) * kv.keys[kv.Offset(c.sink_end + j, h) + i];
        logits[static_cast<size_t>(j)] = dot / std::sqrt(double(d));
      }
      const double max = *std::max_element(logits.begin(), logits.end());
      double sum = 0;
      for (double& l : logits) sum += (l = std::exp(l - max));
      for (int j = 0; j < c.count(); ++j) pooled[static_cast<size_t>(j)] += logits[j] / sum / group;
    }
    std::vector<int> order(static_cast<size_t>(c.count()));
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(),
                     [&](int a, int b) { return pooled[size_t(a)] > pooled[size_t(b)]; });
    std::vector<int>& k = kept[static_cast<size_t>(h)];
    for (int p = 0; p < c.sink_end; ++p) k.push_back(p);
    std::vector<int> top(order.begin(), order.begin() + std::min(config.top_k, c.count()));
    std::sort(top.begin(), top.end());
    for (int j : top) k.push_back(c.sink_end + j);
  }
  return kept;
}

// Runs the backend on one decode entry at the fixture's last position; returns the attention
// output [num_heads][head_dim] of the two-segment op over what it selected.
std::vector<float> RunBackend(Fixture& f, const OracleTopKConfig& config, AttentionBackend& base,
                              const EntryAttention& attention) {
  auto& backend = dynamic_cast<CpuAttentionBackend&>(base);
  const CpuEntryRows rows{0, 1, f.sequence.num_tokens - 1, &f.sequence, &attention, nullptr};
  const CpuLayerContext context{0, &f.config, f.cache.get(), {&rows, 1}, f.q.data(), &f.pool};
  EXPECT_TRUE(backend.BeforeAttention(context).ok());
  auto segment = backend.Compact(context, 0);
  EXPECT_TRUE(segment.ok()) << segment.status().ToString();
  std::vector<float> out(f.q.size());
  TwoSegmentAttentionArgs args;
  args.query = f.q.data();
  args.output = out.data();
  args.num_heads = f.config.num_heads;
  args.compact = segment->view;
  args.compact_counts = segment->counts;
  args.kv = f.View();
  args.recent_begin = attention.action.recent_begin;
  args.recent_end = f.sequence.num_tokens;
  std::vector<float> scratch(static_cast<size_t>(TwoSegmentAttentionScratchSize(args)));
  EXPECT_TRUE(TwoSegmentAttention(args, scratch).ok());
  (void)config;
  return out;
}

EntryAttention TwoSegmentPlan(const OracleTopKConfig& config, int length) {
  EntryAttention attention;
  attention.action.op = AttentionOp::kTwoSegment;
  attention.action.evidence = kPooledProbs;
  attention.action.recent_begin = OracleCandidatesFor(config, length).recent_begin;
  return attention;
}

TEST(OracleTopK, SelectionAndAttentionMatchADoubleReference) {
  for (const auto& [heads, kv_heads, k] :
       std::vector<std::tuple<int, int, int>>{{4, 4, 1}, {8, 2, 7}, {8, 1, 33}, {4, 2, 100}}) {
    Fixture f(heads, kv_heads, /*head_dim=*/16, /*length=*/301, /*seed=*/heads * 31 + k);
    OracleTopKConfig config;
    config.top_k = k;
    config.sink_tokens = 3;
    config.recent_window = 40;
    auto backend = MakeOracleTopKCpuBackend(f.config, config);
    ASSERT_TRUE(backend.ok());
    const EntryAttention plan = TwoSegmentPlan(config, 301);
    const std::vector<float> out = RunBackend(f, config, **backend, plan);
    const auto expected = ReferenceKept(f, config);
    EXPECT_EQ(OracleTopKKeptForTest(**backend, 0), expected) << "k " << k;

    // Attention over sink + selected + recent, in double.
    const int group = heads / kv_heads;
    const PagedKvView kv = f.View();
    for (int head = 0; head < heads; ++head) {
      const int h = head / group;
      std::vector<int> keys = expected[static_cast<size_t>(h)];
      for (int p = plan.action.recent_begin; p < 301; ++p) keys.push_back(p);
      std::vector<double> w;
      for (int p : keys) {
        double dot = 0;
        for (int i = 0; i < 16; ++i)
          dot += double(f.q[head * 16 + i]) * kv.keys[kv.Offset(p, h) + i];
        w.push_back(dot / 4.0);
      }
      const double max = *std::max_element(w.begin(), w.end());
      double sum = 0;
      for (double& x : w) sum += (x = std::exp(x - max));
      for (int i = 0; i < 16; ++i) {
        double acc = 0;
        for (size_t j = 0; j < keys.size(); ++j)
          acc += w[j] / sum * kv.values[kv.Offset(keys[j], h) + i];
        EXPECT_NEAR(out[static_cast<size_t>(head * 16 + i)], acc, 1e-5 + 1e-5 * std::abs(acc))
            << "head " << head << " dim " << i;
      }
    }
  }
}

// k covering every candidate through the two-segment path: the dense attention, bit for bit.
TEST(OracleTopK, TwoSegmentWithEveryCandidateIsDenseBitForBit) {
  Fixture f(8, 2, 32, 517, 7);
  OracleTopKConfig config;
  config.top_k = 517;
  config.recent_window = 64;
  auto backend = MakeOracleTopKCpuBackend(f.config, config);
  ASSERT_TRUE(backend.ok());
  const std::vector<float> sparse = RunBackend(f, config, **backend, TwoSegmentPlan(config, 517));
  std::vector<float> dense(f.q.size());
  CausalAttentionArgs args{f.q.data(), dense.data(), 1, 516, 8, f.View(), AttentionWindow()};
  std::vector<float> scratch(static_cast<size_t>(CausalAttentionScratchSize(args)));
  CausalAttention(args, scratch.data());
  ASSERT_EQ(sparse.size(), dense.size());
  for (size_t i = 0; i < dense.size(); ++i) EXPECT_EQ(sparse[i], dense[i]) << i;
}

TEST(OracleTopK, PlansDenseWhenKCoversTheCandidatesAndNothingOnOffloadedKv) {
  OracleTopKConfig config;
  config.top_k = 10;
  config.sink_tokens = 2;
  config.recent_window = 8;
  OracleTopKPolicy policy(config);
  auto request = policy.Admit(KvResidency::kLocal);
  ASSERT_NE(request, nullptr);
  EXPECT_EQ(request->PlanPrefill(0, 30, true), nullptr);
  EXPECT_EQ(request->PlanDecode(19), nullptr);           // |J| = 20 - 8 - 2 = 10 <= k: dense
  const EntryAttention* plan = request->PlanDecode(20);  // |J| = 11 > k
  ASSERT_NE(plan, nullptr);
  EXPECT_EQ(plan->action.op, AttentionOp::kTwoSegment);
  EXPECT_EQ(plan->action.recent_begin, 13);
  EXPECT_EQ(request->Observe(true, 5, -1.f), PolicyRequest::Verdict::kAccept);
  EXPECT_DOUBLE_EQ(request->RetainedKvRatio(21), (2 + 10 + 8) / 21.0);
  EXPECT_EQ(policy.Admit(KvResidency::kOffloaded), nullptr);
  auto spec = policy.MakeCacheSelector();
  ASSERT_TRUE(spec.ok());
  EXPECT_EQ(spec->name, "oracle_topk");
  EXPECT_EQ(spec->top_k, 10);
  EXPECT_EQ(spec->sink_tokens, 2);
  EXPECT_EQ(spec->recent_tokens, 8);
}

std::vector<std::vector<int>> EngineTokens(const std::filesystem::path& dir,
                                           std::shared_ptr<AttentionPolicy> policy,
                                           double* min_retained = nullptr) {
  auto model = LoadTinyModel(TinyModelKind::kQwen3, dir, /*seed=*/5);
  EXPECT_TRUE(model.ok());
  EngineOptions options;
  options.max_batch = 3;
  options.prefill_chunk = 40;
  options.policy = std::move(policy);
  auto engine = Engine::Create(std::move(model).value(), options);
  EXPECT_TRUE(engine.ok()) << engine.status().ToString();
  std::map<uint64_t, std::vector<int>> tokens;
  for (int r = 0; r < 3; ++r) {
    EXPECT_TRUE((*engine)->Submit(engine_test::Sampled(90 + 20 * r, r + 1, 24)).ok());
  }
  while ((*engine)->HasWork()) {
    auto events = (*engine)->Step();
    EXPECT_TRUE(events.ok()) << events.status().ToString();
    if (!events.ok()) break;
    for (const TokenEvent& event : *events) {
      tokens[event.request_id].push_back(event.token);
      if (min_retained != nullptr) *min_retained = std::min(*min_retained, event.retained_kv_ratio);
    }
  }
  std::vector<std::vector<int>> out;
  for (auto& [id, t] : tokens) out.push_back(t);
  return out;
}

TEST(OracleTopK, EngineWithKCoveringTheContextGivesTheDenseTokens) {
  TestTempDir dir("oracle_topk");
  const auto dense = EngineTokens(dir.path(), nullptr);
  OracleTopKConfig covering;
  covering.top_k = 512;  // the tiny model's whole context (above it: refused by CheckLimits)
  EXPECT_EQ(EngineTokens(dir.path(), std::make_shared<OracleTopKPolicy>(covering)), dense);

  OracleTopKConfig small;
  small.top_k = 8;
  small.sink_tokens = 2;
  small.recent_window = 16;
  double min_retained = 1.0;
  const auto sparse =
      EngineTokens(dir.path(), std::make_shared<OracleTopKPolicy>(small), &min_retained);
  ASSERT_EQ(sparse.size(), dense.size());
  EXPECT_LT(min_retained, 0.3);  // (2 + 8 + 16) / >= 114 positions
}

}  // namespace
}  // namespace rubato
