// The CUDA model: the Llama / Qwen2 / Qwen3 decoder of cpu_model.h on one NVIDIA GPU, with bf16
// weights, activations and KV cache and fp32 accumulation (DESIGN §3, issue #4).
//
// Same contract as the CPU model (model.h): a forward runs a batch of decode tokens and prefill
// chunks of different sequences against a paged KV cache (bf16 device pools, block accounting on
// the host), with the same validation, all-or-nothing block reservation, rewinds and attention
// windows. The differences are precision (bf16 storage, so logits agree with the CPU model to
// bf16 rounding, not bit for bit) and sampling, which runs on the device: an entry that samples
// with LogitsWanted::kLast gets its token id back and no logits.
//
// One forward, on the model's stream:
//   host:   validate, reserve blocks, plan rows (cuda_forward_plan.h), pack the step inputs into
//           pinned memory, ONE host-to-device copy;
//   device: embedding -> per layer { [add +] RMSNorm; fused QKV GEMM (+bias); Qwen3 q/k-norm;
//           RoPE over q|k; KV append; decode attention over the decode rows, prefill attention
//           over the chunk rows; o_proj; add + RMSNorm; fused gate|up GEMM; SwiGLU; down } ->
//           add + final RMSNorm -> gather the rows that need logits -> lm_head (f32) ->
//           sampling;
//   host:   copy back sampled ids (and logits where wanted), one stream synchronization.
// A batch of decode tokens only replays its device part as a CUDA graph (cuda_decode_graph.h).
//
// SFI entries (sfi_state.h, DESIGN §4.2; cuda_model_sfi.cc) after PrepareSfi: fast decode rows
// attend their compact buffers (a slot of the model's pool, cuda_sfi_pool.h) and the recent
// segment in one two-segment launch per layer; slow rows attend densely and also write the raw
// scores the Selector reads, and the chunk that ends an SFI prompt has the scores of its last W
// queries computed the same way; then per layer the Selector and the compact gather run on a
// low-priority aux stream while the main stream goes on (cuda_sfi_ring.h). Decode steps replay
// graphs whatever their SFI mix (the aux stream forks and joins inside the capture).
//
// Offloaded entries (kv_offload.h; cuda_model_offload.cc): per layer, after the KV append, their
// new K/V go to the exchange through pinned host memory and their decode rows attend what it
// returns: a whole prefix as paged blocks with the dense kernel (local dense's bits), a compact
// selection plus the recent segment with the two-segment kernel. Synchronous per layer and never
// in a graph: the correctness path.
//
// Not thread-safe: one thread drives a model (as the engine does).
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <memory>
#include <span>
#include <string_view>
#include <vector>

#include "common/hf_config.h"
#include "common/status.h"
#include "inference_rank/kv/paged_kv_cache.h"
#include "inference_rank/model/cuda_decode_graph.h"
#include "inference_rank/model/cuda_forward_plan.h"
#include "inference_rank/model/cuda_kv_storage.h"
#include "inference_rank/model/cuda_pinned_buffer.h"
#include "inference_rank/model/cuda_sfi_pool.h"
#include "inference_rank/model/cuda_sfi_ring.h"
#include "inference_rank/model/cuda_weights.h"
#include "inference_rank/model/model.h"
#include "inference_rank/model/model_weights.h"
#include "kernels/cuda/decode_attention.cuh"
#include "kernels/cuda/device_buffer.h"
#include "kernels/cuda/gemm.h"

namespace rubato {

struct CudaModelOptions {
  bool random_weights = false;  // weights from config.json alone, generated on the device
  uint64_t seed = 0;            // seed of random_weights
  int device = 0;               // CUDA device index
  bool use_cuda_graph = true;   // replay decode steps as CUDA graphs (off: every step eager)
  // SFI slow steps: the Selector and the compact gather of layer i on a low-priority aux stream,
  // overlapped with layers i+1.. (off: inline on the main stream; the same bits, slower).
  bool sfi_overlap = true;
};

// Reads model_dir/config.json and, unless options.random_weights, its safetensors checkpoint
// (bf16, f16 or f32; converted to bf16 tensor by tensor). Errors: Unsupported for shapes the
// CUDA kernels do not cover (e.g. head_dim 12), Unavailable when there is no such device,
// ResourceExhausted (with the bytes) when the weights do not fit.
Result<std::unique_ptr<Model>> LoadCudaModel(const std::filesystem::path& model_dir,
                                             const CudaModelOptions& options);

class CudaModel : public Model {
 public:
  // From fp32 host weights (tests: the CPU model's weights, so both models compute the same
  // function up to bf16 rounding).
  static Result<std::unique_ptr<CudaModel>> Create(ModelConfig config,
                                                   const ModelWeights& host_weights,
                                                   const CudaModelOptions& options);
  // From weights already on the device (LoadCudaModel).
  static Result<std::unique_ptr<CudaModel>> Create(ModelConfig config, CudaWeights weights,
                                                   const CudaModelOptions& options);

