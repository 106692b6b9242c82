// Tests for the SFI Selector CPU reference: every case is compared against a plain
// double-precision transcription of Eqs. 6–24 and of our continuation stage written here (literal
// formulas, O(|J|·window) soft-NMS and continuation, full sort), plus hand-built cases whose
// answer is known without any reference.
#include "inference_rank/policies/sfi/kernels/sfi_selector.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <iostream>
#include <limits>
#include <numeric>
#include <random>
#include <string>
#include <vector>

namespace rubato {
namespace {

struct Shape {
  int heads = 1;   // H
  int group = 1;   // G
  int window = 1;  // W
  int j_begin = 0;
  int n = 0;  // |J|
};

// Owns the buffers an SfiSelectorInput points to.
struct Case {
  Shape shape;
  std::vector<float> logits;     // [W][H * G][n]
  std::vector<float> key_norms;  // [H][n]
  SfiSelectorInput Input() const {
    SfiSelectorInput input;
    input.num_kv_heads = shape.heads;
    input.group = shape.group;
    input.window = shape.window;
    input.j_begin = shape.j_begin;
    input.j_count = shape.n;
    input.logits = logits.empty() ? nullptr : logits.data();
    input.key_norms = key_norms.empty() ? nullptr : key_norms.data();
    return input;
  }
  float& Logit(int w, int q, int j) {
    return logits[(static_cast<size_t>(w) * shape.heads * shape.group + q) * shape.n + j];
  }
};

// Logits ~ N(0, spread²) and key norms ~ U[0.5, 20).
Case RandomCase(const Shape& shape, uint64_t seed, float spread = 3.0f) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.0f, spread);
  std::uniform_real_distribution<float> uniform(0.5f, 20.0f);
  Case c{shape, {}, {}};
  c.logits.resize(static_cast<size_t>(shape.window) * shape.heads * shape.group * shape.n);
  for (float& x : c.logits) x = normal(rng);
  c.key_norms.resize(static_cast<size_t>(shape.heads) * shape.n);
  for (float& x : c.key_norms) x = uniform(rng);
  return c;
}

// The reference: the paper's formulas as written, per KV head.
struct Reference {
  std::vector<std::vector<double>> f, r;   // [H][n] Eqs. 8 and 12
  std::vector<double> unclipped_lambda;    // [H] Eq. 18 before the clip
  std::vector<double> lambda_star;         // [H]
  std::vector<double> z_adj;               // [H][n] Eq. 23
  std::vector<double> continuation;        // [H][n] stage C's c_h(j), 0 where none
  std::vector<std::vector<int>> selected;  // [H][min(K, n)] Eq. 24 + stage C, ascending
};

