// The offloaded residency's CUDA model half (see offloaded_cuda_backend.h), the twin of the CPU
// half (offloaded_cpu_backend.cc).
#include "inference_rank/residency/offloaded/offloaded_cuda_backend.h"

#include <cuda_bf16.h>

#include <algorithm>
#include <bit>
#include <cstring>
#include <string>
#include <vector>

#include "common/dtype.h"
#include "inference_rank/model/cuda_pinned_buffer.h"
#include "inference_rank/residency/offloaded/kv_offload.h"
#include "inference_rank/residency/offloaded/offloaded_entries.h"
#include "kernels/cuda/cuda_status.h"
#include "kernels/cuda/decode_attention.cuh"
#include "kernels/cuda/device_buffer.h"

namespace rubato {
namespace {

constexpr size_t kSectionAlign = 256;

size_t AlignUp(size_t bytes) { return (bytes + kSectionAlign - 1) / kSectionAlign * kSectionAlign; }

// The pinned buffer, grown (never shrunk) to hold `bytes`. Only call when no copy in flight
// reads or writes it.
Status EnsurePinned(PinnedBuffer& buffer, size_t bytes, const std::string& what) {
  if (buffer.bytes() >= bytes) return Status::Ok();
  buffer = PinnedBuffer();
  RUBATO_ASSIGN_OR_RETURN(buffer, PinnedBuffer::Allocate(std::bit_ceil(bytes), what));
  return Status::Ok();
}

class OffloadedCudaBackend final : public CudaResidencyBackend {
 public:
  explicit OffloadedCudaBackend(const ModelConfig& config) : config_(config) {}

  std::string_view residency_name() const override { return "offloaded"; }
  // Every layer waits on the host for the exchange.
  bool graph_replayable() const override { return false; }

  Status CheckBatch(std::span<const ForwardEntry> batch,
                    const AttentionWindow& window) const override;
  // The batch's offloaded entries and the pinned buffer their rows come back in.
  Status PlanStep(std::span<const ForwardEntry> batch, const ForwardPlan& plan) override;
  // Ships the entries' K/V and last query to the exchange and uploads the replies of their
  // decode rows.
  Status LayerComputed(const CudaLayerContext& layer) override;
  // The offloaded rows: the attention output the cache rank computed (copied into their rows),
  // or two-segment over their compact replies; the others dense in runs.
  Status AttendDecodeRows(const CudaLayerContext& layer, int first_row, int rows,
                          const AttentionWindow& window) override;

 private:
  struct Entry {
    KvOffloadExchange* exchange = nullptr;
    uint64_t session_id = 0;
    int first_row = 0;  // batch row of the entry's first token
    int tokens = 0;
    int start_position = 0;
    int download_row = 0;  // first row in `download_`
    bool attends = false;  // a decode row attending the exchange's compact KV
  };
  struct Row {  // one attending decode row's reply in `compact_`
    int decode_row = 0;
    bool written = false;      // attention on the cache rank: its output (else a compact slab)
    size_t output_offset = 0;  // written: [q_dim] bf16 in `compact_`
    int capacity = 0;          // compact: rows per KV head (>= 1)
    int recent_tokens = 0;     // L - recent_begin
    size_t keys_offset = 0;    // byte offsets in `compact_` (see `upload_`)
    size_t values_offset = 0;
    size_t counts_offset = 0;
    size_t recent_begin_offset = 0;
  };
  std::vector<Entry> entries_;  // batch order
  std::vector<Row> rows_;       // decode-row order
  PinnedBuffer download_;       // [offloaded rows][qkv_dim] bf16
  // The replies of one layer, host (`upload_`) then device (`compact_`), each section 256-byte
  // aligned (tensor maps want 16):
  //   per reply, in decode-row order (Row's offsets), attention on the cache rank:
  //     output  [num_heads * head_dim] bf16
  //   or a compact reply:
  //     keys    [num_kv_heads][capacity][head_dim] bf16, rows past a head's count zero
  //     values  [num_kv_heads][capacity][head_dim] bf16
  //     counts  [num_kv_heads] int32
  //     recent_begin [1] int32
  PinnedBuffer upload_;
  cuda::DeviceBuffer<unsigned char> compact_;
  // The exchange's K/V in the model's dtype, per entry keys [tokens][kv_dim] then values
  // [tokens][kv_dim], bf16 (a query is read in place in `download_`).
  std::vector<uint16_t> kv_;

