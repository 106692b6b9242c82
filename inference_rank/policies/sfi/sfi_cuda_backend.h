// SFI's backend half on the CUDA model (docs/design.md §4.2; docs/sfi.md "CUDA model"): a pool of
// compact buffers with a slot per request (cuda_sfi_pool.h); fast rows (kSfiFastRows) attend
// their slot and the recent segment in one two-segment launch per layer; slow rows
// (kSfiSlowRows), and the last W queries of a prompt's last chunk ("window rows"), attend densely
// and write the raw scores the Selector reads; then per layer the Selector and the compact gather
// run on the maintenance ring's low-priority aux stream (cuda_sfi_ring.h). With
// policy.fidelity_guard, slow entries remember their query per layer and fast rows add their
// query's drift into their slot's sum, read back with the step's tokens (docs/fidelity.md).
// Decode steps of any SFI mix replay as CUDA graphs. The step planning below is host-only
// (tested without a GPU).
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <vector>

#include "common/status.h"
#include "inference_rank/attention/cuda_backend.h"
#include "inference_rank/model/cuda_model.h"
#include "inference_rank/model/cuda_pinned_buffer.h"
#include "inference_rank/policies/sfi/cuda_sfi_pool.h"
#include "inference_rank/policies/sfi/cuda_sfi_ring.h"
#include "inference_rank/policies/sfi/sfi_config.h"
#include "inference_rank/policies/sfi/sfi_state.h"
#include "kernels/cuda/device_buffer.h"

namespace rubato {

// A prompt's last chunk: its selection from its last W queries (the window rows).
struct SfiWindowPlan {
  int entry = 0;          // batch index
  int prefill_index = 0;  // among the prefill chunks (its prefill block-table row)
  int window = 0;         // W: the chunk's last W rows are its window rows
  int first_row = 0;      // its first window row
  int length = 0;         // keys after the chunk: start_position + tokens
  int j_count = 0;        // |J| at that length
};

// How many elements each SFI step-input array can hold (grows, never shrinks).
struct SfiStepInputCapacity {
  int fast_rows = 0;          // fast rows' slots and recent_begin
  int selections = 0;         // selections' slots, sink ends and |J|
  int window_rows = 0;        // window rows' lengths and query rows
  int window_table_ints = 0;  // [window rows][prefill stride] block ids

  bool Covers(const SfiStepInputCapacity& need) const;
  // Each field the larger of the two, rounded up to a power of two.
  SfiStepInputCapacity GrownToCover(const SfiStepInputCapacity& need) const;
};

// Byte offsets of SFI's arrays in its step-input region (the paper's "packed descriptor"),
// 16-byte aligned.
struct SfiStepInputLayout {
  size_t fast_slots = 0;      // [fast rows] int32: compact-pool slot
  size_t recent_begin = 0;    // [fast rows] int32: the state's anchor
  size_t fast_positions = 0;  // [fast rows] int32: the query's position (the guard's)
  size_t slow_slots = 0;      // [selections] int32: compact-pool slot
  size_t sink_end = 0;        // [selections] int32: SfiSinkEnd = J's first position
  size_t j_count = 0;         // [selections] int32: |J| = SfiAnchor - SfiSinkEnd
  // [selections] int32: the batch row and position of the query the selection answers (the
  // entry's last), which the fidelity guard remembers.
  size_t selection_q_rows = 0;
  size_t selection_positions = 0;
  size_t window_seq_lens = 0;      // [window rows] int32: the chunk's end (all its keys)
  size_t window_q_rows = 0;        // [window rows] int32: batch row of the query
  size_t window_block_tables = 0;  // [window rows][prefill_table_stride] int32
  size_t bytes = 0;                // the whole region

