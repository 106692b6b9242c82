// Index-gather sparse decode attention (see index_gather_attention.h): plain fp32 loops with the
// arithmetic of two_segment_attention.cc, keys and values read through the block table.
#include "kernels/cpu/index_gather_attention.h"

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "kernels/cpu/dot.h"
#include "kernels/cpu/softmax.h"

namespace rubato {
namespace {

Status Invalid(const std::string& message) {
  return InvalidArgumentError("index-gather attention: " + message);
}

}  // namespace

Status ValidateIndexGatherAttention(const IndexGatherAttentionArgs& args) {
  const PagedKvView& kv = args.kv;
  if (kv.num_kv_heads <= 0 || kv.head_dim <= 0 || kv.block_tokens <= 0) {
    return Invalid("paged KV shape (num_kv_heads " + std::to_string(kv.num_kv_heads) +
                   ", head_dim " + std::to_string(kv.head_dim) + ", block_tokens " +
                   std::to_string(kv.block_tokens) + ") must be positive");
  }
  if (args.num_heads <= 0 || args.num_heads % kv.num_kv_heads != 0) {
    return Invalid("num_heads " + std::to_string(args.num_heads) +
                   " is not a positive multiple of num_kv_heads " +
                   std::to_string(kv.num_kv_heads));
  }
  if (args.length < 0) return Invalid("length " + std::to_string(args.length) + " < 0");
  if (args.query == nullptr || args.output == nullptr) return Invalid("query or output is null");
  if (args.positions == nullptr || args.counts == nullptr) {
    return Invalid("positions or counts is null");
  }
  std::vector<char> seen(static_cast<size_t>(args.length), 0);
  bool any = false;
  for (int h = 0; h < kv.num_kv_heads; ++h) {
    const int count = args.counts[h];
    if (count < 0 || count > args.length) {
      return Invalid("counts[" + std::to_string(h) + "] = " + std::to_string(count) +
                     " is outside [0, length " + std::to_string(args.length) + "]");
    }
    if (count > 0 && args.positions[h] == nullptr) {
      return Invalid("positions[" + std::to_string(h) + "] is null");
    }
    std::fill(seen.begin(), seen.end(), 0);
    for (int i = 0; i < count; ++i) {
      const int p = args.positions[h][i];
      if (p < 0 || p >= args.length) {
        return Invalid("positions[" + std::to_string(h) + "][" + std::to_string(i) + "] = " +
                       std::to_string(p) + " is outside [0, " + std::to_string(args.length) + ")");
      }
      if (seen[static_cast<size_t>(p)]) {
        return Invalid("positions[" + std::to_string(h) + "] holds " + std::to_string(p) +
                       " twice");
      }
      seen[static_cast<size_t>(p)] = 1;
    }
    any = any || count > 0;
  }
  if (any && (kv.keys == nullptr || kv.values == nullptr || kv.block_table == nullptr)) {
    return Invalid("paged KV keys, values or block table is null");
  }
  return Status::Ok();
}

int IndexGatherAttentionScratchSize(const IndexGatherAttentionArgs& args) {
  int most = 0;
  for (int h = 0; h < args.kv.num_kv_heads; ++h) most = std::max(most, args.counts[h]);
  return most;
}

void IndexGatherAttentionForKvHead(const IndexGatherAttentionArgs& args, int kv_head,
                                   float* scratch) {
  const PagedKvView& kv = args.kv;
  const int head_dim = kv.head_dim;
  const int group = args.num_heads / kv.num_kv_heads;
  // head_dim ** -0.5 evaluated in double and rounded once, as in attention.cc.
  const float scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(head_dim)));
  const int count = args.counts[kv_head];
  const int* positions = args.positions[kv_head];
  for (int g = 0; g < group; ++g) {
    const int head = kv_head * group + g;
    const size_t row = static_cast<size_t>(head) * head_dim;
    const float* q = args.query + row;
    float* out = args.output + row;
    std::fill(out, out + head_dim, 0.0f);
    if (count == 0) {  // nothing to attend: defined as output 0, lse -inf
      if (args.lse != nullptr) args.lse[head] = -INFINITY;
      continue;
    }
    for (int i = 0; i < count; ++i) {
      scratch[i] = Dot(q, kv.keys + kv.Offset(positions[i], kv_head), head_dim) * scale;
    }
    const double lse = SoftmaxInPlaceWithLse(scratch, count);
    if (args.lse != nullptr) args.lse[head] = static_cast<float>(lse);
    for (int i = 0; i < count; ++i) {
      const float prob = scratch[i];
      const float* v = kv.values + kv.Offset(positions[i], kv_head);
      for (int d = 0; d < head_dim; ++d) out[d] += prob * v[d];
    }
  }
}

Status IndexGatherAttention(const IndexGatherAttentionArgs& args, std::span<float> scratch) {
  RUBATO_RETURN_IF_ERROR(ValidateIndexGatherAttention(args));
  const int needed = IndexGatherAttentionScratchSize(args);
  if (scratch.size() < static_cast<size_t>(needed)) {
    return Invalid("scratch holds " + std::to_string(scratch.size()) + " floats, " +
                   std::to_string(needed) + " needed");
  }
  for (int h = 0; h < args.kv.num_kv_heads; ++h) {
    IndexGatherAttentionForKvHead(args, h, scratch.data());
  }
  return Status::Ok();
}

}  // namespace rubato
