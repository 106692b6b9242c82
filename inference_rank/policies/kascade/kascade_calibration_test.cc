// Tests of Kascade's calibration: Algorithm 1 against an exhaustive search, Eq. 3 with the head
// map and the importance weights against a double-precision reference written here, and the
// calibration file's refusals.
#include "inference_rank/policies/kascade/kascade_calibration.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <numeric>
#include <random>

namespace rubato {
namespace {

// Every anchor set of `count` layers that contains layer 0, by recursion.
void AllAnchorSets(int layers, int count, std::vector<int>& current,
                   std::vector<std::vector<int>>& out) {
  if (static_cast<int>(current.size()) == count) {
    out.push_back(current);
    return;
  }
  for (int l = current.back() + 1; l < layers; ++l) {
    current.push_back(l);
    AllAnchorSets(layers, count, current, out);
    current.pop_back();
  }
}

TEST(KascadeAnchors, DynamicProgramMatchesExhaustiveSearch) {
  std::mt19937 rng(7);
  std::uniform_real_distribution<double> unit(0.0, 1.0);
  for (int trial = 0; trial < 60; ++trial) {
    const int L = 2 + trial % 8;
    std::vector<double> s(static_cast<size_t>(L) * L, 0.0);
    for (int a = 0; a < L; ++a) {
      for (int b = a; b < L; ++b) s[static_cast<size_t>(a) * L + b] = unit(rng);
    }
    for (int m = 1; m <= L; ++m) {
      const Result<std::vector<int>> anchors = SelectAnchorLayers(s, L, m);
      ASSERT_TRUE(anchors.ok()) << anchors.status().ToString();
      ASSERT_EQ(anchors->size(), static_cast<size_t>(m));
      EXPECT_EQ(anchors->front(), 0);
      EXPECT_TRUE(std::is_sorted(anchors->begin(), anchors->end()));
      std::vector<std::vector<int>> sets;
      std::vector<int> current = {0};
      AllAnchorSets(L, m, current, sets);
      double best = -1.0;
      for (const std::vector<int>& set : sets) best = std::max(best, AnchorObjective(s, L, set));
      EXPECT_NEAR(AnchorObjective(s, L, *anchors), best, 1e-12) << "L=" << L << " m=" << m;
    }
  }
  const std::vector<double> s(9, 1.0);
  EXPECT_FALSE(SelectAnchorLayers(s, 3, 0).ok());
  EXPECT_FALSE(SelectAnchorLayers(s, 3, 4).ok());
}

// Random causal attention rows: [tokens][heads][tokens], softmax of random logits over 0..q.
std::vector<float> RandomProbs(std::mt19937& rng, int tokens, int heads) {
  std::normal_distribution<float> logit(0.0f, 2.0f);
  std::vector<float> p(static_cast<size_t>(tokens) * heads * tokens, 0.0f);
  for (int q = 0; q < tokens; ++q) {
    for (int h = 0; h < heads; ++h) {
      float* row = p.data() + (static_cast<size_t>(q) * heads + h) * tokens;
      double sum = 0.0;
      for (int i = 0; i <= q; ++i) sum += (row[i] = std::exp(logit(rng)));
      for (int i = 0; i <= q; ++i) row[i] = static_cast<float>(row[i] / sum);
    }
  }
  return p;
}

std::vector<int> ReferenceTopK(const float* row, int n, int k) {
  std::vector<int> order(static_cast<size_t>(n));
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [row](int a, int b) {
    return static_cast<double>(row[a]) > static_cast<double>(row[b]);
  });
  order.resize(static_cast<size_t>(std::min(n, k)));
  return order;
}

TEST(KascadeSimilarity, MatchesDoublePrecisionReference) {
  const int L = 4, H = 2, tokens = 40, k = 5, hidden = 8, prompts = 3;
  std::mt19937 rng(11);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  KascadeSimilarity similarity(L, H, k);
  const size_t pairs = static_cast<size_t>(L) * H * L * H;
  std::vector<double> reference(pairs, 0.0);
  std::vector<double> importance(L, 0.0);
  for (int prompt = 0; prompt < prompts; ++prompt) {
    similarity.BeginPrompt(tokens);
    std::vector<std::vector<float>> probs;
    for (int l = 0; l < L; ++l) {
      probs.push_back(RandomProbs(rng, tokens, H));
      ASSERT_TRUE(similarity.AddLayer(l, probs.back().data()).ok());
      std::vector<float> x(static_cast<size_t>(tokens) * hidden), y(x.size());
      for (size_t i = 0; i < x.size(); ++i) {
        x[i] = normal(rng);
        y[i] = x[i] + 0.5f * normal(rng);
      }
      ASSERT_TRUE(similarity.AddImportance(l, x.data(), y.data(), tokens, hidden).ok());
      double sum = 0.0;
      for (int t = 0; t < tokens; ++t) {
        double dot = 0, nx = 0, ny = 0;
        for (int i = 0; i < hidden; ++i) {
          const double a = x[static_cast<size_t>(t) * hidden + i];
          const double b = y[static_cast<size_t>(t) * hidden + i];
          dot += a * b;
          nx += a * a;
          ny += b * b;
        }
        sum += 1.0 - dot / std::sqrt(nx * ny);
      }
      importance[l] += sum / tokens / prompts;
    }
    ASSERT_TRUE(similarity.EndPrompt().ok());
    // Eq. 3 per head pair: min over tokens, then (below) mean over prompts.
    for (int a = 0; a < L; ++a) {
      for (int ha = 0; ha < H; ++ha) {
        for (int b = a + 1; b < L; ++b) {
          for (int hb = 0; hb < H; ++hb) {
            double low = 1.0;
            for (int q = 0; q < tokens; ++q) {
              const float* row_a = probs[a].data() + (static_cast<size_t>(q) * H + ha) * tokens;
              const float* row_b = probs[b].data() + (static_cast<size_t>(q) * H + hb) * tokens;
              double num = 0, den = 0;
              for (int i : ReferenceTopK(row_a, q + 1, k)) num += row_b[i];
              for (int i : ReferenceTopK(row_b, q + 1, k)) den += row_b[i];
              low = std::min(low, num / den);
            }
            reference[((static_cast<size_t>(a) * H + ha) * L + b) * H + hb] += low / prompts;
          }
        }
      }
    }
  }
  const std::vector<double> got = similarity.HeadSimilarity();
  ASSERT_EQ(got.size(), pairs);
  double below_one = 0;
  for (size_t i = 0; i < pairs; ++i) {
    EXPECT_NEAR(got[i], reference[i], 1e-9) << "pair " << i;
    below_one += reference[i] < 0.999 ? 1 : 0;
  }
  EXPECT_GT(below_one, 10) << "the random rows should make most reuse imperfect";
  const std::vector<double> w = similarity.Importance();
  for (int l = 0; l < L; ++l) EXPECT_NEAR(w[l], importance[l], 1e-9);

  // S and the head map from the reference.
  const std::vector<double> s = LayerSimilarity(got, w, L, H);
  const std::vector<int> anchors = {0, 2};
  const std::vector<std::vector<int>> map = HeadMap(got, anchors, L, H);
  for (int b = 0; b < L; ++b) {
    EXPECT_NEAR(s[static_cast<size_t>(b) * L + b], w[b], 1e-12);
    const int anchor = b >= 2 ? 2 : 0;
    for (int a = 0; a < b; ++a) {
      double total = 0;
      for (int hb = 0; hb < H; ++hb) {
        double best = 0;
        for (int ha = 0; ha < H; ++ha) {
          best = std::max(best, reference[((static_cast<size_t>(a) * H + ha) * L + b) * H + hb]);
        }
        total += best;
      }
      EXPECT_NEAR(s[static_cast<size_t>(a) * L + b], w[b] * total / H, 1e-9);
    }
    for (int hb = 0; hb < H; ++hb) {
      if (b == anchor) {
        EXPECT_EQ(map[b][hb], hb);
        continue;
      }
      int best = 0;
      for (int ha = 1; ha < H; ++ha) {
        const auto at = [&](int h) {
          return reference[((static_cast<size_t>(anchor) * H + h) * L + b) * H + hb];
        };
        if (at(ha) > at(best) + 1e-12) best = ha;
      }
      EXPECT_EQ(map[b][hb], best) << "layer " << b << " head " << hb;
    }
  }
}

KascadeCalibration SmallCalibration() {
  KascadeCalibration c;
  c.model = "models/test";
  c.num_layers = 3;
  c.num_heads = 4;
  c.num_kv_heads = 2;
  c.head_dim = 8;
  c.dev_set = "dev.txt";
  c.dev_set_fnv1a = Fnv1a64Hex("dev");
  c.prompts = 2;
  c.top_k = 64;
  c.anchors = {0, 2};
  c.head_map = {{0, 1}, {1, 1}, {0, 1}};
  c.importance = {0.5, 0.25, 0.125};
  c.similarity = {0.5, 0.2, 0.1, 0, 0.25, 0.1, 0, 0, 0.125};
  return c;
}

class KascadeCalibrationFile : public ::testing::Test {
 protected:
  std::string Path(const std::string& name) {
    return (std::filesystem::temp_directory_path() /
            ("kascade_calibration_test_" + std::to_string(::getpid()) + "_" + name))
        .string();
  }
};

TEST_F(KascadeCalibrationFile, RoundTripsAndRefusesBadFilesByName) {
  const std::string path = Path("good.json");
  ASSERT_TRUE(SaveCalibration(SmallCalibration(), path).ok());
  const Result<KascadeCalibration> loaded = LoadCalibration(path);
  ASSERT_TRUE(loaded.ok()) << loaded.status().ToString();
  EXPECT_EQ(loaded->anchors, std::vector<int>({0, 2}));
  EXPECT_EQ(loaded->head_map, SmallCalibration().head_map);
  EXPECT_EQ(loaded->AnchorOf(1), 0);
  EXPECT_EQ(loaded->AnchorOf(2), 2);
  EXPECT_TRUE(CheckCalibrationFits(*loaded, 3, 4, 2, 8).ok());
  EXPECT_EQ(loaded->known_loss, "");

  // A measured loss written into the file comes back to be logged at start.
  KascadeCalibration noted = SmallCalibration();
  noted.known_loss = "loses retrieval: 0 of 4 pass keys";
  ASSERT_TRUE(SaveCalibration(noted, Path("noted.json")).ok());
  const Result<KascadeCalibration> noted_back = LoadCalibration(Path("noted.json"));
  ASSERT_TRUE(noted_back.ok()) << noted_back.status().ToString();
  EXPECT_EQ(noted_back->known_loss, noted.known_loss);

  // Another model's shape.
  const Status wrong = CheckCalibrationFits(*loaded, 12, 8, 4, 64);
  EXPECT_NE(wrong.message().find("made for 'models/test' (3 layers, 4 query / 2 KV heads"),
            std::string::npos)
      << wrong.message();

  // Truncated.
  std::ifstream in(path);
  std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  const std::string truncated = Path("truncated.json");
  std::ofstream(truncated) << text.substr(0, text.size() / 2);
  Result<KascadeCalibration> bad = LoadCalibration(truncated);
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("not valid JSON (truncated?)"), std::string::npos)
      << bad.status().message();

