// rubato_bench_decode_e2e_longflow: throughput at the largest batch memory allows, LongFlow
// (evicting KV, B slots per request) against dense decode (paged KV of the whole context), on
// the CUDA model with random weights (Qwen3-8B shapes by default): prompt P, output N tokens.
// Each side's batch is the largest its KV fits in the free memory (after the weights and
// headroom); its step time is measured at context lengths every --every tokens from P to P + N
// and tokens/s over the whole generation integrates the step time over the N steps (linear in
// between the measured contexts; prefill excluded). No prefill is run: KV and slots are random
// bf16, every slot valid once the context reaches B. A benchmark, not a test. bench/README.md.
#include <cuda_runtime_api.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "bench/decode_bench_common.h"
#include "common/status.h"
#include "inference_rank/model/cuda_model.h"
#include "inference_rank/model/cuda_slot_kv_storage.h"
#include "inference_rank/policies/longflow/longflow_policy.h"
#include "kernels/cuda/cuda_status.h"
#include "kernels/cuda/longflow_attention.cuh"
#include "kernels/cuda/random_fill.cuh"

namespace rubato {
namespace {

using bench::Percentile;

struct Options {
  bench::CommonOptions common;  // --config, --block-size, --seed, --device, --commit, --out
  int prompt = 512;
  int output = 16000;
  int budget = 3200;
  int every = 1000;  // context step between measured points
  int steps = 5;
  int warmup = 3;
  int dense_batch = 0;     // 0: the largest that fits
  int longflow_batch = 0;  // 0: the largest that fits
  int max_batch = 512;
  int prefill_prompts = 8;  // prompts whose paged KV LongFlow keeps room for (prefill)
};

struct Curve {
  std::vector<int> contexts;
  std::vector<double> step_ms;  // median device time of a step at each context
};

// The contexts measured: P, P + every, ..., and P + N - 1 (the last step's).
std::vector<int> Contexts(const Options& o) {
  std::vector<int> contexts;
  for (int c = o.prompt; c < o.prompt + o.output - 1; c += o.every) contexts.push_back(c);
  contexts.push_back(o.prompt + o.output - 1);
  return contexts;
}

// Seconds of the N decode steps (step t at context P + t), the step time linear between points.
double IntegrateSeconds(const Curve& curve, const Options& o) {
  double ms = 0;
  size_t k = 0;
  for (int t = 0; t < o.output; ++t) {
    const int context = o.prompt + t;
    while (k + 2 < curve.contexts.size() && curve.contexts[k + 1] <= context) ++k;
    const double c0 = curve.contexts[k],
                 c1 = curve.contexts[std::min(k + 1, curve.contexts.size() - 1)];
    const double w = c1 > c0 ? std::clamp((context - c0) / (c1 - c0), 0.0, 1.0) : 0.0;
    ms += curve.step_ms[k] * (1 - w) + curve.step_ms[std::min(k + 1, curve.step_ms.size() - 1)] * w;
  }
  return ms / 1e3;
}

// Median device time of `steps` greedy decode steps of `batch` (after `warmup` untimed ones: the
// first runs eagerly, the second captures the graph); `plan` sets each entry's attention.
template <typename Plan>
Result<double> TimeSteps(CudaModel& model, PagedKvCache& cache, std::vector<ForwardEntry>& batch,
                         std::vector<KvSequence>& sequences, const Options& o, Plan plan) {
  const TokenSampling greedy;
  std::vector<int> next(batch.size(), 7);
  ForwardResult result;
  cudaEvent_t start, stop;
  RUBATO_CUDA_RETURN_IF_ERROR(cudaEventCreate(&start), "creating an event");
  RUBATO_CUDA_RETURN_IF_ERROR(cudaEventCreate(&stop), "creating an event");
  std::vector<double> device_ms;
  Status status;
  for (int step = 0; step < o.warmup + o.steps && status.ok(); ++step) {
    for (size_t i = 0; i < batch.size(); ++i) {
      batch[i].sequence = &sequences[i];
      batch[i].tokens = {&next[i], 1};
      batch[i].start_position = sequences[i].num_tokens;
      batch[i].logits = LogitsWanted::kLast;
      batch[i].sampling = &greedy;
      plan(i, batch[i]);
    }
    cudaEventRecord(start, model.stream());
    status = model.Forward(batch, cache, result);
    cudaEventRecord(stop, model.stream());
    if (status.ok()) status = cuda::CudaStatus(cudaEventSynchronize(stop), "timing a step");
    float ms = 0;
    cudaEventElapsedTime(&ms, start, stop);
    if (step >= o.warmup) device_ms.push_back(ms);
    for (size_t i = 0; i < batch.size() && status.ok(); ++i) next[i] = result.sampled_tokens[i];
  }
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  RUBATO_RETURN_IF_ERROR(status);
  return Percentile(device_ms, 0.5);
}

size_t FreeBytes() {
  size_t free_bytes = 0, total = 0;
  cudaMemGetInfo(&free_bytes, &total);
  return free_bytes;
}

size_t UsedBytes() {
  size_t free_bytes = 0, total = 0;
  cudaMemGetInfo(&free_bytes, &total);
  return total - free_bytes;
}

// Dense: paged KV for the whole generation of every sequence.
Result<nlohmann::json> RunDense(CudaModel& model, const Options& o) {
  const ModelConfig& config = model.config();
  const int grown = o.warmup + o.steps;
  const int tokens = o.prompt + o.output + grown;
  const KvCacheShape one{config.num_layers, config.num_kv_heads, config.head_dim,
                         o.common.block_size,
                         (tokens + o.common.block_size - 1) / o.common.block_size};
  const size_t per_sequence = DeviceKvStorage::PoolBytes(one);
  const size_t free_bytes = FreeBytes();
  const size_t room = free_bytes > bench::kHeadroomBytes ? free_bytes - bench::kHeadroomBytes : 0;
  const int batch = o.dense_batch > 0
                        ? o.dense_batch
                        : std::min<int>(o.max_batch, static_cast<int>(room / per_sequence));
  if (batch < 1)
    return ResourceExhaustedError("dense: not one sequence of " + std::to_string(tokens) +
                                  " tokens fits");
  RUBATO_ASSIGN_OR_RETURN(
      std::unique_ptr<PagedKvCache> cache,
      bench::CreateBenchKvCache(model, o.common.block_size, batch * one.num_blocks, 0, ""));
  Curve curve;
  size_t peak = 0;
  for (int context : Contexts(o)) {
    std::vector<KvSequence> sequences(static_cast<size_t>(batch));
    std::vector<KvSequence*> pointers;
    for (KvSequence& s : sequences) pointers.push_back(&s);
    RUBATO_RETURN_IF_ERROR(bench::FillRandomKv(model, *cache, pointers, context, o.common.seed));
    std::vector<ForwardEntry> entries(sequences.size());
    Result<double> ms =
        TimeSteps(model, *cache, entries, sequences, o, [](size_t, ForwardEntry&) {});
    peak = std::max(peak, UsedBytes());
    for (KvSequence& s : sequences) RUBATO_RETURN_IF_ERROR(cache->Release(s));
    RUBATO_RETURN_IF_ERROR(ms.status());
    curve.contexts.push_back(context);
    curve.step_ms.push_back(*ms);
    std::printf("dense    batch %4d context %6d: step %.3f ms\n", batch, context, *ms);
  }
  const double seconds = IntegrateSeconds(curve, o);
  nlohmann::json j = {{"batch", batch},
                      {"max_batch_by_memory", static_cast<int64_t>(room / per_sequence)},
                      {"kv_bytes", cache->pool_bytes()},
                      {"kv_bytes_per_sequence", per_sequence},
                      {"peak_device_bytes", peak},
                      {"contexts", curve.contexts},
                      {"step_ms", curve.step_ms},
                      {"generation_seconds", seconds},
                      {"tokens_per_s", batch * static_cast<double>(o.output) / seconds}};
  return j;
}

// LongFlow: B slots per request (every slot valid from context B on), the paged cache only for
// prompts being prefilled.
Result<nlohmann::json> RunLongFlow(CudaModel& model, const Options& o) {
  const ModelConfig& config = model.config();
  LongFlowConfig lf;
  lf.budget = o.budget;
  LongFlowPolicy policy(lf);
  const SlotKvShape one{config.num_layers, config.num_kv_heads, config.head_dim, o.budget, 1};
  // Per request: its slot arrays and its row of the fused op's workspace (scores and norms).
  const size_t per_request =
      DeviceSlotKvStorage::PoolBytes(one) +
      cuda::LongFlowAttentionWorkspaceBytes(1, config.num_heads, config.head_dim, o.budget);
  const int prompt_blocks = (o.prompt + o.common.block_size - 1) / o.common.block_size;
  const KvCacheShape paged{config.num_layers, config.num_kv_heads, config.head_dim,
                           o.common.block_size, o.prefill_prompts * prompt_blocks};
  const size_t free_bytes = FreeBytes();
  const size_t reserved = bench::kHeadroomBytes + DeviceKvStorage::PoolBytes(paged);
  const size_t room = free_bytes > reserved ? free_bytes - reserved : 0;
  const int batch = o.longflow_batch > 0
                        ? o.longflow_batch
                        : std::min<int>(o.max_batch, static_cast<int>(room / per_request));
  if (batch < 1) return ResourceExhaustedError("longflow: not one request of B slots fits");
  RUBATO_ASSIGN_OR_RETURN(std::unique_ptr<PagedKvCache> cache,
                          model.CreateKvCache(o.common.block_size, paged.num_blocks));
  RUBATO_ASSIGN_OR_RETURN(std::unique_ptr<AttentionBackend> backend,
                          policy.MakeBackend(model, batch));
  RUBATO_RETURN_IF_ERROR(model.SetAttentionBackend(std::move(backend)));
  RUBATO_ASSIGN_OR_RETURN(std::unique_ptr<SlotKvPool> pool,
                          model.CreateSlotKvPool(o.budget, batch));
  auto* slots = static_cast<DeviceSlotKvStorage*>(pool->storage());
  std::vector<SlotKvForward> forwards(static_cast<size_t>(batch));
  std::vector<std::unique_ptr<PolicyRequest>> requests;
  for (SlotKvForward& f : forwards) {
    f.pool = pool.get();
    RUBATO_RETURN_IF_ERROR(pool->Reserve(f.arrays));
    requests.push_back(policy.Admit(KvResidency::kEvicting));
  }
  // Random K and V in every slot of every layer, once.
  const int64_t elements = static_cast<int64_t>(config.num_layers) * batch * config.num_kv_heads *
                           o.budget * config.head_dim;
  int fill_stream = 0;
  for (__nv_bfloat16* base : {slots->layer_keys(0), slots->layer_values(0)}) {
    cuda::RandomFillParams fill;
    fill.out = base;
    fill.count = elements;
    fill.seed = o.common.seed;
    fill.stream = static_cast<uint64_t>(fill_stream++);
    fill.bound = 1.f;
    RUBATO_RETURN_IF_ERROR(cuda::RandomFill(fill, model.stream()));
  }
  Curve curve;
  size_t peak = 0;
  const size_t masks = static_cast<size_t>(config.num_layers) * batch;
  for (int context : Contexts(o)) {
    // Slots [0, min(context, B)) valid; the next slot the lowest free one, else one past the
    // sinks (the fused op chooses from there on).
    const int valid = std::min(context, o.budget);
    RUBATO_CUDA_RETURN_IF_ERROR(
        cudaMemsetAsync(slots->layer_valid(0), 0, masks * o.budget, model.stream()), "masks");
    RUBATO_CUDA_RETURN_IF_ERROR(
        cudaMemset2DAsync(slots->layer_valid(0), o.budget, 1, valid, masks, model.stream()),
        "masks");
    const std::vector<int32_t> next(masks * config.num_kv_heads,
                                    context < o.budget ? context : lf.sink_tokens);
    RUBATO_CUDA_RETURN_IF_ERROR(cudaMemcpy(slots->layer_next_slot(0), next.data(),
                                           next.size() * sizeof(int32_t), cudaMemcpyHostToDevice),
                                "next slots");
    RUBATO_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(model.stream()), "setting the slots");
    std::vector<KvSequence> sequences(static_cast<size_t>(batch));
    for (KvSequence& s : sequences) s.num_tokens = context;  // no blocks: the slots hold it
    std::vector<ForwardEntry> entries(sequences.size());
    RUBATO_ASSIGN_OR_RETURN(
        const double ms,
        TimeSteps(model, *cache, entries, sequences, o, [&](size_t i, ForwardEntry& entry) {
          entry.attention = requests[i]->PlanDecode(entry.start_position);
          entry.slots = &forwards[i];
        }));
    peak = std::max(peak, UsedBytes());
    curve.contexts.push_back(context);
    curve.step_ms.push_back(ms);
    std::printf("longflow batch %4d context %6d: step %.3f ms\n", batch, context, ms);
  }
  const double seconds = IntegrateSeconds(curve, o);
  nlohmann::json j = {{"batch", batch},
                      {"max_batch_by_memory", static_cast<int64_t>(room / per_request)},
                      {"budget", o.budget},
                      {"slot_bytes", pool->pool_bytes()},
                      {"slot_bytes_per_request", DeviceSlotKvStorage::PoolBytes(one)},
                      {"prefill_kv_bytes", cache->pool_bytes()},
                      {"peak_device_bytes", peak},
                      {"contexts", curve.contexts},
                      {"step_ms", curve.step_ms},
                      {"generation_seconds", seconds},
                      {"tokens_per_s", batch * static_cast<double>(o.output) / seconds}};
  requests.clear();
  for (SlotKvForward& f : forwards) RUBATO_RETURN_IF_ERROR(pool->Release(f.arrays));
  RUBATO_RETURN_IF_ERROR(model.SetAttentionBackend(nullptr));
  return j;
}

Status Run(const Options& o, nlohmann::json& report) {
  if (o.prompt < 1 || o.output < 2 || o.every < 1 || o.budget < 64 || o.steps < 1 || o.warmup < 2 ||
      o.max_batch < 1) {
    return InvalidArgumentError(
        "--prompt >= 1, --output >= 2, --every >= 1, --budget >= 64, --steps >= 1, --warmup >= 2 "
        "(eager, capture) and --max-batch >= 1 are required");
  }
  RUBATO_ASSIGN_OR_RETURN(bench::BenchModel loaded, bench::LoadBenchModel(o.common));
  CudaModel& model = *loaded.model;
  std::printf("device %s, %s: %.2f GB of bf16 weights, prompt %d, output %d, B = %d\n",
              loaded.device_name.c_str(), o.common.config.c_str(), model.weight_bytes() / 1e9,
              o.prompt, o.output, o.budget);
  report["device"] = loaded.device_name;
  report["commit"] = o.common.commit.empty() ? std::string(RUBATO_GIT_COMMIT) : o.common.commit;
  report["command"] = o.common.command_line;
  report["model"] = {{"config", o.common.config},
                     {"architecture", model.config().architecture},
                     {"weights", "random, generated on the device, bf16"},
                     {"weight_bytes", model.weight_bytes()}};
  report["prompt"] = o.prompt;
  report["output"] = o.output;
  report["method"] =
      "step time (median of --steps graph-replayed greedy steps) measured every --every context "
      "tokens; tokens/s = batch x output / the sum of the output's step times, linear in between "
      "the measured contexts; prefill excluded; KV and slots random bf16; batch: the largest "
      "whose KV fits the free memory after the weights and 2 GiB of headroom";
  RUBATO_ASSIGN_OR_RETURN(report["dense"], RunDense(model, o));
  RUBATO_ASSIGN_OR_RETURN(report["longflow"], RunLongFlow(model, o));
  const double dense = report["dense"]["tokens_per_s"].get<double>();
  const double longflow = report["longflow"]["tokens_per_s"].get<double>();
  report["longflow_over_dense_tokens_per_s"] = longflow / dense;
  std::printf("\n%-9s %6s %12s %14s %12s\n", "", "batch", "tok/s", "peak GB", "KV GB");
  for (const char* side : {"dense", "longflow"}) {
    const nlohmann::json& r = report[side];
    const double kv =
        r.contains("kv_bytes") ? r["kv_bytes"].get<double>() : r["slot_bytes"].get<double>();
    std::printf("%-9s %6d %12.1f %14.2f %12.2f\n", side, r["batch"].get<int>(),
                r["tokens_per_s"].get<double>(), r["peak_device_bytes"].get<double>() / 1e9,
                kv / 1e9);
  }
  std::printf("longflow / dense tokens/s: %.2fx\n", longflow / dense);
  return Status::Ok();
}

}  // namespace
}  // namespace rubato