Reference ReferenceSelector(const SfiSelectorConfig& c, const Case& data) {
  const Shape& s = data.shape;
  const int n = s.n;
  const double eps = c.epsilon;
  Reference ref;
  ref.f.assign(s.heads, std::vector<double>(n));
  ref.r.assign(s.heads, std::vector<double>(n));
  ref.unclipped_lambda.assign(s.heads, 0.0);
  ref.lambda_star.assign(s.heads, 0.0);
  std::vector<double> z_nms(static_cast<size_t>(s.heads) * n);
  for (int h = 0; h < s.heads; ++h) {
    std::vector<double> mu(n, 0.0);
    for (int w = 0; w < s.window; ++w) {
      std::vector<double> p(n, 0.0);
      for (int g = 0; g < s.group; ++g) {
        const float* row =
            &data.logits[(static_cast<size_t>(w) * s.heads * s.group + h * s.group + g) * n];
        const double mx = *std::max_element(row, row + n);
        double sum = 0.0;
        for (int j = 0; j < n; ++j) sum += std::exp(row[j] - mx);
        for (int j = 0; j < n; ++j) p[j] += std::exp(row[j] - mx) / sum / s.group;
      }
      for (int j = 0; j < n; ++j) mu[j] += std::pow(p[j], c.alpha) / s.window;
    }
    std::vector<double>& f = ref.f[h];
    std::vector<double>& r = ref.r[h];
    double f_sum = 0.0, r_sum = 0.0;
    const double j_min = s.j_begin, j_max = s.j_begin + n - 1;
    for (int j = 0; j < n; ++j) {
      f[j] = std::pow(mu[j], 1.0 / c.alpha);
      f_sum += f[j];
      const double u = (s.j_begin + j - j_min) / (j_max - j_min + eps);
      const double kn = c.gamma > 0 ? std::pow(data.key_norms[h * n + j] + eps, -c.gamma) : 1.0;
      r[j] = kn * std::exp(-c.beta * std::pow(u, c.p)) * std::pow(1.0 - u + eps, c.eta);
      r_sum += r[j];
    }
    double ff = 0.0, fr = 0.0, rr = 0.0;
    for (int j = 0; j < n; ++j) {
      f[j] /= f_sum;
      r[j] /= r_sum;
      ff += f[j] * f[j];
      fr += f[j] * r[j];
      rr += r[j] * r[j];
    }
    const double denominator = ff - 2.0 * fr + rr;
    ref.unclipped_lambda[h] = denominator == 0.0 ? 0.0 : (ff - fr) / denominator;
    const double lambda = std::min(std::max(ref.unclipped_lambda[h], 0.0), c.lambda_clip);
    ref.lambda_star[h] = lambda;
    std::vector<double> z(n);
    for (int j = 0; j < n; ++j) z[j] = std::log((1.0 - lambda) * f[j] + lambda * r[j] + eps);
    const int half = c.nms_window / 2;
    for (int j = 0; j < n; ++j) {
      double m = -std::numeric_limits<double>::infinity();
      for (int i = std::max(0, j - half); i <= std::min(n - 1, j + half); ++i) {
        m = std::max(m, z[i]);
      }
      z_nms[h * n + j] = z[j] - c.alpha_soft * std::max(m - z[j], 0.0);
    }
  }
  ref.z_adj.assign(z_nms.size(), 0.0);
  for (int j = 0; j < n; ++j) {
    double mx = -std::numeric_limits<double>::infinity();
    for (int h = 0; h < s.heads; ++h) mx = std::max(mx, z_nms[h * n + j] / c.temperature);
    double sum = 0.0;
    for (int h = 0; h < s.heads; ++h) sum += std::exp(z_nms[h * n + j] / c.temperature - mx);
    for (int h = 0; h < s.heads; ++h) {
      const double rh = std::exp(z_nms[h * n + j] / c.temperature - mx) / sum;
      ref.z_adj[h * n + j] = z_nms[h * n + j] + c.alpha_cross * std::log(std::max(rh, eps));
    }
  }
  // Stage C: c(j) = the largest f(a) of an anchor a (f(a) >= threshold) with a <= j <= a + C.
  ref.continuation.assign(static_cast<size_t>(s.heads) * n, 0.0);
  for (int h = 0; h < s.heads; ++h) {
    for (int j = 0; c.continuation > 0 && j < n; ++j) {
      for (int a = std::max(0, j - c.continuation); a <= j; ++a) {
        if (ref.f[h][a] >= c.continuation_threshold) {
          ref.continuation[h * n + j] = std::max(ref.continuation[h * n + j], ref.f[h][a]);
        }
      }
    }
  }
  ref.selected.resize(s.heads);
  for (int h = 0; h < s.heads; ++h) {
    std::vector<int> order(n);
    std::iota(order.begin(), order.end(), 0);
    const double* score = &ref.z_adj[static_cast<size_t>(h) * n];
    const double* priority = &ref.continuation[static_cast<size_t>(h) * n];
    std::sort(order.begin(), order.end(), [score, priority](int a, int b) {
      if (priority[a] != priority[b]) return priority[a] > priority[b];
      return score[a] > score[b] || (score[a] == score[b] && a < b);
    });
    order.resize(std::min(c.budget, n));
    std::sort(order.begin(), order.end());
    for (int& j : order) j += s.j_begin;
    ref.selected[h] = order;
  }
  return ref;
}

// Every element within atol + rtol·|ref|; prints the largest error.
::testing::AssertionResult ScoresClose(const std::vector<double>& actual,
                                       const std::vector<double>& expected, double tol = 1e-9) {
  if (actual.size() != expected.size()) {
    return ::testing::AssertionFailure()
           << actual.size() << " scores, expected " << expected.size();
  }
  double max_error = 0.0;
  size_t failures = 0, first = 0;
  for (size_t i = 0; i < actual.size(); ++i) {
    const double error = std::fabs(actual[i] - expected[i]);
    if (!(error <= tol + tol * std::fabs(expected[i])) && failures++ == 0) first = i;
    max_error = std::max(max_error, error);
  }
  std::cout << "[ max error ] z_adj: " << max_error << " over " << actual.size() << " scores\n";
  if (failures == 0) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure()
         << failures << " scores off by more than " << tol << "; first at " << first << " (got "
         << actual[first] << ", want " << expected[first] << ")";
}

