// The backend half of an attention policy on the CUDA model (cuda_model.h): its device state,
// its kernels, its share of the packed step inputs and of the graph key, and the attention of
// its own decode rows (row groups >= 1 of the plan, cuda_forward_plan.h) with whatever it adds
// per layer. The model runs everything else (group 0 dense rows, prefill, the MLP) and calls the
// hooks below in the order they are declared. docs/attention_seam.md.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <span>

#include "common/hf_config.h"
#include "common/status.h"
#include "inference_rank/attention/attention_backend.h"
#include "inference_rank/model/cuda_decode_graph.h"
#include "inference_rank/model/cuda_forward_plan.h"
#include "inference_rank/model/cuda_kv_storage.h"
#include "kernels/cuda/decode_attention.cuh"
#include "kernels/cuda/device_buffer.h"

namespace rubato {

// What a backend may use in one layer of a forward, all on the device.
struct CudaLayerContext {
  int layer = 0;
  cudaStream_t stream = nullptr;  // the step's main stream
  const ModelConfig* config = nullptr;
  DeviceKvStorage* kv = nullptr;
  const ForwardPlan* plan = nullptr;
  const __nv_bfloat16* qkv = nullptr;  // [tokens][q_dim + 2 kv_dim], bf16, after RoPE
  const float* inv_freq = nullptr;     // [head_dim / 2], f32: the RoPE frequencies it rotated by
  __nv_bfloat16* attention = nullptr;  // [tokens][q_dim], bf16: the rows' attention output
  const int32_t* decode_block_tables = nullptr;      // [decode rows][plan decode_table_stride]
  const int32_t* decode_seq_lens = nullptr;          // [decode rows]
  const int32_t* prefill_block_tables = nullptr;     // [prefill entries][plan prefill_table_stride]
  const int32_t* prefill_query_start = nullptr;      // [prefill entries + 1], rows after the decode
                                                     // rows
  const int32_t* prefill_start_positions = nullptr;  // [prefill entries]
  const std::byte* policy_inputs = nullptr;          // the backend's step-input region
  void* decode_workspace = nullptr;                  // for one decode attention launch at a time
  size_t decode_workspace_bytes = 0;

  // The fields every decode attention launch of the layer shares: its K/V pools, the head
  // shapes, the scale, the output row stride and the step's decode workspace.
  cuda::DecodeAttentionParams LayerDecodeParams() const {
    cuda::DecodeAttentionParams p;
    p.key_pool = kv->layer_keys(layer);
    p.value_pool = kv->layer_values(layer);
    p.num_pool_blocks = kv->shape().num_blocks;
    p.num_heads = config->num_heads;
    p.num_kv_heads = config->num_kv_heads;
    p.head_dim = config->head_dim;
    p.block_tokens = kv->shape().block_tokens;
    p.scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(config->head_dim)));
    p.out_row_stride = config->q_dim();
    p.workspace = decode_workspace;
    p.workspace_bytes = decode_workspace_bytes;
    return p;
  }

  // Dense decode attention of decode rows [first_row, + rows) over every key, writing their
  // attention output: the launch a backend adds segments or evidence to.
  cuda::DecodeAttentionParams DecodeRows(int first_row, int rows) const {
    const int q_dim = config->q_dim();
    const int64_t qkv_dim = q_dim + 2 * config->kv_dim();
    const size_t first = static_cast<size_t>(first_row);
    cuda::DecodeAttentionParams p = LayerDecodeParams();
    p.q = qkv + first * qkv_dim;
    p.q_row_stride = qkv_dim;
    p.block_tables = decode_block_tables + first * plan->decode_table_stride;
    p.block_table_stride = plan->decode_table_stride;
    p.seq_lens = decode_seq_lens + first;
    p.batch = rows;
    p.max_seq_len = plan->decode_max_seq_len;
    p.out = attention + first * q_dim;
    return p;
  }
};

class CudaAttentionBackend : public AttentionBackend {
 public:
  std::string_view backend_name() const final { return "cuda"; }

