// Causal paged GQA attention (see attention.h): the rows path, the dispatch, scratch sizes.
//
// The rows path is plain loops in fp32. Probabilities are normalized before they weight the
// values, as in transformers' eager attention (softmax, then probs @ V). Keys outside the
// window are never read (the scores of the attended keys are packed: sink segment, then recent
// segment), which is the same as masking them to -inf before the softmax.
#include "kernels/cpu/attention.h"

#include <algorithm>
#include <cmath>
#include <cstddef>

#include "kernels/cpu/dot.h"
#include "kernels/cpu/softmax.h"

namespace rubato {
namespace {

// Calls fn(first_position, rows, packed_index) for each run of attended keys of the query at
// `position` that lies inside one KV block; packed_index counts the attended keys before it.
template <typename Fn>
void ForEachAttendedRun(const PagedKvView& kv, const AttentionWindow& window, int position,
                        Fn&& fn) {
  const int segments[2][2] = {{0, window.SinkEnd(position)},
                              {window.RecentBegin(position), position + 1}};
  int packed = 0;
  for (const auto& [begin, end] : segments) {
    for (int first = begin; first < end;) {
      const int block_end = (first / kv.block_tokens + 1) * kv.block_tokens;
      const int rows = std::min(block_end, end) - first;
      fn(first, rows, packed);
      packed += rows;
      first += rows;
    }
  }
}

}  // namespace

int RowsAttentionScratchSize(const CausalAttentionArgs& args) {
  return args.start_position + args.tokens;
}

int CausalAttentionScratchSize(const CausalAttentionArgs& args) {
  return std::max(RowsAttentionScratchSize(args), TiledAttentionScratchSize(args));
}

void RowsAttentionForKvHead(const CausalAttentionArgs& args, int kv_head, float* scratch) {
  const PagedKvView& kv = args.kv;
  const int head_dim = kv.head_dim;
  const int group = args.num_heads / kv.num_kv_heads;
  // head_dim ** -0.5 evaluated in double and rounded once, as Python does before torch uses it.
  const float scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(head_dim)));
  for (int t = 0; t < args.tokens; ++t) {
    const int position = args.start_position + t;
    const int num_keys = args.window.VisibleKeys(position);  // >= 1: the query's own key
    for (int g = 0; g < group; ++g) {
      const int head = kv_head * group + g;
      const size_t row = (static_cast<size_t>(t) * args.num_heads + head) * head_dim;
      const float* q = args.queries + row;
      float* out = args.output + row;

      // scratch: [num_keys] scores of the attended keys, packed. Within a block the rows of
      // one KV head are contiguous: keys + Offset(first) is [rows][head_dim].
      ForEachAttendedRun(kv, args.window, position, [&](int first, int rows, int packed) {
        const float* keys = kv.keys + kv.Offset(first, kv_head);
        for (int r = 0; r < rows; ++r) {
          scratch[packed + r] = Dot(q, keys + static_cast<size_t>(r) * head_dim, head_dim) * scale;
        }
      });
      SoftmaxInPlace(scratch, num_keys);

      std::fill(out, out + head_dim, 0.0f);
      ForEachAttendedRun(kv, args.window, position, [&](int first, int rows, int packed) {
        const float* values = kv.values + kv.Offset(first, kv_head);  // [rows][head_dim]
        for (int r = 0; r < rows; ++r) {
          const float prob = scratch[packed + r];
          const float* v = values + static_cast<size_t>(r) * head_dim;
          for (int d = 0; d < head_dim; ++d) out[d] += prob * v[d];
        }
      });
    }
  }
}

void CausalAttentionForKvHead(const CausalAttentionArgs& args, int kv_head, float* scratch) {
  if (args.tokens >= kTiledAttentionMinTokens) {
    TiledAttentionForKvHead(args, kv_head, scratch);
  } else {
    RowsAttentionForKvHead(args, kv_head, scratch);
  }
}

void CausalAttention(const CausalAttentionArgs& args, float* scratch) {
  for (int h = 0; h < args.kv.num_kv_heads; ++h) CausalAttentionForKvHead(args, h, scratch);
}

}  // namespace rubato
