// SnapKV-style prompt scoring and selection, CPU reference (snapkv_scores.h).
#include "kernels/cpu/snapkv_scores.h"

#include <algorithm>
#include <cmath>
#include <string>

#include "kernels/cpu/dot.h"
#include "kernels/cpu/softmax.h"

namespace rubato {
namespace {

Status Invalid(const std::string& message) {
  return InvalidArgumentError("snapkv scores: " + message);
}

}  // namespace

Status ValidateSnapKvScores(const SnapKvScoreArgs& a) {
  if (a.kv.num_kv_heads <= 0 || a.kv.head_dim <= 0 || a.kv.block_tokens <= 0) {
    return Invalid("the KV view has no heads, head_dim or block size");
  }
  if (a.num_heads <= 0 || a.num_heads % a.kv.num_kv_heads != 0) {
    return Invalid("num_heads " + std::to_string(a.num_heads) +
                   " is not a positive multiple of num_kv_heads " +
                   std::to_string(a.kv.num_kv_heads));
  }
  if (a.window < 1 || a.window >= a.length) {
    return Invalid("window " + std::to_string(a.window) + " outside [1, length " +
                   std::to_string(a.length) + ")");
  }
  if (a.pool_kernel < 1 || a.pool_kernel % 2 == 0) {
    return Invalid("pool_kernel " + std::to_string(a.pool_kernel) + " is not odd and positive");
  }
  if (a.window_queries == nullptr || a.scores == nullptr || a.kv.keys == nullptr ||
      a.kv.block_table == nullptr) {
    return Invalid("a required pointer is null");
  }
  return Status::Ok();
}

int SnapKvScoresScratchSize(const SnapKvScoreArgs& a) { return a.length + (a.length - a.window); }

void SnapKvScoresForKvHead(const SnapKvScoreArgs& a, int kv_head, float* scratch) {
  const PagedKvView& kv = a.kv;
  const int d = kv.head_dim;
  const int group = a.num_heads / kv.num_kv_heads;
  const int prefix = a.length - a.window;
  const float scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(d)));
  float* weights = scratch;            // [length]: one query's softmax
  float* summed = scratch + a.length;  // [prefix]: summed over the window and the group
  std::fill(summed, summed + prefix, 0.f);
  for (int w = 0; w < a.window; ++w) {
    const int keys = prefix + w + 1;  // causal: positions [0, its own]
    for (int g = 0; g < group; ++g) {
      const int head = kv_head * group + g;
      const float* q = a.window_queries + (static_cast<size_t>(w) * a.num_heads + head) * d;
      for (int p = 0; p < keys; ++p)
        weights[p] = Dot(q, kv.keys + kv.Offset(p, kv_head), d) * scale;
      SoftmaxInPlace(weights, keys);
      for (int p = 0; p < prefix; ++p) summed[p] += weights[p];
    }
  }
  const int half = a.pool_kernel / 2;
  float* out = a.scores + static_cast<size_t>(kv_head) * prefix;
  for (int p = 0; p < prefix; ++p) {
    const int begin = std::max(0, p - half);
    const int end = std::min(prefix, p + half + 1);
    out[p] = *std::max_element(summed + begin, summed + end);
  }
}

Status SnapKvScores(const SnapKvScoreArgs& a, std::span<float> scratch) {
  RUBATO_RETURN_IF_ERROR(ValidateSnapKvScores(a));
  const int needed = SnapKvScoresScratchSize(a);
  if (scratch.size() < static_cast<size_t>(needed)) {
    return Invalid("scratch holds " + std::to_string(scratch.size()) + " floats, " +
                   std::to_string(needed) + " needed");
  }
  for (int h = 0; h < a.kv.num_kv_heads; ++h) SnapKvScoresForKvHead(a, h, scratch.data());
  return Status::Ok();
}

void SnapKvKeep(const float* scores, int length, int window, int sink_tokens, int budget,
                std::vector<int>& kept) {
  const int prefix = length - window;
  const int select = budget - sink_tokens - window;
  kept.clear();
  for (int p = 0; p < sink_tokens; ++p) kept.push_back(p);
  const size_t first = kept.size();
  for (int p = sink_tokens; p < prefix; ++p) kept.push_back(p);
  // Highest score first, ties to the lower position.
  std::partial_sort(kept.begin() + static_cast<ptrdiff_t>(first),
                    kept.begin() + static_cast<ptrdiff_t>(first + select), kept.end(),
                    [scores](int a, int b) {
                      return scores[a] > scores[b] || (scores[a] == scores[b] && a < b);
                    });
  kept.resize(first + static_cast<size_t>(select));
  std::sort(kept.begin() + static_cast<ptrdiff_t>(first), kept.end());
  for (int p = prefix; p < length; ++p) kept.push_back(p);
}

}  // namespace rubato
