// Registration of the serving metrics (see serving_metrics.h).
#include "inference_rank/server/serving_metrics.h"

namespace rubato::server {
namespace {

// vLLM's buckets (vllm/v1/metrics/loggers.py), with a few finer bounds below theirs where a
// CPU test model answers in milliseconds.
const std::vector<double> kTimeToFirstTokenBuckets = {
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1,  0.25,  0.5,   0.75,
    1.0,   2.5,   5.0,  7.5,  10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0};
const std::vector<double> kInterTokenBuckets = {0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1,
                                                0.15,  0.2,   0.3,  0.4,   0.5,  0.75,  1.0,
                                                2.5,   5.0,   7.5,  10.0,  20.0, 40.0,  80.0};
const std::vector<double> kRequestLatencyBuckets = {
    0.01, 0.025, 0.05, 0.1,  0.3,  0.5,  0.8,  1.0,   1.5,   2.0,   2.5,    5.0,   10.0,
    15.0, 20.0,  30.0, 40.0, 50.0, 60.0, 120., 240.0, 480.0, 960.0, 1920.0, 7680.0};

}  // namespace

std::vector<double> OneTwoFiveBuckets(int max) {
  std::vector<double> buckets;
  for (double scale = 1; buckets.empty() || buckets.back() < max; scale *= 10) {
    for (const double mantissa : {1.0, 2.0, 5.0}) {
      if (mantissa * scale > max) return buckets.empty() ? std::vector<double>{1.0} : buckets;
      buckets.push_back(mantissa * scale);
    }
  }
  return buckets;
}

Result<ServingMetrics> ServingMetrics::Register(MetricsRegistry& registry,
                                                const std::string& model_name, int max_context) {
  ServingMetrics m;
  const std::vector<std::string> model_label = {"model_name"};
  const std::vector<std::string> model_value = {model_name};
  const auto histogram = [&](Histogram*& out, const char* name, const char* help,
                             const std::vector<double>& buckets) -> Status {
    RUBATO_ASSIGN_OR_RETURN(HistogramFamily * family,
                            registry.AddHistogramFamily(name, help, buckets, model_label));
    RUBATO_ASSIGN_OR_RETURN(out, family->WithLabels(model_value));
    return Status::Ok();
  };
  const auto counter = [&](Counter*& out, const char* name, const char* help) -> Status {
    RUBATO_ASSIGN_OR_RETURN(CounterFamily * family,
                            registry.AddCounterFamily(name, help, model_label));
    RUBATO_ASSIGN_OR_RETURN(out, family->WithLabels(model_value));
    return Status::Ok();
  };
  const auto gauge = [&](Gauge*& out, const char* name, const char* help) -> Status {
    RUBATO_ASSIGN_OR_RETURN(GaugeFamily * family, registry.AddGaugeFamily(name, help, model_label));
    RUBATO_ASSIGN_OR_RETURN(out, family->WithLabels(model_value));
    return Status::Ok();
  };
  RUBATO_RETURN_IF_ERROR(histogram(m.time_to_first_token, "rubato:time_to_first_token_seconds",
                                   "Time from a request's arrival to its first generated token.",
                                   kTimeToFirstTokenBuckets));
  RUBATO_RETURN_IF_ERROR(histogram(m.inter_token_latency, "rubato:inter_token_latency_seconds",
                                   "Time between two consecutive tokens of a request.",
                                   kInterTokenBuckets));
  RUBATO_RETURN_IF_ERROR(histogram(m.e2e_request_latency, "rubato:e2e_request_latency_seconds",
                                   "Time from a request's arrival to its last token.",
                                   kRequestLatencyBuckets));
  RUBATO_RETURN_IF_ERROR(histogram(m.queue_time, "rubato:request_queue_time_seconds",
                                   "Time a request waited before the engine scheduled it.",
                                   kRequestLatencyBuckets));
  RUBATO_RETURN_IF_ERROR(histogram(m.prefill_time, "rubato:request_prefill_time_seconds",
                                   "Time from a request's scheduling to its first token.",
                                   kRequestLatencyBuckets));
  RUBATO_RETURN_IF_ERROR(histogram(m.decode_time, "rubato:request_decode_time_seconds",
                                   "Time from a request's first token to its last.",
                                   kRequestLatencyBuckets));
  const std::vector<double> token_buckets = OneTwoFiveBuckets(max_context);
  RUBATO_RETURN_IF_ERROR(histogram(m.prompt_tokens_per_request, "rubato:request_prompt_tokens",
                                   "Prompt tokens of each finished request.", token_buckets));
  RUBATO_RETURN_IF_ERROR(histogram(m.generation_tokens_per_request,
                                   "rubato:request_generation_tokens",
                                   "Generated tokens of each finished request.", token_buckets));
  RUBATO_RETURN_IF_ERROR(gauge(m.requests_running, "rubato:num_requests_running",
                               "Requests in the engine's running batch."));
  RUBATO_RETURN_IF_ERROR(gauge(m.requests_waiting, "rubato:num_requests_waiting",
                               "Requests queued and not yet running."));
  RUBATO_RETURN_IF_ERROR(gauge(m.kv_cache_usage, "rubato:kv_cache_usage_perc",
                               "Share of the KV cache blocks in use (1 = full)."));
  RUBATO_RETURN_IF_ERROR(counter(m.prompt_tokens, "rubato:prompt_tokens_total",
                                 "Prompt tokens of the requests the engine accepted."));
  RUBATO_RETURN_IF_ERROR(
      counter(m.generation_tokens, "rubato:generation_tokens_total", "Tokens generated."));
  RUBATO_RETURN_IF_ERROR(counter(m.aborted, "rubato:requests_aborted_total",
                                 "Requests whose client went away before they finished."));
  RUBATO_RETURN_IF_ERROR(counter(m.timed_out, "rubato:requests_timed_out_total",
                                 "Requests ended by limits.request_timeout_s."));
  RUBATO_RETURN_IF_ERROR(counter(m.failed, "rubato:requests_failed_total",
                                 "Requests ended by an error of the engine, its cache rank or "
                                 "a shutdown."));
  RUBATO_RETURN_IF_ERROR(counter(m.rejected, "rubato:requests_rejected_total",
                                 "Requests refused by a full queue (429) or by the engine as "
                                 "submitted."));
  RUBATO_ASSIGN_OR_RETURN(
      CounterFamily * success,
      registry.AddCounterFamily("rubato:request_success_total",
                                "Requests finished without error, by finish reason.",
                                {"model_name", "finished_reason"}));
  RUBATO_ASSIGN_OR_RETURN(m.success_stop, success->WithLabels({model_name, "stop"}));
  RUBATO_ASSIGN_OR_RETURN(m.success_length, success->WithLabels({model_name, "length"}));
  return m;
}

void ServingMetrics::CountEnd(RequestEnd end, const std::string& finish_reason) const {
  switch (end) {
    case RequestEnd::kSuccess:
      (finish_reason == "stop" ? success_stop : success_length)->Increment();
      return;
    case RequestEnd::kAborted:
      aborted->Increment();
      return;
    case RequestEnd::kTimedOut:
      timed_out->Increment();
      return;
    case RequestEnd::kFailed:
      failed->Increment();
      return;
    case RequestEnd::kRejected:
      rejected->Increment();
      return;
  }
}

}  // namespace rubato::server
