// SFI Selector, CPU reference (papers/sfi-slow-fast-inference.txt §3.2–3.3, Eqs. 6–24;
// DESIGN.md §4.2). At a slow step the dense attention emits logits over the allowed key set
// J = [j_begin, j_begin + n); the Selector turns them into K positions per KV head, the
// selected set that fast steps attend (with sink and recent tokens) until the next slow step.
//
// Pipeline, per layer (n = |J|, H KV heads, G query heads per KV head, W query rows):
//   A. per KV head h, continuous importance on J:
//      1. Eq. 6   p_{w,q}(j) = softmax_J(logits[w][q][·])(j) for each query head q of the group
//                 (max subtracted); GQA pooling: p_w(j) = (1/G) Σ_q p_{w,q}(j) (DESIGN §4.2).
//      2. Eq. 7   μ(j) = (1/W) Σ_w p_w(j)^α.
//      3. Eq. 8   f(j) = μ(j)^{1/α} / Σ_i μ(i)^{1/α}.
//      4. Eqs. 9–12 prior r(j) ∝ (‖k_h(j)‖ + ε)^{−γ} · exp(−β u(j)^p) · (1 − u(j) + ε)^η with
//                 u(j) = (j − j_min) / (j_max − j_min + ε), j_min / j_max the ends of J.
//      5. Eq. 18  λ* = clip((‖f‖² − fᵀr) / (‖f‖² − 2fᵀr + ‖r‖²), 0, λ_clip);
//         Eq. 15  s = (1 − λ*) f + λ* r.
//      6. Eq. 19  z(j) = log(s(j) + ε).
//   B. discretization in log-score space:
//      7. Eqs. 20–21 soft-NMS: m(j) = max_{i ∈ N(j)} z(i), z_nms = z − α_soft [m − z]_+.
//      8. Eqs. 22–23 cross-head exclusivity at each position j over the H KV heads:
//                 r_h(j) = softmax_h(z_nms(j) / T), z_adj = z_nms + α_cross log(max(r_h, ε)).
//      9. Eq. 24  S_h = top-K of z_adj_h over J, returned as ascending absolute positions.
//   C. continuation (ours, beyond the paper; docs/sfi.md "Continuation"; off with
//      continuation = 0): positions a with f_h(a) >= continuation_threshold are *anchors*; the
//      anchors and the `continuation` positions after each (a .. a + C, clipped to J) enter S_h
//      before any other position, ordered by c_h(j) = max f_h(a) over the anchors that reach j
//      (stronger anchors first when they alone exceed K); the rest of the budget is Eq. 24's
//      top-K of z_adj over the other positions. Why: a head that attends a at the slow step is
//      likely to attend a + 1, a + 2, ... during the following fast steps when it copies a span
//      (induction / retrieval heads), and nothing in the slow step's evidence ranks those
//      positions; soft-NMS even pushes them down as neighbours of a.
//
// Choices the paper leaves open (ours; the GPU pipeline must make the same ones):
//   * Soft-NMS neighbourhood: N(j) = { i ∈ J : |i − j| <= nms_window / 2 } (integer division),
//     symmetric and clipped at the ends of J: 2·⌊nms_window/2⌋ + 1 positions away from the ends
//     (windows 2k and 2k + 1 act alike); nms_window = 1 makes soft-NMS a no-op. m uses the
//     pre-NMS z of every neighbour (the decay is not applied sequentially). O(n) per head with
//     a monotonic-deque sliding maximum.
//   * Top-K ties: higher z_adj first; equal scores → the lower position first. K >= n selects
//     all of J.
//   * ε is the one config.epsilon everywhere the paper writes ε or ϵ (Eqs. 9, 10, 11, 19, 23).
//   * λ* when f == r (zero denominator): 0. Numerator and denominator are evaluated as
//     fᵀ(f − r) and ‖f − r‖² (the same values as Eq. 18's expansion, without its cancellation,
//     so the denominator is never negative).
//   * Overflow-safe forms of the paper's quantities, equal in exact arithmetic: Eq. 8 divides μ
//     by its maximum before the 1/α power (μ^{1/α} underflows for small α), and the prior is
//     built as a sum of logs, max-subtracted, then exponentiated and normalized (with γ > 0 and
//     near-zero norms (‖k‖ + ε)^{−γ} overflows). γ = 0 skips the key-norm factor entirely.
//   * Logits may contain −inf (probability 0; e.g. a position masked inside J) but no NaN or
//     +inf, and every (row, query head) needs one finite logit; key norms (read only when
//     γ > 0) must be finite and >= 0. Anything else is InvalidArgument, never a crash.
//   * Computation is in double throughout (this is the reference the float GPU pipeline is
//     compared against); the scores z_adj are exposed for that comparison (ComputeSfiScores).
#pragma once