  static SfiStepInputLayout For(const SfiStepInputCapacity& capacity);
};

// One forward's SFI work, planned from the model's plan (ForwardPlan): the Selector calls
// ("selections") are the slow decode rows (W = 1), then the prompts' last chunks in batch order.
struct SfiStepPlan {
  int fast_first_row = 0;  // decode rows [fast_first_row, + fast_rows): row group kSfiFastRows
  int fast_rows = 0;
  int slow_first_row = 0;      // decode rows [slow_first_row, + slow_rows): kSfiSlowRows,
  int slow_rows = 0;           // selections [0, slow_rows)
  int selections = 0;          // slow_rows + windows.size()
  int window_rows = 0;         // sum of the windows
  int window_max_seq_len = 0;  // longest window row's keys (max SfiWindowPlan::length)
  // Bound of L - anchor over the fast rows (the two-segment grid): recent_window + t_max, what
  // the schedule allows, or the power of two above a longer segment; at most the decode bucket.
  int recent_bucket = 0;
  int max_j_count = 0;   // SfiSelect bound of |J| over the slow decode rows
  int score_stride = 0;  // row stride of the scores: covers every selection's keys, x 64
  std::vector<SfiWindowPlan> windows;  // the prefill selections, in batch order
  std::vector<int> entry_selection;    // [entries] selection index of a slow entry, or -1

  int score_rows() const { return slow_rows + window_rows; }
  SfiStepInputCapacity Needs(const ForwardPlan& plan) const;
};

// Plans the SFI entries of `batch` (checked by SfiCudaBackend::CheckBatch) under `config`.
void PlanSfiStep(std::span<const ForwardEntry> batch, const ForwardPlan& plan,
                 const SfiPolicyConfig& config, SfiStepPlan& sfi);

// Writes SFI's step inputs into `region` (layout.bytes, laid out for a capacity covering
// sfi.Needs(plan)). slots: [entries] the compact-pool slot of each SFI entry (-1 for the others).
void FillSfiStepInputs(std::span<const ForwardEntry> batch, const ForwardPlan& plan,
                       const SfiStepPlan& sfi, const SfiPolicyConfig& config,
                       const KvCacheShape& shape, const SfiStepInputLayout& layout,
                       std::span<const int> slots, std::byte* region);

class SfiCudaBackend final : public CudaAttentionBackend {
 public:
  ~SfiCudaBackend() override;

  const Model* made_for_model() const override { return &model_; }
  int requests_holding_resources() const override { return pool_->slots_in_use(); }
  // Fast entries need a selection this backend made; slow entries without a slot need a free one
  // (all or nothing over the batch: ResourceExhausted). Nothing is changed.
  Status CheckBatch(std::span<const ForwardEntry> batch) const override;
  Status Reserve(std::span<const ForwardEntry> batch, const ForwardPlan& plan,
                 const std::function<void()>& drop_graphs) override;
  size_t StepInputBytes() const override { return input_layout_.bytes; }
  size_t DecodeWorkspaceBytes(const ForwardPlan& plan) const override;
  // A slot for every SFI entry whose state holds none (slow ones, CheckBatch); a slow entry's
  // state holds no selection from here until its step succeeded (FinishStep).
  Status Acquire(std::span<const ForwardEntry> batch) override;
  void FillStepInputs(std::span<const ForwardEntry> batch, const ForwardPlan& plan,
                      const KvCacheShape& shape, std::byte* region) override;
  void AddToGraphKey(const ForwardPlan& plan, DecodeGraphKey& key) const override;
  Status BeginStep(cudaStream_t main) override;
  Status Attend(const CudaLayerContext& layer) override;
  Status EndStep() override;
  Status EnqueueReadBack(cudaStream_t stream) override;
  void AbortStep() override;
  // The slow entries' states: anchor, and every layer's counts copied back from the device; with
  // the guard, the fast entries' cosine sums and guard_fired.
  Status FinishStep(std::span<const ForwardEntry> batch) override;

  // Slow steps' maintenance on the aux stream, overlapped with the next layers (the default), or
  // inline on the main stream (the same bits, slower; what the benchmark compares against).
  void SetOverlap(bool overlap) { overlap_ = overlap; }
  int slots_in_use() const { return pool_->slots_in_use(); }
  const SfiPolicyConfig& config() const { return config_; }

