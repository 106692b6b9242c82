// SFI slow-step maintenance ring: scratch, aux stream and events (cuda_sfi_ring.h).
#include "inference_rank/policies/sfi/cuda_sfi_ring.h"

#include <string>

#include "kernels/cuda/cuda_status.h"

namespace rubato {

Result<std::unique_ptr<SfiMaintenanceRing>> SfiMaintenanceRing::Create() {
  std::unique_ptr<SfiMaintenanceRing> ring(new SfiMaintenanceRing());
  int least = 0, greatest = 0;
  RUBATO_CUDA_RETURN_IF_ERROR(cudaDeviceGetStreamPriorityRange(&least, &greatest),
                              "reading the stream priority range");
  RUBATO_CUDA_RETURN_IF_ERROR(
      cudaStreamCreateWithPriority(&ring->aux_, cudaStreamNonBlocking, least),
      "creating the SFI maintenance stream");
  for (int i = 0; i < kSlots; ++i) {
    RUBATO_CUDA_RETURN_IF_ERROR(
        cudaEventCreateWithFlags(&ring->attention_done_[i], cudaEventDisableTiming),
        "creating an SFI maintenance event");
    RUBATO_CUDA_RETURN_IF_ERROR(
        cudaEventCreateWithFlags(&ring->maintenance_done_[i], cudaEventDisableTiming),
        "creating an SFI maintenance event");
  }
  return ring;
}

SfiMaintenanceRing::~SfiMaintenanceRing() {
  if (aux_ != nullptr) {
    cudaStreamSynchronize(aux_);
    cudaStreamDestroy(aux_);
  }
  for (int i = 0; i < kSlots; ++i) {
    if (attention_done_[i] != nullptr) cudaEventDestroy(attention_done_[i]);
    if (maintenance_done_[i] != nullptr) cudaEventDestroy(maintenance_done_[i]);
  }
}

Status SfiMaintenanceRing::Reserve(const Sizes& sizes) {
  for (int i = 0; i < kSlots; ++i) {
    Slot& s = slots_[static_cast<size_t>(i)];
    const std::string what = "SFI maintenance ring slot " + std::to_string(i);
    RUBATO_RETURN_IF_ERROR(
        cuda::GrowTo(s.scores, sizes.score_floats, what + " (attention scores)"));
    RUBATO_RETURN_IF_ERROR(
        cuda::GrowTo(s.selected, sizes.selected_ints, what + " (selected positions)"));
    RUBATO_RETURN_IF_ERROR(
        cuda::GrowTo(s.selected_count, sizes.count_ints, what + " (selected counts)"));
    RUBATO_RETURN_IF_ERROR(
        cuda::GrowTo(s.workspace, sizes.workspace_bytes, what + " (Selector workspace)"));
    RUBATO_RETURN_IF_ERROR(cuda::GrowTo(s.key_norms, sizes.norm_floats, what + " (key norms)"));
  }
  return Status::Ok();
}

bool SfiMaintenanceRing::Covers(const Sizes& sizes) const {
  const Slot& s = slots_[0];  // every slot alike
  return sizes.score_floats <= s.scores.size() && sizes.selected_ints <= s.selected.size() &&
         sizes.count_ints <= s.selected_count.size() &&
         sizes.workspace_bytes <= s.workspace.size() && sizes.norm_floats <= s.key_norms.size();
}

void SfiMaintenanceRing::BeginStep(cudaStream_t main, bool overlap) {
  main_ = main;
  overlap_ = overlap;
  in_use_.fill(false);
  last_slot_ = -1;
}

Status SfiMaintenanceRing::BeforeAttention(int layer) {
  const int s = layer % kSlots;
  if (!overlap_ || !in_use_[static_cast<size_t>(s)]) return Status::Ok();
  RUBATO_CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(main_, maintenance_done_[s], 0),
                              "waiting for the SFI maintenance of the ring slot's last use");
  in_use_[static_cast<size_t>(s)] = false;
  return Status::Ok();
}

Result<cudaStream_t> SfiMaintenanceRing::BeginMaintenance(int layer) {
  if (!overlap_) return main_;
  const int s = layer % kSlots;
  RUBATO_CUDA_RETURN_IF_ERROR(cudaEventRecord(attention_done_[s], main_),
                              "recording the end of the layer's attention");
  RUBATO_CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(aux_, attention_done_[s], 0),
                              "forking the layer's SFI maintenance");
  return aux_;
}

Status SfiMaintenanceRing::EndMaintenance(int layer) {
  if (!overlap_) return Status::Ok();
  const int s = layer % kSlots;
  RUBATO_CUDA_RETURN_IF_ERROR(cudaEventRecord(maintenance_done_[s], aux_),
                              "recording the end of the layer's SFI maintenance");
  in_use_[static_cast<size_t>(s)] = true;
  last_slot_ = s;
  return Status::Ok();
}

Status SfiMaintenanceRing::EndStep() {
  if (!overlap_ || last_slot_ < 0) return Status::Ok();
  // The aux stream runs in order: its last event covers every layer's maintenance.
  RUBATO_CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(main_, maintenance_done_[last_slot_], 0),
                              "joining the SFI maintenance stream");
  in_use_.fill(false);
  last_slot_ = -1;
  return Status::Ok();
}

void SfiMaintenanceRing::SynchronizeAux() {
  if (aux_ != nullptr && cudaStreamSynchronize(aux_) != cudaSuccess) cudaGetLastError();
}

}  // namespace rubato
