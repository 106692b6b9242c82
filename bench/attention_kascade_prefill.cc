// rubato_bench_attention_kascade_prefill: Kascade's tile-sparse prefill attention per layer
// against our dense prefill attention, batch 1, at Qwen3-8B attention shapes (32 query / 8 KV
// heads of 128), a prompt of L tokens prefilled in chunks, 10 % top-k per 128-query tile: the
// dense launch; layer 0 (dense writing the lse, then the pooling pass and the per-tile top-k);
// another anchor (lse pass, pooling pass, top-k, then attention over its own selection); a reuse
// layer (attention over an anchor's selection). Times are summed over the prompt's chunks; the
// mean per layer over an anchor set (0, 2, 7, 14, 23 of 36) against dense gives the speedup.
// A benchmark, not a test. docs/benchmarks.md "Kascade prefill attention".
#include <cuda_runtime_api.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <climits>
#include <cmath>
#include <cstdio>
#include <functional>
#include <nlohmann/json.hpp>
#include <random>
#include <string>
#include <vector>

#include "bench/kernel_bench_util.h"
#include "common/status.h"
#include "kernels/cuda/cuda_status.h"
#include "kernels/cuda/device_buffer.h"
#include "kernels/cuda/pooled_top_k.cuh"
#include "kernels/cuda/prefill_attention.cuh"
#include "kernels/cuda/random_fill.cuh"

#ifndef RUBATO_GIT_COMMIT
#define RUBATO_GIT_COMMIT "unknown"
#endif

