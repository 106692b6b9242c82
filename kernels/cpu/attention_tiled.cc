// The tiled path of causal paged GQA attention (see attention.h), for prefill chunks: per KV
// head, tiles of (query token, GQA head) rows against key tiles gathered from the paged blocks,
// scores and probs x V as cblas_sgemm calls, online softmax across key tiles.
// The loop, masks and tile sizes: docs/kernels_cpu.md "The tiled path".
#include <cblas.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstring>

#include "kernels/cpu/attention.h"
#include "kernels/cpu/exp_approx.h"

namespace rubato {
namespace {

constexpr int kQueryTileTokens = 16;
constexpr int kScoreTileFloats = 8192;  // rows x keys of one score tile
constexpr int kMinKeyTile = 16;

// Sizes of one KV head's tiles.
struct TileShape {
  int group = 0;     // query heads per KV head
  int max_rows = 0;  // kQueryTileTokens * group
  int max_keys = 0;  // keys per key tile
  int head_dim = 0;

  explicit TileShape(const CausalAttentionArgs& args)
      : group(args.num_heads / args.kv.num_kv_heads),
        max_rows(kQueryTileTokens * group),
        max_keys(std::max(kMinKeyTile, kScoreTileFloats / max_rows)),
        head_dim(args.kv.head_dim) {}
};

// Views into one thread's scratch.
struct TileScratch {
  float* queries;      // [max_rows][head_dim], scaled queries of the tile
  float* keys;         // [head_dim][count <= max_keys], gathered keys of the key tile,
                       // transposed so that the score sgemm is NN (OpenBLAS's small-matrix
                       // kernels skip packing for NN, not for NT)
  float* values;       // [count <= max_keys][head_dim], gathered values of the key tile
  float* scores;       // [rows][count], scores, then unnormalized probabilities
  float* accumulator;  // [max_rows][head_dim], sum of probabilities x values so far
  float* row_max;      // [max_rows], running max of each row's scores
  float* row_sum;      // [max_rows], running sum of each row's exp(score - row_max)

  TileScratch(const TileShape& s, float* scratch) {
    const size_t rows_dim = static_cast<size_t>(s.max_rows) * s.head_dim;
    const size_t keys_dim = static_cast<size_t>(s.max_keys) * s.head_dim;
    queries = scratch;
    keys = queries + rows_dim;
    values = keys + keys_dim;
    scores = values + keys_dim;
    accumulator = scores + static_cast<size_t>(s.max_rows) * s.max_keys;
    row_max = accumulator + rows_dim;
    row_sum = row_max + s.max_rows;
  }
  static size_t Floats(const TileShape& s) {
    const size_t rows = static_cast<size_t>(s.max_rows);
    const size_t keys = static_cast<size_t>(s.max_keys);
    return 2 * rows * s.head_dim + 2 * keys * s.head_dim + rows * keys + 2 * rows;
  }
};

// The row loops below are compiled for AVX-512, AVX2 and baseline x86-64, picked at load time.
// Their results do not depend on the clone: the reductions' order is fixed by the eight
// partials and contraction into FMAs is off. Not under ThreadSanitizer: the clones' resolvers run
// during relocation, before its runtime is up, and crash there.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && !defined(__SANITIZE_THREAD__)
#define RUBATO_ROW_LOOP_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define RUBATO_ROW_LOOP_CLONES
#endif

// Max of x[0, n), n >= 1, with eight partial maxima (vectorizes; the result is exact).
RUBATO_ROW_LOOP_CLONES float MaxOf(const float* x, int n) {
  float partial[8];
  std::fill(partial, partial + 8, x[0]);
  int i = 0;
  for (; i + 8 <= n; i += 8) {
    for (int j = 0; j < 8; ++j) partial[j] = x[i + j] > partial[j] ? x[i + j] : partial[j];
  }
  for (; i < n; ++i) partial[0] = x[i] > partial[0] ? x[i] : partial[0];
  return *std::max_element(partial, partial + 8);
}

// x[i] = exp(x[i] - max) for i in [0, n); returns their sum (eight partial sums).
RUBATO_ROW_LOOP_CLONES float ExpInPlaceAndSum(float* x, int n, float max) {
  for (int i = 0; i < n; ++i) x[i] = ExpApprox(x[i] - max);
  float partial[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int i = 0;
  for (; i + 8 <= n; i += 8) {
    for (int j = 0; j < 8; ++j) partial[j] += x[i + j];
  }
  for (; i < n; ++i) partial[i % 8] += x[i];
  return ((partial[0] + partial[1]) + (partial[2] + partial[3])) +
         ((partial[4] + partial[5]) + (partial[6] + partial[7]));
}

// Gathers positions [first, first + count) of `kv_head`: keys transposed into
// [head_dim][count], values as [count][head_dim] (one memcpy per block run).
void GatherKeyTile(const PagedKvView& kv, int kv_head, int first, int count, float* keys_t,
                   float* values) {
  const int head_dim = kv.head_dim;
  const size_t row_bytes = static_cast<size_t>(head_dim) * sizeof(float);
  for (int done = 0; done < count;) {
    const int position = first + done;
    const int rows = std::min(count - done, kv.block_tokens - position % kv.block_tokens);
    const size_t source = kv.Offset(position, kv_head);
    const float* keys = kv.keys + source;  // [rows][head_dim]
    for (int r = 0; r < rows; ++r) {
      for (int d = 0; d < head_dim; ++d) {
        keys_t[static_cast<size_t>(d) * count + done + r] = keys[r * head_dim + d];
      }
    }
    std::memcpy(values + static_cast<size_t>(done) * head_dim, kv.values + source,
                rows * row_bytes);
    done += rows;
  }
}

// One key tile [first, first + count) of segment `sink_segment` against the query tile whose
// token 0 sits at `position0`: scores, masked online softmax, accumulation.
void AttendKeyTile(const AttentionWindow& window, const TileShape& shape, int rows, int position0,
                   bool sink_segment, int first, int count, TileScratch& tiles) {
  const int head_dim = shape.head_dim;
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, rows, count, head_dim, 1.0f, tiles.queries,
              head_dim, tiles.keys, count, 0.0f, tiles.scores, count);
  for (int r = 0; r < rows; ++r) {
    const int position = position0 + r / shape.group;
    // The row's attended keys in this tile: [begin, end) in tile columns.
    const int segment_begin = sink_segment ? 0 : window.RecentBegin(position);
    const int segment_end = sink_segment ? window.SinkEnd(position) : position + 1;
    const int begin = std::clamp(segment_begin - first, 0, count);
    const int end = std::clamp(segment_end - first, begin, count);
    float* row = tiles.scores + static_cast<size_t>(r) * count;
    if (begin == end) {
      std::fill(row, row + count, 0.0f);
      continue;
    }
    const float old_max = tiles.row_max[r];
    const float new_max = std::max(old_max, MaxOf(row + begin, end - begin));
    std::fill(row, row + begin, 0.0f);
    std::fill(row + end, row + count, 0.0f);
    const float tile_sum = ExpInPlaceAndSum(row + begin, end - begin, new_max);
    if (new_max != old_max) {
      // Rescale what earlier tiles contributed (nothing yet when old_max is -inf).
      const float rescale = std::isinf(old_max) ? 0.0f : ExpApprox(old_max - new_max);
      float* accumulator = tiles.accumulator + static_cast<size_t>(r) * head_dim;
      for (int d = 0; d < head_dim; ++d) accumulator[d] *= rescale;
      tiles.row_sum[r] *= rescale;
      tiles.row_max[r] = new_max;
    }
    tiles.row_sum[r] += tile_sum;
  }
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, rows, head_dim, count, 1.0f, tiles.scores,
              count, tiles.values, head_dim, 1.0f, tiles.accumulator, head_dim);
}

}  // namespace