  // Unsupported naming the value when the CUDA kernels cannot run `config`.
  static Status CheckSupported(const ModelConfig& config);

  ~CudaModel() override;

  const ModelConfig& config() const override { return config_; }
  std::string_view backend_name() const override { return "cuda"; }
  size_t weight_bytes() const override { return CudaWeightBytes(config_); }  // bf16

  // A cache with bf16 device pools (DeviceKvStorage), zeroed; ResourceExhausted with the bytes.
  Result<std::unique_ptr<PagedKvCache>> CreateKvCache(int block_tokens, int num_blocks) override;

  // Model::Forward. `cache` must come from CreateKvCache of a CUDA model (InvalidArgument
  // otherwise). A batch with offloaded entries runs eagerly, waiting for the exchange in every
  // layer. SFI entries need PrepareSfi first and, within one forward, one config object
  // (the engine's); their config must not change while the model runs (captured step graphs
  // keep the Selector settings they were captured with). A slow entry takes a pool slot for its
  // state if it holds none (all or nothing over the batch: ResourceExhausted when they are
  // taken); a fast entry needs a selection made by this model. A slow entry's state holds no
  // selection from the moment its device work is enqueued until that work succeeded.
  Status Forward(std::span<const ForwardEntry> batch, PagedKvCache& cache, ForwardResult& result,
                 const AttentionWindow& window = AttentionWindow()) override;

  // Model::PrepareSfi: the compact pool for max_sequences requests (cuda_sfi_pool.h) and the
  // maintenance ring. Unsupported for selector.gamma > 0 (the key-norm prior has no CUDA
  // kernel yet). Drops the captured graphs.
  Status PrepareSfi(const SfiPolicyConfig& config, int max_sequences) override;

  // TESTS / DEBUGGING: the positions a request's compact buffers hold in `layer`, per KV head
  // (the CPU model's SfiLayerState::kept): sink positions then the selected ones, ascending.
  // Copies from the device synchronously. FailedPrecondition when the state holds no selection
  // made by this model.
  Result<std::vector<std::vector<int>>> SfiKeptPositions(const SfiSequenceState& state, int layer);
  // TESTING: the key norms (gamma > 0) the last forward computed for its Selector call number
  // `selection` (its slow decode rows first, in the plan's row order, then its prefill windows)
  // at `layer`: [num_kv_heads][positions] f32, row h holding position p at index p (entries
  // outside J hold whatever the ring held). The ring keeps only the last
  // SfiMaintenanceRing::kSlots layers of a step: FailedPrecondition for an older layer, a
  // selection the last forward did not make, more positions than its score rows hold, or gamma 0.
  Result<std::vector<float>> SfiKeyNormsForTest(int layer, int selection, int positions);
  int sfi_slots_in_use() const { return sfi_pool_ == nullptr ? 0 : sfi_pool_->slots_in_use(); }
  // BENCHMARK (bench/decode_e2e_sfi.cc): switches CudaModelOptions::sfi_overlap, dropping the
  // captured graphs (they hold the old mode's launches).
  void SetSfiOverlap(bool overlap) {
    graphs_.Clear();
    options_.sfi_overlap = overlap;
  }

  // BENCHMARK ONLY (bench/decode_e2e.cc): makes every sequence hold `context` positions of
  // random KV without a prefill: reserves their blocks (all or nothing), fills the whole K and V
  // pools of the cache with random bf16 in [-1, 1], and sets num_tokens = context. The values
  // mean nothing; decode speed does not depend on them. Sequences must be empty.
  Status FillKvForBenchmark(PagedKvCache& cache, std::span<KvSequence* const> sequences,
                            int context, uint64_t seed);

  // Decode-step graphs captured and launched so far (tests, benchmark).
  int64_t graph_captures() const { return graphs_.captures(); }
  int64_t graph_replays() const { return graphs_.replays(); }

  cudaStream_t stream() const { return stream_; }

 private:
  CudaModel(ModelConfig config, CudaWeights weights, const CudaModelOptions& options);
  Status Init();