// selected must equal the reference sets. The implementation differs from the reference only in
// rounding (both are double), so a position may differ only where the reference ranks it as a
// near-tie of its K-th position: the same continuation priority within 1e-12 and a score within
// 1e-9 (or a priority just above); anything else fails.
::testing::AssertionResult SameSelection(const std::vector<std::vector<int>>& selected,
                                         const Reference& ref, const Shape& shape, int budget) {
  if (selected.size() != ref.selected.size()) {
    return ::testing::AssertionFailure()
           << selected.size() << " heads, expected " << ref.selected.size();
  }
  const size_t n = static_cast<size_t>(shape.n);
  for (size_t h = 0; h < selected.size(); ++h) {
    const std::vector<int>& got = selected[h];
    if (got == ref.selected[h]) continue;
    const size_t k = static_cast<size_t>(std::min(budget, shape.n));
    if (got.size() != k) {
      return ::testing::AssertionFailure()
             << "head " << h << ": " << got.size() << " positions, expected " << k;
    }
    // The reference's K-th position: its selection is ascending, so find the worst of them.
    const double* priority = &ref.continuation[h * n];
    const double* score = &ref.z_adj[h * n];
    int kth_index = ref.selected[h].front() - shape.j_begin;
    for (int position : ref.selected[h]) {
      const int i = position - shape.j_begin;
      if (priority[i] < priority[kth_index] ||
          (priority[i] == priority[kth_index] && score[i] <= score[kth_index])) {
        kth_index = i;
      }
    }
    const double kth = score[kth_index];
    const double kth_priority = priority[kth_index];
    int differing = 0;
    for (size_t i = 0; i < got.size(); ++i) {
      const int j = got[i] - shape.j_begin;
      if (j < 0 || j >= shape.n || (i > 0 && got[i] <= got[i - 1])) {
        return ::testing::AssertionFailure()
               << "head " << h << ": position " << got[i] << " out of J or not strictly ascending";
      }
      if (!std::binary_search(ref.selected[h].begin(), ref.selected[h].end(), got[i])) {
        ++differing;
        const bool near_tie =
            priority[j] > kth_priority + 1e-12 ||
            (std::fabs(priority[j] - kth_priority) <= 1e-12 && score[j] >= kth - 1e-9);
        if (!near_tie) {
          return ::testing::AssertionFailure()
                 << "head " << h << ": selected position " << got[i] << " has reference (priority, "
                 << "score) (" << priority[j] << ", " << score[j] << ") below the K-th ("
                 << kth_priority << ", " << kth << ")";
        }
      }
    }
    std::cout << "[ near-tie ] head " << h << ": " << differing
              << " positions differ from the reference within 1e-9 of the K-th score\n";
  }
  return ::testing::AssertionSuccess();
}

// Runs ComputeSfiScores and SelectSfi on `data` and compares both with the reference.
void ExpectMatchesReference(const SfiSelectorConfig& config, const Case& data) {
  SCOPED_TRACE(::testing::Message() << "H=" << data.shape.heads << " G=" << data.shape.group
                                    << " W=" << data.shape.window << " n=" << data.shape.n
                                    << " j_begin=" << data.shape.j_begin << " K=" << config.budget
                                    << " nms=" << config.nms_window << " gamma=" << config.gamma
                                    << " continuation=" << config.continuation);
  const Reference ref = ReferenceSelector(config, data);
  SfiScores scores;
  ASSERT_TRUE(ComputeSfiScores(config, data.Input(), scores).ok());
  EXPECT_TRUE(ScoresClose(scores.z_adj, ref.z_adj));
  EXPECT_TRUE(ScoresClose(scores.continuation, ref.continuation, 1e-12));
  ASSERT_EQ(scores.lambda_star.size(), ref.lambda_star.size());
  for (size_t h = 0; h < ref.lambda_star.size(); ++h) {
    EXPECT_NEAR(scores.lambda_star[h], ref.lambda_star[h], 1e-12) << "head " << h;
  }
  std::vector<std::vector<int>> selected;
  ASSERT_TRUE(SelectSfi(config, data.Input(), selected).ok());
  EXPECT_TRUE(SameSelection(selected, ref, data.shape, config.budget));
}

std::vector<int> Range(int begin, int count) {
  std::vector<int> v(count);
  std::iota(v.begin(), v.end(), begin);
  return v;
}

TEST(SfiSelectorConfig, DefaultsAreValidAndBetaIsComputed) {
  const SfiSelectorConfig config;
  EXPECT_TRUE(ValidateSfiSelectorConfig(config).ok());
  EXPECT_EQ(config.beta, -std::log(0.6) / 0.9);  // 0.56758402641 (docs/design.md §4.2)
  EXPECT_NEAR(std::exp(-config.beta * 0.9), 0.6, 1e-15);
}

