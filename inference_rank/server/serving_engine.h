// The serving side of the Engine: one thread owns the Engine and runs Step in a loop; HTTP
// handlers Submit requests into a bounded queue and get their text back through a callback,
// piece by piece, with stop strings applied and the vLLM-compatible metrics measured.
// Thread-safety: Submit, Cancel, Health, Drain, Stop may be called from any thread; on_update
// callbacks run on the engine thread and must not block.
// Narrative: docs/engine_and_models.md "The serving engine".
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "common/metrics.h"
#include "common/status.h"
#include "common/tokenizer/stream_decoder.h"
#include "common/tokenizer/tokenizer.h"
#include "inference_rank/engine/engine.h"
#include "inference_rank/server/serving_metrics.h"

namespace rubato::server {

struct ServingEngineOptions {
  int max_queue = 256;             // requests submitted but not yet running, at most (limits)
  double request_timeout_s = 600;  // a request not finished by then ends with DeadlineExceeded
  // Where the serving metrics are registered (the registry the Engine got through
  // EngineOptions::metrics, so that one /metrics shows both). Null: no metrics. Must outlive
  // the ServingEngine.
  MetricsRegistry* metrics = nullptr;
  std::string model_name = {};  // the model_name label of the metrics
  MetricNames metric_names = MetricNames::kRubato;  // server.metrics_names
};

// One step of a request's progress, delivered to its on_update callback.
struct ServingUpdate {
  std::string text;           // new text since the previous update (complete UTF-8)
  int prompt_tokens = 0;
  int completion_tokens = 0;  // tokens generated so far (an end-of-sequence token included)
  bool finished = false;      // the last update of the request
  std::string finish_reason;  // finished without error: "stop" (stop token or string) | "length"
  // Finished with an error: why. `rejected` says the engine refused the request as submitted
  // (InvalidArgument, OutOfRange, ResourceExhausted: the client's fault); otherwise the request
  // failed while queued or running (cache rank lost, timeout, cancelled, server shutting down).
  Status error;
  bool rejected = false;
  // The request asked for logprobs (SamplingParams::logprobs): the tokens delivered since the
  // previous update (the text may lag them: text held for a stop string), each with its
  // TokenLogprobs. A stop token that ended the request is not among them (nor in the text).
  std::vector<std::pair<int, TokenLogprobs>> logprobs;
};

struct ServingRequest {
  GenerationRequest generation;
  std::vector<std::string> stop_strings;  // non-empty strings
  std::function<void(const ServingUpdate&)> on_update;  // engine thread; must not block
};

class ServingEngine {
 public:
  // Takes the engine; `tokenizer` (must outlive this) turns tokens into text. The loop starts
  // with Start().
  static Result<std::unique_ptr<ServingEngine>> Create(std::unique_ptr<Engine> engine,
                                                       const Tokenizer* tokenizer,
                                                       const ServingEngineOptions& options);
  ~ServingEngine();  // Stop()
  ServingEngine(const ServingEngine&) = delete;
  ServingEngine& operator=(const ServingEngine&) = delete;

  // Starts the engine thread (once).
  void Start();
  // Queues a request and returns its serving id. ResourceExhausted when limits.max_queue
  // requests wait already; Unavailable when the loop has stopped. Every accepted request gets
  // exactly one finished update.
  Result<uint64_t> Submit(ServingRequest request);
  // Ends a request early (its client went away), whether it is queued or running: its KV is
  // released, it is counted aborted and its last update is an error. Unknown or finished ids are
  // ignored.
  void Cancel(uint64_t serving_id);
  // Counts a request that ended before it could be submitted (it waited for the router's request
  // workers): kAborted, its client went away; kRejected, their queue was full.
  void CountEndedBeforeSubmit(RequestEnd end) const;
  // The start of a graceful stop: Submit refuses new requests (Unavailable) and Health reports
  // the server unavailable, while the loop goes on with the requests it has.
  void Drain();
  // Stops the loop: every queued or running request ends with `why` (an Unavailable status);
  // joins the thread.
  void Stop(const Status& why = UnavailableError("the server is shutting down"));
  // Ok while the loop runs, is not draining, its cache rank (if any) works and the last request
  // that ended did not fail inside the engine (a cache rank that comes back clears that); else
  // why not.
  Status Health() const;