  // Grows the step inputs, activations and workspaces to what `plan` needs (outside any
  // capture); any reallocation drops the captured graphs.
  Status EnsureCapacity(const ForwardPlan& plan);
  // Launches the device work of `plan_` on `stream` (cuda_model_forward.cc).
  Status EnqueueForward(DeviceKvStorage& kv, const AttentionWindow& window, cudaStream_t stream);
  Status DecoderLayer(int layer, DeviceKvStorage& kv, const AttentionWindow& window,
                      cudaStream_t stream);
  Status SelfAttention(int layer, DeviceKvStorage& kv, const AttentionWindow& window,
                       cudaStream_t stream);
  Status Mlp(int layer, cudaStream_t stream);
  Status LogitsAndSampling(cudaStream_t stream);
  // Decode attention over decode rows [first_row, first_row + rows) of the batch (dense, in the
  // forward's window), before the SFI specifics.
  // The fields every decode attention launch of `layer` shares: the layer's K/V pools, the
  // head shapes, the scale, the output row stride and the workspace (cuda_model_forward.cc).
  cuda::DecodeAttentionParams LayerDecodeParams(int layer, DeviceKvStorage& kv);
  cuda::DecodeAttentionParams DecodeRows(int layer, DeviceKvStorage& kv, int first_row, int rows,
                                         const AttentionWindow& window);

  // SFI (cuda_model_sfi.cc). Host side, in Forward's order: the CUDA model's own checks of a
  // validated batch (pool, one config, fast states made here, free slots: nothing is changed
  // on failure); slots for the slow entries (into sfi_slots_); the scratch the plan needs; after
  // the device work, the slow entries' states (anchor, counts from sfi_counts_host_).
  Status CheckSfiBatch(std::span<const ForwardEntry> batch) const;
  Status AcquireSfiSlots(std::span<const ForwardEntry> batch);
  Status EnsureSfiCapacity(const ForwardPlan& plan);  // drops the graphs before moving a buffer
  Status FinishSfiStep(std::span<const ForwardEntry> batch);
  // Device side, per layer: fast rows' two-segment attention and slow rows' dense attention with
  // scores (+ the window rows'), on the main `stream`; then the Selector and the gather of the
  // slow entries, on the ring's aux stream (or inline on the step's main stream).
  Status SfiFastAttention(int layer, DeviceKvStorage& kv, cudaStream_t stream);
  Status SfiSlowAttention(int layer, DeviceKvStorage& kv, cudaStream_t stream);
  Status SfiMaintenance(int layer, DeviceKvStorage& kv);
  // The key norms (gamma > 0) of Selector call `selection` of the current plan at `layer`, in
  // layer's ring slot: [num_kv_heads][score stride] f32 indexed by position. KeyNorms writes them
  // and SfiSelect (and SfiKeyNormsForTest) read them here.
  float* SfiKeyNorms(int layer, int selection) {
    const size_t row = static_cast<size_t>(config_.num_kv_heads) * plan_.sfi_score_stride;
    return sfi_ring_->slot(layer).key_norms.data() + static_cast<size_t>(selection) * row;
  }
  // Offloaded entries (cuda_model_offload.cc). PlanOffload (host, before the device work): the
  // batch's offloaded entries and the pinned buffer their rows come back in. OffloadLayer (after
  // the layer's KV append): ships their K/V and last query to the exchange and uploads the
  // replies of their decode rows. OffloadedDecodeAttention: decode rows [first_row, + rows), the
  // offloaded ones two-segment over their replies, the others dense in runs.
  Status PlanOffload(std::span<const ForwardEntry> batch);
  Status OffloadLayer(int layer, DeviceKvStorage& kv, cudaStream_t stream);
  Status OffloadedDecodeAttention(int layer, DeviceKvStorage& kv, int first_row, int rows,
                                  const AttentionWindow& window, cudaStream_t stream);

  // Device address of a step-input array at `offset` (StepInputLayout).
  template <typename T>
  T* StepInput(size_t offset) {
    return reinterpret_cast<T*>(reinterpret_cast<std::byte*>(step_inputs_.data()) + offset);
  }

  ModelConfig config_;
  CudaModelOptions options_;
  CudaWeights weights_;
  cudaStream_t stream_ = nullptr;  // non-blocking: every forward's copies and kernels
  std::unique_ptr<cuda::CublasLtGemm> gemm_;
  cuda::DeviceBuffer<float> inv_freq_;  // [head_dim / 2], f32, RoPE inverse frequencies
  DecodeGraphCache graphs_;

