// rubato_bench_attention_kascade: Kascade's decode attention per layer against our dense decode
// attention, at Qwen3-8B attention shapes (32 query / 8 KV heads of 128), batch 16, 10 % top-k:
// the dense launch; layer 0 (dense with raw scores + pooled top-k); another anchor (scores-only
// pass + pooled top-k + index gather); a reuse layer (index gather). The average attention time per
// layer for an anchor set (the paper's 0, 2, 7, 14, 23 of 36) against dense gives the speedup
// (the paper's Table 3 split). A benchmark, not a test. docs/benchmarks.md "Kascade attention".
#include <cuda_runtime_api.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <functional>
#include <nlohmann/json.hpp>
#include <random>
#include <string>
#include <vector>

#include "bench/kernel_bench_util.h"
#include "common/status.h"
#include "kernels/cuda/cuda_status.h"
#include "kernels/cuda/decode_attention.cuh"
#include "kernels/cuda/decode_scores.cuh"
#include "kernels/cuda/device_buffer.h"
#include "kernels/cuda/index_gather_attention.cuh"
#include "kernels/cuda/pooled_top_k.cuh"
#include "kernels/cuda/random_fill.cuh"

#ifndef RUBATO_GIT_COMMIT
#define RUBATO_GIT_COMMIT "unknown"
#endif

