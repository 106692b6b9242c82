// Attention on the cache rank (docs/design.md §1, §4.5): one decode query's dense attention over a
// session's stored K / V of one layer, the reply of the `attention` selector. The inference
// rank sends the query and the step's new K / V; the cache rank appends them and answers with
// the attention output and its log-sum-exp, so that the KV is read where it lives and the reply
// does not grow with the context. The math is the CPU reference's (kernels/cpu/attention.h rows
// path, kernels/cpu/attention_stats.h): the output equals local dense attention bit for bit when
// the stored K / V and the query are the same f32 values.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "cache_rank/kv_store.h"
#include "common/dtype.h"
#include "common/status.h"

namespace rubato {

// Buffers one caller reuses across calls (they only grow).
struct StoredAttentionScratch {
  std::vector<float> query;   // [num_query_heads][head_dim], f32
  std::vector<float> keys;    // [num_kv_heads][length][head_dim], f32 (sessions not in f32)
  std::vector<float> values;  // same
  std::vector<float> scores;  // [length], f32
};

// The attention of `query` ([num_query_heads][head_dim], the session's dtype), the query of
// position length - 1, over positions [0, length) of `layer` of `session_id` (all readable:
// length <= LayerLength). Query head h reads KV head h / (num_query_heads / num_kv_heads); scale
// 1 / sqrt(head_dim); fp32 softmax with the max subtracted. Writes
//   output: [num_query_heads][head_dim], f32 (as bytes: the reply pack's section)
//   lse:    [num_query_heads], f32: natural-log sum over the positions of exp(scale * q.k)
// Errors name the session and layer (a length past what is stored, sections of the wrong size).
Status StoredDecodeAttention(const KvStore& store, uint64_t session_id, uint32_t layer,
                             std::span<const std::byte> query, uint32_t length,
                             std::span<std::byte> output, std::span<std::byte> lse,
                             StoredAttentionScratch& scratch);

}  // namespace rubato
