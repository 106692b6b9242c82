// The request metrics of `rubato serve`, under vLLM's names and buckets with the prefix that
// server.metrics_names picks (rubato:, vllm: or both), every one labelled with model_name:
// latencies (first token, inter-token, per output token, end to end, queue, prefill, decode),
// request and step lengths, token and preemption counters, requests by how they ended, and the
// engine's load gauges and KV pool size. Narrative: docs/engine_and_models.md "Serving metrics".
#pragma once

#include <array>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "common/metrics.h"
#include "common/status.h"

namespace rubato::server {

// How a request that reached the serving engine ended (one counter each).
enum class RequestEnd {
  kSuccess,   // request_success_total{finished_reason="stop"|"length"}
  kAborted,   // its client went away: finished_reason="abort", and requests_aborted_total
  kTimedOut,  // limits.request_timeout_s: finished_reason="abort", and requests_timed_out_total
  kFailed,    // the engine, its cache rank or a shutdown ended it
  kRejected,  // the queue was full, or the engine refused it as submitted
};

// server.metrics_names: the prefix of the series vLLM also has. rubato: `rubato:` (lint-clean
// for promtool); vllm: `vllm:` with vLLM's labels (model_name, engine) and its extra
// compatibility series, so that vLLM's dashboards read rubato; both: each such series twice.
// Series only rubato has (rejected, failed, timed out, ...) keep `rubato:` in every mode.
enum class MetricNames { kRubato, kVllm, kBoth };
inline constexpr std::array<std::pair<std::string_view, MetricNames>, 3> kMetricNames = {{
    {"rubato", MetricNames::kRubato},
    {"vllm", MetricNames::kVllm},
    {"both", MetricNames::kBoth},
}};

// One series written under one or two names (null children are skipped).
struct HistogramSeries {
  std::array<Histogram*, 2> children{};
  void Observe(double value) const;
};
struct CounterSeries {
  std::array<Counter*, 2> children{};
  void Increment(double amount = 1.0) const;
};
struct GaugeSeries {
  std::array<Gauge*, 2> children{};
  void Set(double value) const;
};

struct ServingMetrics {
  HistogramSeries time_to_first_token;
  HistogramSeries inter_token_latency;
  HistogramSeries time_per_output_token;  // the same gaps, on vLLM's TPOT buckets
  HistogramSeries e2e_request_latency;
  HistogramSeries queue_time;    // arrival -> the engine scheduled it
  HistogramSeries prefill_time;  // scheduled -> first token
  HistogramSeries decode_time;   // first token -> last token
  HistogramSeries prompt_tokens_per_request;
  HistogramSeries generation_tokens_per_request;
  HistogramSeries max_tokens_per_request;  // vllm: only (request_max_num_generation_tokens)
  HistogramSeries iteration_tokens;        // prompt + generated tokens of one engine step
  GaugeSeries requests_running;
  GaugeSeries requests_waiting;
  GaugeSeries requests_swapped;  // vllm: only; rubato never swaps a request out: always 0
  GaugeSeries kv_cache_usage;    // share of the KV pool's blocks held by requests, in [0, 1]
  GaugeSeries kv_pool_tokens;    // rubato: only; tokens the KV pool holds (blocks x block size)
  GaugeSeries gpu_cache_usage;   // vllm: only; vLLM's older name of kv_cache_usage_perc
  GaugeSeries cpu_cache_usage;   // vllm: only; no CPU block pool: always 0
  CounterSeries prompt_tokens;   // counted when the engine accepts the request
  CounterSeries generation_tokens;
  CounterSeries preemptions;     // running requests whose KV was freed for lack of blocks
  CounterSeries success_stop;    // request_success_total{finished_reason="stop"}
  CounterSeries success_length;  // {finished_reason="length"}
  CounterSeries success_abort;   // {finished_reason="abort"}: aborted or timed out
  CounterSeries aborted;         // rubato: only, as the four below
  CounterSeries timed_out;
  CounterSeries failed;
  CounterSeries rejected;

  // Registers every family in `registry` with model_name = `model_name` under `names`; the
  // token-count histograms' buckets are 1, 2, 5, 10, 20, 50, ... up to `max_context` (vLLM's).
  static Result<ServingMetrics> Register(MetricsRegistry& registry, const std::string& model_name,
                                         int max_context, MetricNames names = MetricNames::kRubato);
  // Counts one ended request; `finish_reason` ("stop" | "length") for kSuccess.
  void CountEnd(RequestEnd end, const std::string& finish_reason) const;
};

// vLLM's 1-2-5 series up to `max` inclusive: 1, 2, 5, 10, 20, 50, ...
std::vector<double> OneTwoFiveBuckets(int max);

}  // namespace rubato::server
