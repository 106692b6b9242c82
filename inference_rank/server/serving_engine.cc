// The engine thread of `rubato serve`: queue, Step loop, token -> text routing, stop strings and
// serving metrics (see serving_engine.h).
#include "inference_rank/server/serving_engine.h"

#include <algorithm>
#include <utility>

#include "common/heap_trim.h"
#include "common/logging.h"

namespace rubato::server {
namespace {

constexpr const char* kLogSubsystem = "server";
// How often an idle loop wakes to refresh health and deadlines.
constexpr std::chrono::milliseconds kIdleWake(100);

// Length of the longest suffix of `text` that is a proper prefix of one of `stops`: text that a
// later token could turn into a stop string, so it is not delivered yet.
size_t StopPrefixSuffix(const std::string& text, const std::vector<std::string>& stops) {
  size_t longest = 0;
  for (const std::string& stop : stops) {
    for (size_t k = std::min(stop.size() - 1, text.size()); k > longest; --k) {
      if (text.compare(text.size() - k, k, stop, 0, k) == 0) {
        longest = k;
        break;
      }
    }
  }
  return longest;
}

// The last update of a request whose client went away.
Status ClientGone() { return UnavailableError("request cancelled: its client went away"); }

// The earliest position of any stop string in `text`, or npos.
size_t FirstStop(const std::string& text, const std::vector<std::string>& stops) {
  size_t first = std::string::npos;
  for (const std::string& stop : stops) first = std::min(first, text.find(stop));
  return first;
}

}  // namespace

Result<std::unique_ptr<ServingEngine>> ServingEngine::Create(std::unique_ptr<Engine> engine,
                                                             const Tokenizer* tokenizer,
                                                             const ServingEngineOptions& options) {
  if (engine == nullptr) return InvalidArgumentError("serving engine: no engine");
  if (tokenizer == nullptr) {
    return InvalidArgumentError(
        "serving engine: the model directory has no tokenizer.json; "
        "`rubato serve` returns text and needs one");
  }
  if (options.max_queue < 1) {
    return InvalidArgumentError("limits.max_queue must be at least 1, got " +
                                std::to_string(options.max_queue));
  }
  if (!(options.request_timeout_s > 0)) {
    return InvalidArgumentError("limits.request_timeout_s must be > 0, got " +
                                std::to_string(options.request_timeout_s));
  }
  std::optional<ServingMetrics> metrics;
  if (options.metrics != nullptr) {
    RUBATO_ASSIGN_OR_RETURN(metrics,
                            ServingMetrics::Register(*options.metrics, options.model_name,
                                                     engine->options().max_context,
                                                     options.metric_names));
    const KvCacheShape& pool = engine->kv_cache().shape();
    metrics->kv_pool_tokens.Set(static_cast<double>(int64_t{pool.num_blocks} * pool.block_tokens));
  }
  return std::unique_ptr<ServingEngine>(
      new ServingEngine(std::move(engine), tokenizer, options, metrics));
}

ServingEngine::ServingEngine(std::unique_ptr<Engine> engine, const Tokenizer* tokenizer,
                             const ServingEngineOptions& options,
                             std::optional<ServingMetrics> metrics)
    : engine_(std::move(engine)),
      tokenizer_(tokenizer),
      options_(options),
      metrics_(metrics),
      max_context_(engine_->options().max_context),
      vocab_size_(engine_->model().config().vocab_size) {}

ServingEngine::~ServingEngine() { Stop(); }

void ServingEngine::Start() {
  std::lock_guard<std::mutex> lock(mutex_);
  if (started_ || loop_stopped_) return;
  started_ = true;
  thread_ = std::thread([this] { Loop(); });
}

Result<uint64_t> ServingEngine::Submit(ServingRequest request) {
  std::unique_lock<std::mutex> lock(mutex_);
  if (loop_stopped_ || stop_requested_) {
    return UnavailableError("the serving engine has stopped" +
                            (health_.ok() ? std::string() : ": " + health_.message()));
  }
  if (draining_) return UnavailableError("the server is shutting down and takes no new requests");
  const int waiting = static_cast<int>(incoming_.size()) + engine_waiting_;
  if (waiting >= options_.max_queue) {
    if (metrics_) metrics_->rejected.Increment();
    return ResourceExhaustedError("the server's queue is full: " + std::to_string(waiting) +
                                  " requests wait (limits.max_queue " +
                                  std::to_string(options_.max_queue) + "); retry later");
  }
  const uint64_t id = next_serving_id_++;
  incoming_.push_back(Incoming{id, std::move(request), Clock::now()});
  lock.unlock();
  wake_.notify_one();
  return id;
}

void ServingEngine::Cancel(uint64_t serving_id) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    cancels_.push_back(serving_id);
  }
  wake_.notify_one();
}