TEST(SfiSelector, RandomShapesMatchReference) {
  struct Sweep {
    Shape shape;
    int budget, nms_window;
    double gamma;
    int continuation;
  };
  const Sweep sweeps[] = {
      {{1, 1, 1, 0, 100}, 10, 32, 0.0, 8},      {{8, 4, 1, 123, 1000}, 64, 32, 0.0, 8},
      {{2, 8, 16, 5, 777}, 100, 32, 0.7, 0},    {{8, 1, 16, 0, 513}, 512, 1, 0.0, 3},
      {{4, 4, 4, 1000, 300}, 50, 4096, 1.5, 8}, {{1, 8, 16, 0, 2049}, 2048, 32, 0.0, 0},
      {{3, 2, 5, 7, 64}, 63, 7, 0.3, 100},      {{8, 8, 16, 4, 301}, 37, 2, 2.0, 1},
      {{2, 1, 1, 0, 1}, 1, 32, 0.5, 8},         {{5, 3, 2, 99, 2}, 1, 3, 0.0, 8},
      {{8, 4, 1, 4, 1000}, 64, 32, 0.0, 0},
  };
  uint64_t seed = 1;
  for (const Sweep& sweep : sweeps) {
    SfiSelectorConfig config;
    config.budget = sweep.budget;
    config.nms_window = sweep.nms_window;
    config.gamma = sweep.gamma;
    config.continuation = sweep.continuation;
    ExpectMatchesReference(config, RandomCase(sweep.shape, seed++));
  }
}

TEST(SfiSelector, WindowOf16WithGqaGroupsAndHeadCounts) {
  uint64_t seed = 100;
  for (int heads : {1, 8}) {
    for (int group : {1, 4, 8}) {
      SfiSelectorConfig config;
      config.budget = 40;
      ExpectMatchesReference(config, RandomCase({heads, group, 16, 17, 333}, seed++));
    }
  }
}

TEST(SfiSelector, KeyNormPriorMatchesReference) {
  for (double gamma : {0.25, 1.0, 3.0}) {
    SfiSelectorConfig config;
    config.gamma = gamma;
    config.budget = 30;
    config.lambda_clip = 1.0;  // let the prior weigh as much as Eq. 18 allows
    // Flat logits keep the evidence close to the prior, so λ* is well inside (0, 1].
    ExpectMatchesReference(config, RandomCase({4, 2, 3, 50, 400}, 7, 0.3f));
  }
}

TEST(SfiSelector, LargeAllowedSetMatchesReference) {
  SfiSelectorConfig config;  // K = 2048, nms_window = 32
  ExpectMatchesReference(config, RandomCase({2, 2, 1, 4, 131072}, 11));
}

TEST(SfiSelector, BudgetAtLeastJSelectsEverything) {
  const Case data = RandomCase({3, 2, 2, 40, 50}, 3);
  for (int budget : {50, 51, 2048}) {
    SfiSelectorConfig config;
    config.budget = budget;
    std::vector<std::vector<int>> selected;
    ASSERT_TRUE(SelectSfi(config, data.Input(), selected).ok());
    ASSERT_EQ(selected.size(), 3u);
    for (const std::vector<int>& head : selected) EXPECT_EQ(head, Range(40, 50));
  }
}

TEST(SfiSelector, EmptyAllowedSetGivesEmptyLists) {
  SfiSelectorInput input;
  input.num_kv_heads = 4;
  input.group = 2;
  input.window = 1;
  input.j_begin = 10;
  input.j_count = 0;  // logits may stay null
  std::vector<std::vector<int>> selected = {{1, 2, 3}};
  ASSERT_TRUE(SelectSfi(SfiSelectorConfig{}, input, selected).ok());
  EXPECT_EQ(selected, std::vector<std::vector<int>>(4));
}

TEST(SfiSelector, EqualScoresGoToLowerPositions) {
  // λ_clip = 0 (s = f), one head, no NMS: z follows the logits exactly, ties included.
  SfiSelectorConfig config;
  config.continuation = 0;  // the paper's stages alone
  config.lambda_clip = 0.0;
  config.nms_window = 1;
  config.budget = 3;
  Case data{{1, 1, 1, 20, 10}, {0, 1, 1, 0, 1, 0, 0, 1, 0, 0}, {}};
  std::vector<std::vector<int>> selected;
  ASSERT_TRUE(SelectSfi(config, data.Input(), selected).ok());
  EXPECT_EQ(selected, (std::vector<std::vector<int>>{{21, 22, 24}}));
  EXPECT_EQ(SfiTopKPositions(std::vector<double>{2, 5, 5, 1, 5}, {}, 2, 100),
            (std::vector<int>{101, 102}));
  // Priorities rank first: the lone priority of position 3 beats every score.
  EXPECT_EQ(SfiTopKPositions(std::vector<double>{2, 5, 5, 1, 5}, std::vector<double>{0, 0, 0, 0.5, 0},
                             2, 100),
            (std::vector<int>{101, 103}));
}

TEST(SfiSelector, DuplicatedLogitsMatchReference) {
  // Every logit value appears three times in a row and across the heads of a group.
  for (double lambda_clip : {0.0, 0.02}) {
    Case data = RandomCase({4, 2, 2, 0, 600}, 21);
    for (int w = 0; w < 2; ++w) {
      for (int q = 0; q < 8; ++q) {
        for (int j = 0; j < 600; ++j) data.Logit(w, q, j) = data.Logit(0, q & ~1, j - j % 3);
      }
    }
    SfiSelectorConfig config;
    config.lambda_clip = lambda_clip;
    config.budget = 100;
    ExpectMatchesReference(config, data);
    config.nms_window = 1;
    ExpectMatchesReference(config, data);
  }
}