  // TESTS / DEBUGGING: the positions a request's compact buffers hold in `layer`, per KV head
  // (the CPU backend's SfiLayerState::kept): sink positions then the selected ones, ascending.
  // Copies from the device synchronously. FailedPrecondition when the state holds no selection
  // made by this backend.
  Result<std::vector<std::vector<int>>> KeptPositions(const SfiSequenceState& state, int layer);
  // TESTING: the key norms (gamma > 0) the last forward computed for its Selector call number
  // `selection` (its slow decode rows first, in row order, then its prefill windows) at
  // `layer`: [num_kv_heads][positions] f32, row h holding position p at index p (entries outside
  // J hold whatever the ring held). The ring keeps only the last SfiMaintenanceRing::kSlots
  // layers of a step: FailedPrecondition for an older layer, a selection the last forward did
  // not make, more positions than its score rows hold, or gamma 0.
  Result<std::vector<float>> KeyNormsForTest(int layer, int selection, int positions);

 private:
  friend Result<std::unique_ptr<AttentionBackend>> MakeSfiCudaBackend(CudaModel&,
                                                                      const SfiPolicyConfig&, int);
  SfiCudaBackend(CudaModel& model, const SfiPolicyConfig& config, std::unique_ptr<CudaSfiPool> pool,
                 std::unique_ptr<SfiMaintenanceRing> ring, PinnedBuffer counts_host,
                 PinnedBuffer guard_sums_host);

  // Per layer, on the main stream: fast rows' two-segment attention; slow rows' dense attention
  // with scores (+ the window rows'); then the Selector and the gather of the slow entries, on
  // the ring's aux stream (or inline).
  Status FastAttention(const CudaLayerContext& layer);
  Status SlowAttention(const CudaLayerContext& layer);
  Status Maintenance(const CudaLayerContext& layer);
  // The fidelity guard (policy.fidelity_guard > 0), on the main stream: the selections' queries
  // become their slots' references; the fast rows' drift is added into their slots' sums.
  Status RememberGuardQueries(const CudaLayerContext& layer);
  Status AddGuardDrift(const CudaLayerContext& layer);
  // The fast entries' states: the read-back cosine sum and whether the guard fired.
  void FinishGuard(std::span<const ForwardEntry> batch);
  bool guard_on() const { return config_.fidelity_guard > 0.0; }
  // The key norms (gamma > 0) of Selector call `selection` at `layer`, in the layer's ring slot:
  // [num_kv_heads][score stride] f32 indexed by position.
  float* KeyNorms(int layer, int selection);

  CudaModel& model_;
  const SfiPolicyConfig config_;
  bool overlap_ = true;
  std::unique_ptr<CudaSfiPool> pool_;         // per-request compact buffers
  std::unique_ptr<SfiMaintenanceRing> ring_;  // slow-step scratch, aux stream, events
  PinnedBuffer counts_host_;                  // [layer][slot][kv_head] int32, host copy
  // The fidelity guard's host copy of the pool's cosine sums, [slot] f32 (empty when it is off).
  // It un-rotates queries with the model's RoPE frequencies (CudaLayerContext::inv_freq).
  PinnedBuffer guard_sums_host_;
  // Per forward.
  SfiStepPlan step_;
  std::vector<int> slots_;  // [entries] pool slot of SFI entries, or -1
  SfiStepInputCapacity input_capacity_;
  SfiStepInputLayout input_layout_;
  int window_capacity_ = 0;                       // rows the two buffers below hold
  cuda::DeviceBuffer<__nv_bfloat16> window_qkv_;  // [window rows][q_dim + 2 kv_dim], bf16
  cuda::DeviceBuffer<__nv_bfloat16> window_out_;  // [window rows][q_dim], bf16, unused
};

// SFI's CUDA half for `model` and up to `max_batch` requests holding a selection at once: the
// compact pool (sink + budget rows per layer and KV head and request), the maintenance ring and,
// with policy.fidelity_guard, the guard's references (num_heads x head_dim f32 per layer and
// request).
// InvalidArgument for an invalid config, max_batch < 1 or more than 2^24 compact rows per head;
// ResourceExhausted naming the bytes when the pool does not fit.
Result<std::unique_ptr<AttentionBackend>> MakeSfiCudaBackend(CudaModel& model,
                                                             const SfiPolicyConfig& config,
                                                             int max_batch);

}  // namespace rubato
