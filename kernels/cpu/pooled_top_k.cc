// Pooled top-k over one (sequence, KV head) (pooled_top_k.h).
#include "kernels/cpu/pooled_top_k.h"

#include <algorithm>
#include <climits>
#include <cmath>
#include <limits>
#include <numeric>
#include <string>
#include <utility>
#include <vector>

#include "kernels/cpu/dot.h"

namespace rubato {
namespace {

Status Validate(const PooledTopKInput& in, int k) {
  const auto invalid = [](const std::string& what) {
    return InvalidArgumentError("PooledTopK: " + what);
  };
  if (in.group < 1) return invalid("group = " + std::to_string(in.group) + " must be >= 1");
  if (in.count < 0) return invalid("count = " + std::to_string(in.count) + " must be >= 0");
  if (in.begin < 0) return invalid("begin = " + std::to_string(in.begin) + " must be >= 0");
  if (static_cast<int64_t>(in.begin) + in.count > INT32_MAX) {
    return invalid("begin + count = " + std::to_string(static_cast<int64_t>(in.begin) + in.count) +
                   " exceeds INT32_MAX");
  }
  if (in.stride < in.count) {
    return invalid("stride = " + std::to_string(in.stride) +
                   " < count = " + std::to_string(in.count));
  }
  if (k < 0) return invalid("k = " + std::to_string(k) + " must be >= 0");
  if (in.scores == nullptr && in.count > 0) return invalid("scores is null");
  return Status::Ok();
}

}  // namespace

Status PooledTopKOfQuery(const float* query, int group, const PagedKvView& kv, int kv_head,
                         int begin, int count, int k, std::vector<float>& logits,
                         std::vector<int>& positions_out) {
  const int head_dim = kv.head_dim;
  const float scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(head_dim)));
  logits.resize(static_cast<size_t>(group) * count);
  for (int g = 0; g < group; ++g) {
    const float* q = query + static_cast<size_t>(g) * head_dim;
    for (int j = 0; j < count; ++j) {
      logits[static_cast<size_t>(g) * count + j] =
          Dot(q, kv.keys + kv.Offset(begin + j, kv_head), head_dim) * scale;
    }
  }
  PooledTopKInput input;
  input.scores = logits.data();
  input.stride = count;
  input.group = group;
  input.count = count;
  input.begin = begin;
  input.units = ScoreUnits::kNatural;
  return PooledTopK(input, k, positions_out);
}

Status PooledTopK(const PooledTopKInput& in, int k, std::vector<int>& positions_out) {
  RUBATO_RETURN_IF_ERROR(Validate(in, k));
  const int n = in.count;
  if (k >= n) {  // every candidate, no scoring needed
    positions_out.resize(static_cast<size_t>(n));
    std::iota(positions_out.begin(), positions_out.end(), in.begin);
    return Status::Ok();
  }
  constexpr float kMinusInf = -std::numeric_limits<float>::infinity();
  const bool log2_units = in.units == ScoreUnits::kLog2;

  // Softmax per query head, pooled by the mean of the probabilities: the arithmetic of the cache
  // rank's exact top-k, in the same order.
  std::vector<float> probs(static_cast<size_t>(n));  // [n] one head's exp(score - max)
  std::vector<float> pooled(static_cast<size_t>(n), 0.0f);
  for (int q = 0; q < in.group; ++q) {
    const float* row = in.scores + q * in.stride;
    float max_score = kMinusInf;
    for (int i = 0; i < n; ++i) {
      probs[i] = std::isfinite(row[i]) ? row[i] : kMinusInf;
      max_score = std::max(max_score, probs[i]);
    }
    if (max_score == kMinusInf) continue;  // no finite score: the head contributes 0
    float sum = 0.0f;
    for (int i = 0; i < n; ++i) {
      probs[i] = log2_units ? std::exp2(probs[i] - max_score) : std::exp(probs[i] - max_score);
      sum += probs[i];
    }
    const float weight = 1.0f / (sum * static_cast<float>(in.group));
    for (int i = 0; i < n; ++i) pooled[i] += probs[i] * weight;
  }

  // Highest pooled score first, lower position on ties: a strict total order, so the k kept are
  // unique.
  std::vector<int> order(static_cast<size_t>(n));
  std::iota(order.begin(), order.end(), 0);
  const auto better = [&](int a, int b) {
    return pooled[a] != pooled[b] ? pooled[a] > pooled[b] : a < b;
  };
  std::nth_element(order.begin(), order.begin() + k, order.end(), better);
  order.resize(static_cast<size_t>(k));
  std::sort(order.begin(), order.end());
  for (int& i : order) i += in.begin;
  positions_out = std::move(order);
  return Status::Ok();
}

}  // namespace rubato
