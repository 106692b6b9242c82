// The split_by_head residency's CPU model half (see split_by_head_cpu_backend.h).
#include "inference_rank/residency/split_by_head/split_by_head_cpu_backend.h"

#include <algorithm>

#include "kernels/cpu/two_segment_attention.h"

namespace rubato {
namespace {

SplitByHeadKv* KvOf(const CpuEntryRows& entry) {
  const auto* handle = dynamic_cast<const SplitByHeadEntry*>(entry.residency);
  return handle != nullptr ? handle->kv : nullptr;
}

}  // namespace

void SplitByHeadMetrics::Publish(const SplitByHeadCounters& c) {
  const int64_t fetches_now = c.fetches, rows = c.rows_fetched, bytes = c.bytes_fetched,
                wait = c.exposed_wait_ns;
  if (fetches != nullptr) fetches->Increment(static_cast<double>(fetches_now - published_fetches));
  if (rows_fetched != nullptr) rows_fetched->Increment(static_cast<double>(rows - published_rows));
  if (bytes_fetched != nullptr) {
    bytes_fetched->Increment(static_cast<double>(bytes - published_bytes));
  }
  if (exposed_wait_seconds != nullptr) {
    exposed_wait_seconds->Increment(static_cast<double>(wait - published_wait_ns) * 1e-9);
  }
  const int64_t full = c.full_kv_bytes;
  if (local_kv_share != nullptr && full > 0) {
    local_kv_share->Set(static_cast<double>(c.local_kv_bytes) / static_cast<double>(full));
  }
  published_fetches = fetches_now, published_rows = rows, published_bytes = bytes;
  published_wait_ns = wait;
}

Status SplitByHeadCpuBackend::CheckBatch(std::span<const ForwardEntry> batch,
                                         const AttentionWindow& window) const {
  if (!window.IsDense()) {
    return InvalidArgumentError("split_by_head KV: a windowed forward is not supported");
  }
  for (size_t e = 0; e < batch.size(); ++e) {
    if (batch[e].residency == nullptr) continue;
    if (dynamic_cast<const SplitByHeadEntry*>(batch[e].residency) == nullptr) {
      return InvalidArgumentError("split_by_head KV: batch entry " + std::to_string(e) +
                                  " carries another residency's handle");
    }
  }
  return Status::Ok();
}

Status SplitByHeadCpuBackend::LayerComputed(const CpuLayerContext& context) {
  const int layer = context.layer;
  const int kv_dim = context.config->kv_dim();
  decode_.assign(context.entries.size(), 0);
  if (layer == 0) local_bytes_ = full_bytes_ = 0;
  for (size_t e = 0; e < context.entries.size(); ++e) {
    const CpuEntryRows& p = context.entries[e];
    SplitByHeadKv* kv = KvOf(p);
    if (kv == nullptr) continue;
    const int position = p.start_position + p.tokens - 1;
    // Decode once the prompt's selection is installed (the last prefill chunk installs it).
    decode_[e] = kv->Installed(layer);
    if (decode_[e]) RUBATO_RETURN_IF_ERROR(kv->BeginStep(layer, position));
    const size_t offset = static_cast<size_t>(p.first_token) * kv_dim;
    RUBATO_RETURN_IF_ERROR(
        kv->Offload(layer, context.k + offset, context.v + offset, p.start_position, p.tokens));
    RUBATO_RETURN_IF_ERROR(
        kv->ApplySelection(layer, context.cache->LayerView(layer, *p.sequence), position));
  }
  return Status::Ok();
}

Result<ResidencyAttention> SplitByHeadCpuBackend::Attend(const CpuLayerContext& context,
                                                         int entry) {
  const CpuEntryRows& p = context.entries[static_cast<size_t>(entry)];
  ResidencyAttention read;
  if (!decode_[static_cast<size_t>(entry)]) return read;  // prefill: dense, every head local
  if (p.tokens != 1) {
    return InvalidArgumentError("split_by_head KV: a decode entry holds one token, not " +
                                std::to_string(p.tokens));
  }
  SplitByHeadKv& kv = *KvOf(p);
  const int layer = context.layer;
  const ModelConfig& config = *context.config;
  const int position = p.start_position;
  const size_t offset = static_cast<size_t>(p.first_token) * config.q_dim();
  no_rows_.assign(static_cast<size_t>(config.num_kv_heads), 0);
  // R-heads: no front, every position in place. NR-heads: the front, then the recent positions.
  TwoSegmentAttentionArgs whole;
  whole.query = context.q + offset;
  whole.output = context.output + offset;
  whole.num_heads = config.num_heads;
  whole.compact = kv.Front(layer).view;
  whole.compact_counts = no_rows_.data();
  whole.kv = context.cache->LayerView(layer, *p.sequence);
  whole.recent_begin = 0;
  whole.recent_end = position + 1;
  TwoSegmentAttentionArgs split = whole;
  split.compact_counts = kv.Front(layer).counts;
  split.recent_begin = std::min(kv.recent_begin(layer), position + 1);
  RUBATO_RETURN_IF_ERROR(ValidateTwoSegmentAttention(whole));
  RUBATO_RETURN_IF_ERROR(ValidateTwoSegmentAttention(split));
  const size_t scratch = static_cast<size_t>(
      std::max(TwoSegmentAttentionScratchSize(whole), TwoSegmentAttentionScratchSize(split)));
  scratch_.resize(static_cast<size_t>(context.pool->num_workers()));
  for (std::vector<float>& s : scratch_) s.resize(std::max(s.size(), scratch));
  context.pool->ParallelFor(config.num_kv_heads, [&](int h, int worker) {
    TwoSegmentAttentionForKvHead(split_.IsRepresentative(layer, h) ? whole : split, h,
                                 scratch_[static_cast<size_t>(worker)].data());
  });
  local_bytes_ += kv.LocalBytes(layer, position);
  full_bytes_ += kv.FullBytes(position);
  if (layer == config.num_layers - 1) {
    counters_.local_kv_bytes = local_bytes_;
    counters_.full_kv_bytes = full_bytes_;
    metrics_.Publish(counters_);
  }
  read.kind = ResidencyAttention::Kind::kWritten;
  return read;
}

}  // namespace rubato
