// The cache rank's reply pack: selections checked, then positions written and rows gathered
// straight into the pack's sections (see reply_builder.h).
#include "cache_rank/reply_builder.h"

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

}  // namespace rubato