  int max_context() const { return max_context_; }
  int vocab_size() const { return vocab_size_; }

 private:
  using Clock = std::chrono::steady_clock;
  // A request the engine thread tracks, from Submit to its finished update.
  struct LiveRequest {
    ServingRequest request;
    uint64_t engine_id = 0;  // 0 until Engine::Submit accepted it
    std::unique_ptr<StreamDecoder> decoder;
    std::string held_text;  // decoded, not yet delivered: may be the start of a stop string
    std::vector<std::pair<int, TokenLogprobs>> held_logprobs;  // not yet delivered (logprobs)
    int prompt_tokens = 0;
    int completion_tokens = 0;
    Clock::time_point arrival;
    Clock::time_point scheduled;    // the engine moved it to running (arrival until then)
    Clock::time_point first_token;
    Clock::time_point last_token;
    Clock::time_point deadline;
  };
  struct Incoming {
    uint64_t serving_id;
    ServingRequest request;
    Clock::time_point arrival;
  };

  ServingEngine(std::unique_ptr<Engine> engine, const Tokenizer* tokenizer,
                const ServingEngineOptions& options, std::optional<ServingMetrics> metrics);
  void Loop();
  // Loop parts, on the engine thread.
  // Hands new requests to the engine, but ends those `cancelled` already without running them.
  void AdmitIncoming(std::deque<Incoming>& incoming, const std::unordered_set<uint64_t>& cancelled);
  // Ends a request that never reached the engine (its only update).
  void EndNotAdmitted(Incoming& request, const Status& why, RequestEnd end);
  void CancelOnEngineThread(uint64_t serving_id, const Status& why, RequestEnd end);
  // The engine scheduled these requests in the step that began at `step_start`.
  void MarkScheduled(const std::vector<uint64_t>& engine_ids, Clock::time_point step_start);
  void ExpireDeadlines();
  void RouteEvent(const TokenEvent& event);
  // Delivers the finished update and forgets the request (it must have left the engine).
  // `end` says how, for the metrics (kSuccess when update.error is ok).
  void Finish(uint64_t serving_id, ServingUpdate update, RequestEnd end);
  void FailAll(const Status& why);
  void UpdateGauges();

  std::unique_ptr<Engine> engine_;
  const Tokenizer* tokenizer_;
  ServingEngineOptions options_;
  std::optional<ServingMetrics> metrics_;  // set when options.metrics is
  int max_context_ = 0;
  int vocab_size_ = 0;

  // Engine thread only.
  std::unordered_map<uint64_t, LiveRequest> live_;           // by serving id
  std::unordered_map<uint64_t, uint64_t> serving_by_engine_;  // engine id -> serving id

  mutable std::mutex mutex_;  // guards the fields below
  std::condition_variable wake_;
  std::deque<Incoming> incoming_;
  std::vector<uint64_t> cancels_;
  uint64_t next_serving_id_ = 1;
  int engine_waiting_ = 0;  // requests waiting inside the engine after the last loop turn
  bool started_ = false;  // Start() ran (thread_ itself is touched by Start and Stop only)
  bool stop_requested_ = false;
  bool draining_ = false;
  bool loop_stopped_ = false;
  Status stop_reason_;   // what Stop gives the requests it ends
  Status health_;        // the loop's end, or the offload client's Broken()
  // The error of the last request that failed inside the engine (kError: e.g. its cache rank
  // could not be reached), until a request finishes well again.
  std::thread thread_;
};

}  // namespace rubato::server
