// Tests for Kascade on the CPU: the anchors' selections against a brute-force double-precision
// reference of the rule (GQA-pooled softmax over every position, top-k, ties low), the reuse
// layers' positions through the head map and their attention against a double reference, the
// plans, config and calibration refusals, and the engine: k >= context gives the dense tokens.
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
#include "inference_rank/policies/kascade/kascade_cpu_backend.h"
#include "inference_rank/policies/kascade/kascade_policy.h"
#include "kernels/cpu/index_gather_attention.h"

namespace rubato {
namespace {

// A calibration for a model of `layers` x `kv_heads` with the given anchors; reuse layers map
// KV head h to (h + 1) % kv_heads of their anchor, so the map is exercised.
KascadeCalibration MakeCalibration(const ModelConfig& m, std::vector<int> anchors) {
  KascadeCalibration c;
  c.model = "test";
  c.num_layers = m.num_layers;
  c.num_heads = m.num_heads;
  c.num_kv_heads = m.num_kv_heads;
  c.head_dim = m.head_dim;
  c.anchors = std::move(anchors);
  c.importance.assign(static_cast<size_t>(m.num_layers), 1.0);
  c.similarity.assign(static_cast<size_t>(m.num_layers) * m.num_layers, 0.5);
  for (int l = 0; l < m.num_layers; ++l) {
    std::vector<int> row(static_cast<size_t>(m.num_kv_heads));
    for (int h = 0; h < m.num_kv_heads; ++h) row[h] = c.IsAnchor(l) ? h : (h + 1) % m.num_kv_heads;
    c.head_map.push_back(row);
  }
  EXPECT_TRUE(ValidateCalibration(c).ok());
  return c;
}

// Random K/V of `layers` layers for one sequence of `length` positions, a random query per layer.
struct Fixture {
  ModelConfig config;
  std::unique_ptr<PagedKvCache> cache;
  KvSequence sequence;
  std::vector<std::vector<float>> q;  // [layer][num_heads * head_dim]
  ThreadPool pool{2};