void ServingEngine::CountEndedBeforeSubmit(RequestEnd end) const {
  if (metrics_) metrics_->CountEnd(end, "");
}

void ServingEngine::Drain() {
  std::lock_guard<std::mutex> lock(mutex_);
  draining_ = true;
}

void ServingEngine::Stop(const Status& why) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!stop_requested_) stop_reason_ = why;
    stop_requested_ = true;
  }
  wake_.notify_one();
  // Start and Stop come from the owner's thread, never concurrently: thread_ needs no lock.
  if (thread_.joinable()) thread_.join();
  // Never started, or requests that raced the loop's end: they still get their last update.
  std::deque<Incoming> left;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    loop_stopped_ = true;
    left.swap(incoming_);
  }
  for (Incoming& request : left) EndNotAdmitted(request, stop_reason_, RequestEnd::kFailed);
  FailAll(stop_reason_);
}

Status ServingEngine::Health() const {
  std::lock_guard<std::mutex> lock(mutex_);
  if (!health_.ok()) return health_;
  if (loop_stopped_ || stop_requested_) return UnavailableError("the engine loop has stopped");
  if (draining_) return UnavailableError("the server is shutting down");
  if (!started_) return UnavailableError("the engine loop has not started");
  // A request that failed alone (its KV did not fit the cache rank's budget, say) is that
  // request's error, not the server's health.
  return Status::Ok();
}

void ServingEngine::Loop() {
  while (true) {
    std::deque<Incoming> incoming;
    std::vector<uint64_t> cancels;
    bool stopping = false;
    {
      std::unique_lock<std::mutex> lock(mutex_);
      if (!engine_->HasWork()) {
        wake_.wait_for(lock, kIdleWake, [this] {
          return stop_requested_ || !incoming_.empty() || !cancels_.empty();
        });
      }
      incoming.swap(incoming_);
      cancels.swap(cancels_);
      stopping = stop_requested_;
    }
    // Idle: give back what large requests freed (heap_trim.h), off any request's latency.
    if (!stopping && incoming.empty() && !engine_->HasWork()) HeapTrimmer::Process().TrimIfDue();
    if (stopping) {
      for (Incoming& request : incoming) {
        EndNotAdmitted(request, stop_reason_, RequestEnd::kFailed);
      }
      FailAll(stop_reason_);
      break;
    }
    // A request and its cancel can come in the same turn (the client left while the engine was
    // busy with a step): the request then ends here, never reaching the engine.
    const std::unordered_set<uint64_t> cancelled(cancels.begin(), cancels.end());
    AdmitIncoming(incoming, cancelled);
    for (uint64_t id : cancels) {
      CancelOnEngineThread(id, ClientGone(), RequestEnd::kAborted);
    }
    ExpireDeadlines();
    if (const Residency* residency = engine_->options().residency.get(); residency != nullptr) {
      Status broken = residency->Broken();
      std::lock_guard<std::mutex> lock(mutex_);
      health_ = broken.ok() ? Status::Ok() : broken.WithContext("cache rank lost");
    }
    if (engine_->HasWork()) {
      const Clock::time_point step_start = Clock::now();
      Result<std::vector<TokenEvent>> events = engine_->Step();
      if (!events.ok()) {
        const Status why = events.status().WithContext("engine loop stopped");
        RUBATO_LOG_ERROR(kLogSubsystem, "{}", why.message());
        {
          std::lock_guard<std::mutex> lock(mutex_);
          health_ = why;
          loop_stopped_ = true;
        }
        FailAll(why);
        break;
      }
      MarkScheduled(engine_->admitted(), step_start);
      if (metrics_) {
        const auto generated = std::count_if(events->begin(), events->end(), [](const auto& e) {
          return e.finish != FinishReason::kError;
        });
        metrics_->iteration_tokens.Observe(
            static_cast<double>(engine_->last_step_prompt_tokens() + generated));
        if (engine_->last_step_preemptions() > 0) {
          metrics_->preemptions.Increment(engine_->last_step_preemptions());
        }
      }
      for (const TokenEvent& event : *events) RouteEvent(event);
    }
    UpdateGauges();
  }
}