TEST(SfiSelector, AllEqualLogitsSelectTheFirstPositions) {
  Case data{{3, 2, 4, 7, 200}, std::vector<float>(4 * 6 * 200, 1.25f), {}};
  SfiSelectorConfig config;
  config.continuation = 0;  // the paper's stages alone
  config.budget = 64;
  config.lambda_clip = 0.0;  // s uniform: every score ties, the tie rule picks the lowest
  std::vector<std::vector<int>> selected;
  ASSERT_TRUE(SelectSfi(config, data.Input(), selected).ok());
  for (const std::vector<int>& head : selected) EXPECT_EQ(head, Range(7, 64));
  // Default λ_clip: uniform f gives λ* = 0 in exact arithmetic (fᵀr = 1/n = ‖f‖²).
  config.lambda_clip = SfiSelectorConfig{}.lambda_clip;
  SfiScores scores;
  ASSERT_TRUE(ComputeSfiScores(config, data.Input(), scores).ok());
  for (double lambda : scores.lambda_star) EXPECT_LE(lambda, 1e-12);
  ExpectMatchesReference(config, data);
}

TEST(SfiSelectorLambdaStar, ClosedFormAndClipEnds) {
  using V = std::vector<double>;
  // Unclipped (0.505 - 0.54) / 0.245 < 0 → 0.
  EXPECT_EQ(SfiLambdaStar(V{0.55, 0.45}, V{0.9, 0.1}, 0.02), 0.0);
  // Unclipped (1 - 0.5) / (1 - 1 + 0.5) = 1 → λ_clip.
  EXPECT_EQ(SfiLambdaStar(V{1, 0}, V{0.5, 0.5}, 0.02), 0.02);
  EXPECT_DOUBLE_EQ(SfiLambdaStar(V{1, 0}, V{0.5, 0.5}, 1.0), 1.0);
  // Interior: (1 - 0) / (1 - 0 + 0.5) = 2/3.
  EXPECT_DOUBLE_EQ(SfiLambdaStar(V{1, 0, 0}, V{0, 0.5, 0.5}, 1.0), 2.0 / 3.0);
  EXPECT_DOUBLE_EQ(SfiLambdaStar(V{1, 0, 0}, V{0, 0.5, 0.5}, 0.5), 0.5);
  // f == r: zero denominator → 0.
  EXPECT_EQ(SfiLambdaStar(V{0.25, 0.75}, V{0.25, 0.75}, 1.0), 0.0);
}

TEST(SfiSelectorLambdaStar, MinimizesSquaredNormOverTheClipRange) {
  std::mt19937_64 rng(5);
  std::uniform_real_distribution<double> uniform(0.0, 1.0);
  for (int trial = 0; trial < 20; ++trial) {
    std::vector<double> f(37), r(37);
    for (double& x : f) x = std::pow(uniform(rng), 4.0);
    for (double& x : r) x = uniform(rng);
    const double fs = std::accumulate(f.begin(), f.end(), 0.0);
    const double rs = std::accumulate(r.begin(), r.end(), 0.0);
    for (double& x : f) x /= fs;
    for (double& x : r) x /= rs;
    const double clip = trial % 2 ? 1.0 : 0.02;
    const double lambda = SfiLambdaStar(f, r, clip);
    const auto norm2 = [&](double l) {
      double sum = 0.0;
      for (size_t j = 0; j < f.size(); ++j) sum += std::pow((1 - l) * f[j] + l * r[j], 2);
      return sum;
    };
    for (int i = 0; i <= 200; ++i) {
      EXPECT_LE(norm2(lambda), norm2(clip * i / 200.0) + 1e-15) << "trial " << trial;
    }
  }
}