  Fixture(int layers, int heads, int kv_heads, int head_dim, int length, uint32_t seed) {
    config.num_layers = layers;
    config.num_heads = heads;
    config.num_kv_heads = kv_heads;
    config.head_dim = head_dim;
    config.hidden_size = heads * head_dim;
    cache =
        PagedKvCache::Create(KvCacheShape{layers, kv_heads, head_dim, 16, length / 16 + 2}).value();
    EXPECT_TRUE(cache->Reserve(sequence, length).ok());
    sequence.num_tokens = length;
    std::mt19937 rng(seed);
    std::normal_distribution<float> normal(0.f, 1.f);
    for (int l = 0; l < layers; ++l) {
      const PagedKvView kv = cache->LayerView(l, sequence);
      for (int p = 0; p < length; ++p) {
        for (int h = 0; h < kv_heads; ++h) {
          for (int d = 0; d < head_dim; ++d) {
            kv.keys[kv.Offset(p, h) + d] = normal(rng);
            kv.values[kv.Offset(p, h) + d] = normal(rng);
          }
        }
      }
      q.emplace_back(static_cast<size_t>(heads) * head_dim);
      for (float& x : q.back()) x = 1.5f * normal(rng);
    }
  }
};

// The anchor rule in double precision: per KV head the top k of the group's mean softmax.
std::vector<std::vector<int>> ReferenceSelection(const Fixture& f, int layer, int k) {
  const int length = f.sequence.num_tokens;
  const int group = f.config.num_heads / f.config.num_kv_heads;
  const int d = f.config.head_dim;
  const PagedKvView kv = f.cache->LayerView(layer, f.sequence);
  std::vector<std::vector<int>> kept(static_cast<size_t>(f.config.num_kv_heads));
  for (int h = 0; h < f.config.num_kv_heads; ++h) {
    std::vector<double> pooled(static_cast<size_t>(length), 0.0);
    for (int g = 0; g < group; ++g) {
      const float* q = f.q[layer].data() + static_cast<size_t>(h * group + g) * d;
      std::vector<double> logits(static_cast<size_t>(length));
      for (int j = 0; j < length; ++j) {
        double dot = 0;
        for (int i = 0; i < d; ++i) dot += double(q[i]) * kv.keys[kv.Offset(j, h) + i];
        logits[j] = dot / std::sqrt(double(d));
      }
      const double max = *std::max_element(logits.begin(), logits.end());
      double sum = 0;
      for (double& l : logits) sum += (l = std::exp(l - max));
      for (int j = 0; j < length; ++j) pooled[j] += logits[j] / sum / group;
    }
    std::vector<int> order(static_cast<size_t>(length));
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(),
                     [&](int a, int b) { return pooled[size_t(a)] > pooled[size_t(b)]; });
    order.resize(static_cast<size_t>(k));
    std::sort(order.begin(), order.end());
    kept[h] = order;
  }
  return kept;
}

TEST(Kascade, AnchorsSelectTheReferenceTopKAndReuseLayersFollowTheHeadMap) {
  Fixture f(/*layers=*/3, /*heads=*/8, /*kv_heads=*/2, /*head_dim=*/32, /*length=*/301, 3);
  KascadeConfig config;
  config.top_k_min = 20;  // k = max(ceil(30.1), 20) = 31
  KascadePolicy policy(config, MakeCalibration(f.config, {0, 2}));
  const int k = KascadeTopK(config, 301);
  ASSERT_EQ(k, 31);
  auto request = policy.Admit(KvResidency::kLocal);
  const EntryAttention* plan = request->PlanDecode(300);
  ASSERT_NE(plan, nullptr);
  EXPECT_EQ(plan->ActionFor(0).op, AttentionOp::kDense);
  EXPECT_EQ(plan->ActionFor(1).op, AttentionOp::kIndexGather);
  EXPECT_EQ(plan->ActionFor(1).source_layer, 0);
  EXPECT_EQ(plan->ActionFor(2).source_layer, 2);
  auto made = MakeKascadeCpuBackend(f.config, policy);
  ASSERT_TRUE(made.ok());
  auto& backend = dynamic_cast<CpuAttentionBackend&>(**made);
  const CpuEntryRows rows{0, 1, 300, &f.sequence, plan, nullptr};
  for (int layer = 0; layer < 3; ++layer) {
    const CpuLayerContext context{layer,      &f.config,         f.cache.get(),
                                  {&rows, 1}, f.q[layer].data(), &f.pool};
    ASSERT_TRUE(backend.BeforeAttention(context).ok());
    if (layer != 1) {
      EXPECT_EQ(KascadeSelectionForTest(**made, 0, layer), ReferenceSelection(f, layer, k))
          << "anchor " << layer;
    }
    if (layer == 0) continue;
    auto positions = backend.Positions(context, 0);
    ASSERT_TRUE(positions.ok()) << positions.status().ToString();
    const int anchor = layer == 1 ? 0 : 2;
    const auto expected = ReferenceSelection(f, anchor, k);
    for (int h = 0; h < 2; ++h) {
      const int from = layer == 1 ? (h + 1) % 2 : h;
      std::vector<int> got(positions->lists[h], positions->lists[h] + positions->counts[h]);
      EXPECT_EQ(got, expected[from]) << "layer " << layer << " head " << h;
    }
    // The index gather over those positions against a double softmax over them.
    std::vector<float> out(f.q[layer].size());
    IndexGatherAttentionArgs args{
        f.q[layer].data(), out.data(),       nullptr, 8, f.cache->LayerView(layer, f.sequence), 301,
        positions->lists,  positions->counts};
    std::vector<float> scratch(static_cast<size_t>(IndexGatherAttentionScratchSize(args)));
    ASSERT_TRUE(IndexGatherAttention(args, scratch).ok());
    const PagedKvView kv = f.cache->LayerView(layer, f.sequence);
    for (int head = 0; head < 8; ++head) {
      const int h = head / 4;
      const int* list = positions->lists[h];
      std::vector<double> w;
      for (int i = 0; i < positions->counts[h]; ++i) {
        double dot = 0;
        for (int d = 0; d < 32; ++d)
          dot += double(f.q[layer][head * 32 + d]) * kv.keys[kv.Offset(list[i], h) + d];
        w.push_back(dot / std::sqrt(32.0));
      }
      const double max = *std::max_element(w.begin(), w.end());
      double sum = 0;
      for (double& x : w) sum += (x = std::exp(x - max));
      for (int d = 0; d < 32; ++d) {
        double expect = 0;
        for (int i = 0; i < positions->counts[h]; ++i)
          expect += w[i] / sum * kv.values[kv.Offset(list[i], h) + d];
        EXPECT_NEAR(out[head * 32 + d], expect, 2e-5);
      }
    }
  }
}

TEST(Kascade, PlansDenseWhileKCoversTheContext) {
  ModelConfig m;
  m.num_layers = 4;
  m.num_heads = 4;
  m.num_kv_heads = 2;
  m.head_dim = 8;
  KascadeConfig config;  // k = max(ceil(0.1 L), 128)
  KascadePolicy policy(config, MakeCalibration(m, {0, 2}));
  auto request = policy.Admit(KvResidency::kLocal);
  EXPECT_EQ(request->PlanPrefill(0, 200, true), nullptr);    // tiles at 0, 128: k(256) = 128
  EXPECT_NE(request->PlanPrefill(200, 200, true), nullptr);  // tile at 256: k(384) = 128 < 256
  EXPECT_TRUE(KascadePrefillChunkIsDense(config, 0, 256));
  EXPECT_FALSE(KascadePrefillChunkIsDense(config, 250, 10));
  EXPECT_EQ(request->PlanDecode(127), nullptr);  // L = 128 = k
  ASSERT_NE(request->PlanDecode(128), nullptr);  // L = 129 > k = 128
  EXPECT_EQ(request->Observe(true, 1, -1.f), PolicyRequest::Verdict::kAccept);
  EXPECT_DOUBLE_EQ(request->RetainedKvRatio(129), (1 + 3 * 128.0 / 129) / 4);
  EXPECT_EQ(KascadeTopK(config, 5000), 500);
  EXPECT_EQ(KascadeTopK(config, 1281), 129);  // ceil(128.1)
  EXPECT_EQ(KascadeTopK(config, 50), 50);
  EXPECT_NE(policy.StatsLine().find("kascade_sparse_steps=1"), std::string::npos);
}

TEST(Kascade, RefusesBadConfigsAndCalibrationsByName) {
  TestTempDir dir("kascade_config");
  auto section = [](const std::string& yaml) {
    RubatoConfig config = DefaultConfig();
    config.policy.name = "kascade";
    config.policy.params = YAML::Load(yaml);
    return config.policy;
  };
  auto missing = CreateKascadePolicy(section("{}"));
  EXPECT_NE(missing.status().message().find("'calibration' names the file"), std::string::npos);
  auto absent = CreateKascadePolicy(section("{calibration: /nonexistent.json}"));
  EXPECT_EQ(absent.status().code(), StatusCode::kNotFound);
  ModelConfig m;
  m.num_layers = 3;
  m.num_heads = 4;
  m.num_kv_heads = 2;
  m.head_dim = 8;
  const std::string path = (dir.path() / "c.json").string();
  ASSERT_TRUE(SaveCalibration(MakeCalibration(m, {0}), path).ok());
  auto sparse = CreateKascadePolicy(section("{calibration: " + path + ", prefill: sparse}"));
  EXPECT_NE(sparse.status().message().find("prefill 'sparse' is not one of tiled, dense"),
            std::string::npos);
  auto ratio = CreateKascadePolicy(section("{calibration: " + path + ", top_k_ratio: 0}"));
  EXPECT_FALSE(ratio.ok());
  auto good = CreateKascadePolicy(section("{calibration: " + path + "}"));
  ASSERT_TRUE(good.ok()) << good.status().ToString();
  // A model of another shape: refused when the backend is made.
  auto model = LoadTinyModel(TinyModelKind::kQwen3, dir.path(), 1);
  ASSERT_TRUE(model.ok());
  auto backend = (*good)->MakeBackend(**model, 4);
  ASSERT_FALSE(backend.ok());
  EXPECT_NE(backend.status().message().find("kascade calibration made for 'test' (3 layers"),
            std::string::npos)
      << backend.status().message();
}

TEST(Kascade, PrefillTilesSelectThePooledReferenceTopK) {
  // One layer, a chunk [70, 130) in tiles of 32: tiles [64, 96), [96, 128), [128, 160).
  const int heads = 8, kv_heads = 2, d = 16, start = 70, tokens = 60, tile = 32;
  ModelConfig m;
  m.num_layers = 1;
  m.num_heads = heads;
  m.num_kv_heads = kv_heads;
  m.head_dim = d;
  m.hidden_size = heads * d;
  auto cache = PagedKvCache::Create(KvCacheShape{1, kv_heads, d, 16, 10}).value();
  KvSequence sequence;
  ASSERT_TRUE(cache->Reserve(sequence, start + tokens).ok());
  sequence.num_tokens = start + tokens;
  std::mt19937 rng(4);
  std::normal_distribution<float> normal(0.f, 1.f);
  const PagedKvView kv = cache->LayerView(0, sequence);
  for (int p = 0; p < start + tokens; ++p) {
    for (int h = 0; h < kv_heads; ++h) {
      for (int i = 0; i < d; ++i) {
        kv.keys[kv.Offset(p, h) + i] = normal(rng);
        kv.values[kv.Offset(p, h) + i] = normal(rng);
      }
    }
  }
  std::vector<float> q(static_cast<size_t>(tokens) * heads * d);
  for (float& x : q) x = 1.5f * normal(rng);
  KascadeConfig config;
  config.top_k_min = 5;
  config.prefill_tile = tile;
  KascadePolicy policy(config, MakeCalibration(m, {0}));
  auto request = policy.Admit(KvResidency::kLocal);
  const EntryAttention* plan = request->PlanPrefill(start, tokens, true);
  ASSERT_NE(plan, nullptr);
  auto made = MakeKascadeCpuBackend(m, policy);
  ASSERT_TRUE(made.ok());
  auto& backend = dynamic_cast<CpuAttentionBackend&>(**made);
  ThreadPool pool(1);
  const CpuEntryRows rows{0, tokens, start, &sequence, plan, nullptr};
  const CpuLayerContext context{0, &m, cache.get(), {&rows, 1}, q.data(), &pool};
  ASSERT_TRUE(backend.BeforeAttention(context).ok());
  const auto& got = KascadeSelectionForTest(**made, 0, 0);
  ASSERT_EQ(got.size(), 3u * kv_heads);
  const int group = heads / kv_heads;
  for (int t = 0; t < 3; ++t) {
    const int begin = 64 + 32 * t;
    const int k = std::min(begin, KascadeTopK(config, begin + tile));
    for (int h = 0; h < kv_heads; ++h) {
      std::vector<double> pooled(static_cast<size_t>(begin), 0.0);
      const int first = std::max(begin, start), last = std::min(begin + tile, start + tokens);
      for (int p = first; p < last; ++p) {
        for (int g = 0; g < group; ++g) {
          const float* qh = q.data() + (static_cast<size_t>(p - start) * heads + h * group + g) * d;
          std::vector<double> w(static_cast<size_t>(p) + 1);
          for (int j = 0; j <= p; ++j) {
            double dot = 0;
            for (int i = 0; i < d; ++i) dot += double(qh[i]) * kv.keys[kv.Offset(j, h) + i];
            w[j] = dot / std::sqrt(double(d));
          }
          const double max = *std::max_element(w.begin(), w.end());
          double sum = 0;
          for (double& x : w) sum += (x = std::exp(x - max));
          for (int j = 0; j < begin; ++j) pooled[j] += w[j] / sum / ((last - first) * group);
        }
      }
      std::vector<int> order(static_cast<size_t>(begin));
      std::iota(order.begin(), order.end(), 0);
      std::stable_sort(order.begin(), order.end(),
                       [&](int a, int b) { return pooled[a] > pooled[b]; });
      order.resize(static_cast<size_t>(k));
      std::sort(order.begin(), order.end());
      EXPECT_EQ(got[static_cast<size_t>(t) * kv_heads + h], order) << "tile " << t << " head " << h;
    }
  }
  auto positions = backend.Positions(context, 0);
  ASSERT_TRUE(positions.ok()) << positions.status().ToString();
  EXPECT_EQ(positions->tiles, 3);
  EXPECT_EQ(positions->tile_tokens, tile);
}

TEST(Kascade, CommittedConfigsAndCalibrationsLoad) {
  for (const char* path :
       {"configs/policies/kascade.yaml", "configs/policies/kascade_dense_prefill.yaml",
        "configs/policies/kascade_yardstick.yaml",
        "configs/policies/kascade_yardstick_dense_prefill.yaml",
        "bench/configs/kascade_qwen3_8b.yaml"}) {
    auto file = LoadConfigFile(path);
    ASSERT_TRUE(file.ok()) << file.status().ToString();
    auto policy = CreateKascadePolicy(file->policy);
    ASSERT_TRUE(policy.ok()) << path << ": " << policy.status().ToString();
  }
  auto tiny = LoadCalibration("configs/kascade/tiny-qwen3-longctx.json");
  ASSERT_TRUE(tiny.ok()) << tiny.status().ToString();
  EXPECT_TRUE(CheckCalibrationFits(*tiny, 6, 8, 2, 32).ok());
  auto yardstick = LoadCalibration("configs/kascade/qwen3-yardstick-16k.json");
  ASSERT_TRUE(yardstick.ok()) << yardstick.status().ToString();
  EXPECT_TRUE(CheckCalibrationFits(*yardstick, 12, 8, 4, 64).ok());
}

std::vector<std::vector<int>> EngineTokens(const std::filesystem::path& dir,
                                           std::shared_ptr<AttentionPolicy> policy) {
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
    for (const TokenEvent& event : *events) tokens[event.request_id].push_back(event.token);
  }
  std::vector<std::vector<int>> out;
  for (auto& [id, t] : tokens) out.push_back(t);
  return out;
}

