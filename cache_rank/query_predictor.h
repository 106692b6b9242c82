// AsyncSpade's next-query predictor (AsyncSpade §4.2, Eqs. 2-5, App. C), the CPU reference: from
// a window of recent queries of one query head, the assembled softmax-normalised ridge
// regression predicts the next query. For each window size k in 1..m (m = min(W, queries - 1)):
// solve the ridge least squares (H_k H_k^T + lambda I) w = H_k q_t on the k x k Gram matrix of
// the k queries before the newest (H_k rows q_{t-k}..q_{t-1}, target the newest q_t), normalise
// w by softmax, apply the weight of q_{t-i} to q_{t+1-i} (the window shifted by one step), and
// average the m candidates. Our choices where the paper is open (docs/asyncspade.md):
// lambda = ridge_lambda x the mean squared norm of H_k's rows (scale-free); the softmax of +w
// (Eq. 3; App. C's listing writes a minus); one query alone is repeated. Gram and solve in
// double, output fp32. QueryWindow keeps the last W + 1 queries of every query head.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "common/status.h"

namespace rubato {

// The ridge weights of one window size: solves (H H^T + lambda I) w = H y by Cholesky, where
// `history` is [k][dim] (rows oldest first) and `target` [dim]; lambda = ridge_lambda x the mean
// of the rows' squared norms (no rows of any norm: w = 0). Writes the raw weights (before the
// softmax) to `weights` [k].
void SolveRidgeWeights(std::span<const float> history, std::span<const float> target, int k,
                       int dim, double ridge_lambda, std::span<double> weights);

// The assembled prediction of the next query from `window` [n][dim], oldest first, the newest
// (q_t) last, n >= 1: the mean over k = 1..min(max_window, n - 1) of sum_i softmax(w^(k))_i
// q_{t+1-i}; n == 1 or max_window == 0 repeats q_t. Writes [dim] to `predicted`.
void PredictNextQuery(std::span<const float> window, int n, int dim, int max_window,
                      double ridge_lambda, std::span<float> predicted);

// Every head's prediction from its ring, the CPU twin of the device predictor
// (kernels/cuda/query_predictor.cuh, the same contract): `rings` [heads][capacity][dim], per head
// the slot the next query goes to (`next`) and the queries held (`count`, the newest at next - 1,
// cyclic); PredictNextQuery of each head's queries, oldest first, into `predicted` [heads][dim].
// A head whose count is outside [1, capacity] or next outside [0, capacity) gets zeros.
void PredictQueriesFromRings(std::span<const float> rings, std::span<const int32_t> next,
                             std::span<const int32_t> count, int heads, int capacity, int dim,
                             int max_window, double ridge_lambda, std::span<float> predicted);

// The last W + 1 queries of `heads` query heads (the newest and the W before it), a ring per
// head: [heads][W + 1][dim] fp32.
class QueryWindow {
 public:
  QueryWindow(int heads, int window, int dim);

  // Appends one query per head, [heads][dim], dropping the oldest when full.
  void Push(std::span<const float> queries);
  int size() const { return count_; }  // queries held per head, <= W + 1
  // Head `head`'s queries oldest first into `out` [size()][dim].
  void Ordered(int head, std::span<float> out) const;
  // PredictNextQuery for every head into `predicted` [heads][dim].
  void Predict(double ridge_lambda, std::span<float> predicted) const;

 private:
  int heads_, window_, dim_;
  int capacity_;             // W + 1
  int next_ = 0;             // ring slot the next Push writes
  int count_ = 0;            // queries held
  std::vector<float> ring_;  // [heads][capacity_][dim]
};

}  // namespace rubato
