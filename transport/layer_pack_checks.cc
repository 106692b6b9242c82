// The layer-pack checks that read more than the header and table (see layer_pack.h): a reply's
// counts, positions, delta slots and log-sum-exps, and a pack's request against its session.
#include <fmt/format.h>

#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "transport/layer_pack.h"

namespace rubato {

namespace {

// A delta reply's rows of KV head `h`: the entering rows are the positions before the first -1,
// ascending and below `limit`, each with a distinct slot below `count`; -1 past them.
Status CheckDeltaRows(const LayerPackView& reply, uint32_t l, uint32_t r, uint32_t h, int32_t count,
                      int64_t limit, const std::string& where) {
  const uint32_t rows = reply.requests()[r].delta_rows;
  const auto positions = reply.Positions(l, r);
  const auto slots = reply.Slots(l, r);
  std::vector<bool> taken(static_cast<size_t>(count), false);
  int64_t previous = -1;
  bool ended = false;
  for (uint32_t i = 0; i < rows; ++i) {
    const int32_t p = LoadInt32(positions, size_t{h} * rows + i);
    const int32_t slot = LoadInt32(slots, size_t{h} * rows + i);
    ended = ended || p == -1;
    if (ended) {
      if (p != -1 || slot != -1) {
        return DataLossError(
            fmt::format("{}: delta row {} after the entering rows has position "
                        "{} and slot {}, both must be -1",
                        where, i, p, slot));
      }
      continue;
    }
    if (p <= previous || p >= limit) {
      return DataLossError(
          fmt::format("{}: delta position[{}] = {} is not ascending after {} "
                      "or not below {}",
                      where, i, p, previous, limit));
    }
    if (slot < 0 || slot >= count || taken[static_cast<size_t>(slot)]) {
      return DataLossError(
          fmt::format("{}: delta slot[{}] = {} is outside [0, count {}) or "
                      "taken twice",
                      where, i, slot, count));
    }
    taken[static_cast<size_t>(slot)] = true;
    previous = p;
  }
  return Status::Ok();
}

}  // namespace

Status ValidateReplyContents(const LayerPackView& reply) {
  if (reply.kind() != LayerPackKind::kReplyPack) {
    return InvalidArgumentError(
        "layer pack: ValidateReplyContents needs a reply pack, got a "
        "kv pack");
  }
  for (uint32_t l = 0; l < reply.num_layers(); ++l) {
    for (uint32_t r = 0; r < reply.batch(); ++r) {
      const LayerPackRequest& request = reply.requests()[r];
      const int64_t limit = int64_t{request.first_position} + request.new_tokens;
      const auto counts = reply.Counts(l, r);
      const auto positions = reply.Positions(l, r);
      for (uint32_t h = 0; h < reply.num_kv_heads(); ++h) {
        const std::string where = fmt::format(
            "layer pack reply: layer {}, request {} (session "
            "{}), kv head {}",
            reply.first_layer() + l, r, request.session_id, h);
        const int32_t count = LoadInt32(counts, h);
        if (count < 0 || static_cast<uint32_t>(count) > request.reply_slots) {
          return DataLossError(fmt::format("{}: count {} is outside [0, reply_slots {}]", where,
                                           count, request.reply_slots));
        }
        if (reply.delta()) {
          RUBATO_RETURN_IF_ERROR(CheckDeltaRows(reply, l, r, h, count, limit, where));
          continue;
        }
        int64_t previous = -1;
        for (uint32_t i = 0; i < request.reply_slots; ++i) {
          const int32_t p = LoadInt32(positions, size_t{h} * request.reply_slots + i);
          if (i < static_cast<uint32_t>(count)) {
            if (p <= previous || p >= limit) {
              return DataLossError(
                  fmt::format("{}: position[{}] = {} is not ascending after {} or not below {}",
                              where, i, p, previous, limit));
            }
            previous = p;
          } else if (p != -1) {
            return DataLossError(
                fmt::format("{}: position[{}] = {} past count {} must be -1", where, i, p, count));
          }
        }
      }
      const auto lse = reply.AttentionLse(l, r);
      for (size_t i = 0; i < lse.size() / sizeof(float); ++i) {
        float value;
        std::memcpy(&value, lse.data() + i * sizeof(value), sizeof(value));
        if (!std::isfinite(value)) {
          return DataLossError(fmt::format(
              "layer pack reply: layer {}, request {} (session {}): attention lse[{}] is {}, "
              "not finite",
              reply.first_layer() + l, r, request.session_id, i, value));
        }
      }
    }
  }
  return Status::Ok();
}

Status ValidateAgainstSession(const LayerPackView& view, uint32_t request,
                              const SessionShape& session) {
  if (request >= view.batch()) {
    return InvalidArgumentError(
        fmt::format("layer pack: request index {} is not below batch {}", request, view.batch()));
  }
  const LayerPackRequest& entry = view.requests()[request];
  const std::string where = fmt::format("layer pack step {}, request {} (session {})", view.step(),
                                        request, entry.session_id);
  const uint64_t layer_end = uint64_t{view.first_layer()} + view.num_layers();
  if (layer_end > session.num_layers) {
    return OutOfRangeError(
        fmt::format("{}: layers [{}, {}) of the pack exceed the session's num_layers {}", where,
                    view.first_layer(), layer_end, session.num_layers));
  }
  auto mismatch = [&](std::string_view field, uint64_t pack, uint64_t expected) {
    return InvalidArgumentError(fmt::format("{}: '{}' is {} in the pack but {} in the session",
                                            where, field, pack, expected));
  };
  if (view.num_kv_heads() != session.num_kv_heads) {
    return mismatch("num_kv_heads", view.num_kv_heads(), session.num_kv_heads);
  }
  if (view.num_query_heads() != session.num_query_heads) {
    return mismatch("num_query_heads", view.num_query_heads(), session.num_query_heads);
  }
  if (view.head_dim() != session.head_dim) {
    return mismatch("head_dim", view.head_dim(), session.head_dim);
  }
  if (view.dtype() != session.dtype) {
    return InvalidArgumentError(
        fmt::format("{}: 'dtype' is {} in the pack but {} in the "
                    "session",
                    where, DTypeName(view.dtype()), DTypeName(session.dtype)));
  }
  const uint64_t end = uint64_t{entry.first_position} + entry.new_tokens;
  if (end > session.capacity_tokens) {
    return ResourceExhaustedError(fmt::format(
        "{}: first_position {} + new_tokens {} = {} exceeds the session's capacity_tokens {}",
        where, entry.first_position, entry.new_tokens, end, session.capacity_tokens));
  }
  if (entry.reply_slots > end) {
    return OutOfRangeError(
        fmt::format("{}: reply_slots {} exceeds the {} positions that exist after the append",
                    where, entry.reply_slots, end));
  }
  return Status::Ok();
}

}  // namespace rubato
