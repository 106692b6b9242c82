// The CPU reference model: a Llama / Qwen2 / Qwen3 decoder in fp32 that follows transformers'
// modelling code op for op, running batches of prefill chunks and decode tokens against a paged
// KV cache (one sgemm per linear layer over the whole batch, attention per entry). Entries with
// an attention plan run its op with the operands of the attention backend (cpu_backend.h).
// docs/engine_and_models.md has the details and a usage example.
#pragma once

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <memory>
#include <span>
#include <string_view>
#include <vector>

#include "common/hf_config.h"
#include "common/status.h"
#include "inference_rank/attention/cpu_backend.h"
#include "inference_rank/kv/paged_kv_cache.h"
#include "inference_rank/model/model.h"
#include "inference_rank/model/model_weights.h"
#include "inference_rank/residency/cpu_residency_backend.h"
#include "kernels/cpu/attention_window.h"
#include "kernels/cpu/index_gather_attention.h"
#include "kernels/cpu/sampling.h"
#include "kernels/cpu/thread_pool.h"
#include "kernels/cpu/tile_gather_attention.h"
#include "kernels/cpu/two_segment_attention.h"

namespace rubato {

class CpuModel : public Model {
 public:
  // Reads model_dir/config.json and, unless options.random_weights, the safetensors checkpoint
  // in model_dir (single file or sharded), converting every weight to fp32.
  static Result<std::unique_ptr<CpuModel>> Load(const std::filesystem::path& model_dir,
                                                const ModelLoadOptions& options);

  // From weights already in memory; their sizes are checked against `config`.
  static Result<std::unique_ptr<CpuModel>> Create(ModelConfig config, ModelWeights weights,
                                                  const ModelLoadOptions& options);

  const ModelConfig& config() const override { return config_; }
  std::string_view backend_name() const override { return "cpu"; }
  size_t weight_bytes() const override { return WeightBytes(config_); }  // fp32
  const ModelWeights& weights() const { return weights_; }

  // A KV cache shaped for this model, with f32 host pools.
  Result<std::unique_ptr<PagedKvCache>> CreateKvCache(int block_tokens, int num_blocks) override;
  // Model::KvPoolMemoryFor: host memory (ReadHostMemory), f32 blocks. Its activations, grown on
  // first need, are not counted: the share 1 - gpu_memory_utilization leaves covers them.
  Result<KvPoolMemory> KvPoolMemoryFor(int block_tokens, const StepBounds& bounds) const override;
  // Model::CreateSlotKvPool: f32 host slot arrays.
  Result<std::unique_ptr<SlotKvPool>> CreateSlotKvPool(int budget, int num_arrays) override;

  // Threads for attention and (process-wide: OpenBLAS has one setting) GEMMs; 0 = all cores.
  void SetNumThreads(int num_threads) override;

  // Model::SetAttentionBackend: a CpuAttentionBackend (InvalidArgument for another).
  Status SetAttentionBackend(std::unique_ptr<AttentionBackend> backend) override;
  AttentionBackend* attention_backend() override { return backend_.get(); }
  // Model::SetResidencyBackend: a CpuResidencyBackend (InvalidArgument for another).
  Status SetResidencyBackend(std::unique_ptr<ResidencyBackend> backend) override;
  ResidencyBackend* residency_backend() const override { return residency_.get(); }

  // Model::Forward. The window is per batch because the engine runs one policy; the KV cache
  // still holds every position (the CPU reference masks, it never drops a position), except
  // for kFixedBudget entries, whose K/V go to their slot arrays. Sampled entries keep their
  // logits too.
  Status Forward(std::span<const ForwardEntry> batch, PagedKvCache& cache, ForwardResult& result,
                 const AttentionWindow& window = AttentionWindow()) override;

 private:
  CpuModel(ModelConfig config, ModelWeights weights, const ModelLoadOptions& options);

  void PlanBatch(std::span<const ForwardEntry> batch);
  void EnsureWorkspace(int total_tokens, int attention_scratch_floats);