namespace rubato {
namespace {

using cuda::DeviceBuffer;
using cuda::PrefillMode;

struct Options {
  int heads = 32;
  int kv_heads = 8;
  int head_dim = 128;
  int block_size = 64;
  int chunk = 4096;
  int tile = 128;
  std::vector<int> contexts = {32768, 131072};
  double top_k_ratio = 0.1;
  int top_k_min = 128;
  std::vector<int> anchors = {0, 2, 7, 14, 23};
  int layers = 36;
  int warmup = 1;
  int iterations = 3;
  std::string out;
  std::string commit = RUBATO_GIT_COMMIT;
};

int TopK(const Options& o, int length) {
  const double wanted = std::ceil(o.top_k_ratio * length);
  const int k = wanted >= length ? length : static_cast<int>(wanted);
  return std::min(length, std::max(k, o.top_k_min));
}

using bench::Upload;

// Times of one chunk's launches, by layer kind.
struct ChunkTimes {
  double dense = 0, anchor0 = 0, anchor = 0, reuse = 0;
};

Status RunContext(const Options& o, int context, nlohmann::json& point) {
  const int blocks = (context + o.block_size - 1) / o.block_size;
  const size_t pool = static_cast<size_t>(blocks) * o.kv_heads * o.block_size * o.head_dim;
  RUBATO_ASSIGN_OR_RETURN(auto keys, DeviceBuffer<__nv_bfloat16>::Allocate(pool, "K pool"));
  RUBATO_ASSIGN_OR_RETURN(auto values, DeviceBuffer<__nv_bfloat16>::Allocate(pool, "V pool"));
  const int64_t row = static_cast<int64_t>(o.heads) * o.head_dim;
  const size_t q_count = static_cast<size_t>(o.chunk) * row;
  RUBATO_ASSIGN_OR_RETURN(auto q, DeviceBuffer<__nv_bfloat16>::Allocate(q_count, "q"));
  RUBATO_ASSIGN_OR_RETURN(auto out, DeviceBuffer<__nv_bfloat16>::Allocate(q_count, "out"));
  uint64_t stream_id = 0;
  for (auto* buffer : {&keys, &values, &q}) {
    cuda::RandomFillParams fill;
    fill.out = buffer->data();
    fill.count = static_cast<int64_t>(buffer->size());
    fill.seed = 13;
    fill.stream = stream_id++;
    fill.bound = 1.f;
    RUBATO_RETURN_IF_ERROR(cuda::RandomFill(fill, nullptr));
  }
  std::vector<int32_t> table(static_cast<size_t>(blocks));
  for (int i = 0; i < blocks; ++i) table[i] = i;
  std::shuffle(table.begin(), table.end(), std::mt19937_64(3));
  RUBATO_ASSIGN_OR_RETURN(auto d_table, Upload(table, "block table"));
  RUBATO_ASSIGN_OR_RETURN(
      auto lse, DeviceBuffer<float>::Allocate(static_cast<size_t>(o.chunk) * o.heads, "lse"));
  const int tiles = o.chunk / o.tile;
  const int64_t stride = context;
  const int k_max = TopK(o, context);
  const size_t pairs = static_cast<size_t>(tiles) * o.kv_heads;
  RUBATO_ASSIGN_OR_RETURN(auto pooled, DeviceBuffer<float>::Allocate(pairs * stride, "pooled"));
  RUBATO_ASSIGN_OR_RETURN(auto selected, DeviceBuffer<int32_t>::Allocate(pairs * k_max, "lists"));
  RUBATO_ASSIGN_OR_RETURN(auto counts, DeviceBuffer<int32_t>::Allocate(pairs, "counts"));
  const size_t top_k_bytes = cuda::PooledTopKWorkspaceBytes(tiles, o.kv_heads, o.kv_heads, context);
  RUBATO_ASSIGN_OR_RETURN(auto top_k_ws,
                          DeviceBuffer<unsigned char>::Allocate(top_k_bytes, "top-k ws"));
  RUBATO_ASSIGN_OR_RETURN(auto tile_base, Upload(std::vector<int32_t>{0}, "tile base"));
  RUBATO_ASSIGN_OR_RETURN(auto tile_begin_zero,
                          Upload(std::vector<int32_t>(static_cast<size_t>(tiles), 0), "begin"));

  std::vector<ChunkTimes> times;
  double tokens_kept = 0, tokens_before = 0;
  for (int start = 0; start < context; start += o.chunk) {
    const int tokens = std::min(o.chunk, context - start);
    RUBATO_ASSIGN_OR_RETURN(auto query_start, Upload(std::vector<int32_t>{0, tokens}, "starts"));
    RUBATO_ASSIGN_OR_RETURN(auto start_position, Upload(std::vector<int32_t>{start}, "start"));
    const int chunk_tiles = (tokens + o.tile - 1) / o.tile;
    std::vector<int32_t> count(static_cast<size_t>(chunk_tiles)), row_k(count.size());
    for (int t = 0; t < chunk_tiles; ++t) {
      const int begin = start + t * o.tile;
      count[t] = begin;
      row_k[t] = std::min(begin, TopK(o, begin + o.tile));
      tokens_kept += double(row_k[t]) * std::min(o.tile, tokens - t * o.tile);
      tokens_before += double(begin) * std::min(o.tile, tokens - t * o.tile);
    }
    RUBATO_ASSIGN_OR_RETURN(auto d_count, Upload(count, "count"));
    RUBATO_ASSIGN_OR_RETURN(auto d_row_k, Upload(row_k, "row k"));

    cuda::PrefillAttentionParams dense;
    dense.q = q.data();
    dense.q_row_stride = row;
    dense.key_pool = keys.data();
    dense.value_pool = values.data();
    dense.block_tables = d_table.data();
    dense.block_table_stride = blocks;
    dense.query_start = query_start.data();
    dense.start_position = start_position.data();
    dense.entries = 1;
    dense.total_tokens = tokens;
    dense.max_query_tokens = tokens;
    dense.num_heads = o.heads;
    dense.num_kv_heads = o.kv_heads;
    dense.head_dim = o.head_dim;
    dense.block_tokens = o.block_size;
    dense.scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(o.head_dim)));
    dense.out = out.data();
    dense.out_row_stride = row;
    dense.tile_tokens = o.tile;
    dense.tile_base = tile_base.data();
    cuda::PrefillAttentionParams dense_lse = dense;
    dense_lse.lse = lse.data();
    cuda::PrefillAttentionParams lse_pass = dense_lse;
    lse_pass.mode = PrefillMode::kLse;
    cuda::PrefillAttentionParams pool_pass = dense_lse;
    pool_pass.mode = PrefillMode::kPool;
    pool_pass.pooled = pooled.data();
    pool_pass.pooled_stride = stride;
    cuda::PrefillAttentionParams list = dense;
    list.mode = PrefillMode::kList;
    list.lists = selected.data();
    list.list_counts = counts.data();
    list.list_capacity = k_max;
    list.list_heads = o.kv_heads;
    cuda::PooledTopKParams top_k;
    top_k.scores = pooled.data();
    top_k.scores_stride = stride;
    top_k.begin = tile_begin_zero.data();
    top_k.count = d_count.data();
    top_k.max_count = context;
    top_k.batch = chunk_tiles;
    top_k.num_heads = top_k.num_kv_heads = o.kv_heads;
    top_k.k = k_max;
    top_k.row_k = d_row_k.data();
    top_k.pooled_input = true;
    top_k.selected = selected.data();
    top_k.selected_count = counts.data();
    top_k.workspace = top_k_ws.data();
    top_k.workspace_bytes = top_k_bytes;
    const size_t pooled_bytes = static_cast<size_t>(chunk_tiles) * o.kv_heads * stride * 4;
    const auto select = [&]() -> Status {
      RUBATO_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(pooled.data(), 0, pooled_bytes, nullptr),
                                  "zeroing the pooled sums");
      RUBATO_RETURN_IF_ERROR(cuda::PrefillAttention(pool_pass, nullptr));
      return cuda::PooledTopK(top_k, nullptr);
    };
    const auto time = [&](const std::function<Status()>& launch) {
      return bench::MedianLaunchMs(launch, o.warmup, o.iterations);
    };
    ChunkTimes chunk;
    RUBATO_ASSIGN_OR_RETURN(chunk.dense,
                            time([&] { return cuda::PrefillAttention(dense, nullptr); }));
    RUBATO_ASSIGN_OR_RETURN(chunk.anchor0, time([&]() -> Status {
                              RUBATO_RETURN_IF_ERROR(cuda::PrefillAttention(dense_lse, nullptr));
                              return select();
                            }));
    RUBATO_ASSIGN_OR_RETURN(chunk.anchor, time([&]() -> Status {
                              RUBATO_RETURN_IF_ERROR(cuda::PrefillAttention(lse_pass, nullptr));
                              RUBATO_RETURN_IF_ERROR(select());
                              return cuda::PrefillAttention(list, nullptr);
                            }));
    RUBATO_ASSIGN_OR_RETURN(chunk.reuse,
                            time([&] { return cuda::PrefillAttention(list, nullptr); }));
    times.push_back(chunk);
  }
  ChunkTimes total;
  for (const ChunkTimes& c : times) {
    total.dense += c.dense;
    total.anchor0 += c.anchor0;
    total.anchor += c.anchor;
    total.reuse += c.reuse;
  }
  const int a = static_cast<int>(o.anchors.size());
  const double per_layer =
      (total.anchor0 + (a - 1) * total.anchor + (o.layers - a) * total.reuse) / o.layers;
  const double kept = tokens_before > 0 ? tokens_kept / tokens_before : 1.0;
  std::printf(
      "L %d, chunk %d (%zu chunks), kept %.3f of earlier keys: dense %.2f ms | anchor 0 %.2f | "
      "anchor %.2f | reuse %.2f | per layer %.2f: %.2fx dense\n",
      context, o.chunk, times.size(), kept, total.dense, total.anchor0, total.anchor, total.reuse,
      per_layer, total.dense / per_layer);
  point = {{"context", context},         {"chunk", o.chunk},
           {"chunks", times.size()},     {"kept_share_of_earlier_keys", kept},
           {"dense_ms", total.dense},    {"anchor0_ms", total.anchor0},
           {"anchor_ms", total.anchor},  {"reuse_ms", total.reuse},
           {"mean_layer_ms", per_layer}, {"speedup_vs_dense", total.dense / per_layer}};
  return Status::Ok();
}

}  // namespace
}  // namespace rubato

