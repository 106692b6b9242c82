// rubato_bench_decode_e2e: end-to-end dense decode of the CUDA model at real shapes (random
// weights from a config.json) at batch x context points, steps replayed as CUDA graphs with
// greedy sampling on the device, against the memory roofline (weight + KV bytes per step / the
// copy bandwidth measured in this process); with --policy FILE, each point again with that
// attention policy's decode plans, and the ratio. No prefill: the KV is random bf16. A
// benchmark, not a test. docs/benchmarks.md "End-to-end dense decode".
#include <cuda_profiler_api.h>
#include <cuda_runtime_api.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <nlohmann/json.hpp>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "bench/decode_bench_common.h"
#include "common/status.h"
#include "inference_rank/model/cuda_kv_storage.h"
#include "inference_rank/model/cuda_model.h"
#include "inference_rank/policies/policy_registry.h"
#include "kernels/cuda/cuda_status.h"
#include "kernels/cuda/device_buffer.h"

namespace rubato {
namespace {

using bench::CopyBandwidth;
using bench::KvBytesPerStep;
using bench::Percentile;
using bench::Point;
using bench::WeightBytesPerStep;

struct Options {
  bench::CommonOptions common;  // --config, --block-size, --seed, --device, --commit, --out
  int batch = 16;
  int context = 32768;
  std::string points;  // "8x12288,16x32768": overrides batch / context
  int steps = 20;
  int warmup = 3;
  std::string policy;     // YAML with a `policy:` section: also run each point with it
  int profile_steps = 0;  // steps after the timed ones, bracketed for ncu --profile-from-start off
};

struct PointResult {
  Point point;
  double median_ms = 0, p90_ms = 0, min_ms = 0, host_median_ms = 0;
  double mean_keys = 0, weight_bytes = 0, kv_bytes = 0, roofline_ms = 0;
  int64_t graph_steps = 0;
};

// `policy` set: every sequence's decode plans come from its PolicyRequest (the policy's backend
// is installed on `model`).
Result<PointResult> RunPoint(CudaModel& model, PagedKvCache& cache, const Point& point,
                             const Options& options, double copy_bandwidth, uint64_t seed,
                             AttentionPolicy* policy) {
  const ModelConfig& config = model.config();
  std::vector<KvSequence> sequences(static_cast<size_t>(point.batch));
  std::vector<KvSequence*> pointers;
  for (KvSequence& s : sequences) pointers.push_back(&s);
  RUBATO_RETURN_IF_ERROR(bench::FillRandomKv(model, cache, pointers, point.context, seed));

  std::mt19937_64 rng(seed);
  std::vector<int> next(sequences.size());
  for (int& token : next)
    token = static_cast<int>(rng() % static_cast<uint64_t>(config.vocab_size));
  const TokenSampling greedy;
  ForwardResult result;
  std::vector<ForwardEntry> batch(sequences.size());
  std::vector<std::unique_ptr<PolicyRequest>> requests(sequences.size());
  if (policy != nullptr) {
    for (auto& request : requests) request = policy->Admit(KvResidency::kLocal);
  }
  cudaEvent_t start, stop;
  RUBATO_CUDA_RETURN_IF_ERROR(cudaEventCreate(&start), "creating an event");
  RUBATO_CUDA_RETURN_IF_ERROR(cudaEventCreate(&stop), "creating an event");
  std::vector<double> device_ms, host_ms;
  int64_t replays_before = 0;
  Status status;
  const int timed_end = options.warmup + options.steps;
  for (int step = 0; step < timed_end + options.profile_steps && status.ok(); ++step) {
    if (step == options.warmup) replays_before = model.graph_replays();
    if (step == timed_end) cudaProfilerStart();  // the profiled steps run after the timed ones
    for (size_t i = 0; i < sequences.size(); ++i) {
      batch[i] = ForwardEntry{
          &sequences[i], {&next[i], 1}, sequences[i].num_tokens, LogitsWanted::kLast, &greedy};
      if (requests[i] != nullptr)
        batch[i].attention = requests[i]->PlanDecode(batch[i].start_position);
    }
    // The stream is idle here, so the events bracket the whole step: host planning, the input
    // copy, the graph, sampling and the token copy back (what a client sees per token).
    const auto host_start = std::chrono::steady_clock::now();
    cudaEventRecord(start, model.stream());
    status = model.Forward(batch, cache, result);
    cudaEventRecord(stop, model.stream());
    if (status.ok()) status = cuda::CudaStatus(cudaEventSynchronize(stop), "timing a step");
    const auto host_end = std::chrono::steady_clock::now();
    float ms = 0;
    cudaEventElapsedTime(&ms, start, stop);
    if (step >= options.warmup && step < timed_end) {
      device_ms.push_back(ms);
      host_ms.push_back(std::chrono::duration<double, std::milli>(host_end - host_start).count());
    }
    for (size_t i = 0; i < sequences.size() && status.ok(); ++i) {
      next[i] = result.sampled_tokens[i];
      if (requests[i] != nullptr) requests[i]->Observe(true, next[i], -1.f);
    }
  }
  if (options.profile_steps > 0) cudaProfilerStop();
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  for (KvSequence& s : sequences) {
    const Status released = cache.Release(s);
    if (status.ok()) status = released;
  }
  RUBATO_RETURN_IF_ERROR(status);

  PointResult r;
  r.point = point;
  r.graph_steps = model.graph_replays() - replays_before;
  if (options.profile_steps > 0) r.graph_steps -= options.profile_steps;
  r.median_ms = Percentile(device_ms, 0.5);
  r.p90_ms = Percentile(device_ms, 0.9);
  r.min_ms = *std::min_element(device_ms.begin(), device_ms.end());
  r.host_median_ms = Percentile(host_ms, 0.5);
  // Timed step i (0-based over all steps) decodes position context + i: context + i + 1 keys.
  r.mean_keys = point.context + options.warmup + (options.steps - 1) / 2.0 + 1.0;
  r.weight_bytes = WeightBytesPerStep(config);
  r.kv_bytes = KvBytesPerStep(config, point.batch, r.mean_keys);
  r.roofline_ms = (r.weight_bytes + r.kv_bytes) / copy_bandwidth * 1e3;
  return r;
}

Status Run(const Options& options, nlohmann::json& report, std::vector<PointResult>& results) {
  RUBATO_ASSIGN_OR_RETURN(const std::vector<Point> points,
                          bench::ParsePoints(options.points, options.batch, options.context));
  if (options.steps < 1 || options.warmup < 2 || options.profile_steps < 0) {
    return InvalidArgumentError(
        "--steps must be >= 1 and --warmup >= 2 (the first step of a shape runs eagerly, the "
        "second captures its graph), --profile-steps >= 0");
  }
  RUBATO_ASSIGN_OR_RETURN(bench::BenchModel loaded, bench::LoadBenchModel(options.common));
  CudaModel* model = loaded.model;
  RUBATO_ASSIGN_OR_RETURN(const double copy_bandwidth,
                          CopyBandwidth(size_t{4} << 30, model->stream()));
  std::printf(
      "device %s, device-to-device copy %.0f GB/s (read + write), %s: %.2f GB of bf16 "
      "weights\n",
      loaded.device_name.c_str(), copy_bandwidth / 1e9, options.common.config.c_str(),
      model->weight_bytes() / 1e9);

  // One pool for the largest point; points run one after the other and release their blocks.
  const int num_blocks = bench::BlocksForPoints(
      points, options.warmup + options.steps + options.profile_steps, options.common.block_size);
  RUBATO_ASSIGN_OR_RETURN(
      std::unique_ptr<PagedKvCache> cache,
      bench::CreateBenchKvCache(*model, options.common.block_size, num_blocks, 0, ""));

  bench::AddReportHeader(report, options.common, loaded, *cache,
                         "random bf16 in [-1, 1] written directly, no prefill: decode speed "
                         "does not depend on the KV values");
  report["copy_bandwidth_bytes_per_s"] = copy_bandwidth;
  report["steps"] = options.steps;
  report["warmup"] = options.warmup;
  report["sampling"] = "greedy, on the device";

  std::shared_ptr<AttentionPolicy> policy;
  if (!options.policy.empty()) {
    RUBATO_ASSIGN_OR_RETURN(const RubatoConfig file, LoadConfigFile(options.policy));
    RUBATO_ASSIGN_OR_RETURN(PolicyChoice choice, ResolvePolicy(file.policy));
    policy = choice.policy;
    report["policy_config"] = options.policy;
    report["policy"] = choice.name;
  }
  for (size_t i = 0; i < points.size(); ++i) {
    RUBATO_ASSIGN_OR_RETURN(PointResult r,
                            RunPoint(*model, *cache, points[i], options, copy_bandwidth,
                                     options.common.seed + 1 + i, nullptr));
    if (policy != nullptr) {
      RUBATO_ASSIGN_OR_RETURN(std::unique_ptr<AttentionBackend> backend,
                              policy->MakeBackend(*model, r.point.batch));
      RUBATO_RETURN_IF_ERROR(model->SetAttentionBackend(std::move(backend)));
      Result<PointResult> with = RunPoint(*model, *cache, points[i], options, copy_bandwidth,
                                          options.common.seed + 1 + i, policy.get());
      RUBATO_RETURN_IF_ERROR(model->SetAttentionBackend(nullptr));
      RUBATO_RETURN_IF_ERROR(with.status());
      std::printf("%dx%d: %s step %.3f ms against dense %.3f ms: %.2fx tok/s\n", r.point.batch,
                  r.point.context, std::string(policy->name()).c_str(), with->median_ms,
                  r.median_ms, r.median_ms / with->median_ms);
      report["policy_points"].push_back({{"batch", r.point.batch},
                                         {"context", r.point.context},
                                         {"step_ms_median", with->median_ms},
                                         {"step_ms_p90", with->p90_ms},
                                         {"tokens_per_s", r.point.batch / (with->median_ms / 1e3)},
                                         {"dense_step_ms_median", r.median_ms},
                                         {"speedup_tokens_per_s", r.median_ms / with->median_ms},
                                         {"graph_replayed_steps", with->graph_steps},
                                         {"policy_stats", policy->StatsLine()}});
    }
    std::printf("%dx%d: step %.3f ms (p90 %.3f), roofline %.3f ms, ratio %.3f\n", r.point.batch,
                r.point.context, r.median_ms, r.p90_ms, r.roofline_ms, r.median_ms / r.roofline_ms);
    report["points"].push_back({{"batch", r.point.batch},
                                {"context", r.point.context},
                                {"mean_keys_attended", r.mean_keys},
                                {"step_ms_median", r.median_ms},
                                {"step_ms_p90", r.p90_ms},
                                {"step_ms_min", r.min_ms},
                                {"host_step_ms_median", r.host_median_ms},
                                {"tpot_ms", r.median_ms},
                                {"tokens_per_s", r.point.batch / (r.median_ms / 1e3)},
                                {"weight_bytes_per_step", r.weight_bytes},
                                {"kv_bytes_per_step", r.kv_bytes},
                                {"roofline_ms", r.roofline_ms},
                                {"ratio_to_roofline", r.median_ms / r.roofline_ms},
                                {"graph_replayed_steps", r.graph_steps}});
    results.push_back(r);
  }
  return Status::Ok();
}

void PrintTable(const std::vector<PointResult>& results) {
  std::printf("\n%8s %8s %10s %10s %10s %9s %9s %11s %7s\n", "batch", "context", "tok/s", "TPOT ms",
              "p90 ms", "W GB", "KV GB", "roofline ms", "ratio");
  for (const PointResult& r : results) {
    std::printf("%8d %8d %10.1f %10.3f %10.3f %9.2f %9.2f %11.3f %7.3f\n", r.point.batch,
                r.point.context, r.point.batch / (r.median_ms / 1e3), r.median_ms, r.p90_ms,
                r.weight_bytes / 1e9, r.kv_bytes / 1e9, r.roofline_ms, r.median_ms / r.roofline_ms);
  }
}

}  // namespace
}  // namespace rubato

