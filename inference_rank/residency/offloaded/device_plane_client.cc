// The inference rank's side of the device data plane (device_plane_client.h).
#include "inference_rank/residency/offloaded/device_plane_client.h"

#include <algorithm>
#include <string>

#include "kernels/cuda/cuda_status.h"

namespace rubato {
namespace {

using transport::MemoryKind;
using transport::TransferOp;

}  // namespace

DevicePlaneClient::DevicePlaneClient(const ModelConfig& config,
                                     transport::StreamOrderedTransport& transport,
                                     const DevicePlaneClientOptions& options)
    : config_(config), options_(options), exchange_(transport, options.transfer_timeout) {}

Result<std::unique_ptr<DevicePlaneClient>> DevicePlaneClient::Create(
    const ModelConfig& config, transport::StreamOrderedTransport& transport,
    const DevicePlaneClientOptions& options) {
  RUBATO_RETURN_IF_ERROR(options.limits.Check());
  if (!transport.SupportsMemory(MemoryKind::kCuda) || options.peer < 0 ||
      options.peer >= transport.WorldSize() || options.peer == transport.Rank()) {
    return InvalidArgumentError("device data plane: the " + std::string(transport.BackendName()) +
                                " transport must carry device memory and peer " +
                                std::to_string(options.peer) + " must be another of its ranks");
  }
  std::unique_ptr<DevicePlaneClient> client(new DevicePlaneClient(config, transport, options));
  const size_t bytes = DeviceStepBytes(options.limits);
  RUBATO_ASSIGN_OR_RETURN(client->descriptor_,
                          cuda::DeviceBuffer<std::byte>::Allocate(bytes, "the step descriptor"));
  // Zeroed once: the run slots a step leaves unused travel too.
  RUBATO_CUDA_RETURN_IF_ERROR(cudaMemset(client->descriptor_.data(), 0, bytes),
                              "zeroing the step descriptor");
  for (int s = 0; s < 2; ++s) {
    void* pinned = nullptr;
    RUBATO_CUDA_RETURN_IF_ERROR(cudaHostAlloc(&pinned, bytes, 0), "the step descriptor (host)");
    client->staging_[s] = static_cast<std::byte*>(pinned);
    RUBATO_CUDA_RETURN_IF_ERROR(
        cudaEventCreateWithFlags(&client->staged_[s], cudaEventDisableTiming),
        "creating a descriptor upload event");
  }
  RUBATO_CUDA_RETURN_IF_ERROR(cudaDeviceSynchronize(), "zeroing the step descriptor");
  return client;
}

DevicePlaneClient::~DevicePlaneClient() {
  for (int s = 0; s < 2; ++s) {
    if (staged_[s] != nullptr) {
      (void)cudaEventSynchronize(staged_[s]);
      (void)cudaEventDestroy(staged_[s]);
    }
    if (staging_[s] != nullptr) (void)cudaFreeHost(staging_[s]);
  }
}

Status DevicePlaneClient::SendDescriptor(const DeviceStep& step, cudaStream_t main) {
  // A slot is rewritten two steps after its upload: normally long done.
  std::byte* staging = staging_[staging_index_];
  RUBATO_CUDA_RETURN_IF_ERROR(cudaEventSynchronize(staged_[staging_index_]),
                              "waiting for an old descriptor upload");
  RUBATO_RETURN_IF_ERROR(
      EncodeDeviceStep(step, options_.limits, {staging, DeviceStepBytes(options_.limits)}));
  RUBATO_CUDA_RETURN_IF_ERROR(
      cudaMemcpyAsync(descriptor_.data(), staging, DeviceStepUsedBytes(step),
                      cudaMemcpyHostToDevice, main),
      "uploading the step descriptor");
  RUBATO_CUDA_RETURN_IF_ERROR(cudaEventRecord(staged_[staging_index_], main),
                              "recording the descriptor upload");
  staging_index_ ^= 1;
  const TransferOp send = TransferOp::Send(options_.peer, kDeviceStepTag, descriptor_.data(),
                                           descriptor_.bytes(), MemoryKind::kCuda);
  return exchange_.Exchange({&send, 1}, main);
}

Status DevicePlaneClient::PlanStep(std::span<const DeviceStepRun> runs, int decode_rows,
                                   int max_seq_len, cudaStream_t main, int num_splits) {
  // The last step's transfers (in-process transports keep their groups until now).
  RUBATO_RETURN_IF_ERROR(exchange_.Drain());
  rows_ = 0;
  scratch_.kind = DeviceStep::Kind::kStep;
  scratch_.step = ++step_;
  scratch_.decode_rows = decode_rows;
  scratch_.max_seq_len = decode_rows > 0 ? max_seq_len : 0;
  scratch_.num_splits = decode_rows > 0 ? num_splits : 0;
  scratch_.runs.assign(runs.begin(), runs.end());
  RUBATO_RETURN_IF_ERROR(SendDescriptor(scratch_, main).WithContext("GPU cache rank"));
  rows_ = scratch_.rows();
  decode_rows_ = decode_rows;
  const size_t layers = static_cast<size_t>(config_.num_layers);
  step_bytes_out_ =
      descriptor_.bytes() + layers * DeviceRowsBytes(rows_, config_.q_dim(), config_.kv_dim());
  step_bytes_back_ = layers * DeviceOutputBytes(decode_rows_, config_.q_dim());
  total_bytes_out_ += step_bytes_out_;
  total_bytes_back_ += step_bytes_back_;
  return Status::Ok();
}

Status DevicePlaneClient::CheckLayer(int layer) const {
  if (rows_ == 0 || layer < 0 || layer >= config_.num_layers) {
    return FailedPreconditionError("GPU cache rank: layer " + std::to_string(layer) +
                                   " outside a planned step");
  }
  return Status::Ok();
}

Status DevicePlaneClient::Layer(int layer, const __nv_bfloat16* qkv, __nv_bfloat16* attention,
                                cudaStream_t main) {
  RUBATO_RETURN_IF_ERROR(CheckLayer(layer));
  const TransferOp ops[2] = {
      TransferOp::Send(options_.peer, kDeviceRowsTag, qkv,
                       DeviceRowsBytes(rows_, config_.q_dim(), config_.kv_dim()),
                       MemoryKind::kCuda),
      TransferOp::Recv(options_.peer, kDeviceOutputTag, attention,
                       DeviceOutputBytes(decode_rows_, config_.q_dim()), MemoryKind::kCuda)};
  const size_t count = decode_rows_ > 0 ? 2 : 1;
  return exchange_.Exchange({ops, count}, main)
      .WithContext("GPU cache rank: layer " + std::to_string(layer));
}

Status DevicePlaneClient::Send(int layer, const __nv_bfloat16* qkv, cudaStream_t main) {
  RUBATO_RETURN_IF_ERROR(CheckLayer(layer));
  const TransferOp send = TransferOp::Send(
      options_.peer, kDeviceRowsTag, qkv, DeviceRowsBytes(rows_, config_.q_dim(), config_.kv_dim()),
      MemoryKind::kCuda);
  return exchange_.Exchange({&send, 1}, main)
      .WithContext("GPU cache rank: sending layer " + std::to_string(layer));
}

Status DevicePlaneClient::Receive(int layer, __nv_bfloat16* attention, cudaStream_t main) {
  RUBATO_RETURN_IF_ERROR(CheckLayer(layer));
  if (decode_rows_ == 0) return Status::Ok();
  const TransferOp recv =
      TransferOp::Recv(options_.peer, kDeviceOutputTag, attention,
                       DeviceOutputBytes(decode_rows_, config_.q_dim()), MemoryKind::kCuda);
  return exchange_.Exchange({&recv, 1}, main)
      .WithContext("GPU cache rank: receiving layer " + std::to_string(layer));
}

Status DevicePlaneClient::Stop(cudaStream_t main) {
  RUBATO_RETURN_IF_ERROR(exchange_.Drain());
  DeviceStep stop;
  stop.kind = DeviceStep::Kind::kStop;
  stop.step = ++step_;
  rows_ = 0;
  RUBATO_RETURN_IF_ERROR(SendDescriptor(stop, main));
  RUBATO_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(main), "sending the stop descriptor");
  return exchange_.Drain();
}

}  // namespace rubato
