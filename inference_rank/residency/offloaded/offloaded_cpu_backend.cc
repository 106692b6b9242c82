// The offloaded residency's CPU model half (see offloaded_cpu_backend.h).
#include "inference_rank/residency/offloaded/offloaded_cpu_backend.h"

#include <algorithm>
#include <string>
#include <vector>

#include "inference_rank/residency/offloaded/kv_offload.h"
#include "inference_rank/residency/offloaded/offloaded_entries.h"

namespace rubato {
namespace {

// A one-token entry past position 0 attends the exchange's compact KV.
bool AttendsCompact(const CpuEntryRows& p) { return p.tokens == 1 && p.start_position > 0; }

class OffloadedCpuBackend final : public CpuResidencyBackend {
 public:
  explicit OffloadedCpuBackend(const ModelConfig& config) : config_(config) {}

  std::string_view residency_name() const override { return "offloaded"; }

  Status CheckBatch(std::span<const ForwardEntry> batch,
                    const AttentionWindow& window) const override {
    return CheckOffloadedEntries(batch, window);
  }

  Status LayerComputed(const CpuLayerContext& layer) override {
    const int kv_dim = config_.kv_dim();
    const int q_dim = config_.q_dim();
    // Every exchange of the batch gets its entries' K/V (usually one exchange: one cache rank).
    exchanges_.clear();
    for (const CpuEntryRows& p : layer.entries) {
      if (p.residency == nullptr) continue;
      KvOffloadExchange* exchange = OffloadHandle(p.residency).exchange;
      if (std::find(exchanges_.begin(), exchanges_.end(), exchange) == exchanges_.end()) {
        exchanges_.push_back(exchange);
      }
    }
    for (KvOffloadExchange* exchange : exchanges_) {
      layer_kv_.clear();
      for (const CpuEntryRows& p : layer.entries) {
        if (p.residency == nullptr || OffloadHandle(p.residency).exchange != exchange) continue;
        const size_t row = static_cast<size_t>(p.first_token);
        const size_t last = row + static_cast<size_t>(p.tokens) - 1;
        layer_kv_.push_back(OffloadLayerKv{OffloadHandle(p.residency).session_id, p.start_position,
                                           p.tokens, layer.k + row * kv_dim, layer.v + row * kv_dim,
                                           layer.q + last * q_dim});
      }
      RUBATO_RETURN_IF_ERROR(exchange->LayerComputed(layer.layer, layer_kv_));
    }
    return Status::Ok();
  }

  Result<ResidencyAttention> Attend(const CpuLayerContext& layer, int entry) override {
    const CpuEntryRows& p = layer.entries[static_cast<size_t>(entry)];
    ResidencyAttention read;
    if (!AttendsCompact(p)) return read;  // a prefill chunk, or position 0: the paged cache
    const OffloadForward& handle = OffloadHandle(p.residency);
    if (handle.exchange->ServesPartialAttention(handle.session_id)) {
      // Attention on the cache rank: every position [0, start_position] is in its reply, so it
      // is the token's whole attention output.
      RUBATO_ASSIGN_OR_RETURN(
          const OffloadPartial partial,
          handle.exchange->PartialFor(layer.layer, handle.session_id, p.start_position));
      const size_t q_dim = static_cast<size_t>(config_.q_dim());
      std::copy(partial.output, partial.output + q_dim,
                layer.output + static_cast<size_t>(p.first_token) * q_dim);
      read.kind = ResidencyAttention::Kind::kWritten;
      return read;
    }
    RUBATO_ASSIGN_OR_RETURN(
        const OffloadCompactKv compact,
        handle.exchange->CompactFor(layer.layer, handle.session_id, p.start_position));
    read.kind = ResidencyAttention::Kind::kTwoSegment;
    read.compact = CompactSegment{compact.compact, compact.counts};
    read.recent_begin = compact.recent_begin;
    return read;
  }

 private:
  const ModelConfig config_;
  std::vector<KvOffloadExchange*> exchanges_;  // one layer's, in first-use order
  std::vector<OffloadLayerKv> layer_kv_;       // one exchange's entries of one layer, batch order
};

}  // namespace

std::unique_ptr<CpuResidencyBackend> MakeOffloadedCpuBackend(const ModelConfig& config) {
  return std::make_unique<OffloadedCpuBackend>(config);
}

}  // namespace rubato
