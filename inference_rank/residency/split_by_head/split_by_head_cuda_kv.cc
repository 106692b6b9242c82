// The split_by_head residency's device storage (see split_by_head_cuda_kv.h).
#include "inference_rank/residency/split_by_head/split_by_head_cuda_kv.h"

#include <algorithm>
#include <string>

#include "kernels/cuda/cuda_status.h"
#include "kernels/cuda/peer_access.h"

namespace rubato {
namespace {

template <typename T>
Status AllocateZeroed(cuda::DeviceBuffer<T>& buffer, size_t count, const std::string& what,
                      size_t& bytes, int fill = 0) {
  RUBATO_ASSIGN_OR_RETURN(buffer, cuda::DeviceBuffer<T>::Allocate(count, "split_by_head " + what));
  bytes += buffer.bytes();
  return cuda::CudaStatus(cudaMemset(buffer.data(), fill, buffer.bytes()),
                          "clearing split_by_head " + what);
}

}  // namespace

Result<std::unique_ptr<SplitByHeadDeviceKv>> SplitByHeadDeviceKv::Create(
    const HeadSplit& split, const ModelConfig& model, int device, int slots, int context_capacity,
    int pool_capacity, const HeadSplitStore& store) {
  if (slots < 1 || context_capacity < 1 || pool_capacity < 1) {
    return InvalidArgumentError(
        "split_by_head: slots, context capacity and pool rows must be >= 1");
  }
  std::unique_ptr<SplitByHeadDeviceKv> kv(new SplitByHeadDeviceKv());
  kv->split_ = split;
  kv->store_ = store;
  kv->device_ = device;
  kv->layers_ = model.num_layers;
  kv->kv_heads_ = model.num_kv_heads;
  kv->head_dim_ = model.head_dim;
  kv->clusters_ = split.clusters(0);
  for (int l = 0; l < split.num_layers; ++l) {
    if (split.clusters(l) != kv->clusters_) {
      return InvalidArgumentError(
          "split_by_head on the CUDA model: every layer must have the same "
          "number of R-heads (layer " +
          std::to_string(l) + " has " + std::to_string(split.clusters(l)) + ", layer 0 " +
          std::to_string(kv->clusters_) + ")");
    }
  }
  kv->nr_heads_ = kv->kv_heads_ - kv->clusters_;
  kv->slots_ = slots;
  kv->context_capacity_ = (context_capacity + kRBlockTokens - 1) / kRBlockTokens * kRBlockTokens;
  kv->pool_capacity_ = std::min(pool_capacity, kv->context_capacity_);
  for (int s = slots - 1; s >= 0; --s) kv->free_slots_.push_back(s);

  RUBATO_CUDA_RETURN_IF_ERROR(cudaSetDevice(device), "split_by_head: selecting the model's GPU");
  const size_t layers = static_cast<size_t>(kv->layers_), d = static_cast<size_t>(kv->head_dim_);
  const size_t r_rows =
      layers * kv->clusters_ * static_cast<size_t>(kv->r_pool_blocks()) * kRBlockTokens;
  const size_t pool_rows =
      layers * slots * static_cast<size_t>(kv->kv_heads_) * static_cast<size_t>(kv->pool_capacity_);
  const size_t books = layers * slots * static_cast<size_t>(kv->clusters_);
  size_t& bytes = kv->device_bytes_;
  RUBATO_RETURN_IF_ERROR(AllocateZeroed(kv->r_keys_, r_rows * d, "R-head keys", bytes));
  RUBATO_RETURN_IF_ERROR(AllocateZeroed(kv->r_values_, r_rows * d, "R-head values", bytes));
  RUBATO_RETURN_IF_ERROR(AllocateZeroed(kv->pool_keys_, pool_rows * d, "pool keys", bytes));
  RUBATO_RETURN_IF_ERROR(AllocateZeroed(kv->pool_values_, pool_rows * d, "pool values", bytes));
  RUBATO_RETURN_IF_ERROR(
      AllocateZeroed(kv->positions_, books * kv->pool_capacity_, "pool positions", bytes));
  RUBATO_RETURN_IF_ERROR(
      AllocateZeroed(kv->row_of_, books * kv->context_capacity_, "pool rows", bytes, 0xff));
  RUBATO_RETURN_IF_ERROR(AllocateZeroed(kv->sizes_, books * 2, "pool sizes", bytes));
  RUBATO_RETURN_IF_ERROR(
      AllocateZeroed(kv->counts_, layers * slots * kv->kv_heads_, "pool counts", bytes));
  RUBATO_RETURN_IF_ERROR(AllocateZeroed(kv->copied_rows_, 2, "copy counters", bytes));

  std::vector<int32_t> maps(layers * 2 * kv->kv_heads_, -1);
  for (int l = 0; l < kv->layers_; ++l) {
    int nr = 0;
    for (int h = 0; h < kv->kv_heads_; ++h) {
      if (split.IsRepresentative(l, h)) continue;
      maps[(static_cast<size_t>(l) * 2) * kv->kv_heads_ + h] = split.cluster[l][h];
      maps[(static_cast<size_t>(l) * 2 + 1) * kv->kv_heads_ + h] = nr++;
    }
  }
  RUBATO_ASSIGN_OR_RETURN(kv->head_maps_,
                          cuda::DeviceBuffer<int32_t>::Allocate(maps.size(), "split_by_head maps"));
  RUBATO_CUDA_RETURN_IF_ERROR(cudaMemcpy(kv->head_maps_.data(), maps.data(),
                                         maps.size() * sizeof(int32_t), cudaMemcpyHostToDevice),
                              "split_by_head: copying the head maps");

  // The store: every NR-head's full KV.
  kv->store_bytes_ =
      layers * kv->nr_heads_ * static_cast<size_t>(kv->store_rows()) * d * sizeof(__nv_bfloat16);
  void* keys = nullptr;
  void* values = nullptr;
  if (store.where == "host") {
    const unsigned flags = cudaHostAllocMapped | cudaHostAllocPortable;
    RUBATO_CUDA_RETURN_IF_ERROR(cudaHostAlloc(&keys, kv->store_bytes_, flags),
                                "split_by_head: pinned host memory for the NR-heads' keys (" +
                                    std::to_string(kv->store_bytes_) + " bytes)");
    kv->store_keys_ = static_cast<__nv_bfloat16*>(keys);
    RUBATO_CUDA_RETURN_IF_ERROR(cudaHostAlloc(&values, kv->store_bytes_, flags),
                                "split_by_head: pinned host memory for the NR-heads' values (" +
                                    std::to_string(kv->store_bytes_) + " bytes)");
    kv->store_values_ = static_cast<__nv_bfloat16*>(values);
  } else if (store.where == "device") {
    RUBATO_ASSIGN_OR_RETURN(const bool peer, cuda::EnablePeerAccessOnce(device, store.device));
    if (!peer) {
      return InvalidArgumentError("policy.store_device: GPU " + std::to_string(store.device) +
                                  " cannot be read by GPU " + std::to_string(device) +
                                  " through peer access");
    }
    RUBATO_CUDA_RETURN_IF_ERROR(cudaSetDevice(store.device),
                                "split_by_head: selecting the store's GPU");
    const cudaError_t k = cudaMalloc(&keys, kv->store_bytes_);
    kv->store_keys_ = static_cast<__nv_bfloat16*>(keys);
    const cudaError_t v = k == cudaSuccess ? cudaMalloc(&values, kv->store_bytes_) : k;
    kv->store_values_ = static_cast<__nv_bfloat16*>(values);
    cudaSetDevice(device);
    RUBATO_CUDA_RETURN_IF_ERROR(v, "split_by_head: memory of GPU " + std::to_string(store.device) +
                                       " for the NR-heads' store (2 x " +
                                       std::to_string(kv->store_bytes_) + " bytes)");
  } else {
    return InvalidArgumentError("policy.store: '" + store.where + "' is not one of host, device");
  }

  int lowest = 0, highest = 0;
  RUBATO_CUDA_RETURN_IF_ERROR(cudaDeviceGetStreamPriorityRange(&lowest, &highest),
                              "split_by_head: stream priorities");
  RUBATO_CUDA_RETURN_IF_ERROR(
      cudaStreamCreateWithPriority(&kv->copy_stream_, cudaStreamNonBlocking, lowest),
      "split_by_head: the fetch stream");
  kv->events_.assign(layers * 3, nullptr);
  for (size_t i = 0; i < kv->events_.size(); ++i) {
    const unsigned flags = i % 3 == 0 ? cudaEventDisableTiming : cudaEventDefault;
    RUBATO_CUDA_RETURN_IF_ERROR(cudaEventCreateWithFlags(&kv->events_[i], flags),
                                "split_by_head: fetch events");
  }
  kv->fetch_pending_.assign(layers, 0);
  kv->waited_.assign(layers, 0);
  return kv;
}

SplitByHeadDeviceKv::~SplitByHeadDeviceKv() {
  if (copy_stream_ != nullptr) {
    cudaStreamSynchronize(copy_stream_);
    cudaStreamDestroy(copy_stream_);
  }
  for (cudaEvent_t event : events_) {
    if (event != nullptr) cudaEventDestroy(event);
  }
  if (store_.where == "host") {
    if (store_keys_ != nullptr) cudaFreeHost(store_keys_);
    if (store_values_ != nullptr) cudaFreeHost(store_values_);
  } else {
    cudaSetDevice(store_.device);
    if (store_keys_ != nullptr) cudaFree(store_keys_);
    if (store_values_ != nullptr) cudaFree(store_values_);
    cudaSetDevice(device_);
  }
}

int SplitByHeadDeviceKv::AcquireSlot() {
  if (free_slots_.empty()) return -1;
  const int slot = free_slots_.back();
  free_slots_.pop_back();
  return slot;
}

void SplitByHeadDeviceKv::ReleaseSlot(int slot) { free_slots_.push_back(slot); }

int32_t* SplitByHeadDeviceKv::positions(int layer) {
  return positions_.data() + static_cast<size_t>(layer) * slots_ * clusters_ * pool_capacity_;
}
int32_t* SplitByHeadDeviceKv::row_of(int layer) {
  return row_of_.data() + static_cast<size_t>(layer) * slots_ * clusters_ * context_capacity_;
}
int32_t* SplitByHeadDeviceKv::sizes(int layer) {
  return sizes_.data() + static_cast<size_t>(layer) * slots_ * clusters_ * 2;
}
int32_t* SplitByHeadDeviceKv::counts(int layer) {
  return counts_.data() + static_cast<size_t>(layer) * slots_ * kv_heads_;
}
const int32_t* SplitByHeadDeviceKv::cluster_of(int layer) const {
  return head_maps_.data() + static_cast<size_t>(layer) * 2 * kv_heads_;
}
const int32_t* SplitByHeadDeviceKv::store_index(int layer) const {
  return head_maps_.data() + (static_cast<size_t>(layer) * 2 + 1) * kv_heads_;
}

Status SplitByHeadDeviceKv::ReadCopiedRows(unsigned long long out[2]) {
  RUBATO_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(copy_stream_),
                              "split_by_head: waiting for the fetch stream");
  return cuda::CudaStatus(
      cudaMemcpy(out, copied_rows_.data(), 2 * sizeof(unsigned long long), cudaMemcpyDeviceToHost),
      "split_by_head: reading the copy counters");
}

}  // namespace rubato
