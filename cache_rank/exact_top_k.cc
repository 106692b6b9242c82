// Exact GQA-pooled top-k over a session's stored keys (see exact_top_k.h).
#include "cache_rank/exact_top_k.h"

#include <fmt/format.h>

#include <cmath>
#include <limits>
#include <numeric>
#include <vector>

#include "kernels/cpu/pooled_top_k.h"

namespace rubato {
namespace {

// q . k in fp32 with 8 independent partial sums, so the compiler can vectorize it (a single
// running sum fixes the order of additions and forbids that).
float Dot(const float* q, const float* k, uint32_t n) {
  float partial[8] = {};
  uint32_t d = 0;
  for (; d + 8 <= n; d += 8) {
    for (uint32_t lane = 0; lane < 8; ++lane) partial[lane] += q[d + lane] * k[d + lane];
  }
  float dot = 0.0f;
  for (; d < n; ++d) dot += q[d] * k[d];
  for (float p : partial) dot += p;
  return dot;
}

}  // namespace

Result<KvHeadSelection> ExactTopK(const KvStore& store, uint64_t session_id, uint32_t layer,
                                  std::span<const float> query, uint32_t k, uint32_t begin,
                                  uint32_t end) {
  RUBATO_ASSIGN_OR_RETURN(const SessionShape shape, store.GetSessionShape(session_id));
  RUBATO_ASSIGN_OR_RETURN(const uint32_t readable, store.LayerLength(session_id, layer));
  const std::string where = fmt::format("exact top-k (session {}, layer {})", session_id, layer);
  const size_t query_elements = size_t{shape.num_query_heads} * shape.head_dim;
  if (query.size() != query_elements) {
    return InvalidArgumentError(
        fmt::format("{}: query has {} values, expected num_query_heads {} x head_dim {} = {}",
                    where, query.size(), shape.num_query_heads, shape.head_dim, query_elements));
  }
  for (size_t i = 0; i < query.size(); ++i) {
    if (!std::isfinite(query[i])) {
      return InvalidArgumentError(
          fmt::format("{}: query[{}] = {} is not finite", where, i, query[i]));
    }
  }
  if (begin > end || end > readable) {
    return OutOfRangeError(fmt::format("{}: range [{}, {}) is not within the {} readable tokens",
                                       where, begin, end, readable));
  }
  const uint32_t n = end - begin;
  const uint32_t group = shape.num_query_heads / shape.num_kv_heads;
  const float scale = 1.0f / std::sqrt(static_cast<float>(shape.head_dim));
  const size_t row_bytes = size_t{shape.head_dim} * DTypeSize(shape.dtype);

  KvHeadSelection selection(shape.num_kv_heads);
  std::vector<float> key(shape.head_dim);        // one key row in fp32
  std::vector<float> logits(size_t{group} * n);  // [group][n]
  std::vector<int> positions;                    // one head's selection
  for (uint32_t g = 0; g < shape.num_kv_heads; ++g) {
    RUBATO_ASSIGN_OR_RETURN(const KvHeadRows rows, store.HeadRows(session_id, layer, g));
    if (k >= n) {  // the whole range, no scoring needed
      selection[g].resize(n);
      std::iota(selection[g].begin(), selection[g].end(), static_cast<int32_t>(begin));
      continue;
    }
    // Logits of the group's query heads, reading each key row once.
    for (uint32_t j = 0; j < n; ++j) {
      ConvertToF32(shape.dtype, rows.keys.data() + size_t{begin + j} * row_bytes, key.data(),
                   shape.head_dim);
      for (uint32_t q = 0; q < group; ++q) {
        const float* qh = query.data() + size_t{g * group + q} * shape.head_dim;
        const float dot = Dot(qh, key.data(), shape.head_dim);
        // A non-finite logit (NaN / inf in the key) would poison the head's softmax; such a
        // row scores as if its logit were -inf.
        const float logit = dot * scale;
        logits[size_t{q} * n + j] =
            std::isfinite(logit) ? logit : -std::numeric_limits<float>::infinity();
      }
    }
    // Softmax per query head over the range, mean over the group, the k best (ties low):
    // the same op the inference rank's oracle_topk selects with (kernels/cpu/pooled_top_k.h).
    PooledTopKInput input;
    input.scores = logits.data();
    input.stride = n;
    input.group = static_cast<int>(group);
    input.count = static_cast<int>(n);
    input.begin = static_cast<int>(begin);
    RUBATO_RETURN_IF_ERROR(PooledTopK(input, static_cast<int>(k), positions));
    selection[g].assign(positions.begin(), positions.end());
  }
  return selection;
}

}  // namespace rubato
