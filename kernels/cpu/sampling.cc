// Greedy and filtered sampling (see sampling.h).
#include "kernels/cpu/sampling.h"

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <numeric>

namespace rubato {

int ArgMax(std::span<const float> logits) {
  int best = 0;
  bool found = false;
  for (size_t i = 0; i < logits.size(); ++i) {
    const float value = logits[i];
    if (std::isnan(value)) continue;
    if (!found || value > logits[static_cast<size_t>(best)]) {
      best = static_cast<int>(i);
      found = true;
    }
  }
  return best;
}

void FilteredDistribution(std::span<const float> logits, const SamplingFilter& filter,
                          SamplingWorkspace& workspace) {
  std::vector<int>& candidates = workspace.candidates;
  std::vector<double>& probs = workspace.probabilities;
  const int vocab = static_cast<int>(logits.size());
  candidates.resize(static_cast<size_t>(vocab));
  std::iota(candidates.begin(), candidates.end(), 0);

  // Higher logit first, lower id first among equal logits.
  const auto more_probable = [&logits](int a, int b) {
    const float la = logits[static_cast<size_t>(a)];
    const float lb = logits[static_cast<size_t>(b)];
    return la > lb || (la == lb && a < b);
  };
  int kept = vocab;
  if (filter.top_k > 0 && filter.top_k < vocab) {
    kept = filter.top_k;
    std::partial_sort(candidates.begin(), candidates.begin() + kept, candidates.end(),
                      more_probable);
  } else if (filter.top_p < 1.0f) {
    std::sort(candidates.begin(), candidates.end(), more_probable);
  }
  candidates.resize(static_cast<size_t>(kept));

  // Softmax of logits / temperature over the kept tokens, in double for the cumulative sums.
  float max_scaled = -INFINITY;
  for (int id : candidates) {
    max_scaled = std::max(max_scaled, logits[static_cast<size_t>(id)] / filter.temperature);
  }
  probs.resize(candidates.size());
  double total = 0.0;
  for (size_t i = 0; i < candidates.size(); ++i) {
    const float scaled = logits[static_cast<size_t>(candidates[i])] / filter.temperature;
    probs[i] = std::exp(static_cast<double>(scaled) - static_cast<double>(max_scaled));
    total += probs[i];
  }
  for (double& p : probs) p /= total;

  if (filter.top_p < 1.0f) {
    // Candidates are sorted here (top-k sorted its prefix, or the full sort above).
    double cumulative = 0.0;
    size_t nucleus = 0;
    while (nucleus < probs.size()) {
      cumulative += probs[nucleus++];
      if (cumulative >= static_cast<double>(filter.top_p)) break;
    }
    candidates.resize(nucleus);
    probs.resize(nucleus);
    for (double& p : probs) p /= cumulative;
  }
}

void BuildLogitDeltas(const LogitAdjustments& adjustments, std::vector<int>& sorted_generated,
                      std::vector<LogitDelta>& out) {
  if (!adjustments.active()) return;
  const size_t first = out.size();
  for (const auto& [token, bias] : adjustments.logit_bias) out.push_back({token, bias, 0.f});
  if (adjustments.presence_penalty != 0.f || adjustments.frequency_penalty != 0.f) {
    // Runs of equal ids in the sorted copy give each generated token's count.
    sorted_generated.assign(adjustments.generated.begin(), adjustments.generated.end());
    std::sort(sorted_generated.begin(), sorted_generated.end());
    for (size_t i = 0; i < sorted_generated.size();) {
      size_t end = i;
      while (end < sorted_generated.size() && sorted_generated[end] == sorted_generated[i]) ++end;
      const float count = static_cast<float>(end - i);
      out.push_back({sorted_generated[i], 0.f,
                     adjustments.frequency_penalty * count + adjustments.presence_penalty});
      i = end;
    }
  }
  // One delta per token: a biased token that was also generated merges its two entries.
  const auto begin = out.begin() + static_cast<std::ptrdiff_t>(first);
  std::stable_sort(begin, out.end(),
                   [](const LogitDelta& a, const LogitDelta& b) { return a.token < b.token; });
  size_t kept = first;
  for (size_t i = first; i < out.size(); ++i) {
    if (kept > first && out[kept - 1].token == out[i].token) {
      out[kept - 1].bias += out[i].bias;  // one of the two is 0: exact
      out[kept - 1].penalty += out[i].penalty;
    } else {
      out[kept++] = out[i];
    }
  }
  out.resize(kept);
}

void ApplyLogitDeltas(std::span<float> logits, std::span<const LogitDelta> deltas) {
  for (const LogitDelta& d : deltas) {
    float& logit = logits[static_cast<size_t>(d.token)];
    logit = (logit + d.bias) - d.penalty;
  }
}

void ApplyLogitAdjustments(std::span<float> logits, const LogitAdjustments& adjustments,
                           SamplingWorkspace& workspace) {
  if (adjustments.repetition_active()) {
    const float penalty = adjustments.repetition_penalty;
    for (const int id : adjustments.repetition_seen) {
      float& logit = logits[static_cast<size_t>(id)];
      logit = logit > 0.f ? logit / penalty : logit * penalty;
    }
  }
  workspace.deltas.clear();
  BuildLogitDeltas(adjustments, workspace.sorted_generated, workspace.deltas);
  ApplyLogitDeltas(logits, workspace.deltas);
}

double DrawUniform(std::mt19937_64& rng) { return static_cast<double>(rng() >> 11) * 0x1.0p-53; }

int SampleTokenWithUniform(std::span<const float> logits, const SamplingFilter& filter,
                           double uniform, SamplingWorkspace& workspace) {
  FilteredDistribution(logits, filter, workspace);
  double cumulative = 0.0;
  const std::vector<double>& probs = workspace.probabilities;
  for (size_t i = 0; i < probs.size(); ++i) {
    cumulative += probs[i];
    if (uniform < cumulative) return workspace.candidates[i];
  }
  // `uniform` within rounding of 1: the last candidate that can be drawn at all (never a
  // candidate of probability 0, e.g. a -inf logit kept by top-k).
  for (size_t i = probs.size(); i-- > 0;) {
    if (probs[i] > 0.0) return workspace.candidates[i];
  }
  return workspace.candidates.front();
}

float TokenProbability(std::span<const float> logits, int token) {
  float max_logit = -INFINITY;
  for (const float value : logits) {
    if (!std::isnan(value)) max_logit = std::max(max_logit, value);
  }
  const float token_logit = logits[static_cast<size_t>(token)];
  if (!std::isfinite(max_logit) || std::isnan(token_logit)) return 0.0f;
  double total = 0.0;
  for (const float value : logits) {
    if (!std::isnan(value)) total += std::exp(static_cast<double>(value) - max_logit);
  }
  return static_cast<float>(std::exp(static_cast<double>(token_logit) - max_logit) / total);
}

void ComputeTokenLogprobs(std::span<const float> logits, int token, int count,
                          std::vector<int>& order, TokenLogprobs& out) {
  float max_logit = -INFINITY;
  for (const float value : logits) max_logit = std::max(max_logit, value);
  double total = 0.0;
  for (const float value : logits) total += std::exp(static_cast<double>(value) - max_logit);
  const double log_total = std::log(total) + static_cast<double>(max_logit);
  const auto logprob = [&](int id) {
    return static_cast<float>(static_cast<double>(logits[static_cast<size_t>(id)]) - log_total);
  };
  out.logprob = logprob(token);
  out.top.clear();
  const int vocab = static_cast<int>(logits.size());
  count = std::clamp(count, 0, vocab);
  if (count == 0) return;
  order.resize(static_cast<size_t>(vocab));
  std::iota(order.begin(), order.end(), 0);
  std::partial_sort(order.begin(), order.begin() + count, order.end(), [&logits](int a, int b) {
    const float la = logits[static_cast<size_t>(a)];
    const float lb = logits[static_cast<size_t>(b)];
    return la > lb || (la == lb && a < b);
  });
  for (int i = 0; i < count; ++i)
    out.top.emplace_back(order[static_cast<size_t>(i)], logprob(order[static_cast<size_t>(i)]));
}

int SampleToken(std::span<const float> logits, const SamplingFilter& filter, std::mt19937_64& rng,
                SamplingWorkspace& workspace) {
  return SampleTokenWithUniform(logits, filter, DrawUniform(rng), workspace);
}

}  // namespace rubato
