// Pooled top-k: for one (sequence, KV head), the candidates its GQA group of query heads attends
// most. Each query head's raw scores go through a softmax over the n candidates; a candidate's
// pooled score is the mean of its probabilities over the group; the min(k, n) of highest pooled
// score are kept, ties to the lower position, and returned ascending. fp32 math in the order of
// the cache rank's exact top-k (cache_rank/exact_top_k.h): the same positions for the same logits,
// except where a query head has no finite logit (there every position ranks alike; here that
// head adds nothing).
//
// CUDA twin: kernels/cuda/pooled_top_k.cuh (a batch of rows, log2 units, rows indexed by
// position); where no two pooled scores near the cut lie within rounding, both keep the same set.
#pragma once

#include <cstdint>
#include <vector>

#include "common/status.h"
#include "kernels/cpu/paged_kv_view.h"

namespace rubato {

// How a raw score turns into a softmax weight: exp(score) or exp2(score). The CUDA decode
// attention writes log2 units (scale * q.k * log2 e, kernels/cuda/decode_attention.cuh).
enum class ScoreUnits { kNatural, kLog2 };

struct PooledTopKInput {
  // [group][stride], f32: scores[q * stride + i] is query head q's raw score of candidate i, at
  // position begin + i. A non-finite score counts as -inf (the candidate gets no probability from
  // that head); a head whose scores are all -inf contributes 0 to every pooled score.
  const float* scores = nullptr;
  int64_t stride = 0;  // >= count
  int group = 0;       // query heads of the GQA group, >= 1
  int count = 0;       // candidates n, >= 0
  int begin = 0;       // position of candidate 0, >= 0, begin + count <= INT32_MAX
  ScoreUnits units = ScoreUnits::kNatural;
};

// positions_out: replaced by the min(k, n) kept positions, strictly ascending. k >= n keeps every
// candidate without reading a score. Pooled scores are finite, in [0, 1]. InvalidArgument naming
// the field on a null `scores` (count > 0), a bad size or k < 0; positions_out is then untouched.
Status PooledTopK(const PooledTopKInput& input, int k, std::vector<int>& positions_out);

// The same for one decode query of a KV head's GQA group over the paged positions
// [begin, begin + count): the raw scores scale * Dot(q, k) (the attention op's rounding, natural
// units) into `logits` ([group][count], grown as needed), then PooledTopK.
//   query: [group][head_dim] the group's query heads (after RoPE)
Status PooledTopKOfQuery(const float* query, int group, const PagedKvView& kv, int kv_head,
                         int begin, int count, int k, std::vector<float>& logits,
                         std::vector<int>& positions_out);

}  // namespace rubato
