// rubato_bench_decode_e2e_offload: end-to-end decode of the CUDA model at real shapes (random
// weights from a config.json), local KV against offloaded KV on a GPU cache rank of this process
// (GpuCacheResidency), at batch x context points, in one process and one run, steps replayed as
// CUDA graphs: TPOT, tok/s, bytes per step each way and the exposed wait (the model stream's time
// blocked on the cache GPU). --policy dense: the cache GPU keeps the KV and attends it (the model
// GPU sends each layer's q|k|v rows and takes the attention rows back). --policy oracle_topk:
// local oracle_topk against oracle_topk on the cache GPU (it selects; only the rows entering
// each selection come back into the model GPU's compact pools), with delta replies and with full
// ones. --policy asyncspade: the same, then AsyncSpade on the cache GPU (the same C, selected one
// step ahead from predicted queries, its pack scattered after each layer's attention; one warm-up
// step with the real query, the timed ones all ahead). A point that does not fit the cards is
// reported as such. No prefill: the KV is random bf16 on both sides. A benchmark, not a test.
// docs/benchmarks.md "Offloaded decode".
#include <cuda_runtime_api.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <cstdio>
#include <functional>
#include <memory>
#include <nlohmann/json.hpp>
#include <random>
#include <string>
#include <vector>

#include "bench/decode_bench_common.h"
#include "common/config.h"
#include "common/status.h"
#include "inference_rank/model/cuda_model.h"
#include "inference_rank/policies/asyncspade/asyncspade_policy.h"
#include "inference_rank/policies/oracle_topk/oracle_topk_policy.h"
#include "inference_rank/residency/offloaded/gpu_cache_residency.h"
#include "inference_rank/residency/offloaded/gpu_cache_session.h"
#include "kernels/cuda/cuda_status.h"

