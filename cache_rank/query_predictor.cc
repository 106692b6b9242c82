// The assembled ridge-regression query predictor (see query_predictor.h).
#include "cache_rank/query_predictor.h"

#include <algorithm>
#include <cmath>
#include <cstring>

namespace rubato {
namespace {

// Solves A x = b for a symmetric positive definite `a` [n][n] (overwritten by its Cholesky
// factor), in place in `b`.
void CholeskySolve(std::vector<double>& a, std::span<double> b, int n) {
  for (int j = 0; j < n; ++j) {
    double d = a[j * n + j];
    for (int p = 0; p < j; ++p) d -= a[j * n + p] * a[j * n + p];
    // H H^T + lambda I with lambda > 0 is positive definite; the guard keeps a degenerate
    // window (rounding at a lambda far below the rows' norms) from dividing by zero.
    const double root = std::sqrt(std::max(d, 1e-300));
    a[j * n + j] = root;
    for (int i = j + 1; i < n; ++i) {
      double s = a[i * n + j];
      for (int p = 0; p < j; ++p) s -= a[i * n + p] * a[j * n + p];
      a[i * n + j] = s / root;
    }
  }
  for (int i = 0; i < n; ++i) {  // L y = b
    double s = b[i];
    for (int p = 0; p < i; ++p) s -= a[i * n + p] * b[p];
    b[i] = s / a[i * n + i];
  }
  for (int i = n - 1; i >= 0; --i) {  // L^T x = y
    double s = b[i];
    for (int p = i + 1; p < n; ++p) s -= a[p * n + i] * b[p];
    b[i] = s / a[i * n + i];
  }
}

double DotD(const float* x, const float* y, int dim) {
  double s = 0.0;
  for (int d = 0; d < dim; ++d) s += static_cast<double>(x[d]) * y[d];
  return s;
}

}  // namespace

void SolveRidgeWeights(std::span<const float> history, std::span<const float> target, int k,
                       int dim, double ridge_lambda, std::span<double> weights) {
  std::vector<double> gram(static_cast<size_t>(k) * k);
  double trace = 0.0;
  for (int i = 0; i < k; ++i) {
    for (int j = 0; j <= i; ++j) {
      const double g = DotD(&history[size_t(i) * dim], &history[size_t(j) * dim], dim);
      gram[i * k + j] = gram[j * k + i] = g;
    }
    trace += gram[i * k + i];
    weights[i] = DotD(&history[size_t(i) * dim], target.data(), dim);
  }
  if (trace <= 0.0) {  // every row zero: no evidence, equal weights
    std::fill(weights.begin(), weights.begin() + k, 0.0);
    return;
  }
  const double lambda = ridge_lambda * trace / k;
  for (int i = 0; i < k; ++i) gram[i * k + i] += lambda;
  CholeskySolve(gram, weights.first(static_cast<size_t>(k)), k);
}

void PredictNextQuery(std::span<const float> window, int n, int dim, int max_window,
                      double ridge_lambda, std::span<float> predicted) {
  const float* newest = &window[size_t(n - 1) * dim];
  const int m = std::min(max_window, n - 1);
  if (m <= 0) {
    std::memcpy(predicted.data(), newest, size_t(dim) * sizeof(float));
    return;
  }
  std::vector<double> sum(static_cast<size_t>(dim), 0.0);
  std::vector<double> w(static_cast<size_t>(m));
  for (int k = 1; k <= m; ++k) {
    // H_k: the k queries before the newest, q_{t-k}..q_{t-1}, rows n-1-k .. n-2.
    const std::span<const float> history = window.subspan(size_t(n - 1 - k) * dim, size_t(k) * dim);
    SolveRidgeWeights(history, window.subspan(size_t(n - 1) * dim, size_t(dim)), k, dim,
                      ridge_lambda, w);
    double top = w[0];
    for (int i = 1; i < k; ++i) top = std::max(top, w[i]);
    double z = 0.0;
    for (int i = 0; i < k; ++i) z += (w[i] = std::exp(w[i] - top));
    // Row r of H_k (query q_{t-k+r}) weighs the query one step later: window row n-k+r.
    for (int r = 0; r < k; ++r) {
      const double weight = w[r] / z;
      const float* shifted = &window[size_t(n - k + r) * dim];
      for (int d = 0; d < dim; ++d) sum[d] += weight * shifted[d];
    }
  }
  for (int d = 0; d < dim; ++d) predicted[d] = static_cast<float>(sum[d] / m);
}

void PredictQueriesFromRings(std::span<const float> rings, std::span<const int32_t> next,
                             std::span<const int32_t> count, int heads, int capacity, int dim,
                             int max_window, double ridge_lambda, std::span<float> predicted) {
  std::vector<float> ordered;
  for (int h = 0; h < heads; ++h) {
    const std::span<float> out = predicted.subspan(size_t(h) * dim, size_t(dim));
    const int n = count[h];
    if (n < 1 || n > capacity || next[h] < 0 || next[h] >= capacity) {
      std::fill(out.begin(), out.end(), 0.0f);
      continue;
    }
    ordered.resize(size_t(n) * dim);
    for (int i = 0; i < n; ++i) {
      const int slot = (next[h] - n + i + 2 * capacity) % capacity;
      std::memcpy(&ordered[size_t(i) * dim], &rings[(size_t(h) * capacity + slot) * dim],
                  size_t(dim) * sizeof(float));
    }
    PredictNextQuery(ordered, n, dim, max_window, ridge_lambda, out);
  }
}

QueryWindow::QueryWindow(int heads, int window, int dim)
    : heads_(heads), window_(window), dim_(dim), capacity_(window + 1) {
  ring_.assign(size_t(heads) * capacity_ * dim, 0.0f);
}

void QueryWindow::Push(std::span<const float> queries) {
  for (int h = 0; h < heads_; ++h) {
    std::memcpy(&ring_[(size_t(h) * capacity_ + next_) * dim_], &queries[size_t(h) * dim_],
                size_t(dim_) * sizeof(float));
  }
  next_ = (next_ + 1) % capacity_;
  count_ = std::min(count_ + 1, capacity_);
}

void QueryWindow::Ordered(int head, std::span<float> out) const {
  const int oldest = (next_ - count_ + capacity_) % capacity_;
  for (int i = 0; i < count_; ++i) {
    const int slot = (oldest + i) % capacity_;
    std::memcpy(&out[size_t(i) * dim_], &ring_[(size_t(head) * capacity_ + slot) * dim_],
                size_t(dim_) * sizeof(float));
  }
}

void QueryWindow::Predict(double ridge_lambda, std::span<float> predicted) const {
  std::vector<float> ordered(size_t(count_) * dim_);
  for (int h = 0; h < heads_; ++h) {
    Ordered(h, ordered);
    PredictNextQuery(ordered, count_, dim_, window_, ridge_lambda,
                     predicted.subspan(size_t(h) * dim_, size_t(dim_)));
  }
}

}  // namespace rubato
