// Kascade's tile-sparse prefill on the CUDA model (docs/kascade.md "Prefill"): for the prefill
// chunks of a forward that carry its plan, the selection tiles they meet, their step inputs, and
// per layer the passes of the prefill kernel (kernels/cuda/prefill_attention.cuh): layer 0 dense
// writing each row's lse, other anchors an lse pass; on anchors the pooled probabilities of each
// tile and their top k_t; every layer but 0 the tile lists of its anchor through its head map.
// The CPU twin is the Kascade CPU backend's SelectPrefill with kernels/cpu/tile_gather_attention.h.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <span>
#include <vector>

#include "common/status.h"
#include "inference_rank/attention/cuda_backend.h"
#include "inference_rank/policies/kascade/kascade_policy.h"
#include "kernels/cuda/device_buffer.h"

namespace rubato {

class KascadeCudaPrefill {
 public:
  KascadeCudaPrefill(const ModelConfig& model, const KascadeConfig& config, int anchors)
      : model_(model), config_(config), anchors_(anchors) {}

  // Host, after planning: the chunks with a plan (the plan's last backend_prefill_entries prefill
  // indices), their tiles, and the buffers they need. `drop_graphs` before the step-input
  // layout changes (it follows the capacities).
  Status Reserve(std::span<const ForwardEntry> batch, const ForwardPlan& plan,
                 const std::function<void()>& drop_graphs);
  // Bytes of this part of the step-input region (laid out by capacity).
  size_t StepInputBytes() const;
  void FillStepInputs(std::byte* region) const;

  // The layer's passes over the chunks (a no-op without any); `anchor_slot` is the layer's index
  // among the anchors or -1, `source_slot` its anchor's; `head_map` the layer's [kv_heads] map.
  Status Attend(const CudaLayerContext& layer, const LayerAction& action, int anchor_slot,
                int source_slot, const int32_t* head_map, const std::byte* region);

  // Copies the last forward's selections of anchor `slot` back (synchronizes): per tile in chunk
  // order and KV head, the kept positions, ascending.
  Result<std::vector<std::vector<int>>> Selections(int slot) const;

 private:
  struct Chunk {
    int start = 0;   // its first position
    int tokens = 0;  // its rows
    int tiles = 0;   // the selection tiles it meets
  };

  const ModelConfig model_;
  const KascadeConfig config_;
  const int anchors_;
  // The current forward (Reserve).
  std::vector<Chunk> chunks_;        // in prefill-index order
  std::vector<int32_t> tile_base_;   // [chunks]
  std::vector<int32_t> tile_begin_;  // [tiles]: each tile's first position (its candidates)
  std::vector<int32_t> tile_k_;      // [tiles]: positions it keeps
  int first_entry_ = 0;              // prefill index of the first chunk
  int rows_ = 0;                     // rows of the chunks
  int max_tokens_ = 0;               // the largest chunk
  int max_begin_ = 0;                // the last tile's first position
  int64_t pooled_stride_ = 0;
  int k_capacity_ = 0;
  // Capacities of the step inputs (grow only).
  int chunk_capacity_ = 0;
  int tile_capacity_ = 0;
  cuda::DeviceBuffer<float> lse_;       // [prefill rows][heads], natural log
  cuda::DeviceBuffer<float> pooled_;    // [tiles][kv_heads][pooled stride]
  cuda::DeviceBuffer<int32_t> lists_;   // [anchors][tiles][kv_heads][k capacity]
  cuda::DeviceBuffer<int32_t> counts_;  // [anchors][tiles][kv_heads]
  cuda::DeviceBuffer<unsigned char> top_k_workspace_;
};

}  // namespace rubato