TEST(SfiSelector, LambdaStarHitsBothClipEnds) {
  SfiSelectorConfig config;
  config.budget = 20;
  // Evidence flatter than the prior (logits fall gently with position while the prior falls
  // steeply): ‖f‖² < fᵀr, so the unclipped value is negative.
  Case flat{{2, 2, 2, 0, 500}, std::vector<float>(2 * 4 * 500), {}};
  for (int w = 0; w < 2; ++w) {
    for (int q = 0; q < 4; ++q) {
      for (int j = 0; j < 500; ++j) flat.Logit(w, q, j) = -0.1f * j / 499;
    }
  }
  // Peaked evidence: the unclipped value is near 1, far above λ_clip = 0.02.
  const Case peaked = RandomCase({2, 2, 2, 0, 500}, 9, 4.0f);
  const Reference flat_ref = ReferenceSelector(config, flat);
  const Reference peaked_ref = ReferenceSelector(config, peaked);
  SfiScores flat_scores, peaked_scores;
  ASSERT_TRUE(ComputeSfiScores(config, flat.Input(), flat_scores).ok());
  ASSERT_TRUE(ComputeSfiScores(config, peaked.Input(), peaked_scores).ok());
  for (int h = 0; h < 2; ++h) {
    EXPECT_LT(flat_ref.unclipped_lambda[h], 0.0);
    EXPECT_EQ(flat_scores.lambda_star[h], 0.0);
    EXPECT_EQ(SfiLambdaStar(flat_ref.f[h], flat_ref.r[h], config.lambda_clip), 0.0);
    EXPECT_GT(peaked_ref.unclipped_lambda[h], config.lambda_clip);
    EXPECT_EQ(peaked_scores.lambda_star[h], config.lambda_clip);
    EXPECT_EQ(SfiLambdaStar(peaked_ref.f[h], peaked_ref.r[h], config.lambda_clip),
              config.lambda_clip);
  }
  ExpectMatchesReference(config, flat);
  ExpectMatchesReference(config, peaked);
}

TEST(SfiSelector, NmsWindowOneIsANoOp) {
  const Case data = RandomCase({3, 2, 2, 0, 257}, 13);
  SfiSelectorConfig plain;
  plain.nms_window = 1;
  plain.alpha_soft = 0.0;
  SfiSelectorConfig strong = plain;
  strong.alpha_soft = 5.0;
  SfiScores a, b;
  ASSERT_TRUE(ComputeSfiScores(plain, data.Input(), a).ok());
  ASSERT_TRUE(ComputeSfiScores(strong, data.Input(), b).ok());
  EXPECT_EQ(a.z_adj, b.z_adj);
  // Windows 2 and 3 both reach one neighbour on each side (half-width 1) and change scores.
  strong.nms_window = 2;
  ASSERT_TRUE(ComputeSfiScores(strong, data.Input(), b).ok());
  EXPECT_NE(a.z_adj, b.z_adj);
  SfiScores c;
  strong.nms_window = 3;
  ASSERT_TRUE(ComputeSfiScores(strong, data.Input(), c).ok());
  EXPECT_EQ(b.z_adj, c.z_adj);
  ExpectMatchesReference(strong, data);
}

TEST(SfiSelector, SoftNmsMovesASlotToAnotherNeighbourhood) {
  // Peaks at 10 and 11 (one neighbourhood) and a slightly weaker isolated peak at 60.
  Case data{{1, 1, 1, 0, 100}, std::vector<float>(100, 0.0f), {}};
  data.Logit(0, 0, 10) = 5.0f;
  data.Logit(0, 0, 11) = 4.9f;
  data.Logit(0, 0, 60) = 4.8f;
  SfiSelectorConfig config;
  config.continuation = 0;  // the paper's stages alone
  config.budget = 2;
  config.nms_window = 8;
  config.alpha_soft = 0.0;
  std::vector<std::vector<int>> selected;
  ASSERT_TRUE(SelectSfi(config, data.Input(), selected).ok());
  EXPECT_EQ(selected, (std::vector<std::vector<int>>{{10, 11}}));
  config.alpha_soft = 2.0;  // 11 loses 2 × 0.1 and falls below 60
  ASSERT_TRUE(SelectSfi(config, data.Input(), selected).ok());
  EXPECT_EQ(selected, (std::vector<std::vector<int>>{{10, 60}}));
  ExpectMatchesReference(config, data);
}

TEST(SfiSelector, CrossHeadExclusivityYieldsAContestedPosition) {
  // Head 0 prefers 10 over 20; head 1 claims 10 far more strongly.
  Case data{{2, 1, 1, 0, 64}, std::vector<float>(2 * 64, 0.0f), {}};
  data.Logit(0, 0, 10) = 6.0f;
  data.Logit(0, 0, 20) = 5.0f;
  data.Logit(0, 1, 10) = 12.0f;
  data.Logit(0, 1, 30) = 3.0f;
  SfiSelectorConfig config;
  config.continuation = 0;  // the paper's stages alone
  config.budget = 1;
  config.nms_window = 1;
  config.lambda_clip = 0.0;
  config.alpha_cross = 0.0;
  std::vector<std::vector<int>> selected;
  ASSERT_TRUE(SelectSfi(config, data.Input(), selected).ok());
  EXPECT_EQ(selected, (std::vector<std::vector<int>>{{10}, {10}}));
  config.alpha_cross = 3.0;
  config.temperature = 0.1;
  ASSERT_TRUE(SelectSfi(config, data.Input(), selected).ok());
  EXPECT_EQ(selected, (std::vector<std::vector<int>>{{20}, {10}}));
  ExpectMatchesReference(config, data);
}