namespace rubato {
namespace {

using bench::Percentile;
using bench::Point;

struct Options {
  bench::CommonOptions common;  // --config, --block-size, --seed, --device, --commit, --out
  std::string points = "8x32768,16x32768,4x131072";
  int steps = 20;
  int warmup = 3;
  int cache_device = -1;         // -1: device 1 when there are two GPUs, else the model's
  std::string policy = "dense";  // dense | oracle_topk | asyncspade
  OracleTopKConfig topk;         // --top-k, --sink-tokens, --recent-window
  int query_window = 16;         // asyncspade's W
};

struct StepTimes {
  double median_ms = 0, p90_ms = 0;
  double wait_ms = 0;  // median exposed wait per step (offloaded only)
  int64_t graph_steps = 0;
};

// Decode steps of `sequences` (one token each), `requests` attached when offloaded, `plans`
// (local oracle_topk) planning each decode entry; `after_step` runs after every timed step (its
// device work done). The median device time of the timed steps.
Result<StepTimes> RunSteps(CudaModel& model, PagedKvCache& cache,
                           std::vector<KvSequence>& sequences,
                           const std::vector<std::unique_ptr<ResidencyRequest>>& requests,
                           const std::vector<std::unique_ptr<PolicyRequest>>& plans,
                           const std::function<Result<double>()>& wait_ms_of_step,
                           const std::function<void()>& after_step, const Options& options,
                           uint64_t seed) {
  const ModelConfig& config = model.config();
  std::mt19937_64 rng(seed);
  std::vector<int> next(sequences.size());
  for (int& token : next) token = static_cast<int>(rng() % config.vocab_size);
  const TokenSampling greedy;
  ForwardResult result;
  std::vector<ForwardEntry> batch(sequences.size());
  cudaEvent_t start, stop;
  RUBATO_CUDA_RETURN_IF_ERROR(cudaEventCreate(&start), "creating an event");
  RUBATO_CUDA_RETURN_IF_ERROR(cudaEventCreate(&stop), "creating an event");
  std::vector<double> device_ms, wait_ms;
  int64_t replays_before = 0;
  Status status;
  for (int step = 0; step < options.warmup + options.steps && status.ok(); ++step) {
    if (step == options.warmup) replays_before = model.graph_replays();
    for (size_t i = 0; i < sequences.size(); ++i) {
      batch[i] = ForwardEntry{
          &sequences[i], {&next[i], 1}, sequences[i].num_tokens, LogitsWanted::kLast, &greedy};
      if (!requests.empty()) requests[i]->AttachTo(batch[i]);
      if (!plans.empty()) batch[i].attention = plans[i]->PlanDecode(sequences[i].num_tokens);
    }
    cudaEventRecord(start, model.stream());
    status = model.Forward(batch, cache, result);
    cudaEventRecord(stop, model.stream());
    if (status.ok()) status = cuda::CudaStatus(cudaEventSynchronize(stop), "timing a step");
    float ms = 0;
    cudaEventElapsedTime(&ms, start, stop);
    if (step >= options.warmup && status.ok()) {
      device_ms.push_back(ms);
      if (wait_ms_of_step) {
        Result<double> waited = wait_ms_of_step();
        if (!waited.ok()) status = waited.status();
        if (waited.ok()) wait_ms.push_back(*waited);
      }
      if (after_step) after_step();
    }
    for (size_t i = 0; i < sequences.size() && status.ok(); ++i) next[i] = result.sampled_tokens[i];
  }
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  RUBATO_RETURN_IF_ERROR(status);
  StepTimes times;
  times.median_ms = Percentile(device_ms, 0.5);
  times.p90_ms = Percentile(device_ms, 0.9);
  if (!wait_ms.empty()) times.wait_ms = Percentile(wait_ms, 0.5);
  times.graph_steps = model.graph_replays() - replays_before;
  return times;
}

nlohmann::json TimesJson(const StepTimes& times, int batch) {
  return {{"tpot_ms", times.median_ms},
          {"step_ms_p90", times.p90_ms},
          {"tokens_per_s", batch / (times.median_ms / 1e3)},
          {"graph_replayed_steps", times.graph_steps}};
}

// The cache GPU's budget for `batch` sessions of `longest` positions (and a block's slack).
CacheSection CacheFor(const ModelConfig& config, int cache_device, int batch, int longest) {
  CacheSection section;
  section.memory = CacheSection::Memory::kDevice;
  section.device = cache_device;
  const KvCacheShape one_token{config.num_layers, config.num_kv_heads, config.head_dim, 1, 1};
  const size_t bytes_per_token = DeviceKvStorage::PoolBytes(one_token);
  section.budget_gib = static_cast<double>(bytes_per_token) * batch * (longest + 64) /
                       static_cast<double>(1ull << 30);
  return section;
}

// Local dense, then offloaded dense, of one point; both into `json`.
Status RunPoint(CudaModel& model, PagedKvCache& cache, const Point& point, const Options& options,
                int cache_device, uint64_t seed, nlohmann::json& json) {
  const ModelConfig& config = model.config();
  json = {{"batch", point.batch}, {"context", point.context}};
  std::vector<KvSequence> sequences(static_cast<size_t>(point.batch));
  std::vector<KvSequence*> pointers;
  for (KvSequence& s : sequences) pointers.push_back(&s);
  RUBATO_RETURN_IF_ERROR(bench::FillRandomKv(model, cache, pointers, point.context, seed));
  auto release = [&] {
    for (KvSequence& s : sequences) (void)cache.Release(s);
  };
  Result<StepTimes> local =
      RunSteps(model, cache, sequences, {}, {}, nullptr, nullptr, options, seed);
  if (!local.ok()) {
    release();
    return local.status();
  }
  json["local"] = TimesJson(*local, point.batch);
  // The same sequences go on from where the local run left them; the cache rank holds every
  // position up to the last one this point decodes.
  const int longest = sequences.front().num_tokens + options.warmup + options.steps + 1;
  GpuCacheResidency residency(CacheFor(config, cache_device, point.batch, longest), longest,
                              point.batch, options.common.block_size);
  Status attached = residency.Attach(model, nullptr, point.batch);
  if (!attached.ok()) {
    release();
    (void)model.SetResidencyBackend(nullptr);
    json["offloaded"] = {{"not_run", attached.message()}};
    std::printf("%dx%d: offloaded does not fit: %s\n", point.batch, point.context,
                attached.message().c_str());
    return Status::Ok();
  }
  std::vector<std::unique_ptr<ResidencyRequest>> requests;
  Status status = residency.attention()->FillRandom(seed + 7);
  for (size_t i = 0; i < sequences.size() && status.ok(); ++i) {
    Result<std::unique_ptr<ResidencyRequest>> opened = residency.Open(i, longest - 1);
    status = opened.status();
    if (opened.ok()) requests.push_back(std::move(*opened));
  }
  if (status.ok()) status = residency.attention()->SetMeasureWaits(true);
  Result<StepTimes> offloaded = status;
  if (status.ok()) {
    GpuCacheAttention* attention = residency.attention();
    offloaded = RunSteps(
        model, cache, sequences, requests, {}, [attention] { return attention->LastStepWaitMs(); },
        nullptr, options, seed);
  }
  const size_t out = residency.attention()->step_bytes_out();
  const size_t back = residency.attention()->step_bytes_back();
  const size_t device_bytes = residency.attention()->device_bytes();
  for (auto& request : requests) (void)residency.Close(*request);
  const Status detached = model.SetResidencyBackend(nullptr);
  release();
  RUBATO_RETURN_IF_ERROR(offloaded.status());
  RUBATO_RETURN_IF_ERROR(detached);
  json["offloaded"] = TimesJson(*offloaded, point.batch);
  json["offloaded"].update(nlohmann::json{{"exposed_wait_ms_per_step", offloaded->wait_ms},
                                          {"bytes_to_cache_per_step", out},
                                          {"bytes_from_cache_per_step", back},
                                          {"bytes_to_cache_per_sequence", out / point.batch},
                                          {"bytes_from_cache_per_sequence", back / point.batch},
                                          {"cache_device_bytes", device_bytes}});
  json["tpot_ratio_offloaded_to_local"] = offloaded->median_ms / local->median_ms;
  std::printf(
      "%dx%d: local %.3f ms, offloaded %.3f ms (%.3fx), exposed wait %.3f ms/step, "
      "%.0f KB out / %.0f KB back per sequence and step\n",
      point.batch, point.context, local->median_ms, offloaded->median_ms,
      offloaded->median_ms / local->median_ms, offloaded->wait_ms, out / 1e3 / point.batch,
      back / 1e3 / point.batch);
  return Status::Ok();
}

// One offloaded oracle_topk run on `residency`'s sessions: times, exposed wait and the mean bytes
// of its timed steps.
Result<nlohmann::json> RunTopKOffloaded(
    CudaModel& model, PagedKvCache& cache, std::vector<KvSequence>& sequences,
    const std::vector<std::unique_ptr<ResidencyRequest>>& requests, GpuCacheTopK& topk,
    const Options& options, uint64_t seed) {
  GpuCacheTopKBytes sum;
  int steps = 0;
  RUBATO_ASSIGN_OR_RETURN(const StepTimes times, RunSteps(
                                                     model, cache, sequences, requests, {},
                                                     [&topk] { return topk.LastStepWaitMs(); },
                                                     [&] {
                                                       const GpuCacheTopKBytes& step =
                                                           topk.last_step();
                                                       sum.out += step.out;
                                                       sum.back += step.back;
                                                       sum.full_back += step.full_back;
                                                       sum.rows_back += step.rows_back;
                                                       sum.rows_full += step.rows_full;
                                                       ++steps;
                                                     },
                                                     options, seed));
  const double n = std::max(steps, 1);
  const int batch = static_cast<int>(sequences.size());
  nlohmann::json json = TimesJson(times, batch);
  json.update(nlohmann::json{{"exposed_wait_ms_per_step", times.wait_ms},
                             {"bytes_to_cache_per_step", sum.out / n},
                             {"bytes_from_cache_per_step", sum.back / n},
                             {"full_reply_bytes_per_step", sum.full_back / n},
                             {"bytes_back_to_full", sum.back / std::max<double>(sum.full_back, 1)},
                             {"rows_entering_per_step", sum.rows_back / n},
                             {"rows_selected_per_step", sum.rows_full / n},
                             {"delta_replies", topk.delta_replies()}});
  return json;
}

// AsyncSpade on the cache GPU over `sequences` (after the oracle_topk runs): options.topk's C,
// sink and recent window selected one step ahead from predicted queries; one warm-up step (and
// the first step after the store's random fill) selects with the real query (dense_steps 1).
Result<nlohmann::json> RunSpadeOffloaded(CudaModel& model, PagedKvCache& cache,
                                         std::vector<KvSequence>& sequences, const Point& point,
                                         const Options& options, int cache_device, uint64_t seed) {
  AsyncSpadeConfig config;
  config.top_k = options.topk.top_k;
  config.sink_tokens = options.topk.sink_tokens;
  config.recent_window = options.topk.recent_window;
  config.query_window = options.query_window;
  config.dense_steps = 1;
  AsyncSpadePolicy policy(config);
  const int longest = sequences.front().num_tokens + options.warmup + options.steps + 1;
  GpuCacheResidency residency(CacheFor(model.config(), cache_device, point.batch, longest), longest,
                              point.batch, options.common.block_size);
  RUBATO_RETURN_IF_ERROR(residency.Attach(model, &policy, point.batch));
  GpuCacheTopK& topk = *residency.topk();
  std::vector<std::unique_ptr<ResidencyRequest>> requests;
  Status status = topk.FillRandom(seed + 11);
  for (size_t i = 0; i < sequences.size() && status.ok(); ++i) {
    Result<std::unique_ptr<ResidencyRequest>> opened = residency.Open(i, longest - 1);
    status = opened.status();
    if (!opened.ok()) break;
    const int session = static_cast<int>(static_cast<GpuCacheRequest&>(**opened).session());
    status = topk.SetSessionLength(session, sequences[i].num_tokens);
    requests.push_back(std::move(*opened));
  }
  Result<nlohmann::json> run = status;
  if (status.ok()) run = RunTopKOffloaded(model, cache, sequences, requests, topk, options, seed);
  const uint64_t predicted = topk.predicted_steps();
  const uint64_t steps = topk.steps();
  const size_t cache_bytes = topk.cache_device_bytes();
  for (auto& request : requests) (void)residency.Close(*request);
  (void)model.SetResidencyBackend(nullptr);
  RUBATO_RETURN_IF_ERROR(run.status());
  nlohmann::json json = *run;
  json["query_window"] = options.query_window;
  json["steps_ahead"] = predicted;  // every step of the run, warm-up included
  json["steps_run"] = steps;
  json["cache_device_bytes"] = cache_bytes;
  return json;
}

// oracle_topk: local, then offloaded with delta replies, then with full ones (the same sessions
// going on), of one point; with --policy asyncspade then AsyncSpade offloaded; all into `json`.
Status RunTopKPoint(CudaModel& model, PagedKvCache& cache, const Point& point,
                    const Options& options, int cache_device, uint64_t seed, nlohmann::json& json) {
  const ModelConfig& config = model.config();
  json = {{"batch", point.batch},
          {"context", point.context},
          {"policy", options.policy},
          {"top_k", options.topk.top_k},
          {"sink_tokens", options.topk.sink_tokens},
          {"recent_window", options.topk.recent_window}};
  std::vector<KvSequence> sequences(static_cast<size_t>(point.batch));
  std::vector<KvSequence*> pointers;
  for (KvSequence& s : sequences) pointers.push_back(&s);
  RUBATO_RETURN_IF_ERROR(bench::FillRandomKv(model, cache, pointers, point.context, seed));
  OracleTopKPolicy policy(options.topk);
  std::vector<std::unique_ptr<PolicyRequest>> plans;
  for (int i = 0; i < point.batch; ++i) plans.push_back(policy.Admit(KvResidency::kLocal));
  auto release = [&] {
    (void)model.SetAttentionBackend(nullptr);
    (void)model.SetResidencyBackend(nullptr);
    for (KvSequence& s : sequences) (void)cache.Release(s);
  };
  Result<std::unique_ptr<AttentionBackend>> backend = policy.MakeBackend(model, point.batch);
  Status status = backend.status();
  if (status.ok()) status = model.SetAttentionBackend(std::move(backend).value());
  Result<StepTimes> local = status;
  if (status.ok()) {
    local = RunSteps(model, cache, sequences, {}, plans, nullptr, nullptr, options, seed);
  }
  if (status.ok()) status = model.SetAttentionBackend(nullptr);
  if (!local.ok() || !status.ok()) {
    release();
    return !local.ok() ? local.status() : status;
  }
  json["local"] = TimesJson(*local, point.batch);
  // Two offloaded runs follow on the same sequences (AsyncSpade's after them).
  const bool spade = options.policy == "asyncspade";
  const int longest = sequences.front().num_tokens + 2 * (options.warmup + options.steps) + 1;
  auto owned =
      std::make_unique<GpuCacheResidency>(CacheFor(config, cache_device, point.batch, longest),
                                          longest, point.batch, options.common.block_size);
  GpuCacheResidency& residency = *owned;
  status = residency.Attach(model, &policy, point.batch);
  if (!status.ok()) {
    release();
    json["offloaded"] = {{"not_run", status.message()}};
    std::printf("%dx%d: offloaded does not fit: %s\n", point.batch, point.context,
                status.message().c_str());
    return Status::Ok();
  }
  GpuCacheTopK& topk = *residency.topk();
  std::vector<std::unique_ptr<ResidencyRequest>> requests;
  status = topk.FillRandom(seed + 7);
  for (size_t i = 0; i < sequences.size() && status.ok(); ++i) {
    Result<std::unique_ptr<ResidencyRequest>> opened = residency.Open(i, longest - 1);
    status = opened.status();
    if (!opened.ok()) break;
    const int session = static_cast<int>(static_cast<GpuCacheRequest&>(**opened).session());
    status = topk.SetSessionLength(session, sequences[i].num_tokens);
    requests.push_back(std::move(*opened));
  }
  if (status.ok()) status = topk.SetMeasureWaits(true);
  Result<nlohmann::json> deltas = status, full = status;
  if (status.ok()) {
    deltas = RunTopKOffloaded(model, cache, sequences, requests, topk, options, seed + 1);
  }
  if (deltas.ok()) {
    topk.set_delta_replies(false);
    full = RunTopKOffloaded(model, cache, sequences, requests, topk, options, seed + 2);
  }
  const size_t cache_bytes = topk.cache_device_bytes();
  const size_t pool_bytes = topk.model_device_bytes();
  for (auto& request : requests) (void)residency.Close(*request);
  (void)model.SetResidencyBackend(nullptr);
  owned.reset();  // the cache GPU's store, before AsyncSpade's
  Result<nlohmann::json> ahead = nlohmann::json();
  if (spade && deltas.ok() && full.ok()) {
    ahead = RunSpadeOffloaded(model, cache, sequences, point, options, cache_device, seed + 3);
  }
  release();
  RUBATO_RETURN_IF_ERROR(deltas.status());
  RUBATO_RETURN_IF_ERROR(full.status());
  RUBATO_RETURN_IF_ERROR(ahead.status());
  json["offloaded"] = *deltas;
  json["offloaded_full_replies"] = *full;
  json["cache_device_bytes"] = cache_bytes;
  json["compact_pool_bytes"] = pool_bytes;
  const double local_ms = local->median_ms;
  json["tpot_ratio_offloaded_to_local"] = (*deltas)["tpot_ms"].get<double>() / local_ms;
  json["tpot_ratio_full_replies_to_local"] = (*full)["tpot_ms"].get<double>() / local_ms;
  std::printf(
      "%dx%d: local oracle_topk %.3f ms, offloaded %.3f ms (%.3fx; full replies %.3f ms, %.3fx), "
      "exposed wait %.3f ms/step, %.0f KB out / %.0f KB back per step (full replies %.0f KB)\n",
      point.batch, point.context, local_ms, (*deltas)["tpot_ms"].get<double>(),
      json["tpot_ratio_offloaded_to_local"].get<double>(), (*full)["tpot_ms"].get<double>(),
      json["tpot_ratio_full_replies_to_local"].get<double>(),
      (*deltas)["exposed_wait_ms_per_step"].get<double>(),
      (*deltas)["bytes_to_cache_per_step"].get<double>() / 1e3,
      (*deltas)["bytes_from_cache_per_step"].get<double>() / 1e3,
      (*deltas)["full_reply_bytes_per_step"].get<double>() / 1e3);
  if (spade) {
    json["asyncspade"] = *ahead;
    const double ms = (*ahead)["tpot_ms"].get<double>();
    json["tpot_ratio_asyncspade_to_local"] = ms / local_ms;
    json["tpot_ratio_asyncspade_to_offloaded"] = ms / (*deltas)["tpot_ms"].get<double>();
    std::printf(
        "%dx%d: asyncspade %.3f ms (%.3fx local oracle_topk, %.3fx offloaded), exposed wait %.3f "
        "ms/step, %.0f KB back per step (full replies %.0f KB), %llu of %llu steps ahead\n",
        point.batch, point.context, ms, ms / local_ms,
        json["tpot_ratio_asyncspade_to_offloaded"].get<double>(),
        (*ahead)["exposed_wait_ms_per_step"].get<double>(),
        (*ahead)["bytes_from_cache_per_step"].get<double>() / 1e3,
        (*ahead)["full_reply_bytes_per_step"].get<double>() / 1e3,
        static_cast<unsigned long long>((*ahead)["steps_ahead"].get<uint64_t>()),
        static_cast<unsigned long long>((*ahead)["steps_run"].get<uint64_t>()));
  }
  return Status::Ok();
}

Status Run(const Options& options, nlohmann::json& report) {
  RUBATO_ASSIGN_OR_RETURN(const std::vector<Point> points,
                          bench::ParsePoints(options.points, 8, 32768));
  if (options.steps < 1 || options.warmup < 2) {
    return InvalidArgumentError("--steps must be >= 1 and --warmup >= 2 (eager, then capture)");
  }
  int devices = 0;
  RUBATO_CUDA_RETURN_IF_ERROR(cudaGetDeviceCount(&devices), "counting CUDA devices");
  const int cache_device = options.cache_device >= 0 ? options.cache_device
                           : devices > 1             ? (options.common.device == 0 ? 1 : 0)
                                                     : options.common.device;
  RUBATO_ASSIGN_OR_RETURN(bench::BenchModel loaded, bench::LoadBenchModel(options.common));
  CudaModel* model = loaded.model;
  if (options.policy != "dense" && options.policy != "oracle_topk" &&
      options.policy != "asyncspade") {
    return InvalidArgumentError("--policy must be dense, oracle_topk or asyncspade, got '" +
                                options.policy + "'");
  }
  const bool topk = options.policy != "dense";
  // Each point's sequences go through two runs (dense), three (oracle_topk) or four.
  const int runs = options.policy == "asyncspade" ? 4 : topk ? 3 : 2;
  const int num_blocks = bench::BlocksForPoints(points, runs * (options.warmup + options.steps) + 1,
                                                options.common.block_size);
  RUBATO_ASSIGN_OR_RETURN(
      std::unique_ptr<PagedKvCache> cache,
      bench::CreateBenchKvCache(*model, options.common.block_size, num_blocks, 0, ""));
  bench::AddReportHeader(report, options.common, loaded, *cache,
                         "random bf16 in [-1, 1] written directly on both GPUs, no prefill");
  report["cache_device"] = cache_device;
  report["model_device"] = options.common.device;
  report["gpus"] = devices;
  report["same_gpu"] = cache_device == options.common.device;
  report["policy"] = options.policy;
  report["steps"] = options.steps;
  report["warmup"] = options.warmup;
  std::printf("model on GPU %d, cache rank on GPU %d (%d GPUs)%s\n", options.common.device,
              cache_device, devices,
              cache_device == options.common.device
                  ? ": one GPU serves both, so its bandwidth is shared (an overhead check only)"
                  : "");
  for (size_t i = 0; i < points.size(); ++i) {
    nlohmann::json point;
    const uint64_t seed = options.common.seed + 1 + i;
    RUBATO_RETURN_IF_ERROR(
        topk ? RunTopKPoint(*model, *cache, points[i], options, cache_device, seed, point)
             : RunPoint(*model, *cache, points[i], options, cache_device, seed, point));
    report["points"].push_back(point);
  }
  return Status::Ok();
}

}  // namespace
}  // namespace rubato