  const ModelConfig config_;
};

Status OffloadedCudaBackend::CheckBatch(std::span<const ForwardEntry> batch,
                                        const AttentionWindow& window) const {
  return CheckOffloadedEntries(batch, window);
}

Status OffloadedCudaBackend::PlanStep(std::span<const ForwardEntry> batch,
                                      const ForwardPlan& plan) {
  entries_.clear();
  rows_.clear();
  size_t rows = 0;
  for (size_t e = 0; e < batch.size(); ++e) {
    const ForwardEntry& entry = batch[e];
    if (entry.residency == nullptr) continue;
    Entry p;
    p.exchange = OffloadHandle(entry.residency).exchange;
    p.session_id = OffloadHandle(entry.residency).session_id;
    p.first_row = plan.entry_first_row[e];
    p.tokens = static_cast<int>(entry.tokens.size());
    p.start_position = entry.start_position;
    p.download_row = static_cast<int>(rows);
    // A decode row past position 0 attends the exchange's compact KV (the CPU model's rule).
    p.attends = p.tokens == 1 && p.start_position > 0;
    rows += static_cast<size_t>(p.tokens);
    entries_.push_back(p);
  }
  const size_t qkv_dim = static_cast<size_t>(config_.q_dim() + 2 * config_.kv_dim());
  return EnsurePinned(download_, rows * qkv_dim * sizeof(__nv_bfloat16),
                      "the offloaded entries' q|k|v rows");
}

Status OffloadedCudaBackend::LayerComputed(const CudaLayerContext& context) {
  const int layer = context.layer;
  const cudaStream_t stream = context.stream;
  const int q_dim = config_.q_dim();
  const int kv_dim = config_.kv_dim();
  const size_t qkv_dim = static_cast<size_t>(q_dim + 2 * kv_dim);
  auto* download = reinterpret_cast<__nv_bfloat16*>(download_.data());
  // The offloaded entries' q|k|v rows (after q/k-norm and RoPE), [download rows][qkv_dim] bf16.
  for (const Entry& p : entries_) {
    RUBATO_CUDA_RETURN_IF_ERROR(
        cudaMemcpyAsync(download + static_cast<size_t>(p.download_row) * qkv_dim,
                        context.qkv + static_cast<size_t>(p.first_row) * qkv_dim,
                        static_cast<size_t>(p.tokens) * qkv_dim * sizeof(__nv_bfloat16),
                        cudaMemcpyDeviceToHost, stream),
        "copying the offloaded entries' K/V of layer " + std::to_string(layer) + " to the host");
  }
  // Also orders this layer's upload after the previous layer's: that copy has finished once the
  // stream is idle, so the upload buffer may be rewritten.
  RUBATO_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream),
                              "running layer " + std::to_string(layer) + " up to its KV append");

  // The exchange's inputs in bf16, the model's K/V dtype (the wire's, ConnectOffload): per
  // entry keys [tokens][kv_dim], values [tokens][kv_dim]; the last token's query in place.
  size_t elements = 0;
  for (const Entry& p : entries_) elements += static_cast<size_t>(p.tokens) * 2 * kv_dim;
  kv_.resize(elements);
  std::vector<OffloadLayerKv> layer_kv;
  layer_kv.reserve(entries_.size());
  uint16_t* out = kv_.data();
  for (const Entry& p : entries_) {
    const auto* first =
        reinterpret_cast<const uint16_t*>(download + static_cast<size_t>(p.download_row) * qkv_dim);
    OffloadLayerKv entry_kv{p.session_id, p.start_position, p.tokens, nullptr, nullptr, nullptr};
    entry_kv.dtype = DType::kBF16;
    entry_kv.keys = out;
    for (int t = 0; t < p.tokens; ++t, out += kv_dim) {
      std::memcpy(out, first + t * qkv_dim + q_dim, kv_dim * sizeof(uint16_t));
    }
    entry_kv.values = out;
    for (int t = 0; t < p.tokens; ++t, out += kv_dim) {
      std::memcpy(out, first + t * qkv_dim + q_dim + kv_dim, kv_dim * sizeof(uint16_t));
    }
    entry_kv.last_query = first + static_cast<size_t>(p.tokens - 1) * qkv_dim;
    layer_kv.push_back(entry_kv);
  }
  // Every exchange of the batch gets its own entries, in batch order.
  std::vector<OffloadLayerKv> for_exchange;
  for (size_t i = 0; i < entries_.size(); ++i) {
    KvOffloadExchange* exchange = entries_[i].exchange;
    bool seen = false;
    for (size_t j = 0; j < i; ++j) seen = seen || entries_[j].exchange == exchange;
    if (seen) continue;
    for_exchange.clear();
    for (size_t j = i; j < entries_.size(); ++j) {
      if (entries_[j].exchange == exchange) for_exchange.push_back(layer_kv[j]);
    }
    RUBATO_RETURN_IF_ERROR(exchange->LayerComputed(layer, for_exchange));
  }

