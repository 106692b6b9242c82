// SyncKV's calibration: the overlap of Eq. 1-2, K-means against a brute-force reference, the
// R-head nearest its centroid, the file's round trip and its refusals (wrong shape, truncated,
// NaN / null, an R-head outside its cluster), and the calibrator end to end on the small model.
#include "inference_rank/policies/synckv/synckv_calibration.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <limits>
#include <random>

#include "inference_rank/policies/synckv/synckv_calibrator.h"

namespace rubato {
namespace {

std::string TempPath(const std::string& name) {
  return (std::filesystem::temp_directory_path() /
          ("synckv_calibration_test_" + std::to_string(::getpid()) + "_" + name))
      .string();
}

TEST(SyncKvHeadOverlap, OverlapCoefficientOfTopKSets) {
  SyncKvHeadOverlap overlap(1, 3, 2);
  // Heads 0 and 1 share their top-2 {1, 3}; head 2 keeps {0, 3}: overlap 1/2 with both.
  const float step[3][4] = {
      {0.1f, 0.4f, 0.1f, 0.4f}, {0.0f, 0.3f, 0.2f, 0.5f}, {0.5f, 0.0f, 0.1f, 0.4f}};
  ASSERT_TRUE(overlap.AddStep(0, &step[0][0], 4).ok());
  // A second step of length 1: every set is {0}, overlap 1.
  const float one[3] = {1.0f, 1.0f, 1.0f};
  ASSERT_TRUE(overlap.AddStep(0, one, 1).ok());
  const std::vector<double> s = overlap.Similarity();
  EXPECT_DOUBLE_EQ(s[0 * 3 + 1], 1.0);
  EXPECT_DOUBLE_EQ(s[0 * 3 + 2], 0.75);  // (1/2 + 1) / 2
  EXPECT_DOUBLE_EQ(s[2 * 3 + 1], 0.75);
  EXPECT_DOUBLE_EQ(s[2 * 3 + 2], 1.0);
  EXPECT_EQ(overlap.steps(0), 2);
  EXPECT_FALSE(overlap.AddStep(1, one, 1).ok());
}

// Every assignment into exactly `clusters` non-empty labelled-by-first-appearance parts.
void AllPartitions(int heads, int clusters, std::vector<int>& current, int used,
                   std::vector<std::vector<int>>& out) {
  if (static_cast<int>(current.size()) == heads) {
    if (used == clusters) out.push_back(current);
    return;
  }
  for (int c = 0; c <= std::min(used, clusters - 1); ++c) {
    current.push_back(c);
    AllPartitions(heads, clusters, current, std::max(used, c + 1), out);
    current.pop_back();
  }
}

// The reference: the partition of least objective (first on ties), written independently.
std::pair<std::vector<int>, double> BruteForce(const std::vector<double>& d, int heads,
                                               int clusters) {
  std::vector<std::vector<int>> partitions;
  std::vector<int> current;
  AllPartitions(heads, clusters, current, 0, partitions);
  std::vector<int> best;
  double best_objective = std::numeric_limits<double>::infinity();
  for (const std::vector<int>& p : partitions) {
    // Objective from scratch: means, then squared distances.
    double objective = 0.0;
    for (int c = 0; c < clusters; ++c) {
      std::vector<double> mean(static_cast<size_t>(heads), 0.0);
      int n = 0;
      for (int h = 0; h < heads; ++h) {
        if (p[h] != c) continue;
        ++n;
        for (int x = 0; x < heads; ++x) mean[x] += d[h * heads + x];
      }
      for (int h = 0; h < heads; ++h) {
        if (p[h] != c) continue;
        for (int x = 0; x < heads; ++x) {
          const double diff = d[h * heads + x] - mean[x] / n;
          objective += diff * diff;
        }
      }
    }
    if (objective < best_objective - 1e-12) best_objective = objective, best = p;
  }
  return {best, best_objective};
}

// A random symmetric similarity with 1 on the diagonal; `planted` > 0 adds that many groups.
std::vector<double> RandomSimilarity(std::mt19937& rng, int heads, int planted) {
  std::uniform_real_distribution<double> noise(0.0, 0.3);
  std::vector<double> s(static_cast<size_t>(heads) * heads, 1.0);
  for (int i = 0; i < heads; ++i) {
    for (int j = i + 1; j < heads; ++j) {
      const bool same = planted > 0 && i % planted == j % planted;
      s[i * heads + j] = s[j * heads + i] = (same ? 0.7 : 0.1) + noise(rng);
    }
  }
  return s;
}

void ExpectRepresentativesNearest(const std::vector<double>& d, int heads, const HeadClusters& got,
                                  int clusters) {
  for (int c = 0; c < clusters; ++c) {
    std::vector<double> mean(static_cast<size_t>(heads), 0.0);
    int n = 0;
    for (int h = 0; h < heads; ++h) {
      if (got.cluster[h] != c) continue;
      ++n;
      for (int x = 0; x < heads; ++x) mean[x] += d[h * heads + x];
    }
    double nearest = std::numeric_limits<double>::infinity();
    int nearest_head = -1;
    for (int h = 0; h < heads; ++h) {
      if (got.cluster[h] != c) continue;
      double dist = 0.0;
      for (int x = 0; x < heads; ++x) {
        dist += (d[h * heads + x] - mean[x] / n) * (d[h * heads + x] - mean[x] / n);
      }
      if (dist < nearest - 1e-12) nearest = dist, nearest_head = h;
    }
    EXPECT_EQ(got.representative[c], nearest_head) << "cluster " << c;
  }
}

TEST(SyncKvClustering, ExactSearchEqualsBruteForce) {
  const unsigned seed = std::random_device{}();
  std::mt19937 rng(seed);
  SCOPED_TRACE("seed " + std::to_string(seed));
  for (int heads = 1; heads <= 7; ++heads) {
    for (int clusters = 1; clusters <= std::min(heads, 4); ++clusters) {
      const std::vector<double> d = OverlapDistance(RandomSimilarity(rng, heads, 0), heads);
      const Result<HeadClusters> got = ClusterHeads(d, heads, clusters);
      ASSERT_TRUE(got.ok()) << got.status().ToString();
      const auto [reference, objective] = BruteForce(d, heads, clusters);
      EXPECT_EQ(got->cluster, reference) << heads << " heads, " << clusters << " clusters";
      EXPECT_NEAR(KMeansObjective(d, heads, got->cluster, clusters), objective, 1e-12);
      ExpectRepresentativesNearest(d, heads, *got, clusters);
    }
  }
}

TEST(SyncKvClustering, LloydFindsPlantedGroupsAsBruteForceDoes) {
  const unsigned seed = std::random_device{}();
  std::mt19937 rng(seed);
  SCOPED_TRACE("seed " + std::to_string(seed));
  KMeansOptions lloyd;
  lloyd.exact_limit = 0;  // force the iterative path
  for (int heads = 4; heads <= 8; ++heads) {
    for (int clusters = 2; clusters <= 3; ++clusters) {
      const std::vector<double> d = OverlapDistance(RandomSimilarity(rng, heads, clusters), heads);
      const Result<HeadClusters> got = ClusterHeads(d, heads, clusters, lloyd);
      ASSERT_TRUE(got.ok()) << got.status().ToString();
      const auto [reference, objective] = BruteForce(d, heads, clusters);
      EXPECT_EQ(got->cluster, reference) << heads << " heads, " << clusters << " clusters";
      for (int h = 0; h < heads; ++h) EXPECT_EQ(got->cluster[h], h % clusters) << "planted";
      ExpectRepresentativesNearest(d, heads, *got, clusters);
    }
  }
}

TEST(SyncKvClustering, RefusesClusterCountsByName) {
  const std::vector<double> d = OverlapDistance(std::vector<double>(4, 1.0), 2);
  const Result<HeadClusters> none = ClusterHeads(d, 2, 0);
  ASSERT_FALSE(none.ok());
  EXPECT_NE(none.status().message().find("policy.representatives"), std::string::npos);
  EXPECT_FALSE(ClusterHeads(d, 2, 3).ok());
}

SyncKvCalibration Small() {
  SyncKvCalibration c;
  c.model = "models/tiny";
  c.num_layers = 2;
  c.num_heads = 4;
  c.num_kv_heads = 2;
  c.head_dim = 8;
  c.dev_set = "dev.jsonl";
  c.dev_set_fnv1a = "0123456789abcdef";
  c.prompts = 1;
  c.similarity = {1.0, 0.25, 0.25, 1.0, 1.0, 0.5, 0.5, 1.0};
  EXPECT_TRUE(ClusterCalibration(c, 1).ok());
  return c;
}

std::string Saved(const SyncKvCalibration& c) {
  const std::string path = TempPath("saved.json");
  EXPECT_TRUE(SaveSyncKvCalibration(c, path).ok());
  std::ifstream in(path);
  std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  std::filesystem::remove(path);
  return text;
}

void ExpectRefused(const std::string& text, const std::string& names) {
  const Result<SyncKvCalibration> parsed = ParseSyncKvCalibration(text, "calib.json");
  ASSERT_FALSE(parsed.ok()) << "accepted: " << text.substr(0, 200);
  EXPECT_NE(parsed.status().message().find(names), std::string::npos) << parsed.status().message();
  EXPECT_NE(parsed.status().message().find("calib.json"), std::string::npos);
}

std::string Replaced(std::string text, const std::string& from, const std::string& to) {
  const size_t at = text.find(from);
  EXPECT_NE(at, std::string::npos) << from;
  return at == std::string::npos ? text : text.replace(at, from.size(), to);
}

TEST(SyncKvCalibrationFile, RoundTripsAndFitsByShape) {
  const SyncKvCalibration c = Small();
  const Result<SyncKvCalibration> parsed = ParseSyncKvCalibration(Saved(c), "calib.json");
  ASSERT_TRUE(parsed.ok()) << parsed.status().ToString();
  EXPECT_EQ(parsed->similarity, c.similarity);
  EXPECT_EQ(parsed->layers[1].representative, c.layers[1].representative);
  EXPECT_TRUE(CheckSyncKvCalibrationFits(*parsed, 2, 4, 2, 8).ok());
  const Status other = CheckSyncKvCalibrationFits(*parsed, 6, 8, 2, 32);
  ASSERT_FALSE(other.ok());
  EXPECT_NE(other.message().find("made for 'models/tiny' (2 layers"), std::string::npos);
}

TEST(SyncKvCalibrationFile, RefusesBadFilesByName) {
  const std::string good = Saved(Small());
  ExpectRefused(good.substr(0, good.size() / 2), "not valid JSON");  // truncated
  // A similarity row of the wrong shape, a missing layer, a NaN written as null or a bare word.
  ExpectRefused(Replaced(good, "0.25,", "0.25, 0.5,"), "similarity[0][1]");
  ExpectRefused(Replaced(good, "\"num_layers\": 2", "\"num_layers\": 3"), "similarity");
  ExpectRefused(Replaced(good, "0.25,", "null,"), "similarity[0][1][0]: expected a number");
  ExpectRefused(Replaced(good, "0.25,", "NaN,"), "not valid JSON");
  ExpectRefused(Replaced(good, "0.25,", "1.5,"), "similarity[0][1][0]");
  ExpectRefused(Replaced(good, "\"top_k\": 64", "\"top_k\": 6.5"), "top_k: expected an integer");
  ExpectRefused(Replaced(good, "rubato-synckv-calibration", "rubato-kascade-calibration"),
                "format");
  ExpectRefused(Replaced(good, "\"count\": 1", "\"count\": 2"), "clusters.representatives[0]");
}

TEST(SyncKvCalibrationFile, RefusesAnRHeadOutsideItsCluster) {
  SyncKvCalibration c = Small();
  ASSERT_TRUE(ClusterCalibration(c, 2).ok());
  c.layers[0].representative = {1, 0};
  const Status status = ValidateSyncKvCalibration(c);
  ASSERT_FALSE(status.ok());
  EXPECT_NE(status.message().find("clusters.representatives[0][0]"), std::string::npos);
}

TEST(SyncKvCalibrator, WritesAFileThatLoadsAndFitsTheModel) {
  const std::string dev = TempPath("dev.jsonl");
  std::ofstream(dev) << "{\"prompt\": \"The value of key abc is 123. " << std::string(200, 'x')
                     << " What is the value of key abc?\"}\n";
  SyncKvCalibrateOptions options;
  options.model_dir = "models/tiny-qwen3-random";  // 4 layers, 2 KV heads
  options.dev_set = dev;
  options.clusters = 1;
  options.top_k = 8;
  options.decode_steps = 16;
  options.threads = 2;
  options.progress = nullptr;
  options.out = TempPath("out.json");
  const Result<SyncKvCalibration> made = CalibrateSyncKv(options);
  ASSERT_TRUE(made.ok()) << made.status().ToString();
  EXPECT_EQ(made->steps, 16);
  const Result<SyncKvCalibration> loaded = LoadSyncKvCalibration(options.out);
  ASSERT_TRUE(loaded.ok()) << loaded.status().ToString();
  EXPECT_TRUE(CheckSyncKvCalibrationFits(*loaded, 4, 8, 2, 32).ok());
  EXPECT_EQ(loaded->dev_set_fnv1a.size(), 16u);
  EXPECT_EQ(loaded->layers.size(), 4u);
  options.clusters = 3;  // more clusters than KV heads
  const Result<SyncKvCalibration> refused = CalibrateSyncKv(options);
  ASSERT_FALSE(refused.ok());
  EXPECT_NE(refused.status().message().find("--clusters 3"), std::string::npos);
  std::filesystem::remove(dev);
  std::filesystem::remove(options.out);
}

TEST(SyncKvCalibrator, RefusesHostileOptionsBeforeLoading) {
  const std::string dev = TempPath("hostile_dev.jsonl");
  std::ofstream(dev) << "{\"prompt\": \"a\"}\n";
  // A model directory with a config.json only: every refusal comes before any weight is read.
  const std::filesystem::path model = TempPath("config_only");
  std::filesystem::create_directories(model);
  std::ifstream in("models/tiny-qwen3-random/config.json");
  std::string config((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  const std::string key = "\"max_position_embeddings\": ";
  const size_t at = config.find(key);
  ASSERT_NE(at, std::string::npos);
  config.replace(at + key.size(), config.find_first_of(",\n}", at) - at - key.size(), "16777216");
  std::ofstream(model / "config.json") << config;
  SyncKvCalibrateOptions options;
  options.model_dir = model.string();
  options.dev_set = dev;
  options.progress = nullptr;
  options.out = TempPath("never.json");
  auto refused = [&](const std::string& needle) {
    const Result<SyncKvCalibration> made = CalibrateSyncKv(options);
    ASSERT_FALSE(made.ok()) << needle;
    EXPECT_NE(made.status().message().find(needle), std::string::npos) << made.status().message();
  };
  options.max_prompt_tokens = 1 << 24;
  options.decode_steps = 1 << 24;
  refused("MiB of observations");
  options.max_prompt_tokens = 64;
  options.decode_steps = 65;
  refused("--decode-steps 65 exceeds --max-tokens 64");
  options.decode_steps = 8;
  options.out = "";
  refused("--out: empty");
  options.out = TempPath("no_such_dir") + "/out.json";
  refused("does not exist");
  EXPECT_FALSE(std::filesystem::exists(TempPath("never.json")));
  std::filesystem::remove_all(model);
  std::filesystem::remove(dev);
}

}  // namespace
}  // namespace rubato
