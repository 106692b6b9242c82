// SFI Selector CPU reference (sfi_selector.h; the pipeline and its choices: docs/sfi.md).
#include "inference_rank/policies/sfi/kernels/sfi_selector.h"

#include <algorithm>
#include <cassert>
#include <climits>
#include <cmath>
#include <cstddef>
#include <numeric>
#include <sstream>
#include <string>
#include <utility>

namespace rubato {
namespace {

// "SfiSelectorConfig.<name> = <value> is outside <range>".
Status ConfigRangeError(const char* name, double value, const char* range) {
  std::ostringstream message;
  message << "SfiSelectorConfig." << name << " = " << value << " is outside " << range;
  return InvalidArgumentError(message.str());
}

Status InputError(const std::string& what) {
  return InvalidArgumentError("SfiSelectorInput." + what);
}

Status ValidateInput(const SfiSelectorInput& input, bool needs_key_norms) {
  if (input.num_kv_heads < 1) {
    return InputError("num_kv_heads = " + std::to_string(input.num_kv_heads) + " must be >= 1");
  }
  if (input.group < 1) {
    return InputError("group = " + std::to_string(input.group) + " must be >= 1");
  }
  if (input.window < 1) {
    return InputError("window = " + std::to_string(input.window) + " must be >= 1");
  }
  if (input.j_begin < 0) {
    return InputError("j_begin = " + std::to_string(input.j_begin) + " must be >= 0");
  }
  if (input.j_count < 0) {
    return InputError("j_count = " + std::to_string(input.j_count) + " must be >= 0");
  }
  if (input.j_count > INT_MAX - input.j_begin) {
    return InputError("j_begin + j_count = " +
                      std::to_string(static_cast<long long>(input.j_begin) + input.j_count) +
                      " exceeds the largest int position");
  }
  if (input.j_count == 0) return Status::Ok();
  if (input.logits == nullptr) return InputError("logits is null with j_count > 0");
  if (needs_key_norms && input.key_norms == nullptr) {
    return InputError("key_norms is null but SfiSelectorConfig.gamma > 0 needs them");
  }
  return Status::Ok();
}

// Per-layer scratch, allocated once per call; every vector is [n] (n = |J|).
struct SfiScratch {
  std::vector<double> exps;    // [n] exp(logit - row max) of one (query row, query head)
  std::vector<double> pooled;  // [n] p_w(j): the group-averaged softmax of one query row
  std::vector<double> mu;      // [n] Eq. 7 μ(j)
  std::vector<double> f;       // [n] Eq. 8 evidence distribution
  std::vector<double> r;       // [n] Eq. 12 prior distribution
  std::vector<double> z;       // [n] Eq. 19 pre-NMS log-score of the current head
  std::vector<int> deque;      // [n] ring of candidate indices for the sliding maximum
};

// Stage C for one head: continuation[j] = max f[a] over the anchors a (f[a] >= threshold) with
// a <= j <= a + config.continuation, else 0. A monotonic deque of anchors (f decreasing) holds
// the ones still in reach: O(n).
void ContinuationPriority(const SfiSelectorConfig& config, std::span<const double> f,
                          std::vector<int>& deque, std::span<double> continuation) {
  const int n = static_cast<int>(f.size());
  const int reach = config.continuation;
  int front = 0;
  int back = 0;
  for (int j = 0; j < n; ++j) {
    if (reach > 0 && f[j] >= config.continuation_threshold) {
      while (back > front && f[deque[back - 1]] <= f[j]) --back;
      deque[back++] = j;
    }
    while (back > front && deque[front] < j - reach) ++front;
    continuation[j] = back > front ? f[deque[front]] : 0.0;
  }
}

// Eqs. 6–8 for KV head h: scratch.f. InvalidArgument for NaN / +inf logits or a row of -inf.
Status EvidenceDistribution(const SfiSelectorConfig& config, const SfiSelectorInput& input, int h,
                            SfiScratch& scratch) {
  const size_t n = static_cast<size_t>(input.j_count);
  const size_t heads = static_cast<size_t>(input.num_kv_heads) * input.group;
  std::vector<double>& exps = scratch.exps;
  std::vector<double>& pooled = scratch.pooled;
  std::vector<double>& mu = scratch.mu;
  std::fill(mu.begin(), mu.end(), 0.0);
  const double inv_window = 1.0 / input.window;
  for (int w = 0; w < input.window; ++w) {
    std::fill(pooled.begin(), pooled.end(), 0.0);
    for (int g = 0; g < input.group; ++g) {
      const size_t q = static_cast<size_t>(h) * input.group + g;
      // [n] f32: logits of query row w, query head q.
      const float* row = input.logits + (static_cast<size_t>(w) * heads + q) * n;
      double row_max = -INFINITY;
      for (size_t j = 0; j < n; ++j) {
        const float value = row[j];
        if (std::isnan(value) || value == INFINITY) {
          return InputError("logits[" + std::to_string(w) + "][" + std::to_string(q) + "][" +
                            std::to_string(j) + "] is " + (std::isnan(value) ? "NaN" : "+inf") +
                            " (finite or -inf expected)");
        }
        row_max = std::max(row_max, static_cast<double>(value));
      }
      if (row_max == -INFINITY) {
        return InputError("logits[" + std::to_string(w) + "][" + std::to_string(q) +
                          "] is -inf at every position of J (no attention distribution)");
      }
      double sum = 0.0;
      for (size_t j = 0; j < n; ++j) {
        exps[j] = std::exp(static_cast<double>(row[j]) - row_max);
        sum += exps[j];
      }
      // Eq. 6 divides by the row sum; pooling averages over the group's G query heads.
      const double row_scale = 1.0 / (sum * input.group);
      for (size_t j = 0; j < n; ++j) pooled[j] += exps[j] * row_scale;
    }
    for (size_t j = 0; j < n; ++j) mu[j] += std::pow(pooled[j], config.alpha) * inv_window;
  }
  // Eq. 8, with μ scaled by 1 / max μ first (the normalization cancels the scale; it keeps
  // μ^{1/α} from underflowing to an all-zero vector when α is small). max μ > 0: every row has
  // a finite maximum, whose probability is >= 1/n.
  const double mu_max = *std::max_element(mu.begin(), mu.end());
  const double inv_alpha = 1.0 / config.alpha;
  double total = 0.0;
  for (size_t j = 0; j < n; ++j) {
    scratch.f[j] = std::pow(mu[j] / mu_max, inv_alpha);
    total += scratch.f[j];
  }
  for (size_t j = 0; j < n; ++j) scratch.f[j] /= total;
  return Status::Ok();
}

// Eqs. 9–12 for KV head h: scratch.r. InvalidArgument for a negative or non-finite key norm.
Status PriorDistribution(const SfiSelectorConfig& config, const SfiSelectorInput& input, int h,
                         SfiScratch& scratch) {
  const size_t n = static_cast<size_t>(input.j_count);
  std::vector<double>& r = scratch.r;
  const double eps = config.epsilon;
  // j_max - j_min = n - 1; the position factor depends on j only through u(j).
  const double span = static_cast<double>(n - 1) + eps;
  // [n] f32: key norms of KV head h over J (null when gamma == 0).
  const float* norms = config.gamma > 0.0 ? input.key_norms + static_cast<size_t>(h) * n : nullptr;
  double log_max = -INFINITY;
  for (size_t j = 0; j < n; ++j) {
    const double u = static_cast<double>(j) / span;
    double log_prior = -config.beta * std::pow(u, config.p) + config.eta * std::log(1.0 - u + eps);
    if (norms != nullptr) {
      const float norm = norms[j];
      if (!(norm >= 0.0f) || norm == INFINITY) {
        return InputError("key_norms[" + std::to_string(h) + "][" + std::to_string(j) +
                          "] = " + std::to_string(norm) + " (a finite norm >= 0 expected)");
      }
      log_prior -= config.gamma * std::log(static_cast<double>(norm) + eps);
    }
    r[j] = log_prior;
    log_max = std::max(log_max, log_prior);
  }
  double total = 0.0;
  for (size_t j = 0; j < n; ++j) {
    r[j] = std::exp(r[j] - log_max);
    total += r[j];
  }
  for (size_t j = 0; j < n; ++j) r[j] /= total;
  return Status::Ok();
}

// Eqs. 20–21: z_nms[j] = z[j] - alpha_soft * (max of z over [j - half, j + half] ∩ [0, n) - z[j]).
// A monotonic deque of indices with decreasing z gives every window maximum in O(n) total.
void SoftNms(std::span<const double> z, int half, double alpha_soft, std::vector<int>& deque,
             std::span<double> z_nms) {
  const int n = static_cast<int>(z.size());
  int front = 0;  // deque[front, back): indices, z strictly decreasing from front to back
  int back = 0;
  int next = 0;  // the next index to enter the window
  for (int j = 0; j < n; ++j) {
    const int last = std::min(n - 1, j + half);
    for (; next <= last; ++next) {
      while (back > front && z[deque[back - 1]] <= z[next]) --back;
      deque[back++] = next;
    }
    while (deque[front] < j - half) ++front;
    const double m = z[deque[front]];
    z_nms[j] = z[j] - alpha_soft * std::max(m - z[j], 0.0);
  }
}

// Eqs. 22–23 in place over scores [H][n] (z_nms in, z_adj out), one position at a time.
void CrossHeadExclusivity(const SfiSelectorConfig& config, int num_heads, size_t n,
                          std::vector<double>& scores) {
  std::vector<double> weight(static_cast<size_t>(num_heads));  // [H] exp((z_h - max) / T)
  for (size_t j = 0; j < n; ++j) {
    double scaled_max = -INFINITY;
    for (int h = 0; h < num_heads; ++h) {
      scaled_max = std::max(scaled_max, scores[h * n + j] / config.temperature);
    }
    double total = 0.0;
    for (int h = 0; h < num_heads; ++h) {
      weight[h] = std::exp(scores[h * n + j] / config.temperature - scaled_max);
      total += weight[h];
    }
    for (int h = 0; h < num_heads; ++h) {
      const double responsibility = weight[h] / total;
      scores[h * n + j] += config.alpha_cross * std::log(std::max(responsibility, config.epsilon));
    }
  }
}

}  // namespace

Status ValidateSfiSelectorConfig(const SfiSelectorConfig& c) {
  const auto finite = [](double x) { return std::isfinite(x); };
  if (c.budget < 1) return ConfigRangeError("budget", c.budget, "[1, inf)");
  if (!(finite(c.alpha) && c.alpha > 0.0 && c.alpha <= 1.0)) {
    return ConfigRangeError("alpha", c.alpha, "(0, 1]");
  }
  if (!(finite(c.gamma) && c.gamma >= 0.0)) return ConfigRangeError("gamma", c.gamma, "[0, inf)");
  if (!(finite(c.beta) && c.beta >= 0.0)) return ConfigRangeError("beta", c.beta, "[0, inf)");
  if (!(finite(c.p) && c.p >= 1.0)) return ConfigRangeError("p", c.p, "[1, inf)");
  if (!(finite(c.eta) && c.eta >= 0.0)) return ConfigRangeError("eta", c.eta, "[0, inf)");
  if (!(c.lambda_clip >= 0.0 && c.lambda_clip <= 1.0)) {
    return ConfigRangeError("lambda_clip", c.lambda_clip, "[0, 1]");
  }
  if (!(finite(c.epsilon) && c.epsilon > 0.0)) {
    return ConfigRangeError("epsilon", c.epsilon, "(0, inf)");
  }
  if (c.nms_window < 1) return ConfigRangeError("nms_window", c.nms_window, "[1, inf)");
  if (!(finite(c.alpha_soft) && c.alpha_soft >= 0.0)) {
    return ConfigRangeError("alpha_soft", c.alpha_soft, "[0, inf)");
  }
  if (!(finite(c.alpha_cross) && c.alpha_cross >= 0.0)) {
    return ConfigRangeError("alpha_cross", c.alpha_cross, "[0, inf)");
  }
  if (!(finite(c.temperature) && c.temperature > 0.0)) {
    return ConfigRangeError("temperature", c.temperature, "(0, inf)");
  }
  if (c.continuation < 0) return ConfigRangeError("continuation", c.continuation, "[0, inf)");
  if (!(c.continuation_threshold > 0.0 && c.continuation_threshold <= 1.0)) {
    return ConfigRangeError("continuation_threshold", c.continuation_threshold, "(0, 1]");
  }
  return Status::Ok();
}

double SfiLambdaStar(std::span<const double> f, std::span<const double> r, double lambda_clip) {
  assert(f.size() == r.size());
  const size_t n = std::min(f.size(), r.size());
  // ‖f‖² − fᵀr = fᵀ(f − r) and ‖f‖² − 2fᵀr + ‖r‖² = ‖f − r‖².
  double numerator = 0.0;
  double denominator = 0.0;
  for (size_t j = 0; j < n; ++j) {
    const double diff = f[j] - r[j];
    numerator += f[j] * diff;
    denominator += diff * diff;
  }
  if (denominator == 0.0) return 0.0;  // f == r: every λ gives the same s
  return std::min(std::max(numerator / denominator, 0.0), lambda_clip);
}

std::vector<int> SfiTopKPositions(std::span<const double> scores, std::span<const double> priority,
                                  int budget, int j_begin) {
  const int n = static_cast<int>(scores.size());
  assert(priority.empty() || priority.size() == scores.size());
  const int k = std::clamp(budget, 0, n);
  std::vector<int> order(static_cast<size_t>(n));  // [n] local indices, best k first
  std::iota(order.begin(), order.end(), 0);
  if (k < n) {
    // Higher priority first, then higher score, then the lower position (a strict total order).
    const auto rank = [&](int i) { return priority.empty() ? 0.0 : priority[i]; };
    const auto better = [&](int a, int b) {
      if (rank(a) != rank(b)) return rank(a) > rank(b);
      return scores[a] > scores[b] || (scores[a] == scores[b] && a < b);
    };
    std::nth_element(order.begin(), order.begin() + k, order.end(), better);
    order.resize(static_cast<size_t>(k));
    std::sort(order.begin(), order.end());
  }
  for (int& index : order) index += j_begin;
  return order;
}

Status ComputeSfiScores(const SfiSelectorConfig& config, const SfiSelectorInput& input,
                        SfiScores& scores) {
  RUBATO_RETURN_IF_ERROR(ValidateSfiSelectorConfig(config));
  RUBATO_RETURN_IF_ERROR(ValidateInput(input, config.gamma > 0.0));
  const int num_heads = input.num_kv_heads;
  const size_t n = static_cast<size_t>(input.j_count);
  scores.z_adj.assign(static_cast<size_t>(num_heads) * n, 0.0);
  scores.lambda_star.assign(static_cast<size_t>(num_heads), 0.0);
  scores.continuation.assign(static_cast<size_t>(num_heads) * n, 0.0);
  if (n == 0) return Status::Ok();

  SfiScratch scratch;
  for (std::vector<double>* v :
       {&scratch.exps, &scratch.pooled, &scratch.mu, &scratch.f, &scratch.r, &scratch.z}) {
    v->resize(n);
  }
  scratch.deque.resize(n);
  const int half = config.nms_window / 2;
  for (int h = 0; h < num_heads; ++h) {
    RUBATO_RETURN_IF_ERROR(EvidenceDistribution(config, input, h, scratch));
    ContinuationPriority(config, scratch.f, scratch.deque,
                         std::span<double>(scores.continuation).subspan(static_cast<size_t>(h) * n, n));
    RUBATO_RETURN_IF_ERROR(PriorDistribution(config, input, h, scratch));
    const double lambda = SfiLambdaStar(scratch.f, scratch.r, config.lambda_clip);
    scores.lambda_star[h] = lambda;
    for (size_t j = 0; j < n; ++j) {
      const double s = (1.0 - lambda) * scratch.f[j] + lambda * scratch.r[j];  // Eq. 15
      scratch.z[j] = std::log(s + config.epsilon);                             // Eq. 19
    }
    SoftNms(scratch.z, half, config.alpha_soft, scratch.deque,
            std::span<double>(scores.z_adj).subspan(static_cast<size_t>(h) * n, n));
  }
  CrossHeadExclusivity(config, num_heads, n, scores.z_adj);
  return Status::Ok();
}

Status SelectSfi(const SfiSelectorConfig& config, const SfiSelectorInput& input,
                 std::vector<std::vector<int>>& selected) {
  SfiScores scores;
  RUBATO_RETURN_IF_ERROR(ComputeSfiScores(config, input, scores));
  const size_t n = static_cast<size_t>(input.j_count);
  std::vector<std::vector<int>> result(static_cast<size_t>(input.num_kv_heads));
  for (size_t h = 0; h < result.size(); ++h) {
    result[h] = SfiTopKPositions(std::span<const double>(scores.z_adj).subspan(h * n, n),
                                 std::span<const double>(scores.continuation).subspan(h * n, n),
                                 config.budget, input.j_begin);
  }
  selected = std::move(result);
  return Status::Ok();
}

}  // namespace rubato
