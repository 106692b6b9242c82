// SFI's fidelity guard on the CUDA model (sfi_cuda_backend.h; docs/fidelity.md): the twin of
// sfi_cpu_backend.cc's BeforeAttention / FinishForward / Remember. Slow entries' last queries
// become their slots' references, fast rows add their drift per layer, and the sums come back
// with the step's sampled tokens (EnqueueReadBack, the model's one synchronization).
#include "inference_rank/policies/sfi/kernels/query_drift.cuh"
#include "inference_rank/policies/sfi/sfi_cuda_backend.h"

namespace rubato {
namespace {

// Device address of one of SFI's step-input arrays (SfiStepInputLayout) in `layer`'s region.
const int32_t* StepInts(const CudaLayerContext& layer, size_t offset) {
  return reinterpret_cast<const int32_t*>(layer.policy_inputs + offset);
}

}  // namespace

// The guard's launches read the layer's queries (after RoPE) from the fused q|k|v rows and their
// positions, slots and rows from the step inputs: nothing that changes between graph replays.
Status SfiCudaBackend::RememberGuardQueries(const CudaLayerContext& layer) {
  const ModelConfig& model = *layer.config;
  cuda::QueryDriftParams remember;
  remember.q = layer.qkv;
  remember.q_row_stride = model.q_dim() + 2 * model.kv_dim();
  remember.q_rows = StepInts(layer, input_layout_.selection_q_rows);
  remember.positions = StepInts(layer, input_layout_.selection_positions);
  remember.slots = StepInts(layer, input_layout_.slow_slots);
  remember.num_slots = pool_->shape().slots;
  remember.inv_freq = layer.inv_freq;
  remember.references = pool_->layer_guard_references(layer.layer);
  remember.batch = step_.selections;
  remember.num_heads = model.num_heads;
  remember.head_dim = model.head_dim;
  return cuda::RememberQueries(remember, layer.stream);
}

Status SfiCudaBackend::AddGuardDrift(const CudaLayerContext& layer) {
  const ModelConfig& model = *layer.config;
  const int64_t qkv_dim = model.q_dim() + 2 * model.kv_dim();
  cuda::QueryDriftParams drift;
  drift.q = layer.qkv + static_cast<size_t>(step_.fast_first_row) * qkv_dim;  // fast rows: b
  drift.q_row_stride = qkv_dim;
  drift.positions = StepInts(layer, input_layout_.fast_positions);
  drift.slots = StepInts(layer, input_layout_.fast_slots);
  drift.num_slots = pool_->shape().slots;
  drift.inv_freq = layer.inv_freq;
  drift.references = pool_->layer_guard_references(layer.layer);
  drift.cosine_sums = pool_->guard_cosine_sums();
  drift.reset = layer.layer == 0;
  drift.batch = step_.fast_rows;
  drift.num_heads = model.num_heads;
  drift.head_dim = model.head_dim;
  return cuda::AddQueryDrift(drift, layer.stream);
}

void SfiCudaBackend::FinishGuard(std::span<const ForwardEntry> batch) {
  if (!guard_on() || step_.fast_rows == 0) return;
  const auto* sums = reinterpret_cast<const float*>(guard_sums_host_.data());
  for (size_t e = 0; e < batch.size(); ++e) {
    const EntryAttention* attention = batch[e].attention;
    if (attention == nullptr || !IsSfiFastPlan(*attention)) continue;
    SfiSequenceState& state = SfiStateOf(*attention);
    state.guard_cosine_sum = sums[slots_[e]];
    // As the CPU backend: the mean over the layers against the threshold.
    state.guard_fired = QueryDriftGuard::Fires(config_.fidelity_guard,
                                               state.guard_cosine_sum / model_.config().num_layers);
  }
}

}  // namespace rubato