TEST(SfiSelector, NegativeInfinityLogitsAreMaskedPositions) {
  Case data = RandomCase({2, 2, 2, 3, 120}, 17);
  for (int j = 0; j < 120; j += 7) data.Logit(1, 2, j) = -INFINITY;
  SfiSelectorConfig config;
  config.budget = 25;
  ExpectMatchesReference(config, data);
}

// A sharp peak at 50 over flat logits: the continuation keeps 50..58, which soft-NMS otherwise
// pushes to the bottom as 50's neighbours (the paper's stages keep none of them at K = 12).
TEST(SfiSelector, ContinuationKeepsTheSpanAfterAStrongPosition) {
  Case data = RandomCase({1, 1, 1, 100, 200}, 31, 0.3f);
  data.Logit(0, 0, 50) = 9.0f;
  SfiSelectorConfig config;
  config.budget = 12;
  std::vector<std::vector<int>> selected;
  ASSERT_TRUE(SelectSfi(config, data.Input(), selected).ok());
  ASSERT_EQ(selected.size(), 1u);
  for (int position = 150; position <= 158; ++position) {
    EXPECT_TRUE(std::binary_search(selected[0].begin(), selected[0].end(), position)) << position;
  }
  EXPECT_EQ(selected[0].size(), 12u);
  ExpectMatchesReference(config, data);

  config.continuation = 0;
  ASSERT_TRUE(SelectSfi(config, data.Input(), selected).ok());
  EXPECT_TRUE(std::binary_search(selected[0].begin(), selected[0].end(), 150));
  for (int position = 151; position <= 158; ++position) {
    EXPECT_FALSE(std::binary_search(selected[0].begin(), selected[0].end(), position)) << position;
  }
  ExpectMatchesReference(config, data);
}

// Two anchors, 10 stronger than 40, and a budget smaller than their spans: the stronger span
// comes first, in position order (its neighbours tie after soft-NMS, one head, flat logits).
// A span stops at the end of J, and an anchor below the threshold forces nothing.
TEST(SfiSelector, ContinuationOrdersAnchorsByEvidenceAndStopsAtTheEndOfJ) {
  Case data{{1, 1, 1, 0, 45}, std::vector<float>(45, 0.0f), {}};
  data.Logit(0, 0, 10) = 7.0f;
  data.Logit(0, 0, 40) = 6.0f;
  SfiSelectorConfig config;
  config.budget = 5;
  config.continuation = 8;
  std::vector<std::vector<int>> selected;
  ASSERT_TRUE(SelectSfi(config, data.Input(), selected).ok());
  EXPECT_EQ(selected, (std::vector<std::vector<int>>{{10, 11, 12, 13, 14}}));
  config.budget = 14;  // 10..18, then 40..44 (the span of 40 ends with J)
  ASSERT_TRUE(SelectSfi(config, data.Input(), selected).ok());
  EXPECT_EQ(selected, (std::vector<std::vector<int>>{{10, 11, 12, 13, 14, 15, 16, 17, 18, 40, 41,
                                                     42, 43, 44}}));
  SfiScores scores;
  ASSERT_TRUE(ComputeSfiScores(config, data.Input(), scores).ok());
  EXPECT_EQ(scores.continuation[9], 0.0);
  EXPECT_GT(scores.continuation[10], scores.continuation[40]);
  EXPECT_EQ(scores.continuation[18], scores.continuation[10]);
  EXPECT_EQ(scores.continuation[19], 0.0);
  ExpectMatchesReference(config, data);
  // f(10) ~ 0.73: a threshold above it leaves only the paper's top-K (no span after 10).
  config.continuation_threshold = 0.9;
  config.budget = 5;
  ASSERT_TRUE(SelectSfi(config, data.Input(), selected).ok());
  EXPECT_TRUE(std::binary_search(selected[0].begin(), selected[0].end(), 10));
  EXPECT_FALSE(std::binary_search(selected[0].begin(), selected[0].end(), 11));
  ExpectMatchesReference(config, data);
}

// InvalidArgument whose message names `field`; `selected` is left as it was.
void ExpectInvalid(const SfiSelectorConfig& config, const SfiSelectorInput& input,
                   const std::string& field) {
  std::vector<std::vector<int>> selected = {{42}};
  const Status status = SelectSfi(config, input, selected);
  EXPECT_EQ(status.code(), StatusCode::kInvalidArgument) << field;
  EXPECT_NE(status.message().find(field), std::string::npos)
      << "'" << status.message() << "' does not name " << field;
  EXPECT_EQ(selected, (std::vector<std::vector<int>>{{42}})) << field;
}

