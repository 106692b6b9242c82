// The model half of a residency on the CUDA model (cuda_model.h): per layer, after the local KV
// append, the device q|k|v rows of the entries it holds (ForwardEntry::residency) go to it on
// the step's main stream, and it writes the attention output of the plain decode rows (row
// group 0, its own among them): two segments over rows that arrived, a partial result merged,
// or dense over the local cache for the rows that are not its. Like an attention backend
// (attention/cuda_backend.h) it declares whether its steps may be replayed as CUDA graphs and
// gets begin / end / abort hooks, so that an exchange that waits on events rather than the
// host can be captured. docs/residency.md.
#pragma once

#include <cuda_runtime_api.h>

#include <span>

#include "common/status.h"
#include "inference_rank/attention/cuda_backend.h"
#include "inference_rank/model/cuda_decode_graph.h"
#include "inference_rank/model/cuda_forward_plan.h"
#include "inference_rank/residency/residency_backend.h"
#include "kernels/cpu/attention_window.h"

namespace rubato {

class CudaResidencyBackend : public ResidencyBackend {
 public:
  std::string_view backend_name() const final { return "cuda"; }

  // Whether the model may capture and replay a decode step with the residency's entries as a
  // CUDA graph (its device work then must not wait on the host).
  virtual bool graph_replayable() const = 0;

  // Host, on a batch Model::Forward validated, before anything is reserved or changed.
  virtual Status CheckBatch(std::span<const ForwardEntry> /*batch*/,
                            const AttentionWindow& /*window*/) const {
    return Status::Ok();
  }
  // Host, after planning, outside any capture, on a batch with entries of the residency: its
  // entries' rows and the buffers of this step.
  virtual Status PlanStep(std::span<const ForwardEntry> batch, const ForwardPlan& plan) = 0;
  // What a captured decode step with the residency's entries bakes in (DecodeGraphKey::policy);
  // only called when graph_replayable().
  virtual void AddToGraphKey(const ForwardPlan& /*plan*/, DecodeGraphKey& /*key*/) const {}

  // Device work on the step's main stream (eager or inside a capture), on a step PlanStep
  // planned: once before the first layer; per layer after the KV append (the entries' q|k|v
  // rows are layer.qkv's, after RoPE); the attention of the plain decode rows
  // [first_row, + rows), each of them, through `window` for the rows that are not the
  // residency's; once after the last layer.
  virtual Status BeginStep(cudaStream_t /*main*/) { return Status::Ok(); }
  virtual Status LayerComputed(const CudaLayerContext& layer) = 0;
  virtual Status AttendDecodeRows(const CudaLayerContext& layer, int first_row, int rows,
                                  const AttentionWindow& window) = 0;
  virtual Status EndStep() { return Status::Ok(); }
  // Host, after the step's device work synchronized: whether what the residency's peer
  // delivered in it may be trusted (an exchange aborted under a stream wait lets the stream run
  // on; its error then fails the step and its results are dropped).
  virtual Status FinishStep() { return Status::Ok(); }
  // After a failed step: waits for whatever the residency's own streams or peers still run.
  virtual void AbortStep() {}
};

}  // namespace rubato
