// LongFlow's fused attention and eviction choice (see longflow_attention.cuh): the decode
// attention split kernel over the slot arrays (decode_attention_split.cuh SlotsVariant): K and V
// tiles read once (whole-tile tensor copies for head_dim 64 / 128), S = Q K^T and P V on tensor
// cores, and from the same tiles every slot's raw score (per query head) and ||v||_1 into the
// workspace. When one split covers a (sequence, KV head)'s slots (every pair of a large batch),
// the same block then makes the eviction choice from them (slot_choice.cuh); with several
// splits a small kernel does after the merge. The exponentials are fp32 with the split kernel's
// tile-wise running maximum: one max per 64-key tile costs nothing there and no score can
// overflow, so the CPU twin's fallback pass has no GPU counterpart; used_max still reports the
// heads whose plain exponentials would have needed it (largest score past
// kLongFlowPlainExpLimit), as the twin does.
#include <string>

#include "kernels/cuda/decode_attention.cuh"
#include "kernels/cuda/longflow_attention.cuh"

namespace rubato::cuda {
namespace {

// The workspace: the decode attention's, then raw scores [batch][num_heads][budget] (log2
// units) and ||v||_1 [batch][num_kv_heads <= num_heads][budget].
struct Layout {
  size_t decode = 0, scores = 0, norms = 0, total = 0;
};

size_t AlignUp256(size_t bytes) { return (bytes + 255) / 256 * 256; }

Layout MakeLayout(int batch, int num_heads, int head_dim, int budget) {
  Layout layout;
  const size_t per_head = static_cast<size_t>(batch) * num_heads;
  layout.decode = 0;
  layout.scores =
      AlignUp256(DecodeAttentionWorkspaceBytes(batch, num_heads, head_dim, budget, false));
  layout.norms = AlignUp256(layout.scores + per_head * budget * sizeof(float));
  layout.total = AlignUp256(layout.norms + per_head * budget * sizeof(float));
  return layout;
}

}  // namespace

size_t LongFlowAttentionWorkspaceBytes(int batch, int num_heads, int head_dim, int budget) {
  if (batch < 1 || num_heads < 1 || head_dim < 1 || budget < 1) return 0;
  return MakeLayout(batch, num_heads, head_dim, budget).total;
}

Status LongFlowAttention(const LongFlowAttentionParams& p, cudaStream_t stream) {
  if (p.batch == 0) return Status::Ok();
  if (p.batch < 0 || p.num_kv_heads < 1 || p.num_heads % p.num_kv_heads != 0 || p.budget < 1 ||
      p.sink_slots < 0 || p.sink_slots > p.budget) {
    return InvalidArgumentError(
        "longflow attention: bad shape (batch " + std::to_string(p.batch) + ", heads " +
        std::to_string(p.num_heads) + "/" + std::to_string(p.num_kv_heads) + ", budget " +
        std::to_string(p.budget) + ", sinks " + std::to_string(p.sink_slots) + ")");
  }
  if (p.q == nullptr || p.keys == nullptr || p.values == nullptr || p.valid == nullptr ||
      p.out == nullptr || p.next_slot == nullptr || p.workspace == nullptr) {
    return InvalidArgumentError("longflow attention: a required pointer is null");
  }
  if (p.arrays != nullptr && p.num_arrays < 1) {
    return InvalidArgumentError("longflow attention: num_arrays must be >= 1 with arrays, got " +
                                std::to_string(p.num_arrays));
  }
  const size_t needed = LongFlowAttentionWorkspaceBytes(p.batch, p.num_heads, p.head_dim, p.budget);
  if (p.workspace_bytes < needed) {
    return InvalidArgumentError("longflow attention: workspace of " +
                                std::to_string(p.workspace_bytes) + " bytes, " +
                                std::to_string(needed) + " needed");
  }
  const Layout layout = MakeLayout(p.batch, p.num_heads, p.head_dim, p.budget);
  unsigned char* base = static_cast<unsigned char*>(p.workspace);
  float* scores = reinterpret_cast<float*>(base + layout.scores);
  float* norms = reinterpret_cast<float*>(base + layout.norms);

  DecodeAttentionParams d;
  d.q = p.q;
  d.q_row_stride = p.q_row_stride;
  d.slot_keys = p.keys;
  d.slot_values = p.values;
  d.slot_valid = p.valid;
  d.slot_budget = p.budget;
  d.slot_arrays = p.arrays;
  d.num_slot_arrays = p.num_arrays;
  d.slot_value_norms = norms;
  d.batch = p.batch;
  d.num_heads = p.num_heads;
  d.num_kv_heads = p.num_kv_heads;
  d.head_dim = p.head_dim;
  d.max_seq_len = p.budget;
  d.scale = p.scale;
  d.out = p.out;
  d.out_row_stride = p.out_row_stride;
  d.scores = scores;
  d.scores_stride = p.budget;
  d.slot_next = p.next_slot;
  d.slot_sink_slots = p.sink_slots;
  d.slot_choice_scores = p.slot_scores;
  d.slot_used_max = p.used_max;
  d.num_splits = p.num_splits;
  d.workspace = base + layout.decode;
  d.workspace_bytes = layout.scores;
  const Status attention = DecodeAttention(d, stream);
  if (!attention.ok()) {
    return Status(attention.code(), "longflow attention: " + attention.message());
  }
  return Status::Ok();
}

}  // namespace rubato::cuda