  // Per-forward state. Buffers only grow; each growth drops the graphs (captured addresses).
  ForwardPlan plan_;
  StepInputCapacity input_capacity_;
  StepInputLayout input_layout_;
  PinnedBuffer staging_;                            // host copy of the step inputs
  cuda::DeviceBuffer<unsigned char> step_inputs_;   // StepInputLayout, device
  int activation_rows_ = 0;                         // rows the activations below hold
  cuda::DeviceBuffer<float> residual_;              // [rows][hidden], f32, the residual stream
  cuda::DeviceBuffer<__nv_bfloat16> normed_;        // [rows][hidden], bf16, RMSNorm output
  cuda::DeviceBuffer<__nv_bfloat16> qkv_;           // [rows][q_dim + 2 kv_dim], bf16
  cuda::DeviceBuffer<__nv_bfloat16> attention_;     // [rows][q_dim], bf16, attention output
  cuda::DeviceBuffer<__nv_bfloat16> delta_;         // [rows][hidden], bf16, o_proj / down output
  cuda::DeviceBuffer<__nv_bfloat16> gate_up_;       // [rows][2 intermediate], bf16
  cuda::DeviceBuffer<__nv_bfloat16> mlp_act_;       // [rows][intermediate], bf16, SwiGLU output
  int logit_capacity_ = 0;                          // rows the two buffers below hold
  cuda::DeviceBuffer<__nv_bfloat16> logit_inputs_;  // [logit rows][hidden], bf16, gathered
  cuda::DeviceBuffer<float> logits_;                // [logit rows][vocab], f32
  int sample_capacity_ = 0;
  // [2][sample capacity] words, device: the token ids (int32), then their probabilities (f32,
  // cuda::SampleParams::probabilities; -1 for rows that did not ask).
  cuda::DeviceBuffer<int32_t> sampled_;
  PinnedBuffer sampled_host_;                           // the same layout, host copy
  cuda::DeviceBuffer<unsigned char> decode_workspace_;  // DecodeAttentionWorkspaceBytes
  cuda::DeviceBuffer<unsigned char> sample_workspace_;  // SampleWorkspaceBytes

  // SFI, from PrepareSfi on.
  std::unique_ptr<CudaSfiPool> sfi_pool_;             // per-request compact buffers
  std::unique_ptr<SfiMaintenanceRing> sfi_ring_;      // slow-step scratch, aux stream, events
  PinnedBuffer sfi_counts_host_;                      // [layer][slot][kv_head] int32, host copy
  std::vector<int> sfi_slots_;                        // [entries] pool slot of SFI entries, or -1
  int sfi_window_capacity_ = 0;                       // rows the two buffers below hold
  cuda::DeviceBuffer<__nv_bfloat16> sfi_window_qkv_;  // [window rows][q_dim + 2 kv_dim], bf16
  cuda::DeviceBuffer<__nv_bfloat16> sfi_window_out_;  // [window rows][q_dim], bf16, unused

  // Offloaded entries of the current forward (PlanOffload) and their decode rows' replies.
  struct OffloadEntryPlan {
    KvOffloadExchange* exchange = nullptr;
    uint64_t session_id = 0;
    int first_row = 0;       // batch row of the entry's first token
    int tokens = 0;
    int start_position = 0;
    int download_row = 0;    // first row in offload_download_
    bool attends = false;    // a decode row attending the exchange's compact KV
  };
  struct OffloadRow {        // one attending decode row's reply in offload_compact_
    int decode_row = 0;
    bool prefix = false;     // the whole prefix, as paged blocks (else a compact slab)
    int first_block = 0;     // prefix: its first block in the upload pool
    int table_row = 0;       // prefix: its row of the upload block tables
    int capacity = 0;        // compact: rows per KV head (>= 1)
    int recent_tokens = 0;   // L - recent_begin
    size_t keys_offset = 0;  // byte offsets (cuda_model_offload.cc has the layout)
    size_t values_offset = 0;
    size_t counts_offset = 0;
    size_t recent_begin_offset = 0;
  };
  std::vector<OffloadEntryPlan> offload_entries_;
  std::vector<OffloadRow> offload_rows_;
  size_t offload_prefix_keys_offset_ = 0;    // the prefix replies' pool and tables in
  size_t offload_prefix_values_offset_ = 0;  // offload_compact_ (cuda_model_offload.cc)
  size_t offload_prefix_tables_offset_ = 0;
  int offload_prefix_blocks_ = 0;
  PinnedBuffer offload_download_;                      // [offloaded rows][qkv_dim] bf16
  PinnedBuffer offload_upload_;                        // the replies, host
  cuda::DeviceBuffer<unsigned char> offload_compact_;  // the replies, device
  std::vector<float> offload_f32_;                     // the exchange's f32 K/V and queries
};

}  // namespace rubato