#include <cmath>
#include <span>
#include <vector>

#include "common/status.h"

namespace rubato {

struct SfiSelectorConfig {             // DESIGN §4.2 defaults
  int budget = 2048;                   // K: positions selected per KV head, >= 1
  double alpha = 0.5;                  // power-mean exponent, (0, 1]
  double gamma = 0.0;                  // key-norm prior exponent, >= 0
  double beta = -std::log(0.6) / 0.9;  // position decay strength, >= 0 (exp(−0.9β) = 0.6)
  double p = 1.8;                      // position decay curvature, >= 1
  double eta = 0.4;                    // tail brake, >= 0
  double lambda_clip = 0.02;           // upper clip of λ*, [0, 1]
  double epsilon = 1e-8;               // > 0
  int nms_window = 32;                 // soft-NMS neighbourhood width in positions, >= 1
  double alpha_soft = 0.5;             // soft-NMS strength, >= 0
  double alpha_cross = 0.35;           // cross-head exclusivity strength, >= 0
  double temperature = 2.0;            // T of the cross-head softmax, > 0
  // Ours, beyond the paper (stage C above): positions kept after each anchor, >= 0; 0 turns the
  // stage off (the paper's Eq. 24 exactly).
  int continuation = 8;
  double continuation_threshold = 0.01;  // f_h(a) that makes a an anchor, (0, 1]
};

// InvalidArgument naming the field and its range ("SfiSelectorConfig.alpha = 1.5 is outside
// (0, 1]") for the first bad field; NaN and infinities are out of range everywhere.
Status ValidateSfiSelectorConfig(const SfiSelectorConfig& config);

struct SfiSelectorInput {
  int num_kv_heads = 0;  // H >= 1
  int group = 0;         // query heads per KV head (GQA) >= 1, 1..8 typical
  int window = 0;        // W >= 1 query rows (1 in decode, up to 16 after prefill)
  int j_begin = 0;       // the allowed set J = [j_begin, j_begin + j_count) of key positions,
  int j_count = 0;       // j_begin >= 0, j_count >= 0, j_begin + j_count <= INT_MAX
  // [window][num_kv_heads * group][j_count], f32: attention logits (scale * q.k, natural-log
  // units) of query row w of query head kv_head * group + g over J (query head h reads KV head
  // h / group). May be null when j_count == 0.
  const float* logits = nullptr;
  // [num_kv_heads][j_count], f32: L2 norm of the cached key at position j_begin + j; read only
  // when gamma > 0 (may be null otherwise).
  const float* key_norms = nullptr;
};

// The continuous outputs of the pipeline, for diagnostics and for comparing the GPU pipeline.
struct SfiScores {
  std::vector<double> z_adj;        // [num_kv_heads][j_count]: Eq. 23 scores that Top-K ranks
  std::vector<double> lambda_star;  // [num_kv_heads]: Eq. 18 λ* of each KV head
  // [num_kv_heads][j_count]: stage C's c_h(j) (> 0: j enters S_h before every position with 0),
  // all 0 when config.continuation == 0.
  std::vector<double> continuation;
};

// Steps 1–8 of the pipeline. On error `scores` is left unspecified.
Status ComputeSfiScores(const SfiSelectorConfig& config, const SfiSelectorInput& input,
                        SfiScores& scores);

// selected[h]: the positions (absolute, ascending) chosen for KV head h; min(budget, j_count)
// of them. j_count == 0 gives num_kv_heads empty lists. InvalidArgument for bad shapes, null
// pointers, non-finite inputs (see above) or a bad config; `selected` is written only on
// success.
Status SelectSfi(const SfiSelectorConfig& config, const SfiSelectorInput& input,
                 std::vector<std::vector<int>>& selected);

// Eq. 18: λ* = clip((‖f‖² − fᵀr) / (‖f‖² − 2fᵀr + ‖r‖²), 0, lambda_clip), 0 when f == r.
// f, r: [n] distributions on J (f.size() == r.size(); extra entries of the longer are ignored).
double SfiLambdaStar(std::span<const double> f, std::span<const double> r, double lambda_clip);

// Eq. 24 for one head, with stage C's priorities: the positions j_begin + i of the
// min(budget, n) best i, ascending, where i beats i' when priority[i] > priority[i'] (stage C's
// c_h; pass all zeros, or an empty span, for the paper's Eq. 24), else when the priorities are
// equal and scores[i] > scores[i'], else when i < i'. scores: [n], no NaN; priority: [n] or
// empty; budget >= 0.
std::vector<int> SfiTopKPositions(std::span<const double> scores, std::span<const double> priority,
                                  int budget, int j_begin);

}  // namespace rubato
