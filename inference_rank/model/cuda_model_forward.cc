// The device side of a CUDA forward (cuda_model.h): the decoder's kernels and GEMMs, launched on
// one stream, reading the step inputs that the host copied in and the plan's row layout. Nothing
// here allocates or synchronizes, so the same code runs eagerly or inside a graph capture.
#include <cmath>
#include <string>

#include "inference_rank/model/cuda_model.h"
#include "kernels/cuda/decode_attention.cuh"
#include "kernels/cuda/embedding.cuh"
#include "kernels/cuda/gather_rows.cuh"
#include "kernels/cuda/logit_adjust.cuh"
#include "kernels/cuda/prefill_attention.cuh"
#include "kernels/cuda/qk_rope_append.cuh"
#include "kernels/cuda/rmsnorm.cuh"
#include "kernels/cuda/sampling.cuh"
#include "kernels/cuda/swiglu.cuh"

namespace rubato {
namespace {

// y = x W^T (+ bias, when the buffer is not empty) over `rows` rows, bf16 out.
cuda::LinearArgs Linear(const __nv_bfloat16* x, const cuda::DeviceBuffer<__nv_bfloat16>& weight,
                        const cuda::DeviceBuffer<__nv_bfloat16>* bias, void* y, int rows,
                        int in_features, int out_features) {
  cuda::LinearArgs args;
  args.x = x;
  args.weight = weight.data();
  args.bias = bias != nullptr && bias->size() > 0 ? bias->data() : nullptr;
  args.y = y;
  args.rows = rows;
  args.in_features = in_features;
  args.out_features = out_features;
  return args;
}

}  // namespace

Status CudaModel::EnqueueForward(DeviceKvStorage& kv, const AttentionWindow& window,
                                 cudaStream_t stream) {
  if (backend_ != nullptr) RUBATO_RETURN_IF_ERROR(backend_->BeginStep(stream));
  if (residency_step_) RUBATO_RETURN_IF_ERROR(residency_->BeginStep(stream));
  cuda::EmbeddingParams embedding;
  embedding.table = weights_.embed_tokens.data();
  embedding.token_ids = StepInput<const int32_t>(input_layout_.token_ids);
  embedding.tokens = plan_.tokens;
  embedding.hidden = config_.hidden_size;
  embedding.vocab_size = config_.vocab_size;
  embedding.out = residual_.data();
  RUBATO_RETURN_IF_ERROR(cuda::EmbeddingLookup(embedding, stream));

  for (int layer = 0; layer < config_.num_layers; ++layer) {
    const Status status = DecoderLayer(layer, kv, window, stream);
    if (!status.ok()) return status.WithContext("layer " + std::to_string(layer));
  }

  // The last layer's MLP output joins the residual stream in the final norm.
  cuda::RmsNormParams final_norm;
  final_norm.residual = residual_.data();
  final_norm.delta = delta_.data();
  final_norm.weight = weights_.final_norm.data();
  final_norm.out = normed_.data();
  final_norm.rows = plan_.tokens;
  final_norm.dim = config_.hidden_size;
  final_norm.eps = static_cast<float>(config_.rms_norm_eps);
  RUBATO_RETURN_IF_ERROR(cuda::RmsNorm(final_norm, stream));
  RUBATO_RETURN_IF_ERROR(LogitsAndSampling(stream));
  // The backend's end of step (e.g. joining work that overlapped the last layers and the lm_head).
  if (backend_ != nullptr) RUBATO_RETURN_IF_ERROR(backend_->EndStep());
  if (residency_step_) RUBATO_RETURN_IF_ERROR(residency_->EndStep());
  return Status::Ok();
}

// norm -> attention -> residual -> norm -> MLP -> residual; each residual add is fused into the
// norm that follows it (the MLP's into the next layer's input norm, or the final norm).
Status CudaModel::DecoderLayer(int layer, DeviceKvStorage& kv, const AttentionWindow& window,
                               cudaStream_t stream) {
  const CudaLayerWeights& w = weights_.layers[static_cast<size_t>(layer)];
  cuda::RmsNormParams norm;
  norm.residual = residual_.data();
  norm.delta = layer == 0 ? nullptr : delta_.data();  // the previous layer's MLP output
  norm.weight = w.input_norm.data();
  norm.out = normed_.data();
  norm.rows = plan_.tokens;
  norm.dim = config_.hidden_size;
  norm.eps = static_cast<float>(config_.rms_norm_eps);
  RUBATO_RETURN_IF_ERROR(cuda::RmsNorm(norm, stream));

  RUBATO_RETURN_IF_ERROR(SelfAttention(layer, kv, window, stream));

  norm.delta = delta_.data();  // the attention output
  norm.weight = w.post_attention_norm.data();
  RUBATO_RETURN_IF_ERROR(cuda::RmsNorm(norm, stream));

  return Mlp(layer, stream);
}

CudaLayerContext CudaModel::LayerContext(int layer, DeviceKvStorage& kv, cudaStream_t stream) {
  CudaLayerContext context;
  context.layer = layer;
  context.stream = stream;
  context.config = &config_;
  context.kv = &kv;
  context.plan = &plan_;
  context.qkv = qkv_.data();
  context.inv_freq = inv_freq_.data();
  context.attention = attention_.data();
  context.decode_block_tables = StepInput<const int32_t>(input_layout_.decode_block_tables);
  context.decode_seq_lens = StepInput<const int32_t>(input_layout_.decode_seq_lens);
  context.prefill_block_tables = StepInput<const int32_t>(input_layout_.prefill_block_tables);
  context.prefill_query_start = StepInput<const int32_t>(input_layout_.prefill_query_start);
  context.prefill_start_positions = StepInput<const int32_t>(input_layout_.prefill_start_positions);
  context.policy_inputs = StepInput<const std::byte>(input_layout_.backend);
  context.decode_workspace = decode_workspace_.data();
  context.decode_workspace_bytes = decode_workspace_.size();
  return context;
}

// normed -> delta: fused q|k|v projection [+bias] -> [q/k norm] -> RoPE -> KV append ->
// attention (the backend's decode rows, the dense ones, the prefill rows) -> o_proj [+bias].
Status CudaModel::SelfAttention(int layer, DeviceKvStorage& kv, const AttentionWindow& window,
                                cudaStream_t stream) {
  const CudaLayerWeights& w = weights_.layers[static_cast<size_t>(layer)];
  const int tokens = plan_.tokens;
  const int heads = config_.num_heads;
  const int kv_heads = config_.num_kv_heads;
  const int head_dim = config_.head_dim;
  const int q_dim = config_.q_dim();
  const int kv_dim = config_.kv_dim();
  const int qkv_dim = q_dim + 2 * kv_dim;  // row stride of qkv_: [q heads | k heads | v heads]
  const float eps = static_cast<float>(config_.rms_norm_eps);
  const float scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(head_dim)));

  RUBATO_RETURN_IF_ERROR(gemm_->Linear(
      Linear(normed_.data(), w.qkv, &w.qkv_bias, qkv_.data(), tokens, config_.hidden_size, qkv_dim),
      stream));

  // [q/k norm] -> RoPE -> KV append, one launch (cuda::QkNormRopeAppend is bit for bit the three
  // separate ops).
  cuda::QkRopeAppendParams fused;
  fused.qkv = qkv_.data();
  fused.row_stride = qkv_dim;
  fused.tokens = tokens;
  fused.num_heads = heads;
  fused.num_kv_heads = kv_heads;
  fused.head_dim = head_dim;
  if (config_.qk_norm) {
    fused.q_norm_weight = w.q_norm.data();
    fused.k_norm_weight = w.k_norm.data();
  }
  fused.eps = eps;
  fused.positions = StepInput<const int32_t>(input_layout_.positions);
  fused.inv_freq = inv_freq_.data();
  fused.slots = StepInput<const int32_t>(input_layout_.kv_slots);
  const int block_tokens = kv.shape().block_tokens;
  fused.block_tokens = block_tokens;
  fused.key_pool = kv.layer_keys(layer);
  fused.value_pool = kv.layer_values(layer);
  RUBATO_RETURN_IF_ERROR(cuda::QkNormRopeAppend(fused, stream));
  const CudaLayerContext context = LayerContext(layer, kv, stream);
  // The residency's entries' new K/V and queries, after the local append.
  if (residency_step_) RUBATO_RETURN_IF_ERROR(residency_->LayerComputed(context));

  // Decode rows [0, decode_rows), one query each: the backend's row groups, then the dense rows
  // (group 0, the residency's among them). The backend goes first, so that work it forks after
  // its attention (a selection on a side stream) overlaps the rest of the layer.
  if (backend_ != nullptr && plan_.has_backend_work()) {
    RUBATO_RETURN_IF_ERROR(backend_->Attend(context));
  }
  const int decode_rows = plan_.decode_rows;
  const int dense_first = plan_.backend_rows;
  if (decode_rows > dense_first && residency_step_) {
    RUBATO_RETURN_IF_ERROR(
        residency_->AttendDecodeRows(context, dense_first, decode_rows - dense_first, window));
  } else if (decode_rows > dense_first) {
    cuda::DecodeAttentionParams dense = context.DecodeRows(dense_first, decode_rows - dense_first);
    dense.sink_tokens = window.sink_tokens;
    dense.recent_tokens = window.recent_tokens;
    RUBATO_RETURN_IF_ERROR(cuda::DecodeAttention(dense, stream));
  }
  // Rows [decode_rows, tokens): the chunks; those with a plan last, and only when the backend
  // does not attend them itself.
  const bool backend_prefill =
      backend_ != nullptr && plan_.backend_prefill_entries > 0 && backend_->AttendsPrefill();
  const int prefill_entries = backend_prefill
                                  ? plan_.prefill_entries - plan_.backend_prefill_entries
                                  : plan_.prefill_entries;
  if (prefill_entries > 0) {
    cuda::PrefillAttentionParams prefill;
    prefill.q = qkv_.data() + static_cast<size_t>(decode_rows) * qkv_dim;
    prefill.q_row_stride = qkv_dim;
    prefill.key_pool = kv.layer_keys(layer);
    prefill.value_pool = kv.layer_values(layer);
    prefill.block_tables = StepInput<const int32_t>(input_layout_.prefill_block_tables);
    prefill.block_table_stride = plan_.prefill_table_stride;
    prefill.query_start = StepInput<const int32_t>(input_layout_.prefill_query_start);
    prefill.start_position = StepInput<const int32_t>(input_layout_.prefill_start_positions);
    prefill.entries = prefill_entries;
    prefill.total_tokens = backend_prefill ? plan_.plain_prefill_tokens : tokens - decode_rows;
    prefill.max_query_tokens =
        backend_prefill ? plan_.plain_max_prefill_tokens : plan_.max_prefill_tokens;
    prefill.num_heads = heads;
    prefill.num_kv_heads = kv_heads;
    prefill.head_dim = head_dim;
    prefill.block_tokens = block_tokens;
    prefill.scale = scale;
    prefill.sink_tokens = window.sink_tokens;
    prefill.recent_tokens = window.recent_tokens;
    prefill.out = attention_.data() + static_cast<size_t>(decode_rows) * q_dim;
    prefill.out_row_stride = q_dim;
    RUBATO_RETURN_IF_ERROR(cuda::PrefillAttention(prefill, stream));
  }

  return gemm_->Linear(Linear(attention_.data(), w.o_proj, &w.o_bias, delta_.data(), tokens, q_dim,
                              config_.hidden_size),
                       stream);
}

