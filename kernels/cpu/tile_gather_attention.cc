// Tile-sparse prefill attention (see tile_gather_attention.h): plain fp32 loops with the
// arithmetic of two_segment_attention.cc.
#include "kernels/cpu/tile_gather_attention.h"

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "kernels/cpu/dot.h"
#include "kernels/cpu/softmax.h"

namespace rubato {
namespace {

Status Invalid(const std::string& message) {
  return InvalidArgumentError("tile-gather attention: " + message);
}

int FirstTile(const TileGatherAttentionArgs& args) {
  return args.start_position / args.tile_tokens;
}

}  // namespace

int TileGatherTiles(int start_position, int tokens, int tile_tokens) {
  if (tokens <= 0 || tile_tokens <= 0) return 0;
  return (start_position + tokens - 1) / tile_tokens - start_position / tile_tokens + 1;
}

Status ValidateTileGatherAttention(const TileGatherAttentionArgs& args) {
  const PagedKvView& kv = args.kv;
  if (kv.num_kv_heads <= 0 || kv.head_dim <= 0 || kv.block_tokens <= 0) {
    return Invalid("paged KV shape must be positive");
  }
  if (args.num_heads <= 0 || args.num_heads % kv.num_kv_heads != 0) {
    return Invalid("num_heads " + std::to_string(args.num_heads) +
                   " is not a positive multiple of num_kv_heads " +
                   std::to_string(kv.num_kv_heads));
  }
  if (args.tokens < 1 || args.start_position < 0 || args.tile_tokens < 1) {
    return Invalid("tokens " + std::to_string(args.tokens) + ", start " +
                   std::to_string(args.start_position) + ", tile " +
                   std::to_string(args.tile_tokens) + ": need tokens >= 1, start >= 0, tile >= 1");
  }
  if (args.query == nullptr || args.output == nullptr || args.lists == nullptr ||
      args.counts == nullptr || kv.keys == nullptr || kv.values == nullptr ||
      kv.block_table == nullptr) {
    return Invalid("a pointer is null");
  }
  const int tiles = TileGatherTiles(args.start_position, args.tokens, args.tile_tokens);
  const int end = args.start_position + args.tokens;
  std::vector<char> seen(static_cast<size_t>(end), 0);
  for (int t = 0; t < tiles; ++t) {
    const int tile_begin = (FirstTile(args) + t) * args.tile_tokens;
    for (int h = 0; h < kv.num_kv_heads; ++h) {
      const size_t i = static_cast<size_t>(t) * kv.num_kv_heads + h;
      const std::string where = "tile " + std::to_string(t) + ", KV head " + std::to_string(h);
      const int count = args.counts[i];
      if (count < 0 || count > tile_begin) {
        return Invalid(where + ": " + std::to_string(count) + " positions, tile starts at " +
                       std::to_string(tile_begin));
      }
      if (count > 0 && args.lists[i] == nullptr) return Invalid(where + ": list is null");
      std::fill(seen.begin(), seen.end(), 0);
      for (int j = 0; j < count; ++j) {
        const int p = args.lists[i][j];
        if (p < 0 || p >= tile_begin) {
          return Invalid(where + ": position " + std::to_string(p) + " is not before the tile (" +
                         std::to_string(tile_begin) + ")");
        }
        if (seen[static_cast<size_t>(p)]) {
          return Invalid(where + ": position " + std::to_string(p) + " twice");
        }
        seen[static_cast<size_t>(p)] = 1;
      }
    }
  }
  return Status::Ok();
}

int TileGatherAttentionScratchSize(const TileGatherAttentionArgs& args) {
  const int tiles = TileGatherTiles(args.start_position, args.tokens, args.tile_tokens);
  int most = 0;
  for (int i = 0; i < tiles * args.kv.num_kv_heads; ++i) most = std::max(most, args.counts[i]);
  return most + args.tile_tokens;
}

void TileGatherAttentionForKvHead(const TileGatherAttentionArgs& args, int kv_head,
                                  float* scratch) {
  const PagedKvView& kv = args.kv;
  const int head_dim = kv.head_dim;
  const int group = args.num_heads / kv.num_kv_heads;
  const float scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(head_dim)));
  for (int t = 0; t < args.tokens; ++t) {
    const int position = args.start_position + t;
    const int tile = position / args.tile_tokens - FirstTile(args);
    const int tile_begin = position / args.tile_tokens * args.tile_tokens;
    const size_t i = static_cast<size_t>(tile) * kv.num_kv_heads + kv_head;
    const int count = args.counts[i];
    const int* list = args.lists[i];
    const int keys = count + (position - tile_begin + 1);
    for (int g = 0; g < group; ++g) {
      const size_t row = (static_cast<size_t>(t) * args.num_heads + kv_head * group + g) *
                         static_cast<size_t>(head_dim);
      const float* q = args.query + row;
      float* out = args.output + row;
      for (int j = 0; j < count; ++j) {
        scratch[j] = Dot(q, kv.keys + kv.Offset(list[j], kv_head), head_dim) * scale;
      }
      for (int p = tile_begin; p <= position; ++p) {
        scratch[count + p - tile_begin] = Dot(q, kv.keys + kv.Offset(p, kv_head), head_dim) * scale;
      }
      SoftmaxInPlaceWithLse(scratch, keys);
      std::fill(out, out + head_dim, 0.0f);
      auto accumulate = [&](float prob, int p) {
        const float* v = kv.values + kv.Offset(p, kv_head);
        for (int d = 0; d < head_dim; ++d) out[d] += prob * v[d];
      };
      for (int j = 0; j < count; ++j) accumulate(scratch[j], list[j]);
      for (int p = tile_begin; p <= position; ++p) accumulate(scratch[count + p - tile_begin], p);
    }
  }
}

Status TileGatherAttention(const TileGatherAttentionArgs& args, std::span<float> scratch) {
  RUBATO_RETURN_IF_ERROR(ValidateTileGatherAttention(args));
  const int needed = TileGatherAttentionScratchSize(args);
  if (scratch.size() < static_cast<size_t>(needed)) {
    return Invalid("scratch holds " + std::to_string(scratch.size()) + " floats, " +
                   std::to_string(needed) + " needed");
  }
  for (int h = 0; h < args.kv.num_kv_heads; ++h) {
    TileGatherAttentionForKvHead(args, h, scratch.data());
  }
  return Status::Ok();
}

}  // namespace rubato
