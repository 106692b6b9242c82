// SFI Selector, CPU reference (the SFI paper §3.2–3.3, Eqs. 6–24, and our
// stage C "continuation"): at a slow step, turns the dense attention's logits over the allowed
// key set J = [j_begin, j_begin + n) into K positions per KV head, ascending: the selected set
// that fast steps attend (with sink and recent tokens) until the next slow step. Stage A: the
// evidence f, the prior r, λ* and z (Eqs. 6–19); B: soft-NMS, cross-head exclusivity, top-K
// (Eqs. 20–24); C: anchors and the positions after them first. In double; ComputeSfiScores
// exposes z_adj for the GPU twin's comparison. Logits may hold −inf but no NaN or +inf; bad
// input is InvalidArgument, never a crash.
// Narrative (the pipeline, every choice the paper leaves open, which the GPU pipeline makes
// too): docs/sfi.md "The Selector, CPU reference".
#pragma once

#include <cmath>
#include <span>
#include <vector>

#include "common/status.h"

namespace rubato {

struct SfiSelectorConfig {             // docs/design.md §4.2 defaults
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