  // The per-layer step: norm -> attention -> residual -> norm -> MLP -> residual.
  Status DecoderLayer(int layer, PagedKvCache& cache, const AttentionWindow& window);
  // normed -> projected: q,k,v proj [+bias] -> [q/k norm] -> rope -> KV append -> attention
  // -> o proj [+bias].
  Status SelfAttention(int layer, PagedKvCache& cache, const AttentionWindow& window);
  // Entries whose plan runs a policy's op in this layer: kTwoSegment's compact segment from the
  // backend as the two-segment op's arguments (two_segment_args_), kIndexGather's positions via
  // IndexGatherArgs; the workers' scratch grown to them.
  Status PlannedOpArgs(const CpuLayerContext& context);
  // A kIndexGather entry's positions from the backend as the op's arguments (decode tokens:
  // index_gather_args_; prefill chunks, in tiles: tile_gather_args_), the workers' scratch grown
  // to them.
  Status IndexGatherArgs(const CpuLayerContext& context, int entry);
  // Entries with a residency handle: this layer's new K/V to the residency backend, then what
  // each attends (residency_attention_; kTwoSegment as its two_segment_args_).
  Status ResidencyLayer(const CpuLayerContext& context);
  // Refuses, naming the position, any entry whose attention in this layer would read a position
  // whose KV block its sequence released (PagedKvCache::ReleaseBefore): after ResidencyLayer and
  // PlannedOpArgs, before any read.
  Status CheckLocalReads(const CpuLayerContext& context) const;
  // normed -> projected: down(silu(gate(x)) * up(x)).
  void Mlp(int layer);
  // final norm -> lm_head (or tied embedding) for the rows the entries want.
  void ComputeLogits(std::span<const ForwardEntry> batch, ForwardResult& result);
  // result.sampled_tokens for the entries with sampling set.
  void SampleTokens(std::span<const ForwardEntry> batch, ForwardResult& result);

  ModelConfig config_;
  ModelWeights weights_;
  std::vector<float> inv_freq_;              // [head_dim / 2], f32, RoPE inverse frequencies
  std::unique_ptr<ThreadPool> thread_pool_;  // attention workers

  std::unique_ptr<CpuAttentionBackend> backend_;    // the policy's half, or null
  std::unique_ptr<CpuResidencyBackend> residency_;  // the residency's half, or null

  // Per-forward state. Buffers only grow, so steady decoding does not allocate.
  std::vector<CpuEntryRows> plan_;  // where each entry's tokens sit in the activations
  int total_tokens_ = 0;
  std::vector<int> token_ids_;     // [tokens]
  std::vector<int> positions_;     // [tokens]
  std::vector<float> hidden_;      // [tokens][hidden], f32, the residual stream
  std::vector<float> normed_;      // [tokens][hidden], f32, RMSNorm output
  std::vector<float> q_;           // [tokens][num_heads][head_dim], f32
  std::vector<float> k_;           // [tokens][num_kv_heads][head_dim], f32
  std::vector<float> v_;           // [tokens][num_kv_heads][head_dim], f32
  std::vector<float> attention_;   // [tokens][num_heads][head_dim], f32, attention output
  std::vector<float> projected_;   // [tokens][hidden], f32, o_proj / down_proj output
  std::vector<float> gate_;        // [tokens][intermediate], f32, then silu(gate) * up
  std::vector<float> up_;          // [tokens][intermediate], f32
  std::vector<float> rope_cos_;    // [tokens][head_dim / 2], f32
  std::vector<float> rope_sin_;    // [tokens][head_dim / 2], f32
  std::vector<float> logit_rows_;  // [logit rows][hidden], f32, final-normed rows for lm_head
  // [workers][CausalAttentionScratchSize of the batch's largest entry], f32
  std::vector<std::vector<float>> attention_scratch_;
  SamplingWorkspace sampling_workspace_;
  // [entries] per layer: the args of the entries that attend through the two-segment op
  // (kTwoSegment plans, residency entries that attend two segments); unused for the others.
  std::vector<TwoSegmentAttentionArgs> two_segment_args_;
  // [entries] per layer: what each entry with a residency handle attends (kLocal for the others).
  std::vector<ResidencyAttention::Kind> residency_attention_;
  std::vector<IndexGatherAttentionArgs> index_gather_args_;  // [entries], kIndexGather decode
  std::vector<TileGatherAttentionArgs> tile_gather_args_;    // [entries], kIndexGather prefill
};

}  // namespace rubato
