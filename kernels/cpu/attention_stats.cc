// Softmax statistics of a decode query (attention_stats.h), in double precision: this is the
// reference the GPU's fp32 statistics are checked against.
#include "kernels/cpu/attention_stats.h"

#include <algorithm>
#include <cmath>
#include <vector>

namespace rubato {

void DecodeAttentionStats(const DecodeAttentionStatsArgs& args, float* lse, float* probs) {
  const PagedKvView& kv = args.kv;
  const int group = args.num_heads / kv.num_kv_heads;
  const int position = args.seq_len - 1;
  std::vector<double> scores(args.seq_len);
  if (probs != nullptr) {
    std::fill(probs, probs + static_cast<size_t>(kv.num_kv_heads) * args.seq_len, 0.0f);
  }
  for (int head = 0; head < args.num_heads; ++head) {
    const int kv_head = head / group;
    const float* q = args.query + static_cast<size_t>(head) * kv.head_dim;
    double max_score = -INFINITY;
    for (int key = 0; key < args.seq_len; ++key) {
      if (!args.window.Attends(position, key)) continue;
      const float* k = kv.keys + kv.Offset(key, kv_head);
      double dot = 0.0;
      for (int d = 0; d < kv.head_dim; ++d) dot += static_cast<double>(q[d]) * k[d];
      scores[key] = dot * args.scale;
      max_score = std::max(max_score, scores[key]);
    }
    double sum = 0.0;
    for (int key = 0; key < args.seq_len; ++key) {
      if (args.window.Attends(position, key)) sum += std::exp(scores[key] - max_score);
    }
    const double log_sum = max_score + std::log(sum);
    if (lse != nullptr) lse[head] = static_cast<float>(log_sum);
    if (probs != nullptr) {
      float* row = probs + static_cast<size_t>(kv_head) * args.seq_len;
      for (int key = 0; key < args.seq_len; ++key) {
        if (args.window.Attends(position, key)) {
          row[key] += static_cast<float>(std::exp(scores[key] - log_sum) / group);
        }
      }
    }
  }
}

}  // namespace rubato