// normed -> delta: down(silu(gate(x)) * up(x)), gate and up from one fused GEMM.
Status CudaModel::Mlp(int layer, cudaStream_t stream) {
  const CudaLayerWeights& w = weights_.layers[static_cast<size_t>(layer)];
  const int tokens = plan_.tokens;
  const int intermediate = config_.intermediate_size;
  RUBATO_RETURN_IF_ERROR(gemm_->Linear(Linear(normed_.data(), w.gate_up, nullptr, gate_up_.data(),
                                              tokens, config_.hidden_size, 2 * intermediate),
                                       stream));
  cuda::SwiGluParams swiglu;
  swiglu.gate_up = gate_up_.data();
  swiglu.out = mlp_act_.data();
  swiglu.tokens = tokens;
  swiglu.intermediate = intermediate;
  RUBATO_RETURN_IF_ERROR(cuda::SwiGlu(swiglu, stream));
  return gemm_->Linear(Linear(mlp_act_.data(), w.down, nullptr, delta_.data(), tokens, intermediate,
                              config_.hidden_size),
                       stream);
}

// normed rows -> gathered logit rows -> lm_head (f32) -> sampled ids of the first sample_rows.
Status CudaModel::LogitsAndSampling(cudaStream_t stream) {
  const int rows = plan_.logit_rows();
  if (rows == 0) return Status::Ok();
  cuda::GatherRowsParams gather;
  gather.in = normed_.data();
  gather.in_rows = plan_.tokens;
  gather.row_indices = StepInput<const int32_t>(input_layout_.logit_row_indices);
  gather.rows = rows;
  gather.dim = config_.hidden_size;
  gather.out = logit_inputs_.data();
  RUBATO_RETURN_IF_ERROR(cuda::GatherRows(gather, stream));

  cuda::LinearArgs lm_head;
  lm_head.x = logit_inputs_.data();
  lm_head.weight = weights_.output_projection();
  lm_head.y = logits_.data();
  lm_head.y_dtype = DType::kF32;
  lm_head.rows = rows;
  lm_head.in_features = config_.hidden_size;
  lm_head.out_features = config_.vocab_size;
  RUBATO_RETURN_IF_ERROR(gemm_->Linear(lm_head, stream));

  if (plan_.sample_rows == 0) return Status::Ok();
  if (plan_.adjusts_logits()) {
    // Penalties and logit_bias on the sampled rows, in place; the host rows keep raw logits.
    cuda::AdjustLogitsParams adjust;
    adjust.logits = logits_.data();
    adjust.rows = plan_.sample_rows;
    adjust.vocab_size = config_.vocab_size;
    adjust.row_offsets = StepInput<const int32_t>(input_layout_.logit_delta_offsets);
    adjust.deltas = StepInput<const LogitDelta>(input_layout_.logit_deltas);
    RUBATO_RETURN_IF_ERROR(cuda::AdjustLogits(adjust, stream));
  }
  cuda::SampleParams sample;
  sample.logits = logits_.data();
  sample.rows = plan_.sample_rows;
  sample.vocab_size = config_.vocab_size;
  sample.row_params = StepInput<const cuda::SamplingRow>(input_layout_.sampling_rows);
  sample.tokens = sampled_.data();
  sample.workspace = sample_workspace_.data();
  sample.workspace_bytes = sample_workspace_.size();
  sample.probabilities = reinterpret_cast<float*>(sampled_.data() + sample_capacity_);
  return cuda::SampleTokens(sample, stream);
}

}  // namespace rubato
