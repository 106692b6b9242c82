// Causal paged GQA attention (see attention.h).
//
// Plain loops in fp32. Probabilities are normalized before they weight the values, as in
// transformers' eager attention (softmax, then probs @ V).
#include "kernels/cpu/attention.h"

#include <algorithm>
#include <cmath>
#include <cstddef>

#include "kernels/cpu/softmax.h"

namespace rubato {
namespace {

// Dot product with eight independent partial sums: a fixed summation order (results do not
// depend on the caller) that the compiler can keep in vector registers.
float Dot(const float* a, const float* b, int n) {
  float partial[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int i = 0;
  for (; i + 8 <= n; i += 8) {
    for (int j = 0; j < 8; ++j) partial[j] += a[i + j] * b[i + j];
  }
  for (; i < n; ++i) partial[i % 8] += a[i] * b[i];
  return ((partial[0] + partial[1]) + (partial[2] + partial[3])) +
         ((partial[4] + partial[5]) + (partial[6] + partial[7]));
}

}  // namespace

void CausalAttentionForKvHead(const CausalAttentionArgs& args, int kv_head, float* scratch) {
  const PagedKvView& kv = args.kv;
  const int head_dim = kv.head_dim;
  const int group = args.num_heads / kv.num_kv_heads;
  // head_dim ** -0.5 evaluated in double and rounded once, as Python does before torch uses it.
  const float scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(head_dim)));
  for (int t = 0; t < args.tokens; ++t) {
    const int num_keys = args.start_position + t + 1;  // causal: positions [0, start + t]
    for (int g = 0; g < group; ++g) {
      const int head = kv_head * group + g;
      const size_t row = (static_cast<size_t>(t) * args.num_heads + head) * head_dim;
      const float* q = args.queries + row;
      float* out = args.output + row;

      // Scores, block by block: within a block the rows of one KV head are contiguous.
      for (int first = 0; first < num_keys; first += kv.block_tokens) {
        const float* keys = kv.keys + kv.Offset(first, kv_head);  // [block rows][head_dim]
        const int rows = std::min(kv.block_tokens, num_keys - first);
        for (int r = 0; r < rows; ++r) {
          scratch[first + r] = Dot(q, keys + static_cast<size_t>(r) * head_dim, head_dim) * scale;
        }
      }
      SoftmaxInPlace(scratch, num_keys);

      std::fill(out, out + head_dim, 0.0f);
      for (int first = 0; first < num_keys; first += kv.block_tokens) {
        const float* values = kv.values + kv.Offset(first, kv_head);  // [block rows][head_dim]
        const int rows = std::min(kv.block_tokens, num_keys - first);
        for (int r = 0; r < rows; ++r) {
          const float prob = scratch[first + r];
          const float* v = values + static_cast<size_t>(r) * head_dim;
          for (int d = 0; d < head_dim; ++d) out[d] += prob * v[d];
        }
      }
    }
  }
}

void CausalAttention(const CausalAttentionArgs& args, float* scratch) {
  for (int h = 0; h < args.kv.num_kv_heads; ++h) CausalAttentionForKvHead(args, h, scratch);
}

}  // namespace rubato