  // The replies of the decode rows, narrowed to bf16 into the upload buffer (`upload_` has the
  // layout): the attention output the cache rank computed, or a compact slab.
  const int kv_heads = config_.num_kv_heads;
  const int head_dim = config_.head_dim;
  rows_.clear();
  std::vector<OffloadCompactKv> replies;
  std::vector<OffloadPartial> partials;
  size_t upload_bytes = 0;
  for (const Entry& p : entries_) {
    if (!p.attends) continue;
    Row row;
    row.decode_row = p.first_row;
    if (p.exchange->ServesPartialAttention(p.session_id)) {
      RUBATO_ASSIGN_OR_RETURN(const OffloadPartial partial,
                              p.exchange->PartialFor(layer, p.session_id, p.start_position));
      row.written = true;
      row.output_offset = upload_bytes;
      upload_bytes += AlignUp(static_cast<size_t>(q_dim) * sizeof(uint16_t));
      rows_.push_back(row);
      partials.push_back(partial);
      replies.emplace_back();
      continue;
    }
    RUBATO_ASSIGN_OR_RETURN(const OffloadCompactKv reply,
                            p.exchange->CompactFor(layer, p.session_id, p.start_position));
    const CompactKvView& view = reply.compact;
    if (view.num_kv_heads != kv_heads || view.head_dim != head_dim || view.capacity < 0 ||
        reply.recent_begin < 0 || reply.recent_begin > p.start_position) {
      return InternalError(
          "layer " + std::to_string(layer) + ": the exchange's compact KV for session " +
          std::to_string(p.session_id) + " has " + std::to_string(view.num_kv_heads) +
          " KV heads of " + std::to_string(view.head_dim) + " and recent_begin " +
          std::to_string(reply.recent_begin) + " at position " + std::to_string(p.start_position));
    }
    for (int h = 0; h < kv_heads; ++h) {
      if (reply.counts[h] < 0 || reply.counts[h] > view.capacity) {
        return InternalError("layer " + std::to_string(layer) + ": the exchange's compact KV " +
                             "has " + std::to_string(reply.counts[h]) + " rows for KV head " +
                             std::to_string(h) + " in a capacity of " +
                             std::to_string(view.capacity));
      }
    }
    row.recent_tokens = p.start_position + 1 - reply.recent_begin;
    row.capacity = std::max(view.capacity, 1);  // the kernel wants >= 1 row; counts say 0
    const size_t slab = static_cast<size_t>(kv_heads) * row.capacity * head_dim * 2;
    row.keys_offset = upload_bytes;
    row.values_offset = row.keys_offset + AlignUp(slab);
    row.counts_offset = row.values_offset + AlignUp(slab);
    row.recent_begin_offset = row.counts_offset + AlignUp(sizeof(int32_t) * kv_heads);
    upload_bytes = row.recent_begin_offset + AlignUp(sizeof(int32_t));
    rows_.push_back(row);
    replies.push_back(reply);
    partials.emplace_back();
  }
  if (rows_.empty()) return Status::Ok();
  // Offloaded decode rows are all dense-kind rows, which the forward plan numbers in batch
  // order: AttendDecodeRows' binary search relies on it.
  if (!std::is_sorted(rows_.begin(), rows_.end(),
                      [](const Row& a, const Row& b) { return a.decode_row < b.decode_row; })) {
    return InternalError("layer " + std::to_string(layer) +
                         ": the offloaded decode rows are not in row order");
  }
  RUBATO_RETURN_IF_ERROR(EnsurePinned(upload_, upload_bytes, "the offloaded decode replies"));
  RUBATO_RETURN_IF_ERROR(
      cuda::GrowTo(compact_, upload_bytes, "the offloaded decode replies on the device"));
  std::byte* upload = upload_.data();
  for (size_t r = 0; r < rows_.size(); ++r) {
    const Row& row = rows_[r];
    if (row.written) {
      ConvertFromF32(DType::kBF16, partials[r].output, upload + row.output_offset,
                     static_cast<size_t>(q_dim));
      continue;
    }
    const OffloadCompactKv& reply = replies[r];
    const CompactKvView& view = reply.compact;
    auto* keys = reinterpret_cast<uint16_t*>(upload + row.keys_offset);
    auto* values = reinterpret_cast<uint16_t*>(upload + row.values_offset);
    auto* counts = reinterpret_cast<int32_t*>(upload + row.counts_offset);
    for (int h = 0; h < kv_heads; ++h) {
      const int count = reply.counts[h];
      counts[h] = count;
      const size_t head = static_cast<size_t>(h) * row.capacity * head_dim;
      const size_t valid = static_cast<size_t>(count) * head_dim;
      ConvertFromF32(DType::kBF16, view.keys + view.Offset(h, 0), keys + head, valid);
      ConvertFromF32(DType::kBF16, view.values + view.Offset(h, 0), values + head, valid);
      const size_t unused = static_cast<size_t>(row.capacity) * head_dim - valid;
      std::memset(keys + head + valid, 0, unused * sizeof(uint16_t));
      std::memset(values + head + valid, 0, unused * sizeof(uint16_t));
    }
    *reinterpret_cast<int32_t*>(upload + row.recent_begin_offset) = reply.recent_begin;
  }
  return cuda::CudaStatus(
      cudaMemcpyAsync(compact_.data(), upload, upload_bytes, cudaMemcpyHostToDevice, stream),
      "copying the offloaded decode replies of layer " + std::to_string(layer) + " to the device");
}