void ServingEngine::AdmitIncoming(std::deque<Incoming>& incoming,
                                  const std::unordered_set<uint64_t>& cancelled) {
  for (Incoming& next : incoming) {
    if (cancelled.count(next.serving_id) != 0) {
      EndNotAdmitted(next, ClientGone(), RequestEnd::kAborted);
      continue;
    }
    LiveRequest live;
    live.prompt_tokens = static_cast<int>(next.request.generation.prompt_ids.size());
    live.arrival = next.arrival;
    live.deadline = next.arrival + std::chrono::duration_cast<Clock::duration>(
                                       std::chrono::duration<double>(options_.request_timeout_s));
    Result<uint64_t> engine_id = engine_->Submit(next.request.generation);
    live.request = std::move(next.request);
    if (!engine_id.ok()) {
      ServingUpdate update;
      update.finished = true;
      update.prompt_tokens = live.prompt_tokens;
      update.error = engine_id.status();
      update.rejected = true;
      if (metrics_) metrics_->rejected.Increment();
      live.request.on_update(update);
      continue;
    }
    if (metrics_) metrics_->prompt_tokens.Increment(live.prompt_tokens);
    live.scheduled = live.arrival;
    live.engine_id = *engine_id;
    live.decoder = std::make_unique<StreamDecoder>(*tokenizer_, /*skip_special_tokens=*/true);
    serving_by_engine_[live.engine_id] = next.serving_id;
    live_.emplace(next.serving_id, std::move(live));
  }
}

void ServingEngine::EndNotAdmitted(Incoming& request, const Status& why, RequestEnd end) {
  ServingUpdate update;
  update.finished = true;
  update.prompt_tokens = static_cast<int>(request.request.generation.prompt_ids.size());
  update.error = why;
  if (metrics_) metrics_->CountEnd(end, "");
  request.request.on_update(update);
}

void ServingEngine::MarkScheduled(const std::vector<uint64_t>& engine_ids,
                                  Clock::time_point step_start) {
  for (uint64_t engine_id : engine_ids) {
    const auto by_engine = serving_by_engine_.find(engine_id);
    if (by_engine == serving_by_engine_.end()) continue;
    LiveRequest& live = live_.at(by_engine->second);
    live.scheduled = step_start;
    if (metrics_) {
      metrics_->queue_time.Observe(
          std::chrono::duration<double>(step_start - live.arrival).count());
    }
  }
}

void ServingEngine::CancelOnEngineThread(uint64_t serving_id, const Status& why, RequestEnd end) {
  const auto it = live_.find(serving_id);
  if (it == live_.end()) return;  // finished already
  const Status cancelled = engine_->Cancel(it->second.engine_id);
  if (!cancelled.ok()) RUBATO_LOG_WARN(kLogSubsystem, "{}", cancelled.message());
  ServingUpdate update;
  update.finished = true;
  update.error = why;
  Finish(serving_id, std::move(update), end);
}

void ServingEngine::ExpireDeadlines() {
  const Clock::time_point now = Clock::now();
  std::vector<uint64_t> expired;
  for (const auto& [id, live] : live_) {
    if (now >= live.deadline) expired.push_back(id);
  }
  for (uint64_t id : expired) {
    CancelOnEngineThread(
        id,
        DeadlineExceededError("the request ran longer than limits.request_timeout_s (" +
                              std::to_string(options_.request_timeout_s) + " s)"),
        RequestEnd::kTimedOut);
  }
}

