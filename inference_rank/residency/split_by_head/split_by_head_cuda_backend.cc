// The split_by_head residency's CUDA model half (see split_by_head_cuda_backend.h).
#include "inference_rank/residency/split_by_head/split_by_head_cuda_backend.h"

#include <algorithm>
#include <bit>
#include <string>

#include "kernels/cuda/cuda_status.h"
#include "kernels/cuda/decode_attention.cuh"
#include "kernels/cuda/kv_append.cuh"

namespace rubato {
namespace {

const SplitByHeadCudaRequest* RequestOf(const ForwardEntry& entry) {
  const auto* handle = dynamic_cast<const SplitByHeadCudaEntry*>(entry.residency);
  return handle != nullptr ? handle->request : nullptr;
}

}  // namespace

Status SplitByHeadCudaBackend::CheckBatch(std::span<const ForwardEntry> batch,
                                          const AttentionWindow& window) const {
  if (!window.IsDense()) {
    return InvalidArgumentError("split_by_head KV: a windowed forward is not supported");
  }
  for (size_t e = 0; e < batch.size(); ++e) {
    if (batch[e].residency == nullptr) continue;
    const SplitByHeadCudaRequest* request = RequestOf(batch[e]);
    if (request == nullptr) {
      return InvalidArgumentError("split_by_head KV: batch entry " + std::to_string(e) +
                                  " carries another residency's handle");
    }
    const int end = batch[e].start_position + static_cast<int>(batch[e].tokens.size());
    if (end > kv_->context_capacity()) {
      return InvalidArgumentError(
          "split_by_head KV: batch entry " + std::to_string(e) + " reaches position " +
          std::to_string(end - 1) + ", past the device storage's " +
          std::to_string(kv_->context_capacity()) + " positions (engine.max_context)");
    }
  }
  return Status::Ok();
}

Status SplitByHeadCudaBackend::PlanStep(std::span<const ForwardEntry> batch,
                                        const ForwardPlan& plan) {
  tokens_ = plan.tokens;
  const size_t bytes = std::bit_ceil(static_cast<size_t>(std::max(1, tokens_))) * sizeof(int32_t);
  if (staging_.bytes() < bytes) {
    RUBATO_ASSIGN_OR_RETURN(staging_, PinnedBuffer::Allocate(bytes, "split_by_head store rows"));
  }
  RUBATO_RETURN_IF_ERROR(
      cuda::GrowTo(store_rows_, bytes / sizeof(int32_t), "split_by_head store rows"));
  auto* rows = reinterpret_cast<int32_t*>(staging_.data());
  std::fill(rows, rows + tokens_, -1);
  decode_.clear();
  for (size_t e = 0; e < batch.size(); ++e) {
    const SplitByHeadCudaRequest* request = RequestOf(batch[e]);
    if (request == nullptr) continue;
    const int first = plan.entry_first_row[e];
    for (size_t t = 0; t < batch[e].tokens.size(); ++t) {
      rows[first + static_cast<int>(t)] =
          static_cast<int32_t>(static_cast<int64_t>(request->slot) * kv_->context_capacity() +
                               batch[e].start_position + static_cast<int>(t));
    }
    if (batch[e].tokens.size() == 1 && request->installed) {
      decode_.emplace_back(request, batch[e].start_position);
    }
  }
  return Status::Ok();
}

Status SplitByHeadCudaBackend::BeginStep(cudaStream_t main) {
  main_ = main;
  return cuda::CudaStatus(
      cudaMemcpyAsync(store_rows_.data(), staging_.data(),
                      sizeof(int32_t) * static_cast<size_t>(tokens_), cudaMemcpyHostToDevice, main),
      "split_by_head: copying the store rows");
}

Status SplitByHeadCudaBackend::LayerComputed(const CudaLayerContext& layer) {
  const int l = layer.layer;
  const int head_dim = model_.head_dim, q_dim = model_.q_dim(), kv_dim = model_.kv_dim();
  const HeadSplit& split = kv_->split();
  cuda::KvAppendParams append;
  append.row_stride = q_dim + 2 * kv_dim;
  append.slots = store_rows_.data();  // row = slot * capacity + position in one-head pools
  append.tokens = layer.plan->tokens;
  append.num_kv_heads = 1;
  append.head_dim = head_dim;
  append.block_tokens = SplitByHeadDeviceKv::kRBlockTokens;
  for (int h = 0; h < model_.num_kv_heads; ++h) {
    append.keys = layer.qkv + q_dim + h * head_dim;
    append.values = layer.qkv + q_dim + kv_dim + h * head_dim;
    if (split.IsRepresentative(l, h)) {
      const int cluster = split.cluster[l][h];
      append.key_pool = kv_->r_keys(l, cluster);
      append.value_pool = kv_->r_values(l, cluster);
    } else {
      int nr = 0;  // the NR-head's index in the store
      for (int other = 0; other < h; ++other) nr += !split.IsRepresentative(l, other);
      const size_t at = static_cast<size_t>(nr) * kv_->store_rows() * head_dim;
      append.key_pool = kv_->store_keys(l) + at;
      append.value_pool = kv_->store_values(l) + at;
    }
    RUBATO_RETURN_IF_ERROR(cuda::AppendToPagedKv(append, layer.stream));
  }
  return Status::Ok();
}

Status SplitByHeadCudaBackend::AttendDecodeRows(const CudaLayerContext& layer, int first_row,
                                                int rows, const AttentionWindow& window) {
  // Row group 0: decode rows without a SyncKV plan read the paged cache densely.
  cuda::DecodeAttentionParams dense = layer.DecodeRows(first_row, rows);
  dense.sink_tokens = window.sink_tokens;
  dense.recent_tokens = window.recent_tokens;
  return cuda::DecodeAttention(dense, layer.stream);
}

Status SplitByHeadCudaBackend::FinishStep() {
  const int layers = model_.num_layers;
  bool in_flight = false;
  for (int l = 0; l < layers; ++l) {
    in_flight = in_flight || kv_->fetch_pending()[static_cast<size_t>(l)];
    if (!kv_->waited()[static_cast<size_t>(l)]) continue;
    kv_->waited()[static_cast<size_t>(l)] = 0;
    float ms = 0.0f;
    RUBATO_CUDA_RETURN_IF_ERROR(cudaEventElapsedTime(&ms, kv_->wait_begin(l), kv_->wait_end(l)),
                                "split_by_head: timing the fetch wait");
    counters_.exposed_wait_ns += static_cast<int64_t>(static_cast<double>(ms) * 1e6);
  }
  if (!in_flight) {  // the copy stream is idle: its counters can be read without waiting
    unsigned long long copied[2] = {0, 0};
    RUBATO_RETURN_IF_ERROR(kv_->ReadCopiedRows(copied));
    const int64_t fetched = static_cast<int64_t>(copied[0]);
    counters_.rows_fetched = fetched;
    counters_.bytes_fetched = fetched * 2 * model_.head_dim * 2;  // K and V, bf16
    counters_.rows_reused = static_cast<int64_t>(copied[1]);
  }
  // The local KV of this step's decode entries (bf16), as the CPU half counts it.
  if (!decode_.empty()) {
    const int64_t row = 2LL * model_.head_dim * 2;
    int64_t local = 0, full = 0;
    for (const auto& [request, position] : decode_) {
      const int64_t context = position + 1;
      const int64_t nr_rows = request->static_rows + request->dynamic_rows +
                              (context - std::min<int64_t>(request->recent_begin, context));
      local += (kv_->clusters() * context + kv_->nr_heads() * nr_rows) * row;
      full += model_.num_kv_heads * context * row;
    }
    counters_.local_kv_bytes = local * model_.num_layers;
    counters_.full_kv_bytes = full * model_.num_layers;
  }
  metrics_.Publish(counters_);
  return Status::Ok();
}

void SplitByHeadCudaBackend::AbortStep() {
  if (main_ != nullptr) cudaStreamSynchronize(main_);
  cudaStreamSynchronize(kv_->copy_stream());
}

}  // namespace rubato