  // The model the backend was made for (its shapes, its device), or null when it does not say:
  // Model::SetAttentionBackend refuses a backend made for another model.
  virtual const Model* made_for_model() const { return nullptr; }
  // Whether the model may capture and replay decode steps as CUDA graphs while it is installed.
  virtual bool graph_replayable() const { return true; }
  // Whether Attend writes the attention output of the plan's prefill chunks with an attention
  // plan in every layer (the model's dense prefill then skips them); false: the model attends
  // every chunk and the backend only adds its per-layer work.
  virtual bool AttendsPrefill() const { return false; }
  // Requests that still hold resources of this backend (e.g. pool slots): the model refuses to
  // replace it while any do (Model::SetAttentionBackend).
  virtual int requests_holding_resources() const { return 0; }

  // Host, on a batch Model::Forward validated, before anything is reserved or changed.
  virtual Status CheckBatch(std::span<const ForwardEntry> /*batch*/) const { return Status::Ok(); }
  // Host, after planning, outside any capture: grows the backend's buffers and lays out its
  // step-input region for `plan`. `drop_graphs` must be called before anything a captured
  // launch may point to is freed or moved (the region's layout included).
  virtual Status Reserve(std::span<const ForwardEntry> batch, const ForwardPlan& plan,
                         const std::function<void()>& drop_graphs) = 0;
  // Bytes of the step-input region as the last Reserve laid it out (its layout depends on the
  // backend's capacities, not on the batch, so that graphs keep reading the same addresses).
  virtual size_t StepInputBytes() const = 0;
  // Decode-attention workspace the backend's own launches need beyond the plan's decode rows.
  virtual size_t DecodeWorkspaceBytes(const ForwardPlan& /*plan*/) const { return 0; }
  // Host, after the KV blocks are reserved: per-request resources (all or nothing; cannot fail
  // once CheckBatch passed).
  virtual Status Acquire(std::span<const ForwardEntry> /*batch*/) { return Status::Ok(); }
  // Host: the backend's step inputs for this batch, into its region of the pinned staging copy.
  virtual void FillStepInputs(std::span<const ForwardEntry> batch, const ForwardPlan& plan,
                              const KvCacheShape& shape, std::byte* region) = 0;
  // What a captured decode step of this plan bakes in beyond the model's own key fields
  // (DecodeGraphKey::policy), after Reserve.
  virtual void AddToGraphKey(const ForwardPlan& /*plan*/, DecodeGraphKey& /*key*/) const {}

  // Device work of one step, on the step's main stream (eager or inside a graph capture; a
  // replayed graph calls none of them): once before the first layer, once per layer after the
  // KV append and before the model's own attention when the plan has backend rows or prefill
  // chunks with a plan (ForwardPlan::has_backend_work: the attention of the backend's decode
  // rows and its per-layer work), once after the last layer's sampling.
  virtual Status BeginStep(cudaStream_t /*main*/) { return Status::Ok(); }
  virtual Status Attend(const CudaLayerContext& layer) = 0;
  virtual Status EndStep() { return Status::Ok(); }
  // After the device work, outside any graph: copies the backend reads back after the step.
  virtual Status EnqueueReadBack(cudaStream_t /*stream*/) { return Status::Ok(); }
  // After a failed step: waits for whatever the backend's own streams still run.
  virtual void AbortStep() {}
  // Host, after the step's synchronization succeeded: the requests' states.
  virtual Status FinishStep(std::span<const ForwardEntry> /*batch*/) { return Status::Ok(); }
};

// cuda::GrowTo for a backend's device buffer in Reserve, after `drop_graphs` when the buffer must
// move (a captured graph may point into it).
template <typename T>
Status GrowBackendBuffer(cuda::DeviceBuffer<T>& buffer, size_t count, std::string_view what,
                         const std::function<void()>& drop_graphs) {
  if (buffer.size() >= count) return Status::Ok();
  drop_graphs();
  return cuda::GrowTo(buffer, count, what);
}

}  // namespace rubato
