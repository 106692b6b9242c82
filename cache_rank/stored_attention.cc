// StoredDecodeAttention (stored_attention.h): a paged view of one block over the session's
// layer (f32 sessions read in place, others widened into scratch), then the CPU reference ops.
#include "cache_rank/stored_attention.h"

#include <fmt/format.h>

#include <cmath>
#include <cstring>
#include <string>

#include "kernels/cpu/attention.h"
#include "kernels/cpu/attention_stats.h"
#include "kernels/cpu/paged_kv_view.h"

namespace rubato {

Status StoredDecodeAttention(const KvStore& store, uint64_t session_id, uint32_t layer,
                             std::span<const std::byte> query, uint32_t length,
                             std::span<std::byte> output, std::span<std::byte> lse,
                             StoredAttentionScratch& scratch) {
  const std::string where =
      fmt::format("attention on the cache rank: session {}, layer {}", session_id, layer);
  RUBATO_ASSIGN_OR_RETURN(const SessionShape shape, store.GetSessionShape(session_id));
  RUBATO_ASSIGN_OR_RETURN(const uint32_t readable, store.LayerLength(session_id, layer));
  if (length == 0 || length > readable) {
    return OutOfRangeError(
        fmt::format("{}: attends {} positions, {} are stored", where, length, readable));
  }
  const size_t heads = shape.num_query_heads;
  const size_t kv_heads = shape.num_kv_heads;
  const size_t head_dim = shape.head_dim;
  const size_t elem = DTypeSize(shape.dtype);
  if (query.size() != heads * head_dim * elem || output.size() != heads * head_dim * 4 ||
      lse.size() != heads * 4) {
    return InvalidArgumentError(
        fmt::format("{}: query / output / lse of {} / {} / {} bytes, expected {} / {} / {}", where,
                    query.size(), output.size(), lse.size(), heads * head_dim * elem,
                    heads * head_dim * 4, heads * 4));
  }
  scratch.query.resize(heads * head_dim);
  ConvertToF32(shape.dtype, query.data(), scratch.query.data(), scratch.query.size());

  // One block holding every position: keys + Offset(p, h) = ((h * block_tokens) + p) * head_dim.
  const int32_t block_table[1] = {0};
  PagedKvView kv;
  kv.block_table = block_table;
  kv.num_kv_heads = static_cast<int>(kv_heads);
  kv.head_dim = static_cast<int>(head_dim);
  RUBATO_ASSIGN_OR_RETURN(const KvHeadRows first, store.HeadRows(session_id, layer, 0));
  if (shape.dtype == DType::kF32) {
    // The store's layer is [kv_head][capacity][head_dim]: read it in place.
    for (uint32_t h = 1; h < kv_heads; ++h) {
      RUBATO_ASSIGN_OR_RETURN(const KvHeadRows rows, store.HeadRows(session_id, layer, h));
      if (rows.keys.data() != first.keys.data() + h * first.keys.size() ||
          rows.values.data() != first.values.data() + h * first.values.size()) {
        return InternalError(where + ": the store's KV heads are not contiguous");
      }
    }
    kv.keys = reinterpret_cast<float*>(const_cast<std::byte*>(first.keys.data()));
    kv.values = reinterpret_cast<float*>(const_cast<std::byte*>(first.values.data()));
    kv.block_tokens = static_cast<int>(first.keys.size() / (head_dim * elem));
  } else {
    scratch.keys.resize(kv_heads * length * head_dim);
    scratch.values.resize(scratch.keys.size());
    for (uint32_t h = 0; h < kv_heads; ++h) {
      RUBATO_ASSIGN_OR_RETURN(const KvHeadRows rows, store.HeadRows(session_id, layer, h));
      const size_t at = h * length * head_dim;
      ConvertToF32(shape.dtype, rows.keys.data(), scratch.keys.data() + at, length * head_dim);
      ConvertToF32(shape.dtype, rows.values.data(), scratch.values.data() + at, length * head_dim);
    }
    kv.keys = scratch.keys.data();
    kv.values = scratch.values.data();
    kv.block_tokens = static_cast<int>(length);
  }

  // The section offsets are 16-byte aligned in 8-byte aligned buffers: f32 rows are aligned.
  float* out = reinterpret_cast<float*>(output.data());
  CausalAttentionArgs args;
  args.queries = scratch.query.data();
  args.output = out;
  args.tokens = 1;
  args.start_position = static_cast<int>(length) - 1;
  args.num_heads = static_cast<int>(heads);
  args.kv = kv;
  scratch.scores.resize(static_cast<size_t>(RowsAttentionScratchSize(args)));
  for (int h = 0; h < kv.num_kv_heads; ++h) {
    RowsAttentionForKvHead(args, h, scratch.scores.data());
  }
  DecodeAttentionStatsArgs stats;
  stats.query = scratch.query.data();
  stats.seq_len = static_cast<int>(length);
  stats.num_heads = static_cast<int>(heads);
  stats.scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(head_dim)));
  stats.kv = kv;
  DecodeAttentionStats(stats, reinterpret_cast<float*>(lse.data()), /*probs=*/nullptr);
  return Status::Ok();
}

}  // namespace rubato
