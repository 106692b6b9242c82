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
const std::vector<double> kTimePerOutputTokenBuckets = {
    0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1,  0.15, 0.2,  0.3, 0.4,
    0.5,   0.75,  1.0,  2.5,   5.0,  7.5,   10.0, 20.0, 40.0, 80.0};
const std::vector<double> kIterationTokenBuckets = {1,   8,    16,   32,   64,   128,  256,
                                                    512, 1024, 2048, 4096, 8192, 16384};

// Registers each series under the names `names` asks for, labelled with the model (and, under
// vllm:, engine="0" as vLLM's single engine core is).
class SeriesRegistrar {
 public:
  SeriesRegistrar(MetricsRegistry& registry, const std::string& model_name, MetricNames names)
      : registry_(registry),
        model_name_(model_name),
        rubato_(names != MetricNames::kVllm),
        vllm_(names != MetricNames::kRubato) {}

  // `name` is "rubato:..." (kShared, kRubatoOnly; its vllm: name swaps the prefix) or "vllm:..."
  // (kVllmOnly), spelled out so that the sources show every name; `where` says which it gets.
  enum class Where { kShared, kRubatoOnly, kVllmOnly };

  Status Histogram(HistogramSeries& out, const char* name, const char* help,
                   const std::vector<double>& buckets, Where where = Where::kShared) {
    return Add(out, name, where, {}, [&](const std::string& full, std::vector<std::string> labels) {
      return registry_.AddHistogramFamily(full, help, buckets, std::move(labels));
    });
  }
  Status Counter(CounterSeries& out, const char* name, const char* help,
                 Where where = Where::kShared, const std::string& reason = "") {
    return Add(out, name, where, reason, [&](const std::string& full, std::vector<std::string> l) {
      if (!reason.empty()) l.push_back("finished_reason");
      return registry_.AddCounterFamily(full, help, std::move(l));
    });
  }
  Status Gauge(GaugeSeries& out, const char* name, const char* help, Where where = Where::kShared) {
    return Add(out, name, where, {}, [&](const std::string& full, std::vector<std::string> l) {
      return registry_.AddGaugeFamily(full, help, std::move(l));
    });
  }

 private:
  template <typename Series, typename AddFamily>
  Status Add(Series& out, const char* name, Where where, const std::string& reason,
             const AddFamily& add_family) {
    size_t next = 0;
    const bool want_rubato = where == Where::kRubatoOnly || (where == Where::kShared && rubato_);
    const bool want_vllm = where != Where::kRubatoOnly && vllm_;
    for (const bool vllm : {false, true}) {
      if (!(vllm ? want_vllm : want_rubato)) continue;
      std::vector<std::string> label_names = {"model_name"};
      std::vector<std::string> label_values = {model_name_};
      if (vllm) {
        label_names.push_back("engine");
        label_values.push_back("0");
      }
      if (!reason.empty()) label_values.push_back(reason);
      const size_t colon = std::string_view(name).find(':');
      if (colon == std::string_view::npos) {
        return InternalError(std::string("serving metric '") + name + "' has no prefix");
      }
      const std::string_view base = std::string_view(name).substr(colon);  // ":..."
      RUBATO_ASSIGN_OR_RETURN(
          auto* family,
          add_family((vllm ? "vllm" : "rubato") + std::string(base), std::move(label_names)));
      RUBATO_ASSIGN_OR_RETURN(out.children[next++], family->WithLabels(label_values));
    }
    return Status::Ok();
  }

