// The CUDA model: the Llama / Qwen2 / Qwen3 decoder of cpu_model.h on one NVIDIA GPU, with bf16
// weights, activations and KV cache and fp32 accumulation (docs/design.md §3). Same contract as the
// CPU model (model.h), up to bf16 rounding; an entry that samples with LogitsWanted::kLast gets its
// token id back from the device and no logits. One forward: host planning and one input copy,
// the decoder's launches on one stream (a batch of decode tokens replays them as a CUDA graph),
// the results copied back and one synchronization. Attention plans run with the installed
// attention backend (attention/cuda_backend.h); entries whose KV a residency holds go through
// the installed residency backend (residency/cuda_residency_backend.h). docs/cuda_model.md. Not
// thread-safe: one thread drives it.
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
#include "inference_rank/attention/cuda_backend.h"
#include "inference_rank/kv/paged_kv_cache.h"
#include "inference_rank/model/cuda_decode_graph.h"
#include "inference_rank/model/cuda_forward_plan.h"
#include "inference_rank/model/cuda_kv_storage.h"
#include "inference_rank/model/cuda_pinned_buffer.h"
#include "inference_rank/model/cuda_slot_kv_storage.h"
#include "inference_rank/model/cuda_weights.h"
#include "inference_rank/model/model.h"
#include "inference_rank/model/model_weights.h"
#include "inference_rank/residency/cuda_residency_backend.h"
#include "kernels/cuda/device_buffer.h"
#include "kernels/cuda/gemm.h"

namespace rubato {

struct CudaModelOptions {
  bool random_weights = false;  // weights from config.json alone, generated on the device
  uint64_t seed = 0;            // seed of random_weights
  int device = 0;               // CUDA device index
  bool use_cuda_graph = true;   // replay decode steps as CUDA graphs (off: every step eager)
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
  // Model::KvPoolMemoryFor: the device's cudaMemGetInfo (the weights, the policy's and the
  // residency's buffers in place), bf16 blocks, and the activations and workspaces
  // EnsureCapacity will grow to for the largest step of `bounds` (PendingWorkspaceBytes).
  Result<KvPoolMemory> KvPoolMemoryFor(int block_tokens, const StepBounds& bounds) const override;
  // Model::CreateSlotKvPool: bf16 slot arrays, masks and next slots on the device
  // (DeviceSlotKvStorage), reset on the model's stream; ResourceExhausted with the bytes.
  // Slot entries' fixed-budget rows are the attention backend's (it writes their K/V).
  Result<std::unique_ptr<SlotKvPool>> CreateSlotKvPool(int budget, int num_arrays) override;

  // Model::Forward. `cache` must come from CreateKvCache of a CUDA model (InvalidArgument
  // otherwise). A batch with residency entries runs eagerly unless the residency backend is
  // graph_replayable. Entries with an attention plan need an installed backend (FailedPrecondition)
  // and a row_group >= 1; the backend checks the rest (CudaAttentionBackend::CheckBatch).
  Status Forward(std::span<const ForwardEntry> batch, PagedKvCache& cache, ForwardResult& result,
                 const AttentionWindow& window = AttentionWindow()) override;

  // Model::SetAttentionBackend: a CudaAttentionBackend made for this model, or null
  // (InvalidArgument for another backend's; FailedPrecondition while requests hold resources of
  // the current one). Drops the captured graphs.
  Status SetAttentionBackend(std::unique_ptr<AttentionBackend> backend) override;
  AttentionBackend* attention_backend() override { return backend_.get(); }

  // Model::SetResidencyBackend: a CudaResidencyBackend, or null (InvalidArgument for another
  // backend's). Drops the captured graphs.
  Status SetResidencyBackend(std::unique_ptr<ResidencyBackend> backend) override;
  ResidencyBackend* residency_backend() const override { return residency_.get(); }

  // Decode-step graphs captured and launched so far (tests, benchmark).
  int64_t graph_captures() const { return graphs_.captures(); }
  int64_t graph_replays() const { return graphs_.replays(); }

  cudaStream_t stream() const { return stream_; }
  int device() const { return options_.device; }  // the CUDA device index it runs on

 private:
  CudaModel(ModelConfig config, CudaWeights weights, const CudaModelOptions& options);
  Status Init();

  // Entries with an attention plan: a backend to run them and a row group >= 1.
  Status CheckAttentionEntries(std::span<const ForwardEntry> batch) const;
  // Grows the backend's buffers (CudaAttentionBackend::Reserve), then the step inputs,
  // activations and workspaces to what `plan` needs (outside any capture); any reallocation
  // drops the captured graphs first.
  Status EnsureCapacity(std::span<const ForwardEntry> batch, const ForwardPlan& plan);
  // Bytes EnsureCapacity would still allocate (same rounding) for a step of `bounds`: the
  // activations of max_tokens rows, the logits and sampling rows of max_entries, the decode
  // attention workspace over max_context; less what is allocated already.
  size_t PendingWorkspaceBytes(const StepBounds& bounds) const;
  // Launches the device work of `plan_` on `stream` (cuda_model_forward.cc).
  Status EnqueueForward(DeviceKvStorage& kv, const AttentionWindow& window, cudaStream_t stream);
  Status DecoderLayer(int layer, DeviceKvStorage& kv, const AttentionWindow& window,
                      cudaStream_t stream);
  Status SelfAttention(int layer, DeviceKvStorage& kv, const AttentionWindow& window,
                       cudaStream_t stream);
  Status Mlp(int layer, cudaStream_t stream);
  Status LogitsAndSampling(cudaStream_t stream);
  // What layer `layer` of the current forward hands its attention launches (and the backend).
  CudaLayerContext LayerContext(int layer, DeviceKvStorage& kv, cudaStream_t stream);

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

  // The attention backend (SetAttentionBackend), or null.
  std::unique_ptr<CudaAttentionBackend> backend_;

  // The residency backend (SetResidencyBackend), or null.
  std::unique_ptr<CudaResidencyBackend> residency_;
  bool residency_step_ = false;  // the current forward has entries with a residency handle
};

}  // namespace rubato