namespace rubato {
namespace {

using cuda::DeviceBuffer;

struct Options {
  int batch = 16;
  int heads = 32;
  int kv_heads = 8;
  int head_dim = 128;
  int block_size = 64;
  std::vector<int> contexts = {32768, 131072};
  double top_k_ratio = 0.1;
  int top_k_min = 128;
  std::vector<int> anchors = {0, 2, 7, 14, 23};
  int layers = 36;
  int warmup = 5;
  int iterations = 30;
  std::string out;
  std::string commit = RUBATO_GIT_COMMIT;
};

Result<double> Time(const std::function<Status()>& launch, const Options& options) {
  return bench::MedianLaunchMs(launch, options.warmup, options.iterations);
}

using bench::Upload;

Status RunContext(const Options& o, int context, nlohmann::json& point) {
  const int k = std::min(
      context, std::max(static_cast<int>(std::ceil(o.top_k_ratio * context)), o.top_k_min));
  const int blocks_per_sequence = (context + o.block_size - 1) / o.block_size;
  const size_t num_blocks = static_cast<size_t>(o.batch) * blocks_per_sequence;
  const size_t pool = num_blocks * o.kv_heads * o.block_size * o.head_dim;
  RUBATO_ASSIGN_OR_RETURN(auto keys, DeviceBuffer<__nv_bfloat16>::Allocate(pool, "K pool"));
  RUBATO_ASSIGN_OR_RETURN(auto values, DeviceBuffer<__nv_bfloat16>::Allocate(pool, "V pool"));
  const size_t q_count = static_cast<size_t>(o.batch) * o.heads * o.head_dim;
  RUBATO_ASSIGN_OR_RETURN(auto q, DeviceBuffer<__nv_bfloat16>::Allocate(q_count, "q"));
  RUBATO_ASSIGN_OR_RETURN(auto out, DeviceBuffer<__nv_bfloat16>::Allocate(q_count, "out"));
  uint64_t stream_id = 0;
  for (auto* buffer : {&keys, &values, &q}) {
    cuda::RandomFillParams fill;
    fill.out = buffer->data();
    fill.count = static_cast<int64_t>(buffer->size());
    fill.seed = 11;
    fill.stream = stream_id++;
    fill.bound = 1.f;
    RUBATO_RETURN_IF_ERROR(cuda::RandomFill(fill, nullptr));
  }
  std::vector<int32_t> tables(num_blocks);
  for (size_t i = 0; i < num_blocks; ++i) tables[i] = static_cast<int32_t>(i);
  std::shuffle(tables.begin(), tables.end(), std::mt19937_64(3));
  RUBATO_ASSIGN_OR_RETURN(auto d_tables, Upload(tables, "block tables"));
  RUBATO_ASSIGN_OR_RETURN(auto seq_lens, Upload(std::vector<int32_t>(o.batch, context), "L"));
  RUBATO_ASSIGN_OR_RETURN(auto begin, Upload(std::vector<int32_t>(o.batch, 0), "begin"));
  RUBATO_ASSIGN_OR_RETURN(auto row_k, Upload(std::vector<int32_t>(o.batch, k), "k"));
  const int64_t stride = (static_cast<int64_t>(context) + 63) / 64 * 64;
  RUBATO_ASSIGN_OR_RETURN(
      auto scores,
      DeviceBuffer<float>::Allocate(static_cast<size_t>(o.batch) * o.heads * stride, "scores"));
  const size_t pairs = static_cast<size_t>(o.batch) * o.kv_heads;
  RUBATO_ASSIGN_OR_RETURN(auto selected, DeviceBuffer<int32_t>::Allocate(pairs * k, "selected"));
  RUBATO_ASSIGN_OR_RETURN(auto counts, DeviceBuffer<int32_t>::Allocate(pairs, "counts"));
  const size_t decode_ws =
      cuda::DecodeAttentionWorkspaceBytes(o.batch, o.heads, o.head_dim, context, false);
  RUBATO_ASSIGN_OR_RETURN(auto workspace, DeviceBuffer<unsigned char>::Allocate(decode_ws, "ws"));
  const size_t top_k_ws = cuda::PooledTopKWorkspaceBytes(o.batch, o.heads, o.kv_heads, context);
  RUBATO_ASSIGN_OR_RETURN(auto top_k_workspace,
                          DeviceBuffer<unsigned char>::Allocate(top_k_ws, "top-k ws"));
  const size_t gather_ws =
      cuda::IndexGatherAttentionWorkspaceBytes(o.batch, o.heads, o.head_dim, k);
  RUBATO_ASSIGN_OR_RETURN(auto gather_workspace,
                          DeviceBuffer<unsigned char>::Allocate(gather_ws, "gather ws"));

  cuda::DecodeAttentionParams dense;
  dense.q = q.data();
  dense.q_row_stride = static_cast<int64_t>(o.heads) * o.head_dim;
  dense.key_pool = keys.data();
  dense.value_pool = values.data();
  dense.num_pool_blocks = static_cast<int64_t>(num_blocks);
  dense.block_tables = d_tables.data();
  dense.block_table_stride = blocks_per_sequence;
  dense.seq_lens = seq_lens.data();
  dense.batch = o.batch;
  dense.num_heads = o.heads;
  dense.num_kv_heads = o.kv_heads;
  dense.head_dim = o.head_dim;
  dense.block_tokens = o.block_size;
  dense.max_seq_len = context;
  dense.scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(o.head_dim)));
  dense.out = out.data();
  dense.out_row_stride = dense.q_row_stride;
  dense.workspace = workspace.data();
  dense.workspace_bytes = decode_ws;
  // As the Kascade backend runs them: the scores passes also write each head's lse, which the
  // top-k takes instead of a statistics pass of its own.
  RUBATO_ASSIGN_OR_RETURN(
      auto lse, DeviceBuffer<float>::Allocate(static_cast<size_t>(o.batch) * o.heads, "lse"));
  const size_t scores_ws = cuda::DecodeScoresWorkspaceBytes(o.batch, o.heads, context);
  RUBATO_ASSIGN_OR_RETURN(auto scores_workspace,
                          DeviceBuffer<unsigned char>::Allocate(scores_ws, "scores ws"));
  cuda::DecodeAttentionParams with_scores = dense;
  with_scores.scores = scores.data();
  with_scores.scores_stride = stride;
  with_scores.lse = lse.data();
  cuda::DecodeScoresParams scores_only;
  scores_only.q = q.data();
  scores_only.q_row_stride = dense.q_row_stride;
  scores_only.key_pool = keys.data();
  scores_only.num_pool_blocks = dense.num_pool_blocks;
  scores_only.block_tables = d_tables.data();
  scores_only.block_table_stride = blocks_per_sequence;
  scores_only.seq_lens = seq_lens.data();
  scores_only.batch = o.batch;
  scores_only.num_heads = o.heads;
  scores_only.num_kv_heads = o.kv_heads;
  scores_only.head_dim = o.head_dim;
  scores_only.block_tokens = o.block_size;
  scores_only.max_seq_len = context;
  scores_only.scale = dense.scale;
  scores_only.scores = scores.data();
  scores_only.scores_stride = stride;
  scores_only.lse = lse.data();
  scores_only.workspace = scores_workspace.data();
  scores_only.workspace_bytes = scores_ws;

  cuda::PooledTopKParams top_k;
  top_k.scores = scores.data();
  top_k.scores_stride = stride;
  top_k.begin = begin.data();
  top_k.count = seq_lens.data();
  top_k.max_count = context;
  top_k.batch = o.batch;
  top_k.num_heads = o.heads;
  top_k.num_kv_heads = o.kv_heads;
  top_k.k = k;
  top_k.row_k = row_k.data();
  top_k.head_lse = lse.data();
  top_k.selected = selected.data();
  top_k.selected_count = counts.data();
  top_k.workspace = top_k_workspace.data();
  top_k.workspace_bytes = top_k_ws;