int main(int argc, char** argv) {
  rubato::Options o;
  CLI::App app{"Kascade tile-sparse prefill attention per layer against dense prefill"};
  app.add_option("--heads", o.heads);
  app.add_option("--kv-heads", o.kv_heads);
  app.add_option("--head-dim", o.head_dim);
  app.add_option("--block-size", o.block_size);
  app.add_option("--chunk", o.chunk, "prefill chunk, a multiple of --tile")
      ->check(CLI::PositiveNumber);
  app.add_option("--tile", o.tile, "selection tile, a multiple of 64")->check(CLI::PositiveNumber);
  app.add_option("--contexts", o.contexts, "e.g. 32768,131072")->delimiter(',');
  app.add_option("--top-k-ratio", o.top_k_ratio)->check(CLI::Range(0.0, 1.0));
  app.add_option("--top-k-min", o.top_k_min)->check(CLI::PositiveNumber);
  app.add_option("--anchors", o.anchors, "anchor layers, 0 first")->delimiter(',');
  app.add_option("--layers", o.layers);
  app.add_option("--iterations", o.iterations)->check(CLI::PositiveNumber);
  app.add_option("--warmup", o.warmup)->check(CLI::NonNegativeNumber);
  app.add_option("--out", o.out, "JSON results");
  app.add_option("--commit", o.commit);
  CLI11_PARSE(app, argc, argv);
  if (o.anchors.empty() || o.anchors.front() != 0 ||
      o.layers < static_cast<int>(o.anchors.size()) || o.tile % 64 != 0 || o.chunk % o.tile != 0) {
    std::fprintf(stderr,
                 "rubato_bench_attention_kascade_prefill: error: --anchors must start with 0 and "
                 "fit --layers; --tile a multiple of 64; --chunk a multiple of --tile\n");
    return 2;
  }
  cudaDeviceProp prop{};
  cudaGetDeviceProperties(&prop, 0);
  nlohmann::json report = {{"benchmark", "attention_kascade_prefill"},
                           {"device", prop.name},
                           {"commit", o.commit},
                           {"command", rubato::bench::CommandLine(argc, argv)},
                           {"batch", 1},
                           {"heads", o.heads},
                           {"kv_heads", o.kv_heads},
                           {"head_dim", o.head_dim},
                           {"tile", o.tile},
                           {"anchors", o.anchors},
                           {"layers", o.layers},
                           {"top_k_ratio", o.top_k_ratio},
                           {"top_k_min", o.top_k_min},
                           {"points", nlohmann::json::array()}};
  return rubato::bench::RunPoints(
      report, "context", o.contexts,
      [&o](int context, nlohmann::json& point) { return rubato::RunContext(o, context, point); },
      o.out, "rubato_bench_attention_kascade_prefill");
}
