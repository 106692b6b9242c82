// AsyncSpade's query predictor (query_predictor.h) against a double-precision reference written
// here (Gaussian elimination, not Cholesky): the ridge weights, the assembled prediction on random
// and exactly linear query sequences, W = 1 and a single query repeating the newest, the
// window's ring, and the rings of the device predictor's CPU twin. Every element within atol +
// rtol |ref|; the seed is printed.
#include "cache_rank/query_predictor.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <random>
#include <vector>

namespace rubato {
namespace {

// (H H^T + lambda I) w = H y by Gaussian elimination with partial pivoting, lambda = rel x mean
// squared row norm.
std::vector<double> RidgeReference(const std::vector<float>& h, const float* y, int k, int dim,
                                   double rel) {
  std::vector<std::vector<double>> a(k, std::vector<double>(k + 1, 0.0));
  double trace = 0.0;
  for (int i = 0; i < k; ++i) {
    for (int j = 0; j < k; ++j) {
      for (int d = 0; d < dim; ++d) a[i][j] += double{h[i * dim + d]} * h[j * dim + d];
    }
    for (int d = 0; d < dim; ++d) a[i][k] += double{h[i * dim + d]} * y[d];
    trace += a[i][i];
  }
  if (trace <= 0) return std::vector<double>(k, 0.0);
  for (int i = 0; i < k; ++i) a[i][i] += rel * trace / k;
  for (int c = 0; c < k; ++c) {
    int pivot = c;
    for (int r = c + 1; r < k; ++r) {
      if (std::abs(a[r][c]) > std::abs(a[pivot][c])) pivot = r;
    }
    std::swap(a[c], a[pivot]);
    for (int r = 0; r < k; ++r) {
      if (r == c) continue;
      const double f = a[r][c] / a[c][c];
      for (int j = c; j <= k; ++j) a[r][j] -= f * a[c][j];
    }
  }
  std::vector<double> w(k);
  for (int i = 0; i < k; ++i) w[i] = a[i][k] / a[i][i];
  return w;
}

// The assembled prediction (AsyncSpade Eqs. 4-5, App. C) over window rows oldest first.
std::vector<double> PredictReference(const std::vector<float>& window, int n, int dim,
                                     int max_window, double rel) {
  std::vector<double> out(dim, 0.0);
  const int m = std::min(max_window, n - 1);
  if (m <= 0) {
    for (int d = 0; d < dim; ++d) out[d] = window[(n - 1) * dim + d];
    return out;
  }
  for (int k = 1; k <= m; ++k) {
    const std::vector<float> h(window.begin() + (n - 1 - k) * dim, window.begin() + (n - 1) * dim);
    std::vector<double> w = RidgeReference(h, &window[(n - 1) * dim], k, dim, rel);
    double z = 0.0;
    for (double& x : w) z += (x = std::exp(x));
    for (int i = 1; i <= k; ++i) {  // weight of q_{t-i} onto q_{t+1-i}
      const double weight = w[k - i] / z;
      for (int d = 0; d < dim; ++d) out[d] += weight * window[(n - i) * dim + d];
    }
  }
  for (double& x : out) x /= m;
  return out;
}

// Every element within 1e-6 + 1e-5 |ref|; returns the largest error.
double ExpectClose(const std::vector<float>& got, const std::vector<double>& want) {
  double worst = 0.0;
  for (size_t i = 0; i < want.size(); ++i) {
    const double error = std::abs(got[i] - want[i]);
    worst = std::max(worst, error);
    EXPECT_LE(error, 1e-6 + 1e-5 * std::abs(want[i])) << "element " << i;
  }
  return worst;
}

uint32_t Seed() {
  const uint32_t seed = std::random_device{}();
  std::printf("seed %u\n", seed);
  return seed;
}

TEST(QueryPredictor, RidgeWeightsSolveTheRegularisedNormalEquations) {
  std::mt19937 rng(Seed());
  std::normal_distribution<float> normal(0.0f, 3.0f);
  for (const int dim : {1, 5, 64, 128}) {
    for (int k = 1; k <= 17; k += 4) {
      std::vector<float> h(k * dim), y(dim);
      for (float& x : h) x = normal(rng);
      for (float& x : y) x = normal(rng);
      std::vector<double> w(k);
      SolveRidgeWeights(h, y, k, dim, 1e-2, w);
      const std::vector<double> want = RidgeReference(h, y.data(), k, dim, 1e-2);
      for (int i = 0; i < k; ++i) {
        EXPECT_NEAR(w[i], want[i], 1e-9 + 1e-7 * std::abs(want[i])) << "dim " << dim << " k " << k;
      }
    }
  }
}

TEST(QueryPredictor, AssembledPredictionMatchesTheReferenceOnRandomQueries) {
  std::mt19937 rng(Seed());
  std::normal_distribution<float> normal(0.5f, 2.0f);
  double worst = 0.0;
  for (const int dim : {1, 7, 64, 128}) {
    for (const int max_window : {1, 2, 5, 16}) {
      for (int n = 1; n <= max_window + 1; ++n) {
        std::vector<float> window(n * dim);
        for (float& x : window) x = normal(rng);
        std::vector<float> got(dim);
        PredictNextQuery(window, n, dim, max_window, 1e-2, got);
        SCOPED_TRACE("dim " + std::to_string(dim) + " W " + std::to_string(max_window) + " n " +
                     std::to_string(n));
        worst =
            std::max(worst, ExpectClose(got, PredictReference(window, n, dim, max_window, 1e-2)));
      }
    }
  }
  std::printf("max error %.3g\n", worst);
}

TEST(QueryPredictor, AssembledPredictionMatchesTheReferenceOnLinearQueries) {
  // q_t = a + t d, exactly linear in t: the regression's weights are far from uniform.
  std::mt19937 rng(Seed());
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (const int dim : {3, 64}) {
    std::vector<float> a(dim), d(dim);
    for (float& x : a) x = normal(rng);
    for (float& x : d) x = 0.25f * normal(rng);
    const int n = 17;
    std::vector<float> window(n * dim);
    for (int t = 0; t < n; ++t) {
      for (int i = 0; i < dim; ++i) window[t * dim + i] = a[i] + static_cast<float>(t) * d[i];
    }
    for (const double rel : {1e-4, 1e-2, 1.0}) {
      std::vector<float> got(dim);
      PredictNextQuery(window, n, dim, 16, rel, got);
      ExpectClose(got, PredictReference(window, n, dim, 16, rel));
    }
  }
}

TEST(QueryPredictor, OneQueryOrAWindowOfOneRepeatsTheNewest) {
  std::mt19937 rng(Seed());
  std::normal_distribution<float> normal(0.0f, 4.0f);
  const int dim = 32;
  std::vector<float> window(6 * dim);
  for (float& x : window) x = normal(rng);
  const std::vector<float> newest(window.end() - dim, window.end());
  std::vector<float> got(dim);
  PredictNextQuery(window, 6, dim, /*max_window=*/1, 1e-2, got);
  EXPECT_EQ(got, newest);  // k = 1 only: one weight, softmax 1, applied to q_t
  PredictNextQuery(std::span<const float>(window).last(dim), 1, dim, 16, 1e-2, got);
  EXPECT_EQ(got, newest);
  // A window of zeros has no evidence: equal weights, the mean of zeros.
  std::vector<float> zeros(4 * dim, 0.0f);
  PredictNextQuery(zeros, 4, dim, 16, 1e-2, got);
  EXPECT_EQ(got, std::vector<float>(dim, 0.0f));
}

TEST(QueryPredictor, WindowKeepsTheLastWPlusOneQueriesPerHead) {
  const int heads = 3, w = 4, dim = 5;
  QueryWindow window(heads, w, dim);
  std::vector<float> query(heads * dim);
  for (int step = 0; step < 9; ++step) {
    for (int h = 0; h < heads; ++h) {
      for (int d = 0; d < dim; ++d) query[h * dim + d] = 100.0f * h + 10.0f * step + d;
    }
    window.Push(query);
    EXPECT_EQ(window.size(), std::min(step + 1, w + 1));
  }
  std::vector<float> ordered(window.size() * dim);
  std::vector<float> predicted(heads * dim);
  window.Predict(1e-2, predicted);
  for (int h = 0; h < heads; ++h) {
    window.Ordered(h, ordered);
    for (int i = 0; i < window.size(); ++i) {  // steps 4..8, oldest first
      EXPECT_EQ(ordered[i * dim], 100.0f * h + 10.0f * (4 + i)) << "head " << h << " row " << i;
    }
    std::vector<float> one(dim);
    PredictNextQuery(ordered, window.size(), dim, w, 1e-2, one);
    EXPECT_EQ(std::vector<float>(predicted.begin() + h * dim, predicted.begin() + (h + 1) * dim),
              one);
  }
}

TEST(QueryPredictor, RingsGiveTheWindowsPredictionPerHead) {
  // PredictQueriesFromRings, the device predictor's twin: heads at different fill levels and
  // ring positions predict what PredictNextQuery gives on their queries oldest first; a head
  // with a count or next slot outside its ring gets zeros.
  std::mt19937 rng(Seed());
  std::normal_distribution<float> normal(0.0f, 2.0f);
  const int heads = 5, capacity = 7, dim = 24, w = capacity - 1;
  std::vector<float> rings(size_t(heads) * capacity * dim);
  for (float& x : rings) x = normal(rng);
  const std::vector<int32_t> next = {0, 3, 6, 2, 7};
  const std::vector<int32_t> count = {7, 1, 4, 7, 3};  // head 4: next outside the ring
  std::vector<float> got(size_t(heads) * dim, -1.0f);
  PredictQueriesFromRings(rings, next, count, heads, capacity, dim, w, 1e-2, got);
  for (int h = 0; h < heads; ++h) {
    const std::vector<float> head_got(got.begin() + h * dim, got.begin() + (h + 1) * dim);
    if (h == 4) {
      EXPECT_EQ(head_got, std::vector<float>(dim, 0.0f));
      continue;
    }
    std::vector<float> ordered(size_t(count[h]) * dim);
    for (int i = 0; i < count[h]; ++i) {
      const int slot = ((next[h] - count[h] + i) % capacity + capacity) % capacity;
      std::copy_n(&rings[(size_t(h) * capacity + slot) * dim], dim, &ordered[size_t(i) * dim]);
    }
    std::vector<float> want(dim);
    PredictNextQuery(ordered, count[h], dim, w, 1e-2, want);
    EXPECT_EQ(head_got, want) << "head " << h;
  }
}

}  // namespace
}  // namespace rubato