  cuda::IndexGatherAttentionParams gather;
  gather.q = q.data();
  gather.q_row_stride = dense.q_row_stride;
  gather.key_pool = keys.data();
  gather.value_pool = values.data();
  gather.block_tables = d_tables.data();
  gather.block_table_stride = blocks_per_sequence;
  gather.batch = o.batch;
  gather.num_heads = o.heads;
  gather.num_kv_heads = o.kv_heads;
  gather.head_dim = o.head_dim;
  gather.block_tokens = o.block_size;
  gather.scale = dense.scale;
  gather.lists = selected.data();
  gather.counts = counts.data();
  gather.capacity = k;
  gather.list_heads = o.kv_heads;
  gather.out = out.data();
  gather.out_row_stride = dense.q_row_stride;
  gather.workspace = gather_workspace.data();
  gather.workspace_bytes = gather_ws;

  // A real selection for the gather: one scores pass and top-k first.
  RUBATO_RETURN_IF_ERROR(cuda::DecodeAttention(with_scores, nullptr));
  RUBATO_RETURN_IF_ERROR(cuda::PooledTopK(top_k, nullptr));
  RUBATO_ASSIGN_OR_RETURN(const double t_dense,
                          Time([&] { return cuda::DecodeAttention(dense, nullptr); }, o));
  RUBATO_ASSIGN_OR_RETURN(const double t_dense_scores,
                          Time([&] { return cuda::DecodeAttention(with_scores, nullptr); }, o));
  RUBATO_ASSIGN_OR_RETURN(const double t_scores,
                          Time([&] { return cuda::DecodeScores(scores_only, nullptr); }, o));
  RUBATO_ASSIGN_OR_RETURN(const double t_top_k,
                          Time([&] { return cuda::PooledTopK(top_k, nullptr); }, o));
  RUBATO_ASSIGN_OR_RETURN(const double t_gather,
                          Time([&] { return cuda::IndexGatherAttention(gather, nullptr); }, o));
  const double anchor0 = t_dense_scores + t_top_k;
  const double anchor = t_scores + t_top_k + t_gather;
  const double reuse = t_gather;
  const int a = static_cast<int>(o.anchors.size());
  const double per_layer = (anchor0 + (a - 1) * anchor + (o.layers - a) * reuse) / o.layers;
  std::printf(
      "L %d, k %d: dense %.4f ms | anchor 0 %.4f (dense+scores %.4f + top-k %.4f) | "
      "anchor %.4f (scores %.4f) | reuse %.4f | per layer %.4f: %.2fx dense\n",
      context, k, t_dense, anchor0, t_dense_scores, t_top_k, anchor, t_scores, reuse, per_layer,
      t_dense / per_layer);
  point = {{"context", context},          {"k", k},
           {"dense_ms", t_dense},         {"dense_with_scores_ms", t_dense_scores},
           {"scores_pass_ms", t_scores},  {"pooled_top_k_ms", t_top_k},
           {"index_gather_ms", t_gather}, {"anchor0_ms", anchor0},
           {"anchor_ms", anchor},         {"reuse_ms", reuse},
           {"mean_layer_ms", per_layer},  {"speedup_vs_dense", t_dense / per_layer}};
  return Status::Ok();
}

}  // namespace
}  // namespace rubato

int main(int argc, char** argv) {
  rubato::Options o;
  CLI::App app{"Kascade decode attention per layer against dense decode attention"};
  app.add_option("--batch", o.batch);
  app.add_option("--heads", o.heads);
  app.add_option("--kv-heads", o.kv_heads);
  app.add_option("--head-dim", o.head_dim);
  app.add_option("--block-size", o.block_size);
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
      o.layers < static_cast<int>(o.anchors.size())) {
    std::fprintf(stderr,
                 "rubato_bench_attention_kascade: error: --anchors must start with 0 and "
                 "fit --layers\n");
    return 2;
  }
  cudaDeviceProp prop{};
  cudaGetDeviceProperties(&prop, 0);
  const std::string command = rubato::bench::CommandLine(argc, argv);
  nlohmann::json report = {{"benchmark", "attention_kascade"},
                           {"device", prop.name},
                           {"commit", o.commit},
                           {"command", command},
                           {"batch", o.batch},
                           {"heads", o.heads},
                           {"kv_heads", o.kv_heads},
                           {"head_dim", o.head_dim},
                           {"anchors", o.anchors},
                           {"layers", o.layers},
                           {"top_k_ratio", o.top_k_ratio},
                           {"top_k_min", o.top_k_min},
                           {"points", nlohmann::json::array()}};
  return rubato::bench::RunPoints(
      report, "context", o.contexts,
      [&o](int context, nlohmann::json& point) { return rubato::RunContext(o, context, point); },
      o.out, "rubato_bench_attention_kascade");
}
