// The scratch and streams of SFI's slow-step maintenance on the GPU: the Selector and the
// compact gather of layer i run on a low-priority aux stream while the main stream goes on with
// layers i+1..; a ring of R = 4 scratch slots with an event each, one barrier at the step's end,
// the same calls eager or inside a graph capture; inline mode for the benchmark's comparison
// (docs/sfi.md "SFI maintenance ring").
#pragma once

#include <cuda_runtime_api.h>

#include <array>
#include <cstddef>
#include <cstdint>
#include <memory>

#include "common/status.h"
#include "kernels/cuda/device_buffer.h"

namespace rubato {

class SfiMaintenanceRing {
 public:
  static constexpr int kSlots = 4;  // R

  // What each ring slot holds (every slot alike).
  struct Sizes {
    size_t score_floats = 0;     // [score rows][num_heads][score stride], f32, log2 units
    size_t selected_ints = 0;    // [selections][num_kv_heads][budget], int32
    size_t count_ints = 0;       // [selections][num_kv_heads], int32
    size_t workspace_bytes = 0;  // SfiSelect workspace of the largest Selector call
    size_t norm_floats = 0;      // [selections][num_kv_heads][score stride], f32 (gamma > 0)
  };
  struct Slot {
    cuda::DeviceBuffer<float> scores;
    cuda::DeviceBuffer<int32_t> selected;
    cuda::DeviceBuffer<int32_t> selected_count;
    cuda::DeviceBuffer<unsigned char> workspace;
    cuda::DeviceBuffer<float> key_norms;
  };

  // The aux stream (non-blocking, lowest priority) and the events, on the current device.
  static Result<std::unique_ptr<SfiMaintenanceRing>> Create();
  ~SfiMaintenanceRing();
  SfiMaintenanceRing(const SfiMaintenanceRing&) = delete;
  SfiMaintenanceRing& operator=(const SfiMaintenanceRing&) = delete;

  // Grows every slot to hold `sizes` (powers of two, never shrinks; not during a step). Graphs
  // that captured the old addresses must be dropped first: when !Covers(sizes), a buffer moves.
  Status Reserve(const Sizes& sizes);
  bool Covers(const Sizes& sizes) const;
  Slot& slot(int layer) { return slots_[static_cast<size_t>(layer % kSlots)]; }

  // One step's calls, in order, on the host thread that enqueues the step.
  void BeginStep(cudaStream_t main, bool overlap);
  // Before layer `layer`'s attention writes slot(layer): the main stream waits for the aux
  // stream's use of that slot at layer - R (no-op for a slot not used yet in this step).
  Status BeforeAttention(int layer);
  // After layer `layer`'s attention: the stream its maintenance goes on (the aux stream, made
  // to wait for the main stream's work so far; the main stream itself inline).
  Result<cudaStream_t> BeginMaintenance(int layer);
  // After the maintenance of `layer` was enqueued on BeginMaintenance's stream.
  Status EndMaintenance(int layer);
  // The end-of-step barrier: the main stream waits for all of the step's maintenance.
  Status EndStep();
  // After a failed step: waits for whatever the aux stream still runs (its scratch and the
  // compact pool may be reused right after).
  void SynchronizeAux();

 private:
  SfiMaintenanceRing() = default;

  cudaStream_t aux_ = nullptr;
  std::array<cudaEvent_t, kSlots> attention_done_{};    // main: layer's scores written
  std::array<cudaEvent_t, kSlots> maintenance_done_{};  // aux: layer's slot free again
  std::array<Slot, kSlots> slots_;
  Sizes sizes_;
  // Per step.
  cudaStream_t main_ = nullptr;
  bool overlap_ = false;
  std::array<bool, kSlots> in_use_{};  // the aux stream used the slot in this step
  int last_slot_ = -1;                 // slot of the last maintenance on the aux stream
};

}  // namespace rubato