TEST(SfiSelector, BadInputIsInvalidArgument) {
  Case data = RandomCase({2, 2, 1, 0, 16}, 19);
  const SfiSelectorConfig config;
  SfiSelectorInput input = data.Input();
  input.logits = nullptr;
  ExpectInvalid(config, input, "logits");
  const auto with = [&](auto change) {
    SfiSelectorInput changed = data.Input();
    change(changed);
    return changed;
  };
  ExpectInvalid(config, with([](SfiSelectorInput& i) { i.num_kv_heads = -1; }), "num_kv_heads");
  ExpectInvalid(config, with([](SfiSelectorInput& i) { i.num_kv_heads = 0; }), "num_kv_heads");
  ExpectInvalid(config, with([](SfiSelectorInput& i) { i.group = 0; }), "group");
  ExpectInvalid(config, with([](SfiSelectorInput& i) { i.window = 0; }), "window");
  ExpectInvalid(config, with([](SfiSelectorInput& i) { i.window = -3; }), "window");
  ExpectInvalid(config, with([](SfiSelectorInput& i) { i.j_begin = -1; }), "j_begin");
  ExpectInvalid(config, with([](SfiSelectorInput& i) { i.j_count = -16; }), "j_count");
  ExpectInvalid(config, with([](SfiSelectorInput& i) { i.j_begin = INT_MAX - 3; }),
                "j_begin + j_count");

  SfiSelectorConfig with_gamma;
  with_gamma.gamma = 1.0;
  ExpectInvalid(with_gamma, with([](SfiSelectorInput& i) { i.key_norms = nullptr; }), "key_norms");
  data.key_norms[5] = -1.0f;
  ExpectInvalid(with_gamma, data.Input(), "key_norms[0][5]");
  data.key_norms[5] = 1.0f;
  EXPECT_TRUE(ValidateSfiSelectorConfig(with_gamma).ok());

  data.Logit(0, 3, 4) = NAN;
  ExpectInvalid(config, data.Input(), "logits[0][3][4]");
  data.Logit(0, 3, 4) = INFINITY;
  ExpectInvalid(config, data.Input(), "logits[0][3][4]");
  for (int j = 0; j < 16; ++j) data.Logit(0, 3, j) = -INFINITY;
  ExpectInvalid(config, data.Input(), "logits[0][3]");
}

TEST(SfiSelectorConfig, EveryFieldIsRangeChecked) {
  const Case data = RandomCase({1, 1, 1, 0, 8}, 23);
  struct Bad {
    const char* field;
    void (*change)(SfiSelectorConfig&);
  };
  const Bad bad[] = {
      {"budget", [](SfiSelectorConfig& c) { c.budget = 0; }},
      {"alpha", [](SfiSelectorConfig& c) { c.alpha = 0.0; }},
      {"alpha", [](SfiSelectorConfig& c) { c.alpha = 1.5; }},
      {"alpha", [](SfiSelectorConfig& c) { c.alpha = NAN; }},
      {"gamma", [](SfiSelectorConfig& c) { c.gamma = -0.1; }},
      {"gamma", [](SfiSelectorConfig& c) { c.gamma = INFINITY; }},
      {"beta", [](SfiSelectorConfig& c) { c.beta = -1.0; }},
      {"SfiSelectorConfig.p ", [](SfiSelectorConfig& c) { c.p = 0.5; }},
      {"eta", [](SfiSelectorConfig& c) { c.eta = -0.4; }},
      {"lambda_clip", [](SfiSelectorConfig& c) { c.lambda_clip = 1.01; }},
      {"lambda_clip", [](SfiSelectorConfig& c) { c.lambda_clip = -0.01; }},
      {"epsilon", [](SfiSelectorConfig& c) { c.epsilon = 0.0; }},
      {"nms_window", [](SfiSelectorConfig& c) { c.nms_window = 0; }},
      {"alpha_soft", [](SfiSelectorConfig& c) { c.alpha_soft = -0.5; }},
      {"alpha_cross", [](SfiSelectorConfig& c) { c.alpha_cross = -0.35; }},
      {"temperature", [](SfiSelectorConfig& c) { c.temperature = 0.0; }},
      {"continuation", [](SfiSelectorConfig& c) { c.continuation = -1; }},
      {"continuation_threshold", [](SfiSelectorConfig& c) { c.continuation_threshold = 0.0; }},
      {"continuation_threshold", [](SfiSelectorConfig& c) { c.continuation_threshold = 1.5; }},
      {"continuation_threshold", [](SfiSelectorConfig& c) { c.continuation_threshold = NAN; }},
  };
  for (const Bad& b : bad) {
    SfiSelectorConfig config;
    b.change(config);
    const Status status = ValidateSfiSelectorConfig(config);
    EXPECT_EQ(status.code(), StatusCode::kInvalidArgument) << b.field;
    EXPECT_NE(status.message().find(b.field), std::string::npos)
        << "'" << status.message() << "' does not name " << b.field;
    ExpectInvalid(config, data.Input(), b.field);
  }
}

}  // namespace
}  // namespace rubato