Status OffloadedCudaBackend::AttendDecodeRows(const CudaLayerContext& context, int first_row,
                                              int rows, const AttentionWindow& window) {
  const unsigned char* base = compact_.data();
  const size_t q_dim = static_cast<size_t>(config_.q_dim());
  // rows_ is in decode-row order (built in batch order): found by binary search.
  auto offloaded = [&](int row) {
    const auto it =
        std::lower_bound(rows_.begin(), rows_.end(), row,
                         [](const Row& r, int decode_row) { return r.decode_row < decode_row; });
    return it != rows_.end() && it->decode_row == row ? it : rows_.end();
  };
  int row = first_row;
  while (row < first_row + rows) {
    const auto it = offloaded(row);
    if (it != rows_.end() && it->written) {  // the cache rank's attention output, as it is
      RUBATO_CUDA_RETURN_IF_ERROR(
          cudaMemcpyAsync(context.attention + static_cast<size_t>(row) * q_dim,
                          base + it->output_offset, q_dim * sizeof(__nv_bfloat16),
                          cudaMemcpyDeviceToDevice, context.stream),
          "copying the cache rank's attention output of decode row " + std::to_string(row));
      ++row;
      continue;
    }
    if (it != rows_.end()) {  // a compact reply and the recent segment
      cuda::DecodeAttentionParams two_segment = context.DecodeRows(row, 1);
      two_segment.compact_keys = reinterpret_cast<const __nv_bfloat16*>(base + it->keys_offset);
      two_segment.compact_values = reinterpret_cast<const __nv_bfloat16*>(base + it->values_offset);
      two_segment.compact_capacity = it->capacity;
      two_segment.compact_counts = reinterpret_cast<const int32_t*>(base + it->counts_offset);
      two_segment.recent_begin = reinterpret_cast<const int32_t*>(base + it->recent_begin_offset);
      two_segment.max_recent_tokens = it->recent_tokens;
      RUBATO_RETURN_IF_ERROR(cuda::DecodeAttention(two_segment, context.stream));
      ++row;
      continue;
    }
    // A run of local rows: dense over the local cache.
    int end = row + 1;
    while (end < first_row + rows && offloaded(end) == rows_.end()) ++end;
    cuda::DecodeAttentionParams params = context.DecodeRows(row, end - row);
    params.sink_tokens = window.sink_tokens;
    params.recent_tokens = window.recent_tokens;
    RUBATO_RETURN_IF_ERROR(cuda::DecodeAttention(params, context.stream));
    row = end;
  }
  return Status::Ok();
}

}  // namespace

std::unique_ptr<CudaResidencyBackend> MakeOffloadedCudaBackend(const ModelConfig& config) {
  return std::make_unique<OffloadedCudaBackend>(config);
}

}  // namespace rubato