  // Anchors without layer 0: refused on saving and on loading.
  KascadeCalibration no_zero = SmallCalibration();
  no_zero.anchors = {1, 2};
  no_zero.head_map = {{0, 1}, {0, 1}, {0, 1}};
  EXPECT_NE(SaveCalibration(no_zero, Path("x.json")).message().find("must start with layer 0"),
            std::string::npos);
  std::string edited = text;
  const size_t at = edited.find("\"anchors\": [");
  ASSERT_NE(at, std::string::npos);
  edited.replace(edited.find('0', at), 1, "1");
  const std::string no_zero_path = Path("no_zero.json");
  std::ofstream(no_zero_path) << edited;
  bad = LoadCalibration(no_zero_path);
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("anchors must start with layer 0"), std::string::npos)
      << bad.status().message();

  // A head map of the wrong width.
  KascadeCalibration narrow = SmallCalibration();
  narrow.head_map[1] = {0};
  EXPECT_NE(ValidateCalibration(narrow).message().find("head_map[1] has 1 entries, not 2"),
            std::string::npos);
  EXPECT_EQ(LoadCalibration(Path("missing.json")).status().code(), StatusCode::kNotFound);
  for (const char* name : {"good.json", "truncated.json", "no_zero.json"}) {
    std::filesystem::remove(Path(name));
  }
}

