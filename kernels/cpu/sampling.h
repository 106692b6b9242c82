// Next-token selection from one row of logits: greedy argmax, or temperature + top-k + top-p
// sampling with a caller-owned RNG.
//
// Each request owns its std::mt19937_64 (seeded from the request's seed) and every sampled
// token consumes exactly one draw (DrawUniform), so a request's tokens never depend on which
// other requests share its batch. Greedy consumes no draw. SampleTokenWithUniform is the
// deterministic part that the CUDA op (kernels/cuda/sampling.cuh) reproduces: the engine draws
// the uniform on the host and both backends pick the same token for it.
#pragma once

#include <cstdint>
#include <random>
#include <span>
#include <utility>
#include <vector>

namespace rubato {

// Index of the largest logit; the lowest index among equal maxima. NaN entries are never
// chosen unless every entry is NaN (then 0). logits.size() >= 1.
int ArgMax(std::span<const float> logits);

// Filters applied, in this order, to logits / temperature (as transformers' logits warpers):
//   top_k > 0:  keep the top_k largest (ties broken toward the lower token id); 0 = off
//   top_p < 1:  keep the smallest set of most probable tokens whose probability (after top-k)
//               sums to >= top_p; always at least one token; 1 = off
struct SamplingFilter {
  float temperature = 1.0f;  // > 0 (greedy is ArgMax, not a temperature of 0)
  int top_k = 0;
  float top_p = 1.0f;  // in (0, 1]
};

// OpenAI's logit processors, applied to the raw logits before any filter or temperature:
//   logits[t] = logits[t] > 0 ? logits[t] / rp : logits[t] * rp  for t in repetition_seen
//                                                  (rp = repetition_penalty; the CPU model only)
//   logits[t] += logit_bias[t]
//   logits[t] -= frequency_penalty * count[t] + presence_penalty * (count[t] > 0)
// where count[t] is how often t occurs among the tokens the request generated so far (the
// prompt does not count, as in OpenAI and vLLM). Greedy picks from the adjusted logits too.
struct LogitAdjustments {
  float presence_penalty = 0.f;    // [-2, 2]
  float frequency_penalty = 0.f;   // [-2, 2]
  std::span<const int> generated;  // [generated tokens] ids in [0, vocab), repeats included
  std::span<const std::pair<int, float>> logit_bias;  // (token id in [0, vocab), bias), ids unique
  // vLLM's / transformers' repetition penalty (1 = off) over the distinct ids of the prompt and
  // the output so far. Not a LogitDelta (it depends on the logit's sign): ApplyLogitAdjustments
  // applies it first; the CUDA model has no such op (the engine refuses it there).
  float repetition_penalty = 1.f;
  std::span<const int> repetition_seen;  // ids in [0, vocab), distinct

  bool repetition_active() const { return repetition_penalty != 1.f && !repetition_seen.empty(); }
  // Whether the deltas (bias, presence and frequency penalties) can change a logit.
  bool active() const {
    return !logit_bias.empty() ||
           (!generated.empty() && (presence_penalty != 0.f || frequency_penalty != 0.f));
  }
};

// LogitAdjustments as one change per touched token: logits[token] = (logits[token] + bias) -
// penalty, where penalty = frequency_penalty * count + presence_penalty (0 for an id that was
// not generated) and bias is its logit_bias (0 if none). The CUDA op (kernels/cuda/
// logit_adjust.cuh) applies the same deltas, built on the host, with the same two roundings.
struct LogitDelta {
  int32_t token = 0;
  float bias = 0.f;
  float penalty = 0.f;
};

// Reusable buffers so that sampling allocates nothing per token once warm.
struct SamplingWorkspace {
  std::vector<int> candidates;        // [<= vocab] token ids, in FilteredDistribution's order
  std::vector<double> probabilities;  // [vocab] unnormalized probabilities of the candidates
  std::vector<float> adjusted;        // [vocab] logits after LogitAdjustments
  std::vector<int> sorted_generated;  // [generated tokens] the generated ids, sorted
  std::vector<LogitDelta> deltas;     // [touched tokens] BuildLogitDeltas' output
};

// Appends the deltas of `adjustments` to `out`, one per distinct touched token, in increasing
// token order (`sorted_generated`: scratch). Appends nothing when !adjustments.active().
void BuildLogitDeltas(const LogitAdjustments& adjustments, std::vector<int>& sorted_generated,
                      std::vector<LogitDelta>& out);

// logits[d.token] = (logits[d.token] + d.bias) - d.penalty for every delta (ids in range and
// distinct). logits: [vocab].
void ApplyLogitDeltas(std::span<float> logits, std::span<const LogitDelta> deltas);

// The repetition penalty, then the bias and the presence and frequency penalties, in place (see
// LogitAdjustments): BuildLogitDeltas, then ApplyLogitDeltas. logits: [vocab].
void ApplyLogitAdjustments(std::span<float> logits, const LogitAdjustments& adjustments,
                           SamplingWorkspace& workspace);

// One 53-bit uniform in [0, 1) from one draw of `rng`, independent of the standard library's
// distribution implementations (so every platform and backend sees the same value).
double DrawUniform(std::mt19937_64& rng);

// The token that `uniform` (in [0, 1)) selects from softmax(filtered logits / temperature):
// the first candidate, in FilteredDistribution's order, whose cumulative probability exceeds
// `uniform`. If rounding leaves `uniform` at or above the last cumulative value, the last
// candidate with a positive probability. logits: [vocab], f32, no NaN, at least one finite entry
// (-inf entries are never chosen). Filter values must be valid (the engine validates requests).
int SampleTokenWithUniform(std::span<const float> logits, const SamplingFilter& filter,
                           double uniform, SamplingWorkspace& workspace);

// softmax(logits)[token] at temperature 1, whatever filter picked the token: the model's own
// confidence in it (SFI's confidence trigger, sfi_config.h). Max and sum over the non-NaN
// entries, the sum in double. 0 when logits[token] is NaN or -inf, or when the largest logit is
// not finite (no finite entry, or +inf: outside the sampling contract). token in [0, size).
float TokenProbability(std::span<const float> logits, int token);

// What a request that asked for logprobs gets with each token (OpenAI's logprobs): log-softmax
// of the model's logits at temperature 1, before any logit processor, temperature, top-k or
// top-p (vLLM's default "raw_logprobs"). `top`: the `count` most likely ids, most likely first
// (lower id first on equal logprobs).
struct TokenLogprobs {
  float logprob = 0.f;                     // of the sampled token
  std::vector<std::pair<int, float>> top;  // (token id, logprob)
};

// Fills `out` for `token` from one row of logits (no NaN; -inf entries get -inf). count in
// [0, vocab]; `order`: scratch.
void ComputeTokenLogprobs(std::span<const float> logits, int token, int count,
                          std::vector<int>& order, TokenLogprobs& out);

// SampleTokenWithUniform with DrawUniform(rng): consumes exactly one draw of `rng`.
int SampleToken(std::span<const float> logits, const SamplingFilter& filter, std::mt19937_64& rng,
                SamplingWorkspace& workspace);

// The candidate set SampleTokenWithUniform walks, with normalized probabilities. Order: when
// top-k or top-p is active, decreasing probability (higher logit first, lower id first on equal
// logits); with neither filter, plain token id order (no sort: the walk over ids picks from the
// same distribution). Exposed for tests and for callers that report top alternatives.
void FilteredDistribution(std::span<const float> logits, const SamplingFilter& filter,
                          SamplingWorkspace& workspace);

}  // namespace rubato