int main(int argc, char** argv) {
  rubato::Options options;
  CLI::App app{"rubato LongFlow against dense decode at maximum batch (CUDA, random weights)"};
  rubato::bench::AddCommonOptions(app, options.common);
  app.add_option("--prompt", options.prompt, "prompt tokens per request");
  app.add_option("--output", options.output, "generated tokens per request");
  app.add_option("--budget", options.budget, "LongFlow's B: slots per (layer, KV head)");
  app.add_option("--every", options.every, "context tokens between measured points");
  app.add_option("--steps", options.steps, "timed decode steps per point");
  app.add_option("--warmup", options.warmup, "untimed steps per point (>= 2: eager, capture)");
  app.add_option("--dense-batch", options.dense_batch, "dense batch (default: the largest fit)");
  app.add_option("--longflow-batch", options.longflow_batch,
                 "LongFlow batch (default: the largest fit)");
  app.add_option("--max-batch", options.max_batch, "cap of either batch");
  app.add_option("--prefill-prompts", options.prefill_prompts,
                 "prompts whose paged KV LongFlow keeps room for");
  return rubato::bench::BenchMain(
      "rubato_bench_decode_e2e_longflow", app, options.common, argc, argv,
      [&](nlohmann::json& report) { return rubato::Run(options, report); });
}
