// The cache rank's reply pack: selections checked, then positions written and rows gathered
// straight into the pack's sections (see reply_builder.h).
#include "cache_rank/reply_builder.h"

#include <algorithm>
#include <cstring>
#include <string>

#include <fmt/format.h>

#include "cache_rank/stored_attention.h"

namespace rubato {
namespace {

Status CheckSelection(const KvStore& store, const LayerPackView& kv_pack, uint32_t layer_index,
                      uint32_t request, const KvHeadSelection& selection) {
  const LayerPackRequest& entry = kv_pack.requests()[request];
  const uint32_t layer = kv_pack.first_layer() + layer_index;
  const std::string where = fmt::format("reply pack step {}: layer {}, request {} (session {})",
                                        kv_pack.step(), layer, request, entry.session_id);
  if (selection.size() != kv_pack.num_kv_heads()) {
    return InvalidArgumentError(fmt::format("{}: the selection has {} KV heads, the pack {}",
                                            where, selection.size(), kv_pack.num_kv_heads()));
  }
  RUBATO_ASSIGN_OR_RETURN(const uint32_t readable, store.LayerLength(entry.session_id, layer));
  for (uint32_t h = 0; h < selection.size(); ++h) {
    const auto& positions = selection[h];
    if (positions.size() > entry.reply_slots) {
      return InvalidArgumentError(fmt::format("{}, kv head {}: {} positions selected, more than "
                                              "reply_slots {}", where, h, positions.size(),
                                              entry.reply_slots));
    }
    int64_t previous = -1;
    for (size_t i = 0; i < positions.size(); ++i) {
      if (positions[i] <= previous || static_cast<int64_t>(positions[i]) >= readable) {
        return InvalidArgumentError(fmt::format(
            "{}, kv head {}: position[{}] = {} is not ascending after {} or not below the {} "
            "readable tokens", where, h, i, positions[i], previous, readable));
      }
      previous = positions[i];
    }
  }
  return Status::Ok();
}

}  // namespace

Result<uint64_t> BuildReplyPack(KvStore& store, const LayerPackView& kv_pack,
                                std::span<const KvHeadSelection> selections,
                                std::span<std::byte> out) {
  if (kv_pack.kind() != LayerPackKind::kKvPack) {
    return InvalidArgumentError("reply pack: BuildReplyPack needs the kv pack it answers, got "
                                "a reply pack");
  }
  const uint64_t expected = uint64_t{kv_pack.num_layers()} * kv_pack.batch();
  if (selections.size() != expected) {
    return InvalidArgumentError(fmt::format(
        "reply pack step {}: {} selections given, expected num_layers {} x batch {} = {}",
        kv_pack.step(), selections.size(), kv_pack.num_layers(), kv_pack.batch(), expected));
  }
  for (uint32_t l = 0; l < kv_pack.num_layers(); ++l) {
    for (uint32_t r = 0; r < kv_pack.batch(); ++r) {
      RUBATO_RETURN_IF_ERROR(
          CheckSelection(store, kv_pack, l, r, selections[size_t{l} * kv_pack.batch() + r]));
    }
  }
  LayerPackShape shape = kv_pack.shape();
  shape.kind = LayerPackKind::kReplyPack;
  shape.has_query = false;
  RUBATO_ASSIGN_OR_RETURN(LayerPackWriter writer,
                          LayerPackWriter::Create(shape, kv_pack.requests(), out));
  const uint64_t row_bytes = uint64_t{kv_pack.head_dim()} * DTypeSize(kv_pack.dtype());
  StoredAttentionScratch scratch;
  for (uint32_t l = 0; l < kv_pack.num_layers(); ++l) {
    for (uint32_t r = 0; r < kv_pack.batch(); ++r) {
      const LayerPackRequest& entry = kv_pack.requests()[r];
      const KvHeadSelection& selection = selections[size_t{l} * kv_pack.batch() + r];
      const uint64_t slots = entry.reply_slots;
      const auto counts = writer.Counts(l, r);
      const auto positions = writer.Positions(l, r);
      const auto keys = writer.Key(l, r);      // [kv_head][reply_slots][head_dim]
      const auto values = writer.Value(l, r);  // same
      for (uint32_t h = 0; h < kv_pack.num_kv_heads(); ++h) {
        const auto& chosen = selection[h];
        StoreInt32(counts, h, static_cast<int32_t>(chosen.size()));
        for (uint64_t i = 0; i < slots; ++i) {
          StoreInt32(positions, h * slots + i, i < chosen.size() ? chosen[i] : -1);
        }
        const uint64_t head_offset = h * slots * row_bytes;
        if (!chosen.empty()) {
          RUBATO_RETURN_IF_ERROR(store.Gather(entry.session_id, kv_pack.first_layer() + l, h,
                                              chosen, keys.subspan(head_offset),
                                              values.subspan(head_offset)));
        }
        // Slots past the chosen rows are zeroed (a pack with no slots has no buffer at all:
        // memset may not see its null pointer, even for zero bytes).
        const uint64_t used = chosen.size() * row_bytes;
        const uint64_t unused = (slots - chosen.size()) * row_bytes;
        if (unused > 0) {
          std::memset(keys.data() + head_offset + used, 0, unused);
          std::memset(values.data() + head_offset + used, 0, unused);
        }
      }
      if (entry.attention_queries > 0) {  // the layout allows one: the last new token's query
        RUBATO_RETURN_IF_ERROR(StoredDecodeAttention(
            store, entry.session_id, kv_pack.first_layer() + l, kv_pack.Query(l, r),
            entry.first_position + entry.new_tokens, writer.AttentionOutput(l, r),
            writer.AttentionLse(l, r), scratch));
      }
    }
  }
  return writer.size_bytes();
}

Result<uint64_t> BuildDeltaReplyPack(KvStore& store, const LayerPackView& kv_pack,
                                     std::span<const std::vector<CompactDelta>> deltas,
                                     std::vector<LayerPackRequest>& reply_requests,
                                     std::span<std::byte> out) {
  const uint32_t batch = kv_pack.batch();
  const uint32_t kv_heads = kv_pack.num_kv_heads();
  if (!kv_pack.delta() || deltas.size() != uint64_t{kv_pack.num_layers()} * batch) {
    return InvalidArgumentError(fmt::format(
        "delta reply step {}: the kv pack asks for deltas: {}; {} deltas given for num_layers {} "
        "x batch {}", kv_pack.step(), kv_pack.delta(), deltas.size(), kv_pack.num_layers(),
        batch));
  }
  reply_requests.assign(kv_pack.requests().begin(), kv_pack.requests().end());
  for (uint32_t r = 0; r < batch; ++r) {
    LayerPackRequest& entry = reply_requests[r];
    entry.delta_rows = 0;
    entry.delta_reset = 0;
    for (uint32_t l = 0; l < kv_pack.num_layers(); ++l) {
      const std::vector<CompactDelta>& heads = deltas[size_t{l} * batch + r];
      if (heads.size() != kv_heads) {
        return InvalidArgumentError(fmt::format("delta reply step {}: request {} has deltas of "
                                                "{} KV heads, the pack {}", kv_pack.step(), r,
                                                heads.size(), kv_heads));
      }
      for (const CompactDelta& delta : heads) {
        if (delta.count > static_cast<int>(entry.reply_slots)) {
          return InvalidArgumentError(fmt::format(
              "delta reply step {}: request {} keeps {} rows, more than reply_slots {}",
              kv_pack.step(), r, delta.count, entry.reply_slots));
        }
        entry.delta_rows = std::max<uint32_t>(entry.delta_rows,
                                              static_cast<uint32_t>(delta.slots.size()));
        entry.delta_reset |= delta.reset ? 1u : 0u;
      }
    }
  }
  LayerPackShape shape = kv_pack.shape();
  shape.kind = LayerPackKind::kReplyPack;
  shape.has_query = false;
  RUBATO_ASSIGN_OR_RETURN(const uint64_t size, ReplyPackBytes(shape, reply_requests));
  if (out.empty()) return size;
  RUBATO_ASSIGN_OR_RETURN(LayerPackWriter writer,
                          LayerPackWriter::Create(shape, reply_requests, out));
  const uint64_t row_bytes = uint64_t{kv_pack.head_dim()} * DTypeSize(kv_pack.dtype());
  StoredAttentionScratch scratch;
  for (uint32_t l = 0; l < kv_pack.num_layers(); ++l) {
    for (uint32_t r = 0; r < batch; ++r) {
      const LayerPackRequest& entry = reply_requests[r];
      const uint64_t rows = entry.delta_rows;
      const std::vector<CompactDelta>& heads = deltas[size_t{l} * batch + r];
      const auto keys = writer.Key(l, r);  // [kv_head][delta_rows][head_dim]
      const auto values = writer.Value(l, r);
      for (uint32_t h = 0; h < kv_heads; ++h) {
        const CompactDelta& delta = heads[h];
        StoreInt32(writer.Counts(l, r), h, delta.count);
        for (uint64_t i = 0; i < rows; ++i) {
          const bool entering = i < delta.slots.size();
          StoreInt32(writer.Slots(l, r), h * rows + i, entering ? delta.slots[i] : -1);
          StoreInt32(writer.Positions(l, r), h * rows + i, entering ? delta.positions[i] : -1);
        }
        const uint64_t head_offset = h * rows * row_bytes;
        if (!delta.positions.empty()) {
          RUBATO_RETURN_IF_ERROR(store.Gather(entry.session_id, kv_pack.first_layer() + l, h,
                                              delta.positions, keys.subspan(head_offset),
                                              values.subspan(head_offset)));
        }
        const uint64_t used = delta.positions.size() * row_bytes;
        const uint64_t unused = (rows - delta.positions.size()) * row_bytes;
        if (unused > 0) {
          std::memset(keys.data() + head_offset + used, 0, unused);
          std::memset(values.data() + head_offset + used, 0, unused);
        }
      }
      if (entry.attention_queries > 0) {
        RUBATO_RETURN_IF_ERROR(StoredDecodeAttention(
            store, entry.session_id, kv_pack.first_layer() + l, kv_pack.Query(l, r),
            entry.first_position + entry.new_tokens, writer.AttentionOutput(l, r),
            writer.AttentionLse(l, r), scratch));
      }
    }
  }
  return writer.size_bytes();
}

}  // namespace rubato
