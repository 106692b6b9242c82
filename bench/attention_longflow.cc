// rubato_bench_attention_longflow: LongFlow's fused decode attention + eviction choice against
// our plain decode attention over the same B keys, at Qwen3-8B attention shapes (32 query / 8 KV
// heads of 128), batch 128, budgets 2400 and 3200: what the Eq. 6 scores and the argmin add to
// one decode attention pass. A benchmark, not a test. docs/benchmarks.md "LongFlow attention".
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
#include "kernels/cuda/device_buffer.h"
#include "kernels/cuda/longflow_attention.cuh"
#include "kernels/cuda/random_fill.cuh"

#ifndef RUBATO_GIT_COMMIT
#define RUBATO_GIT_COMMIT "unknown"
#endif

namespace rubato {
namespace {

using cuda::DeviceBuffer;

struct Options {
  int batch = 128;
  int heads = 32;
  int kv_heads = 8;
  int head_dim = 128;
  int block_size = 64;
  std::vector<int> budgets = {2400, 3200};
  int sink_slots = 4;
  int warmup = 5;
  int iterations = 50;
  std::string out;
  std::string commit = RUBATO_GIT_COMMIT;
};

Result<double> Time(const std::function<Status()>& launch, const Options& options) {
  return bench::MedianLaunchMs(launch, options.warmup, options.iterations);
}

using bench::Upload;

Status FillRandom(DeviceBuffer<__nv_bfloat16>& buffer, uint64_t stream_id, float bound) {
  cuda::RandomFillParams fill;
  fill.out = buffer.data();
  fill.count = static_cast<int64_t>(buffer.size());
  fill.seed = 17;
  fill.stream = stream_id;
  fill.bound = bound;
  return cuda::RandomFill(fill, nullptr);
}

Status RunBudget(const Options& o, int budget, nlohmann::json& point) {
  const size_t q_count = static_cast<size_t>(o.batch) * o.heads * o.head_dim;
  RUBATO_ASSIGN_OR_RETURN(auto q, DeviceBuffer<__nv_bfloat16>::Allocate(q_count, "q"));
  RUBATO_ASSIGN_OR_RETURN(auto out, DeviceBuffer<__nv_bfloat16>::Allocate(q_count, "out"));
  // Queries in [-0.1, 0.1]: scores stay far below the plain-exponential limit, as with Qwen3's
  // normalized q and k (the fallback's second pass is not what is measured).
  RUBATO_RETURN_IF_ERROR(FillRandom(q, 0, 0.1f));

  // LongFlow's slots: [batch][kv_heads][B][head_dim], every slot valid (a full budget).
  const size_t slots = static_cast<size_t>(o.batch) * o.kv_heads * budget * o.head_dim;
  RUBATO_ASSIGN_OR_RETURN(auto keys, DeviceBuffer<__nv_bfloat16>::Allocate(slots, "slot keys"));
  RUBATO_ASSIGN_OR_RETURN(auto values, DeviceBuffer<__nv_bfloat16>::Allocate(slots, "slot values"));
  RUBATO_RETURN_IF_ERROR(FillRandom(keys, 1, 1.f));
  RUBATO_RETURN_IF_ERROR(FillRandom(values, 2, 1.f));
  RUBATO_ASSIGN_OR_RETURN(
      auto valid,
      Upload(std::vector<uint8_t>(static_cast<size_t>(o.batch) * budget, 1), "valid mask"));
  const size_t pairs = static_cast<size_t>(o.batch) * o.kv_heads;
  RUBATO_ASSIGN_OR_RETURN(auto next_slot, DeviceBuffer<int32_t>::Allocate(pairs, "next slot"));
  const size_t longflow_ws =
      cuda::LongFlowAttentionWorkspaceBytes(o.batch, o.heads, o.head_dim, budget);
  RUBATO_ASSIGN_OR_RETURN(auto longflow_workspace,
                          DeviceBuffer<unsigned char>::Allocate(longflow_ws, "LongFlow ws"));
  cuda::LongFlowAttentionParams fused;
  fused.q = q.data();
  fused.q_row_stride = static_cast<int64_t>(o.heads) * o.head_dim;
  fused.keys = keys.data();
  fused.values = values.data();
  fused.valid = valid.data();
  fused.batch = o.batch;
  fused.num_heads = o.heads;
  fused.num_kv_heads = o.kv_heads;
  fused.head_dim = o.head_dim;
  fused.budget = budget;
  fused.sink_slots = o.sink_slots;
  fused.scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(o.head_dim)));
  fused.out = out.data();
  fused.out_row_stride = fused.q_row_stride;
  fused.next_slot = next_slot.data();
  fused.workspace = longflow_workspace.data();
  fused.workspace_bytes = longflow_ws;