void ServingEngine::RouteEvent(const TokenEvent& event) {
  const auto by_engine = serving_by_engine_.find(event.request_id);
  if (by_engine == serving_by_engine_.end()) return;
  const uint64_t serving_id = by_engine->second;
  LiveRequest& live = live_.at(serving_id);
  ServingUpdate update;
  update.prompt_tokens = live.prompt_tokens;
  if (event.finish == FinishReason::kError) {  // the engine has dropped the request already
    update.finished = true;
    update.error = event.error;
    update.completion_tokens = live.completion_tokens;
    Finish(serving_id, std::move(update), RequestEnd::kFailed);
    return;
  }
  const Clock::time_point now = Clock::now();
  if (live.completion_tokens == 0) {
    live.first_token = now;
    if (metrics_) {
      metrics_->time_to_first_token.Observe(
          std::chrono::duration<double>(now - live.arrival).count());
      metrics_->prefill_time.Observe(std::chrono::duration<double>(now - live.scheduled).count());
    }
  } else if (metrics_) {
    const double gap = std::chrono::duration<double>(now - live.last_token).count();
    metrics_->inter_token_latency.Observe(gap);
    metrics_->time_per_output_token.Observe(gap);
  }
  live.last_token = now;
  ++live.completion_tokens;
  if (metrics_) metrics_->generation_tokens.Increment();
  update.completion_tokens = live.completion_tokens;

  // The stop token itself is not text (as `rubato generate` prints it).
  if (event.finish != FinishReason::kStop) {
    live.decoder->PushTo(event.token, &live.held_text);
    if (live.request.generation.sampling.logprobs >= 0) {
      live.held_logprobs.emplace_back(event.token, event.logprobs);
    }
  }
  const bool engine_finished = event.finish != FinishReason::kNone;
  if (engine_finished) live.held_text += live.decoder->Flush();
  const std::vector<std::string>& stops = live.request.stop_strings;
  const size_t stop_at = FirstStop(live.held_text, stops);
  if (stop_at != std::string::npos) {
    update.text = live.held_text.substr(0, stop_at);
    update.finished = true;
    update.finish_reason = "stop";
    if (!engine_finished) {
      const Status cancelled = engine_->Cancel(live.engine_id);
      if (!cancelled.ok()) RUBATO_LOG_WARN(kLogSubsystem, "{}", cancelled.message());
    }
  } else if (engine_finished) {
    update.text = std::move(live.held_text);
    update.finished = true;
    update.finish_reason = event.finish == FinishReason::kStop ? "stop" : "length";
  } else {
    // Deliver all but a possible stop-string start; never split a UTF-8 character.
    size_t cut = live.held_text.size() - StopPrefixSuffix(live.held_text, stops);
    while (cut > 0 && cut < live.held_text.size() &&
           (static_cast<unsigned char>(live.held_text[cut]) & 0xC0) == 0x80) {
      --cut;
    }
    if (cut == live.held_text.size()) {
      update.text.swap(live.held_text);  // all of it (no stop string can start here)
    } else {
      update.text = live.held_text.substr(0, cut);
      live.held_text.erase(0, cut);
    }
  }
  if (update.finished) {
    update.logprobs = std::move(live.held_logprobs);
    Finish(serving_id, std::move(update), RequestEnd::kSuccess);
  } else if (!update.text.empty() || live.completion_tokens == 1) {
    update.logprobs = std::move(live.held_logprobs);
    live.held_logprobs.clear();
    live.request.on_update(update);
  }
}

void ServingEngine::Finish(uint64_t serving_id, ServingUpdate update, RequestEnd end) {
  const auto it = live_.find(serving_id);
  if (it == live_.end()) return;
  LiveRequest live = std::move(it->second);
  live_.erase(it);
  serving_by_engine_.erase(live.engine_id);
  update.finished = true;
  update.prompt_tokens = live.prompt_tokens;
  update.completion_tokens = live.completion_tokens;
  if (update.error.ok()) {
    end = RequestEnd::kSuccess;
  } else if (end == RequestEnd::kSuccess) {
    end = RequestEnd::kFailed;
  }
  if (metrics_) {
    if (end == RequestEnd::kSuccess) {
      const auto seconds = [](Clock::duration d) {
        return std::chrono::duration<double>(d).count();
      };
      metrics_->e2e_request_latency.Observe(seconds(Clock::now() - live.arrival));
      metrics_->decode_time.Observe(seconds(live.last_token - live.first_token));
      metrics_->prompt_tokens_per_request.Observe(live.prompt_tokens);
      metrics_->generation_tokens_per_request.Observe(live.completion_tokens);
      metrics_->max_tokens_per_request.Observe(live.request.generation.max_new_tokens);
    }
    metrics_->CountEnd(end, update.finish_reason);
  }
  live.request.on_update(update);
}

void ServingEngine::FailAll(const Status& why) {
  std::vector<uint64_t> ids;
  for (const auto& [id, live] : live_) ids.push_back(id);
  for (uint64_t id : ids) {
    if (engine_ != nullptr) (void)engine_->Cancel(live_.at(id).engine_id);
    ServingUpdate update;
    update.error = why;
    Finish(id, std::move(update), RequestEnd::kFailed);
  }
}

void ServingEngine::UpdateGauges() {
  int incoming = 0;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    engine_waiting_ = engine_->num_waiting();
    incoming = static_cast<int>(incoming_.size());
  }
  if (metrics_) {
    metrics_->requests_running.Set(engine_->num_running());
    metrics_->requests_waiting.Set(engine_->num_waiting() + incoming);
    const PagedKvCache& kv = engine_->kv_cache();
    const double usage =
        1.0 - static_cast<double>(kv.free_blocks()) / std::max(1, kv.shape().num_blocks);
    metrics_->kv_cache_usage.Set(usage);
    metrics_->gpu_cache_usage.Set(usage);
  }
}

}  // namespace rubato::server
