// CacheRankClient's replies as they are posted, and its delta replies (cache_client.h,
// transport/compact_delta.h): a reply's receive and what a full reply would carry; a delta
// reply's header announces its size, its rows enter the sessions' persistent compact pools, and
// a decode token attends its pool's rows in position order. docs/disaggregated.md "Delta
// replies".
#include <algorithm>
#include <cstring>
#include <memory>
#include <numeric>
#include <string>
#include <vector>

#include "inference_rank/residency/offloaded/cache_client.h"

namespace rubato {

using transport::TransferId;
using transport::TransferOp;

Result<std::shared_ptr<CacheRankClient::Reply>> CacheRankClient::PostReplyReceive(int pack) {
  // What a full reply carries: rows per KV head and its bytes (the delta savings' yardstick).
  LayerPackShape full_shape = PackShape(LayerPackKind::kReplyPack, pack);
  full_shape.delta = false;
  std::vector<LayerPackRequest> full_requests = step_requests_;
  for (LayerPackRequest& request : full_requests) request.delta_reset = 0;
  RUBATO_ASSIGN_OR_RETURN(const uint64_t full_bytes, ReplyPackBytes(full_shape, full_requests));
  uint64_t full_rows = 0;
  for (const LayerPackRequest& request : step_requests_) full_rows += request.reply_slots;
  full_rows *= uint64_t{session_shape_.num_kv_heads} * static_cast<uint64_t>(PackLayers(pack));
  full_reply_bytes_ += full_bytes;
  compact_rows_full_ += full_rows;
  if (rows_full_metric_ != nullptr) rows_full_metric_->Increment(static_cast<double>(full_rows));
  if (!deltas_) {
    compact_rows_received_ += full_rows;
    if (rows_received_metric_ != nullptr) {
      rows_received_metric_->Increment(static_cast<double>(full_rows));
    }
  }

  auto reply = std::make_shared<Reply>();
  reply->bytes = full_bytes;
  std::span<std::byte> into = reply->buffer.Bytes(reply->bytes);
  uint64_t tag = kReplyTag;
  if (deltas_) {  // the reply's size comes in its header: at most every row entering
    std::vector<LayerPackRequest> largest = step_requests_;
    for (LayerPackRequest& request : largest) request.delta_rows = request.reply_slots;
    RUBATO_ASSIGN_OR_RETURN(reply->max_bytes,
                            ReplyPackBytes(PackShape(LayerPackKind::kReplyPack, pack), largest));
    reply->delta = true;
    reply->bytes = 0;
    into = reply->header.Bytes(sizeof(LayerPackHeader));
    tag = kReplyHeaderTag;
  }
  const TransferOp receive = TransferOp::Recv(cache_peer_, tag, into.data(), into.size());
  const Result<TransferId> posted = transport_.Post({&receive, 1});
  if (!posted.ok()) return Broken(posted.status().WithContext(options_.cache_name));
  reply->receive = *posted;
  return reply;
}

Status CacheRankClient::AwaitDeltaHeader(Reply& reply, const std::string& what) {
  RUBATO_RETURN_IF_ERROR(Wait(reply.receive, what + " (its header)"));
  reply.header_arrived = true;
  bytes_received_ += sizeof(LayerPackHeader);
  if (rx_bytes_metric_ != nullptr) rx_bytes_metric_->Increment(sizeof(LayerPackHeader));
  LayerPackHeader header;
  std::memcpy(&header, reply.header.Bytes(sizeof(header)).data(), sizeof(header));
  if (std::memcmp(header.magic, kLayerPackMagic, sizeof(header.magic)) == 0 &&
      header.version != kLayerPackVersion) {
    return Broken(UnsupportedError(options_.cache_name + ": " + what +
                                   ": a reply of layer-pack "
                                   "version " +
                                   std::to_string(header.version) +
                                   ", this "
                                   "inference rank reads version " +
                                   std::to_string(kLayerPackVersion) +
                                   " (the cache rank runs another rubato version)"));
  }
  if (header.total_bytes < sizeof(LayerPackHeader) || header.total_bytes > reply.max_bytes) {
    return Broken(DataLossError(options_.cache_name + ": " + what +
                                ": a delta reply header "
                                "announcing " +
                                std::to_string(header.total_bytes) + " bytes, outside [64, " +
                                std::to_string(reply.max_bytes) + "] (every row entering)"));
  }
  reply.bytes = header.total_bytes;
  const std::span<std::byte> into = reply.buffer.Bytes(reply.bytes);
  const TransferOp receive = TransferOp::Recv(cache_peer_, kReplyTag, into.data(), into.size());
  const Result<TransferId> posted = transport_.Post({&receive, 1});
  if (!posted.ok()) return Broken(posted.status().WithContext(options_.cache_name));
  reply.receive = *posted;
  return Status::Ok();
}

Status CacheRankClient::ApplyDeltaReply(const LayerPackView& reply) {
  const int kv_heads = model_.num_kv_heads;
  const size_t head_dim = static_cast<size_t>(model_.head_dim);
  std::vector<int32_t> slots, positions;
  std::vector<float> keys, values;
  uint64_t rows_received = 0;
  for (uint32_t l = 0; l < reply.num_layers(); ++l) {
    const int layer = static_cast<int>(reply.first_layer() + l);
    for (uint32_t r = 0; r < reply.batch(); ++r) {
      const LayerPackRequest& entry = reply.requests()[r];
      const auto found = sessions_.find(entry.session_id);
      if (found == sessions_.end()) continue;  // closed since: its pools are gone
      SessionState& session = found->second;
      std::unique_ptr<CompactPool>& pool = session.pools.at(static_cast<size_t>(layer));
      const uint32_t rows = entry.delta_rows;
      if (pool == nullptr) {
        if (rows == 0) continue;  // nothing to hold yet (an empty pool reads as counts 0)
        pool = std::make_unique<CompactPool>(kv_heads, session.pool_capacity, model_.head_dim);
      }
      for (int h = 0; h < kv_heads; ++h) {
        slots.clear();
        positions.clear();
        for (uint32_t i = 0; i < rows; ++i) {
          const int32_t position =
              LoadInt32(reply.Positions(l, r), static_cast<size_t>(h) * rows + i);
          if (position == -1) break;  // ValidateReplyContents: -1 from here on
          positions.push_back(position);
          slots.push_back(LoadInt32(reply.Slots(l, r), static_cast<size_t>(h) * rows + i));
        }
        // The entering rows, widened to f32 (the pool's dtype) from the session's.
        const size_t count = positions.size() * head_dim;
        const size_t row_bytes = head_dim * DTypeSize(reply.dtype());
        keys.resize(count);
        values.resize(count);
        if (count > 0) {
          ConvertToF32(reply.dtype(),
                       reply.Key(l, r).data() + static_cast<size_t>(h) * rows * row_bytes,
                       keys.data(), count);
          ConvertToF32(reply.dtype(),
                       reply.Value(l, r).data() + static_cast<size_t>(h) * rows * row_bytes,
                       values.data(), count);
        }
        const Status applied =
            pool->Apply(h, entry.delta_reset != 0, LoadInt32(reply.Counts(l, r), h), slots,
                        positions, keys, values);
        if (!applied.ok()) {
          return Broken(applied.WithContext(options_.cache_name + ": the delta reply of step " +
                                            std::to_string(reply.step()) + " for session " +
                                            std::to_string(entry.session_id) + " layer " +
                                            std::to_string(layer)));
        }
        rows_received += positions.size();
      }
    }
  }
  compact_rows_received_ += rows_received;
  if (rows_received_metric_ != nullptr) {
    rows_received_metric_->Increment(static_cast<double>(rows_received));
  }
  return Status::Ok();
}

Result<OffloadCompactKv> CacheRankClient::PoolCompactKv(uint64_t session_id, SessionState& session,
                                                        int layer, int slots, int recent_begin) {
  const int kv_heads = model_.num_kv_heads;
  const size_t head_dim = static_cast<size_t>(model_.head_dim);
  CompactPool* pool = session.pools.at(static_cast<size_t>(layer)).get();
  OffloadCompactKv compact;
  compact.recent_begin = recent_begin;
  if (pool == nullptr || slots == 0) {
    if (slots != 0) {
      return Broken(DataLossError(options_.cache_name + ": session " + std::to_string(session_id) +
                                  " layer " + std::to_string(layer) + " has no rows, expected " +
                                  std::to_string(slots) + " per KV head"));
    }
    compact.compact = CompactKvView{nullptr, nullptr, kv_heads, 0, model_.head_dim};
    compact.counts = zero_counts_.data();
    return compact;
  }
  // Rows in position order (a full reply's), [kv_heads][slots][head_dim], kept until the next
  // LayerComputed.
  const size_t floats = static_cast<size_t>(kv_heads) * slots * head_dim;
  widened_.emplace_back(floats);
  widened_.emplace_back(floats);  // may move the first (its buffer stays): refer to both after
  std::vector<float>& keys = widened_[widened_.size() - 2];
  std::vector<float>& values = widened_.back();
  std::vector<int> order;
  for (int h = 0; h < kv_heads; ++h) {
    const std::span<const int32_t> positions = pool->positions(h);
    const int32_t last =
        positions.empty() ? -1 : *std::max_element(positions.begin(), positions.end());
    if (static_cast<int>(positions.size()) != slots || last >= recent_begin) {
      return Broken(DataLossError(options_.cache_name + ": the pool of session " +
                                  std::to_string(session_id) + " layer " + std::to_string(layer) +
                                  " KV head " + std::to_string(h) + " has " +
                                  std::to_string(positions.size()) + " rows up to position " +
                                  std::to_string(last) + ", expected " + std::to_string(slots) +
                                  " rows before position " + std::to_string(recent_begin)));
    }
    order.resize(positions.size());
    std::iota(order.begin(), order.end(), 0);
    std::sort(order.begin(), order.end(),
              [&](int a, int b) { return positions[a] < positions[b]; });
    for (int row = 0; row < slots; ++row) {
      const size_t from = (static_cast<size_t>(h) * pool->capacity() + order[row]) * head_dim;
      const size_t to = (static_cast<size_t>(h) * slots + row) * head_dim;
      std::memcpy(keys.data() + to, pool->keys() + from, head_dim * sizeof(float));
      std::memcpy(values.data() + to, pool->values() + from, head_dim * sizeof(float));
    }
  }
  compact.compact = CompactKvView{keys.data(), values.data(), kv_heads, slots, model_.head_dim};
  compact.counts = pool->counts();
  return compact;
}

}  // namespace rubato
