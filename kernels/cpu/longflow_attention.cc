// LongFlow's fused decode attention and eviction choice, CPU reference (longflow_attention.h).
#include "kernels/cpu/longflow_attention.h"

#include <algorithm>
#include <cmath>
#include <string>

#include "kernels/cpu/dot.h"

namespace rubato {
namespace {

Status Invalid(const std::string& message) {
  return InvalidArgumentError("longflow attention: " + message);
}

}  // namespace

Status ValidateLongFlowAttention(const LongFlowAttentionArgs& a) {
  if (a.num_kv_heads <= 0 || a.head_dim <= 0 || a.budget <= 0) {
    return Invalid("num_kv_heads, head_dim and budget must be positive (got " +
                   std::to_string(a.num_kv_heads) + ", " + std::to_string(a.head_dim) + ", " +
                   std::to_string(a.budget) + ")");
  }
  if (a.num_heads <= 0 || a.num_heads % a.num_kv_heads != 0) {
    return Invalid("num_heads " + std::to_string(a.num_heads) +
                   " is not a positive multiple of num_kv_heads " + std::to_string(a.num_kv_heads));
  }
  if (a.sink_slots < 0 || a.sink_slots > a.budget) {
    return Invalid("sink_slots " + std::to_string(a.sink_slots) + " outside [0, budget " +
                   std::to_string(a.budget) + "]");
  }
  if (a.query == nullptr || a.output == nullptr || a.keys == nullptr || a.values == nullptr ||
      a.valid == nullptr || a.next_slot == nullptr) {
    return Invalid("a required pointer is null");
  }
  return Status::Ok();
}

int LongFlowAttentionScratchSize(const LongFlowAttentionArgs& a) {
  return (a.num_heads / a.num_kv_heads + 1) * a.budget;
}

void LongFlowAttentionForKvHead(const LongFlowAttentionArgs& a, int kv_head, float* scratch) {
  const int group = a.num_heads / a.num_kv_heads;
  const int d = a.head_dim;
  const int budget = a.budget;
  const float scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(d)));
  const float* keys = a.keys + static_cast<size_t>(kv_head) * budget * d;
  const float* values = a.values + static_cast<size_t>(kv_head) * budget * d;
  float* weights = scratch;  // [group][budget]: exp(s) (or exp(s - max)), then alpha
  float* pooled = scratch + static_cast<size_t>(group) * budget;  // [budget] mean alpha
  bool fallback = false;
  for (int g = 0; g < group; ++g) {
    const int head = kv_head * group + g;
    const float* q = a.query + static_cast<size_t>(head) * d;
    float* w = weights + static_cast<size_t>(g) * budget;
    float max = -INFINITY;
    for (int i = 0; i < budget; ++i) {
      w[i] = a.valid[i] ? Dot(q, keys + static_cast<size_t>(i) * d, d) * scale : -INFINITY;
      max = std::max(max, w[i]);
    }
    // The plain path exponentiates the raw scores (the paper's kernel); a score above the limit
    // could overflow the sum, so the head subtracts its maximum instead (same alphas).
    const float shift = max > kLongFlowPlainExpLimit ? max : 0.f;
    fallback = fallback || shift != 0.f;
    float sum = 0.f;
    for (int i = 0; i < budget; ++i) {
      w[i] = a.valid[i] ? std::exp(w[i] - shift) : 0.f;
      sum += w[i];
    }
    float* out = a.output + static_cast<size_t>(head) * d;
    std::fill(out, out + d, 0.f);
    for (int i = 0; i < budget; ++i) {
      if (w[i] == 0.f) continue;
      const float* v = values + static_cast<size_t>(i) * d;
      for (int e = 0; e < d; ++e) out[e] += w[i] * v[e];
    }
    const float inverse = sum > 0.f ? 1.f / sum : 0.f;  // no valid slot: output 0
    for (int e = 0; e < d; ++e) out[e] *= inverse;
    for (int i = 0; i < budget; ++i) w[i] *= inverse;
  }
  // Eq. 6 with the group's mean alpha: ||(mean_g alpha_g,i) v_i||_1.
  int free_slot = -1, best = -1;
  float best_score = INFINITY;
  for (int i = 0; i < budget; ++i) {
    float alpha = 0.f;
    for (int g = 0; g < group; ++g) alpha += weights[static_cast<size_t>(g) * budget + i];
    alpha /= static_cast<float>(group);
    float norm = 0.f;
    if (a.valid[i]) {
      const float* v = values + static_cast<size_t>(i) * d;
      for (int e = 0; e < d; ++e) norm += std::fabs(v[e]);
    }
    pooled[i] = a.valid[i] ? alpha * norm : 0.f;
    if (!a.valid[i]) {
      if (free_slot < 0) free_slot = i;
      continue;
    }
    if (i < a.sink_slots) continue;
    if (pooled[i] < best_score) {
      best_score = pooled[i];
      best = i;
    }
  }
  a.next_slot[kv_head] = free_slot >= 0 ? free_slot : best;
  if (a.slot_scores != nullptr) {
    std::copy(pooled, pooled + budget, a.slot_scores + static_cast<size_t>(kv_head) * budget);
  }
  if (a.used_max != nullptr) a.used_max[kv_head] = fallback ? 1 : 0;
}

Status LongFlowAttention(const LongFlowAttentionArgs& a, std::span<float> scratch) {
  RUBATO_RETURN_IF_ERROR(ValidateLongFlowAttention(a));
  const int needed = LongFlowAttentionScratchSize(a);
  if (scratch.size() < static_cast<size_t>(needed)) {
    return Invalid("scratch holds " + std::to_string(scratch.size()) + " floats, " +
                   std::to_string(needed) + " needed");
  }
  for (int h = 0; h < a.num_kv_heads; ++h) LongFlowAttentionForKvHead(a, h, scratch.data());
  return Status::Ok();
}

}  // namespace rubato