int main(int argc, char** argv) {
  rubato::Options options;
  CLI::App app{"rubato offloaded decode benchmark (CUDA model, random weights, GPU cache rank)"};
  rubato::bench::AddCommonOptions(app, options.common);
  app.add_option("--points", options.points, "BATCHxCONTEXT list, e.g. 8x32768,16x32768");
  app.add_option("--steps", options.steps, "timed decode steps per point and side");
  app.add_option("--warmup", options.warmup, "untimed steps per point and side (>= 2)");
  app.add_option("--cache-device", options.cache_device,
                 "the cache rank's GPU (default: 1 with two GPUs, else the model's)");
  app.add_option("--policy", options.policy,
                 "dense (attention on the cache GPU), oracle_topk (local against offloaded, "
                 "with and without delta replies) or asyncspade (those, then AsyncSpade "
                 "offloaded)");
  app.add_option("--query-window", options.query_window,
                 "asyncspade: W, the past queries a prediction regresses on (at most 16)");
  app.add_option("--top-k", options.topk.top_k, "oracle_topk: positions per layer and KV head");
  app.add_option("--sink-tokens", options.topk.sink_tokens, "oracle_topk: sink positions");
  app.add_option("--recent-window", options.topk.recent_window, "oracle_topk: recent positions");
  return rubato::bench::BenchMain(
      "rubato_bench_decode_e2e_offload", app, options.common, argc, argv,
      [&](nlohmann::json& report) { return rubato::Run(options, report); });
}
