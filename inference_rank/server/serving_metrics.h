// The request metrics of `rubato serve`, under vLLM's names and buckets (rubato: instead of
// vllm:), every one labelled with model_name: latencies (first token, inter-token, end to end,
// queue, prefill, decode), request lengths, token counters, requests by how they ended, and the
// engine's load gauges. Narrative: docs/engine_and_models.md "Serving metrics".
#pragma once

#include <string>
#include <vector>

#include "common/metrics.h"
#include "common/status.h"

namespace rubato::server {

// How a request that reached the serving engine ended (one counter each).
enum class RequestEnd {
  kSuccess,   // rubato:request_success_total{finished_reason}
  kAborted,   // its client went away
  kTimedOut,  // limits.request_timeout_s
  kFailed,    // the engine, its cache rank or a shutdown ended it
  kRejected,  // the queue was full, or the engine refused it as submitted
};

struct ServingMetrics {
  Histogram* time_to_first_token = nullptr;
  Histogram* inter_token_latency = nullptr;
  Histogram* e2e_request_latency = nullptr;
  Histogram* queue_time = nullptr;    // arrival -> the engine scheduled it
  Histogram* prefill_time = nullptr;  // scheduled -> first token
  Histogram* decode_time = nullptr;   // first token -> last token
  Histogram* prompt_tokens_per_request = nullptr;
  Histogram* generation_tokens_per_request = nullptr;
  Gauge* requests_running = nullptr;
  Gauge* requests_waiting = nullptr;
  Gauge* kv_cache_usage = nullptr;   // share of the KV blocks held by requests, in [0, 1]
  Counter* prompt_tokens = nullptr;  // counted when the engine accepts the request
  Counter* generation_tokens = nullptr;
  Counter* success_stop = nullptr;    // {finished_reason="stop"}
  Counter* success_length = nullptr;  // {finished_reason="length"}
  Counter* aborted = nullptr;
  Counter* timed_out = nullptr;
  Counter* failed = nullptr;
  Counter* rejected = nullptr;

  // Registers every family in `registry` with model_name = `model_name`; the token-count
  // histograms' buckets are 1, 2, 5, 10, 20, 50, ... up to `max_context` (vLLM's).
  static Result<ServingMetrics> Register(MetricsRegistry& registry, const std::string& model_name,
                                         int max_context);
  // Counts one ended request; `finish_reason` ("stop" | "length") for kSuccess.
  void CountEnd(RequestEnd end, const std::string& finish_reason) const;
};

// vLLM's 1-2-5 series up to `max` inclusive: 1, 2, 5, 10, 20, 50, ...
std::vector<double> OneTwoFiveBuckets(int max);

}  // namespace rubato::server