int main(int argc, char** argv) {
  rubato::Options options;
  CLI::App app{"rubato end-to-end decode benchmark (CUDA model, random weights)"};
  rubato::bench::AddCommonOptions(app, options.common);
  app.add_option("--batch", options.batch, "sequences per step (without --points)");
  app.add_option("--context", options.context,
                 "tokens per sequence at the start (without --points)");
  app.add_option("--points", options.points, "BATCHxCONTEXT list, e.g. 8x12288,16x32768");
  app.add_option("--steps", options.steps, "timed decode steps per point");
  app.add_option("--warmup", options.warmup, "untimed steps per point (>= 2: eager, capture)");
  app.add_option("--profile-steps", options.profile_steps,
                 "steps after the timed ones, between cudaProfilerStart/Stop, per point (for ncu "
                 "--profile-from-start off: bench/kernel_breakdown.py)");
  app.add_option("--policy", options.policy,
                 "YAML config whose policy section also runs each point (e.g. "
                 "bench/configs/kascade_qwen3_8b.yaml)");
  return rubato::bench::BenchMain("rubato_bench_decode_e2e", app, options.common, argc, argv,
                                  [&](nlohmann::json& report) {
                                    std::vector<rubato::PointResult> results;
                                    RUBATO_RETURN_IF_ERROR(rubato::Run(options, report, results));
                                    rubato::PrintTable(results);
                                    return rubato::Status::Ok();
                                  });
}