  // The plain decode attention over B keys per sequence in the paged pool (its fastest path:
  // whole-block tensor copies), the same bytes read.
  const int blocks_per_sequence = (budget + o.block_size - 1) / o.block_size;
  const size_t num_blocks = static_cast<size_t>(o.batch) * blocks_per_sequence;
  const size_t pool = num_blocks * o.kv_heads * o.block_size * o.head_dim;
  RUBATO_ASSIGN_OR_RETURN(auto pool_keys, DeviceBuffer<__nv_bfloat16>::Allocate(pool, "K pool"));
  RUBATO_ASSIGN_OR_RETURN(auto pool_values, DeviceBuffer<__nv_bfloat16>::Allocate(pool, "V pool"));
  RUBATO_RETURN_IF_ERROR(FillRandom(pool_keys, 3, 1.f));
  RUBATO_RETURN_IF_ERROR(FillRandom(pool_values, 4, 1.f));
  std::vector<int32_t> tables(num_blocks);
  for (size_t i = 0; i < num_blocks; ++i) tables[i] = static_cast<int32_t>(i);
  std::shuffle(tables.begin(), tables.end(), std::mt19937_64(3));
  RUBATO_ASSIGN_OR_RETURN(auto d_tables, Upload(tables, "block tables"));
  RUBATO_ASSIGN_OR_RETURN(auto seq_lens, Upload(std::vector<int32_t>(o.batch, budget), "L"));
  const size_t decode_ws =
      cuda::DecodeAttentionWorkspaceBytes(o.batch, o.heads, o.head_dim, budget, false);
  RUBATO_ASSIGN_OR_RETURN(auto workspace, DeviceBuffer<unsigned char>::Allocate(decode_ws, "ws"));
  cuda::DecodeAttentionParams plain;
  plain.q = q.data();
  plain.q_row_stride = fused.q_row_stride;
  plain.key_pool = pool_keys.data();
  plain.value_pool = pool_values.data();
  plain.num_pool_blocks = static_cast<int64_t>(num_blocks);
  plain.block_tables = d_tables.data();
  plain.block_table_stride = blocks_per_sequence;
  plain.seq_lens = seq_lens.data();
  plain.batch = o.batch;
  plain.num_heads = o.heads;
  plain.num_kv_heads = o.kv_heads;
  plain.head_dim = o.head_dim;
  plain.block_tokens = o.block_size;
  plain.max_seq_len = budget;
  plain.scale = fused.scale;
  plain.out = out.data();
  plain.out_row_stride = fused.q_row_stride;
  plain.workspace = workspace.data();
  plain.workspace_bytes = decode_ws;

  RUBATO_ASSIGN_OR_RETURN(const double t_plain,
                          Time([&] { return cuda::DecodeAttention(plain, nullptr); }, o));
  RUBATO_ASSIGN_OR_RETURN(const double t_fused,
                          Time([&] { return cuda::LongFlowAttention(fused, nullptr); }, o));
  const double bytes = 2.0 * static_cast<double>(slots) * sizeof(__nv_bfloat16);
  std::printf(
      "B %d: plain decode attention %.4f ms (%.0f GB/s) | LongFlow fused %.4f ms "
      "(%.0f GB/s): %.3fx plain\n",
      budget, t_plain, bytes / t_plain / 1e6, t_fused, bytes / t_fused / 1e6, t_fused / t_plain);
  point = {{"budget", budget},
           {"plain_decode_attention_ms", t_plain},
           {"longflow_fused_ms", t_fused},
           {"fused_over_plain", t_fused / t_plain},
           {"kv_bytes_read", bytes}};
  return Status::Ok();
}

}  // namespace
}  // namespace rubato

int main(int argc, char** argv) {
  rubato::Options o;
  CLI::App app{"LongFlow's fused decode attention against plain decode attention over B keys"};
  app.add_option("--batch", o.batch)->check(CLI::PositiveNumber);
  app.add_option("--heads", o.heads)->check(CLI::PositiveNumber);
  app.add_option("--kv-heads", o.kv_heads)->check(CLI::PositiveNumber);
  app.add_option("--head-dim", o.head_dim);
  app.add_option("--block-size", o.block_size);
  app.add_option("--budgets", o.budgets, "e.g. 2400,3200")->delimiter(',');
  app.add_option("--sink-slots", o.sink_slots)->check(CLI::NonNegativeNumber);
  app.add_option("--iterations", o.iterations)->check(CLI::PositiveNumber);
  app.add_option("--warmup", o.warmup)->check(CLI::NonNegativeNumber);
  app.add_option("--out", o.out, "JSON results");
  app.add_option("--commit", o.commit);
  CLI11_PARSE(app, argc, argv);
  cudaDeviceProp prop{};
  cudaGetDeviceProperties(&prop, 0);
  const std::string command = rubato::bench::CommandLine(argc, argv);
  nlohmann::json report = {{"benchmark", "attention_longflow"},
                           {"device", prop.name},
                           {"commit", o.commit},
                           {"command", command},
                           {"batch", o.batch},
                           {"heads", o.heads},
                           {"kv_heads", o.kv_heads},
                           {"head_dim", o.head_dim},
                           {"sink_slots", o.sink_slots},
                           {"points", nlohmann::json::array()}};
  int failed = 0;
  for (int budget : o.budgets) {
    nlohmann::json point;
    const rubato::Status status = rubato::RunBudget(o, budget, point);
    if (!status.ok()) {
      // A point that does not fit the card is reported as such, not dropped.
      std::printf("B %d: %s\n", budget, status.ToString().c_str());
      point = {{"budget", budget}, {"error", status.ToString()}};
      failed += 1;
    }
    report["points"].push_back(point);
  }
  const rubato::Status written = rubato::bench::WriteJsonReport(report, o.out);
  if (!written.ok()) {
    std::fprintf(stderr, "rubato_bench_attention_longflow: error: %s\n", written.message().c_str());
    return 1;
  }
  return failed == 0 ? 0 : 1;
}