int TiledAttentionScratchSize(const CausalAttentionArgs& args) {
  return static_cast<int>(TileScratch::Floats(TileShape(args)));
}

void TiledAttentionForKvHead(const CausalAttentionArgs& args, int kv_head, float* scratch) {
  const TileShape shape(args);
  TileScratch tiles(shape, scratch);
  const int head_dim = shape.head_dim;
  // head_dim ** -0.5 evaluated in double and rounded once, as Python does before torch uses it.
  const float scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(head_dim)));
  // The group's heads of one token are contiguous: [group][head_dim] at this offset.
  const size_t group_offset = static_cast<size_t>(kv_head) * shape.group * head_dim;
  const size_t token_stride = static_cast<size_t>(args.num_heads) * head_dim;
  const size_t group_floats = static_cast<size_t>(shape.group) * head_dim;

  for (int t0 = 0; t0 < args.tokens; t0 += kQueryTileTokens) {
    const int tile_tokens = std::min(kQueryTileTokens, args.tokens - t0);
    const int rows = tile_tokens * shape.group;  // row r = token (r / group), head (r % group)
    for (int t = 0; t < tile_tokens; ++t) {
      const float* q = args.queries + (t0 + t) * token_stride + group_offset;
      float* q_tile = tiles.queries + t * group_floats;
      for (size_t i = 0; i < group_floats; ++i) q_tile[i] = q[i] * scale;
    }
    std::fill(tiles.accumulator, tiles.accumulator + rows * head_dim, 0.0f);
    std::fill(tiles.row_max, tiles.row_max + rows, -INFINITY);
    std::fill(tiles.row_sum, tiles.row_sum + rows, 0.0f);

    // Keys some row attends: the sink segment of the tile's last query and the recent segment
    // from the first query's window start to the last query (both bounds grow with position).
    // When even the last query sees its whole causal range (sink + recent reach back to
    // position 0), the tile is dense: one segment, the same key tiles and so the same bits as
    // dense attention (the "budget >= context equals dense" invariant holds exactly).
    const int first_position = args.start_position + t0;
    const int last_position = first_position + tile_tokens - 1;
    const bool whole_range = args.window.VisibleKeys(last_position) == last_position + 1;
    const AttentionWindow window = whole_range ? AttentionWindow() : args.window;
    const int segments[2][2] = {{0, window.SinkEnd(last_position)},
                                {window.RecentBegin(first_position), last_position + 1}};
    for (int s = 0; s < 2; ++s) {
      for (int first = segments[s][0]; first < segments[s][1]; first += shape.max_keys) {
        const int count = std::min(shape.max_keys, segments[s][1] - first);
        GatherKeyTile(args.kv, kv_head, first, count, tiles.keys, tiles.values);
        AttendKeyTile(window, shape, rows, first_position, /*sink_segment=*/s == 0, first, count,
                      tiles);
      }
    }

    for (int t = 0; t < tile_tokens; ++t) {
      float* out = args.output + (t0 + t) * token_stride + group_offset;
      for (int g = 0; g < shape.group; ++g) {
        const int r = t * shape.group + g;
        const float inv_sum = 1.0f / tiles.row_sum[r];  // > 0: every query attends itself
        const float* accumulator = tiles.accumulator + static_cast<size_t>(r) * head_dim;
        for (int d = 0; d < head_dim; ++d) out[g * head_dim + d] = accumulator[d] * inv_sum;
      }
    }
  }
}

}  // namespace rubato