// Numbers are read by type and range: a float or an integer past int where an integer belongs is
// refused naming the field (nlohmann's get<int> turned 2.7 and 4294967298 into 2), and a number
// past a double (1e999) is a refusal, never an exception.
TEST_F(KascadeCalibrationFile, MistypedNumbersAreRefusedByName) {
  const std::string path = Path("typed.json");
  ASSERT_TRUE(SaveCalibration(SmallCalibration(), path).ok());
  std::ifstream in(path);
  const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  auto with = [&](const std::string& key, const std::string& value) {
    const size_t at = text.find("\"" + key + "\"");
    EXPECT_NE(at, std::string::npos) << key;
    const size_t start = text.find(':', at) + 1;
    const size_t end = text.find_first_of(",}\n", start);
    return text.substr(0, start) + " " + value + text.substr(end);
  };
  const struct {
    const char* key;
    const char* value;
    const char* needle;
  } cases[] = {
      {"num_layers", "2.7", "model.num_layers: expected an integer, got the number 2.7"},
      {"num_layers", "4294967298", "model.num_layers: must be in [1, 1024], got 4294967298"},
      {"top_k", "-1", "top_k: must be in [1, 2147483647], got -1"},
      {"top_k", "1e999", "a value JSON numbers cannot hold"},
      {"version", "\"1\"", "version: expected an integer, got a string"},
      {"prompts", "true", "dev_set.prompts: expected an integer, got a boolean"},
  };
  for (const auto& c : cases) {
    const Result<KascadeCalibration> bad = ParseCalibration(with(c.key, c.value), "cal.json");
    ASSERT_FALSE(bad.ok()) << c.key << " " << c.value;
    EXPECT_NE(bad.status().message().find(c.needle), std::string::npos) << bad.status().message();
  }
  // A float inside an array of integers.
  const Result<KascadeCalibration> big = ParseCalibration(
      std::string(text).replace(text.find("\"anchors\"") + 12, 0, "0.5, "), "cal.json");
  ASSERT_FALSE(big.ok());
  EXPECT_NE(big.status().message().find("anchors[0]: expected an integer, got the number 0.5"),
            std::string::npos)
      << big.status().message();
  // A 20 MB model path is not echoed whole.
  Result<KascadeCalibration> loaded = ParseCalibration(text, "cal.json");
  ASSERT_TRUE(loaded.ok()) << loaded.status().message();
  loaded->model = std::string(20 << 20, 'm');
  EXPECT_LT(CheckCalibrationFits(*loaded, 12, 8, 4, 64).message().size(), 600u);
  std::filesystem::remove(path);
}

}  // namespace
}  // namespace rubato