TEST(Kascade, EngineWithKCoveringTheContextGivesTheDenseTokens) {
  TestTempDir dir("kascade_engine");
  const ModelConfig m = LoadTinyModel(TinyModelKind::kQwen3, dir.path(), 5).value()->config();
  const KascadeCalibration calibration = MakeCalibration(m, {0, m.num_layers / 2});
  const auto dense = EngineTokens(dir.path(), nullptr);
  KascadeConfig covering;
  covering.top_k_min = 1 << 20;
  auto policy = std::make_shared<KascadePolicy>(covering, calibration);
  EXPECT_EQ(EngineTokens(dir.path(), policy), dense);
  EXPECT_NE(policy->StatsLine().find("kascade_sparse_steps=0"), std::string::npos);

  KascadeConfig small;
  small.top_k_min = 8;
  small.prefill_tile = 32;  // prompts of 90-130 tokens: tiles past the first few are sparse
  auto sparse_policy = std::make_shared<KascadePolicy>(small, calibration);
  const auto sparse = EngineTokens(dir.path(), sparse_policy);
  ASSERT_EQ(sparse.size(), dense.size());
  for (size_t r = 0; r < sparse.size(); ++r) EXPECT_EQ(sparse[r].size(), dense[r].size());
  EXPECT_NE(sparse_policy->StatsLine().find("kascade_dense_steps=0"), std::string::npos)
      << sparse_policy->StatsLine();
}