  MetricsRegistry& registry_;
  const std::string& model_name_;
  const bool rubato_;  // the shared series get rubato: names
  const bool vllm_;    // the shared series get vllm: names, and the vllm-only ones exist
};

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
                                                const std::string& model_name, int max_context,
                                                MetricNames names) {
  ServingMetrics m;
  SeriesRegistrar r(registry, model_name, names);
  using Where = SeriesRegistrar::Where;
  RUBATO_RETURN_IF_ERROR(r.Histogram(m.time_to_first_token, "rubato:time_to_first_token_seconds",
                                     "Time from a request's arrival to its first generated token.",
                                     kTimeToFirstTokenBuckets));
  RUBATO_RETURN_IF_ERROR(r.Histogram(m.inter_token_latency, "rubato:inter_token_latency_seconds",
                                     "Time between two consecutive tokens of a request.",
                                     kInterTokenBuckets));
  RUBATO_RETURN_IF_ERROR(r.Histogram(m.time_per_output_token,
                                     "rubato:time_per_output_token_seconds",
                                     "Time between two consecutive tokens of a request, on "
                                     "vLLM's time-per-output-token buckets.",
                                     kTimePerOutputTokenBuckets));
  RUBATO_RETURN_IF_ERROR(r.Histogram(m.e2e_request_latency, "rubato:e2e_request_latency_seconds",
                                     "Time from a request's arrival to its last token.",
                                     kRequestLatencyBuckets));
  RUBATO_RETURN_IF_ERROR(r.Histogram(m.queue_time, "rubato:request_queue_time_seconds",
                                     "Time a request waited before the engine scheduled it.",
                                     kRequestLatencyBuckets));
  RUBATO_RETURN_IF_ERROR(r.Histogram(m.prefill_time, "rubato:request_prefill_time_seconds",
                                     "Time from a request's scheduling to its first token.",
                                     kRequestLatencyBuckets));
  RUBATO_RETURN_IF_ERROR(r.Histogram(m.decode_time, "rubato:request_decode_time_seconds",
                                     "Time from a request's first token to its last.",
                                     kRequestLatencyBuckets));
  const std::vector<double> token_buckets = OneTwoFiveBuckets(max_context);
  RUBATO_RETURN_IF_ERROR(r.Histogram(m.prompt_tokens_per_request, "rubato:request_prompt_tokens",
                                     "Prompt tokens of each finished request.", token_buckets));
  RUBATO_RETURN_IF_ERROR(r.Histogram(m.generation_tokens_per_request,
                                     "rubato:request_generation_tokens",
                                     "Generated tokens of each finished request.", token_buckets));
  RUBATO_RETURN_IF_ERROR(
      r.Histogram(m.max_tokens_per_request, "vllm:request_max_num_generation_tokens",
                  "The max_tokens of each finished request.", token_buckets, Where::kVllmOnly));
  // vLLM's name ends in _total although it is a histogram, which promtool's lint flags: under
  // rubato: the name drops the suffix.
  if (names != MetricNames::kVllm) {
    HistogramSeries rubato_steps;
    RUBATO_RETURN_IF_ERROR(r.Histogram(rubato_steps, "rubato:iteration_tokens",
                                       "Prompt and generated tokens of each engine step.",
                                       kIterationTokenBuckets, Where::kRubatoOnly));
    m.iteration_tokens.children[0] = rubato_steps.children[0];
  }
  if (names != MetricNames::kRubato) {
    HistogramSeries vllm_steps;
    RUBATO_RETURN_IF_ERROR(r.Histogram(vllm_steps, "vllm:iteration_tokens_total",
                                       "Prompt and generated tokens of each engine step.",
                                       kIterationTokenBuckets, Where::kVllmOnly));
    m.iteration_tokens.children[1] = vllm_steps.children[0];
  }
  RUBATO_RETURN_IF_ERROR(r.Gauge(m.requests_running, "rubato:num_requests_running",
                                 "Requests in the engine's running batch."));
  RUBATO_RETURN_IF_ERROR(r.Gauge(m.requests_waiting, "rubato:num_requests_waiting",
                                 "Requests queued and not yet running."));
  RUBATO_RETURN_IF_ERROR(r.Gauge(m.requests_swapped, "vllm:num_requests_swapped",
                                 "Requests swapped out of the KV cache (rubato never swaps: 0).",
                                 Where::kVllmOnly));
  RUBATO_RETURN_IF_ERROR(r.Gauge(m.kv_cache_usage, "rubato:kv_cache_usage_perc",
                                 "Share of the KV cache blocks in use (1 = full)."));
  RUBATO_RETURN_IF_ERROR(r.Gauge(m.kv_pool_tokens, "rubato:kv_cache_pool_tokens",
                                 "Tokens the KV pool holds (its blocks x block size), sized at "
                                 "start from engine.gpu_memory_utilization or kv_pool_tokens.",
                                 Where::kRubatoOnly));
  RUBATO_RETURN_IF_ERROR(r.Gauge(m.gpu_cache_usage, "vllm:gpu_cache_usage_perc",
                                 "Share of the KV cache blocks in use (1 = full); vLLM's older "
                                 "name of kv_cache_usage_perc.",
                                 Where::kVllmOnly));
  RUBATO_RETURN_IF_ERROR(r.Gauge(m.cpu_cache_usage, "vllm:cpu_cache_usage_perc",
                                 "Share of a CPU swap space in use (rubato has none: 0).",
                                 Where::kVllmOnly));
  RUBATO_RETURN_IF_ERROR(r.Counter(m.prompt_tokens, "rubato:prompt_tokens_total",
                                   "Prompt tokens of the requests the engine accepted."));
  RUBATO_RETURN_IF_ERROR(
      r.Counter(m.generation_tokens, "rubato:generation_tokens_total", "Tokens generated."));
  RUBATO_RETURN_IF_ERROR(r.Counter(m.preemptions, "rubato:num_preemptions_total",
                                   "Running requests preempted when the KV pool ran out of "
                                   "blocks (their KV freed and recomputed later)."));
  RUBATO_RETURN_IF_ERROR(r.Counter(m.aborted, "rubato:requests_aborted_total",
                                   "Requests whose client went away before they finished.",
                                   Where::kRubatoOnly));
  RUBATO_RETURN_IF_ERROR(r.Counter(m.timed_out, "rubato:requests_timed_out_total",
                                   "Requests ended by limits.request_timeout_s.",
                                   Where::kRubatoOnly));
  RUBATO_RETURN_IF_ERROR(r.Counter(m.failed, "rubato:requests_failed_total",
                                   "Requests ended by an error of the engine, its cache rank or "
                                   "a shutdown.",
                                   Where::kRubatoOnly));
  RUBATO_RETURN_IF_ERROR(r.Counter(m.rejected, "rubato:requests_rejected_total",
                                   "Requests refused by a full queue (429) or by the engine as "
                                   "submitted.",
                                   Where::kRubatoOnly));
  const char* success_help =
      "Requests that ended, by finish reason (abort: the client went "
      "away or the request timed out).";
  RUBATO_RETURN_IF_ERROR(r.Counter(m.success_stop, "rubato:request_success_total", success_help,
                                   Where::kShared, "stop"));
  RUBATO_RETURN_IF_ERROR(r.Counter(m.success_length, "rubato:request_success_total", success_help,
                                   Where::kShared, "length"));
  RUBATO_RETURN_IF_ERROR(r.Counter(m.success_abort, "rubato:request_success_total", success_help,
                                   Where::kShared, "abort"));
  return m;
}

void HistogramSeries::Observe(double value) const {
  for (Histogram* child : children) {
    if (child != nullptr) child->Observe(value);
  }
}

void CounterSeries::Increment(double amount) const {
  for (Counter* child : children) {
    if (child != nullptr) child->Increment(amount);
  }
}

void GaugeSeries::Set(double value) const {
  for (Gauge* child : children) {
    if (child != nullptr) child->Set(value);
  }
}

void ServingMetrics::CountEnd(RequestEnd end, const std::string& finish_reason) const {
  switch (end) {
    case RequestEnd::kSuccess:
      (finish_reason == "stop" ? success_stop : success_length).Increment();
      return;
    case RequestEnd::kAborted:
      aborted.Increment();
      success_abort.Increment();
      return;
    case RequestEnd::kTimedOut:
      timed_out.Increment();
      success_abort.Increment();
      return;
    case RequestEnd::kFailed:
      failed.Increment();
      return;
    case RequestEnd::kRejected:
      rejected.Increment();
      return;
  }
}

}  // namespace rubato::server