TEST(Kascade, FidelityGuardForcedToFireMakesEveryReuseLayerSelectItsOwnTopK) {
  // fidelity_guard 1 fires on every reuse layer of every sparse decode token: each attends its
  // own top-k, exactly what a calibration with every layer an anchor attends (dense prefill in
  // both, so only decode differs). The tiny model has 2 layers: layer 1 reuses layer 0's.
  TestTempDir dir("kascade_guard");
  const ModelConfig m = LoadTinyModel(TinyModelKind::kQwen3, dir.path(), 5).value()->config();
  std::vector<int> every_layer(static_cast<size_t>(m.num_layers));
  std::iota(every_layer.begin(), every_layer.end(), 0);
  KascadeConfig small;
  small.top_k_ratio = 0.02;
  small.top_k_min = 3;
  small.prefill = "dense";
  KascadeConfig forced = small;
  forced.fidelity_guard = 1.0;
  auto all_anchors = std::make_shared<KascadePolicy>(small, MakeCalibration(m, every_layer));
  auto reuse = std::make_shared<KascadePolicy>(small, MakeCalibration(m, {0}));
  auto guarded = std::make_shared<KascadePolicy>(forced, MakeCalibration(m, {0}));
  const auto expected = EngineTokens(dir.path(), all_anchors);
  ASSERT_NE(EngineTokens(dir.path(), reuse), expected) << "reuse changes nothing: no test";
  EXPECT_EQ(EngineTokens(dir.path(), guarded), expected);
  const std::string stats = guarded->StatsLine();
  EXPECT_NE(stats.find(" kascade_guard_firings_per_100_steps="), std::string::npos) << stats;
  EXPECT_EQ(stats.find(" kascade_guard_firings=0 "), std::string::npos) << stats;
  EXPECT_EQ(reuse->StatsLine().find("guard"), std::string::npos) << reuse->StatsLine();
}

}  // namespace
}  // namespace rubato
