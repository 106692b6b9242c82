// The generation engine: validation, FCFS admission, mixed prefill/decode steps, sampling draws
// and retirement (see engine.h). The KV pool's sizing and preemption: engine_kv_pool.cc.
#include "inference_rank/engine/engine.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>

#include "common/logging.h"
#include "kernels/cpu/sampling.h"

namespace rubato {
namespace {

constexpr const char* kLogSubsystem = "engine";

Status CheckPositive(int value, const char* name) {
  if (value >= 1) return Status::Ok();
  return InvalidArgumentError(std::string(name) + " must be at least 1, got " +
                              std::to_string(value));
}

}  // namespace

double RetainedKvRatio(const AttentionWindow& window, int context) {
  return static_cast<double>(window.VisibleKeys(context - 1)) / context;
}

Result<EngineOptions> Engine::ResolveSizes(const ModelConfig& config,
                                           const EngineOptions& options) {
  EngineOptions resolved = options;
  RUBATO_RETURN_IF_ERROR(CheckPositive(options.max_batch, "engine.max_batch"));
  RUBATO_RETURN_IF_ERROR(CheckPositive(options.prefill_chunk, "engine.prefill_chunk"));
  if (options.block_size != 16 && options.block_size != 64) {
    return InvalidArgumentError("engine.block_size must be 16 or 64, got " +
                                std::to_string(options.block_size));
  }
  if (options.num_threads < 0) {
    return InvalidArgumentError("engine.num_threads must be >= 0 (0 = all cores), got " +
                                std::to_string(options.num_threads));
  }
  if (options.max_context < 0 || options.max_context > config.max_position_embeddings) {
    return InvalidArgumentError(
        "engine.max_context must be between 1 and the model's max_position_embeddings (" +
        std::to_string(config.max_position_embeddings) + "), or 0 for that value; got " +
        std::to_string(options.max_context));
  }
  if (resolved.max_context == 0) resolved.max_context = config.max_position_embeddings;
  if (options.policy != nullptr) {
    RUBATO_RETURN_IF_ERROR(options.policy->CheckLimits(resolved.max_context));
  }
  if (options.max_kv_blocks < 0) {
    return InvalidArgumentError(
        "engine.kv_pool_tokens must be >= 0 (0 = sized from free memory), got " +
        std::to_string(options.max_kv_blocks) + " blocks");
  }
  RUBATO_RETURN_IF_ERROR(CheckMemoryUtilization(options.gpu_memory_utilization));
  return resolved;
}

Result<std::unique_ptr<Engine>> Engine::Create(std::unique_ptr<Model> model,
                                               const EngineOptions& options) {
  if (model == nullptr) return InvalidArgumentError("engine: no model");
  RUBATO_ASSIGN_OR_RETURN(EngineOptions resolved, ResolveSizes(model->config(), options));
  const AttentionWindow window =
      options.policy != nullptr ? options.policy->window() : AttentionWindow();
  if (window.sink_tokens < 0 || window.recent_tokens < 1) {
    return InvalidArgumentError(
        "engine: attention window sink_tokens must be >= 0 and recent_tokens >= 1, got " +
        std::to_string(window.sink_tokens) + " and " + std::to_string(window.recent_tokens));
  }
  const KvResidency residency =
      options.residency != nullptr ? options.residency->kind() : KvResidency::kLocal;
  if (options.policy != nullptr) {
    RUBATO_RETURN_IF_ERROR(CheckResidency(*options.policy, residency).WithContext("engine"));
  }
  if (options.residency != nullptr) {
    RUBATO_RETURN_IF_ERROR(options.residency->Check(options.policy.get()).WithContext("engine"));
  }
  model->SetNumThreads(resolved.num_threads);
  // The policy's backend half first (the CUDA model's pools: at most max_batch requests hold a
  // selection at once), then the KV cache, the large allocation.
  if (resolved.policy != nullptr) {
    RUBATO_ASSIGN_OR_RETURN(std::unique_ptr<AttentionBackend> backend,
                            resolved.policy->MakeBackend(*model, resolved.max_batch));
    RUBATO_RETURN_IF_ERROR(model->SetAttentionBackend(std::move(backend)).WithContext("engine"));
  }
  // The residency's storage for max_batch requests and its model half, before the KV cache.
  if (resolved.residency != nullptr) {
    RUBATO_RETURN_IF_ERROR(
        resolved.residency->Attach(*model, resolved.policy.get(), resolved.max_batch)
            .WithContext("engine"));
  }
  // Everything else is in place: the pool takes what the memory has left.
  std::string sized_by = "engine.kv_pool_tokens";
  if (resolved.max_kv_blocks == 0) {
    RUBATO_ASSIGN_OR_RETURN(sized_by, SizeKvPoolFromMemory(*model, resolved));
  }
  Result<std::unique_ptr<PagedKvCache>> cache =
      model->CreateKvCache(resolved.block_size, resolved.max_kv_blocks);
  if (!cache.ok()) return cache.status().WithContext("engine");
  const int64_t pool_tokens = int64_t{resolved.max_kv_blocks} * resolved.block_size;
  std::string summary = fmt::format("KV pool of {} tokens ({} blocks of {}, {} MiB; {})",
                                    pool_tokens, resolved.max_kv_blocks, resolved.block_size,
                                    (*cache)->pool_bytes() >> 20, sized_by);
  RUBATO_LOG_INFO(
      kLogSubsystem,
      "backend {}, max_batch {}, max_context {}, {}, prefill chunk {}, policy {}, {} KV",
      model->backend_name(), resolved.max_batch, resolved.max_context, summary,
      resolved.prefill_chunk,
      resolved.policy != nullptr ? std::string(resolved.policy->name()) : "dense",
      KvResidencyName(residency));
  if (pool_tokens < resolved.max_context) {
    RUBATO_LOG_WARN(kLogSubsystem,
                    "the KV pool holds {} tokens, fewer than max_context ({}): requests longer "
                    "than the pool are refused",
                    pool_tokens, resolved.max_context);
  }
  auto engine =
      std::unique_ptr<Engine>(new Engine(std::move(model), std::move(cache).value(), resolved));
  engine->window_ = window;
  engine->kv_pool_summary_ = std::move(summary);
  engine->preemptible_ = resolved.residency == nullptr || resolved.residency->Preemptible();
  if (!engine->preemptible_)
    engine->local_window_ = std::max(-1, resolved.residency->LocalWindow());
  if (engine->local_window_ >= 0) {
    RUBATO_LOG_INFO(kLogSubsystem,
                    "{} KV: a request holds its prompt, then a local window of {} positions "
                    "before the one it writes ({} blocks)",
                    KvResidencyName(residency), engine->local_window_,
                    engine->WindowBlocks(engine->local_window_));
  }
  if (options.metrics != nullptr) {
    RUBATO_ASSIGN_OR_RETURN(
        engine->retained_kv_metric_,
        options.metrics->AddHistogram(
            "rubato:retained_kv_ratio",
            "Share of the KV positions the query of each sampled token attended.",
            {0.01, 0.02, 0.05, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 0.99,
             1.0}));
    if (options.policy != nullptr) {
      RUBATO_RETURN_IF_ERROR(options.policy->RegisterMetrics(*options.metrics));
    }
  }
  return engine;
}

Engine::Engine(std::unique_ptr<Model> model, std::unique_ptr<PagedKvCache> kv_cache,
               const EngineOptions& options)
    : model_(std::move(model)), kv_cache_(std::move(kv_cache)), options_(options) {}

int Engine::ReservedTokens(const GenerationRequest& request) const {
  const int64_t prompt = static_cast<int64_t>(request.prompt_ids.size());
  const int longest =
      static_cast<int>(std::min<int64_t>(prompt + request.max_new_tokens, options_.max_context));
  if (options_.residency != nullptr) {
    return options_.residency->ReservedTokens(static_cast<int>(prompt), longest);
  }
  return longest - 1;
}

Result<uint64_t> Engine::Submit(GenerationRequest request) {
  const int vocab = model_->config().vocab_size;
  const SamplingParams& sampling = request.sampling;
  if (request.prompt_ids.empty()) return InvalidArgumentError("request: the prompt is empty");
  for (size_t i = 0; i < request.prompt_ids.size(); ++i) {
    const int id = request.prompt_ids[i];
    if (id < 0 || id >= vocab) {
      return InvalidArgumentError("request: prompt token " + std::to_string(i) + " is " +
                                  std::to_string(id) + ", outside the vocabulary [0, " +
                                  std::to_string(vocab) + ")");
    }
  }
  for (int id : request.stop_token_ids) {
    if (id < 0 || id >= vocab) {
      return InvalidArgumentError("request: stop token " + std::to_string(id) +
                                  " is outside the vocabulary [0, " + std::to_string(vocab) + ")");
    }
  }
  if (!(sampling.temperature >= 0.0f) || std::isinf(sampling.temperature)) {
    return InvalidArgumentError(fmt::format(
        "request: temperature must be a finite number >= 0, got {}", sampling.temperature));
  }
  if (!(sampling.top_p > 0.0f && sampling.top_p <= 1.0f)) {
    return InvalidArgumentError(
        fmt::format("request: top_p must be in (0, 1], got {}", sampling.top_p));
  }
  if (sampling.top_k < 0) {
    return InvalidArgumentError("request: top_k must be >= 0 (0 = off), got " +
                                std::to_string(sampling.top_k));
  }
  for (const float penalty : {sampling.presence_penalty, sampling.frequency_penalty}) {
    if (!(penalty >= -2.0f && penalty <= 2.0f)) {
      return InvalidArgumentError(
          "request: presence and frequency penalties must be in [-2, 2], "
          "got " +
          std::to_string(penalty));
    }
  }
  for (size_t i = 0; i < sampling.logit_bias.size(); ++i) {
    const auto& [id, bias] = sampling.logit_bias[i];
    if (id < 0 || id >= vocab) {
      return InvalidArgumentError("request: logit_bias token " + std::to_string(id) +
                                  " is outside the vocabulary [0, " + std::to_string(vocab) + ")");
    }
    if (!(bias >= -100.0f && bias <= 100.0f)) {
      return InvalidArgumentError("request: logit_bias of token " + std::to_string(id) +
                                  " must be in [-100, 100], got " + std::to_string(bias));
    }
    for (size_t j = 0; j < i; ++j) {
      if (sampling.logit_bias[j].first == id) {
        return InvalidArgumentError("request: logit_bias names token " + std::to_string(id) +
                                    " twice");
      }
    }
  }
  if (!(sampling.repetition_penalty > 0.0f && sampling.repetition_penalty <= 2.0f)) {
    return InvalidArgumentError(fmt::format("request: repetition_penalty must be in (0, 2], got {}",
                                            sampling.repetition_penalty));
  }
  if (sampling.logprobs < -1 || sampling.logprobs > kMaxLogprobs) {
    return InvalidArgumentError("request: logprobs must be in [0, " + std::to_string(kMaxLogprobs) +
                                "] (or -1 for none), got " + std::to_string(sampling.logprobs));
  }
  // The CUDA model samples on the device: no sign-dependent logit op, no logits on the host.
  if (model_->backend_name() != "cpu") {
    if (sampling.repetition_penalty != 1.0f) {
      return UnsupportedError("request: repetition_penalty other than 1 is not supported by the " +
                              std::string(model_->backend_name()) +
                              " backend (engine.backend cpu implements it)");
    }
    if (sampling.logprobs >= 0) {
      return UnsupportedError("request: logprobs are not supported by the " +
                              std::string(model_->backend_name()) +
                              " backend (engine.backend cpu implements them)");
    }
  }
  if (request.max_new_tokens < 1) {
    return InvalidArgumentError("request: max_new_tokens must be at least 1, got " +
                                std::to_string(request.max_new_tokens));
  }
  const int prompt_tokens = static_cast<int>(request.prompt_ids.size());
  if (prompt_tokens >= options_.max_context) {
    return OutOfRangeError("prompt has " + std::to_string(prompt_tokens) +
                           " tokens but the context limit is " +
                           std::to_string(options_.max_context) + " (engine.max_context)");
  }
  // A request alone always fits (a running one then never waits for blocks it cannot get); with
  // a local window, what it holds at most: its prompt, then its window.
  const int full_blocks = kv_cache_->BlocksFor(ReservedTokens(request));
  const int blocks = local_window_ < 0
                         ? full_blocks
                         : std::min(full_blocks, std::max(kv_cache_->BlocksFor(prompt_tokens),
                                                          WindowBlocks(local_window_)));
  const int pool_blocks = kv_cache_->shape().num_blocks;
  if (options_.residency != nullptr && blocks > pool_blocks) {
    RUBATO_RETURN_IF_ERROR(options_.residency->ExplainTooLarge(prompt_tokens, blocks, pool_blocks));
  }
  if (blocks > pool_blocks && local_window_ >= 0) {
    return ResourceExhaustedError(fmt::format(
        "request: its prompt ({} tokens) prefills through {} KV blocks but the cache has {} ({} "
        "tokens: engine.kv_pool_tokens, or engine.gpu_memory_utilization's share of free "
        "memory); its KV lives elsewhere and this rank keeps its prompt, then a window of {} "
        "positions; shorten the prompt or enlarge the pool",
        prompt_tokens, blocks, pool_blocks, int64_t{pool_blocks} * kv_cache_->shape().block_tokens,
        local_window_ + 1));
  }
  if (blocks > pool_blocks) {
    return ResourceExhaustedError(fmt::format(
        "request: prompt ({} tokens) + max_new_tokens ({}) needs {} KV blocks but the cache has "
        "{} ({} tokens: engine.kv_pool_tokens, or engine.gpu_memory_utilization's share of "
        "free memory); lower max_new_tokens or enlarge the pool",
        prompt_tokens, request.max_new_tokens, blocks, pool_blocks,
        int64_t{pool_blocks} * kv_cache_->shape().block_tokens));
  }
  if (request.stop_token_ids.empty() && !request.ignore_eos) {
    request.stop_token_ids = model_->config().eos_token_ids;
  }

  Request queued;
  queued.id = next_id_++;
  // The request's own RNG: its draws never depend on the other requests of a batch.
  queued.rng.seed(sampling.seed);
  if (sampling.repetition_penalty != 1.0f) {
    queued.seen_tokens = request.prompt_ids;
    std::sort(queued.seen_tokens.begin(), queued.seen_tokens.end());
    queued.seen_tokens.erase(std::unique(queued.seen_tokens.begin(), queued.seen_tokens.end()),
                             queued.seen_tokens.end());
  }
  queued.params = std::move(request);
  waiting_.push_back(std::move(queued));
  return waiting_.back().id;
}

Status Engine::AdmitWaiting(std::vector<TokenEvent>& events) {
  while (!waiting_.empty() && static_cast<int>(running_.size()) < options_.max_batch) {
    Request& next = waiting_.front();
    // A preemptible request takes the blocks of what it prefills now and grows from there;
    // otherwise its whole sequence is reserved.
    // With a local window it takes the blocks of its prompt, and admission keeps free what it
    // and the running requests may still take within their bounds (LocalBlocksBound).
    const int reserved = ReservedTokens(next.params);
    int tokens =
        preemptible_ || local_window_ >= 0 ? static_cast<int>(PrefillIds(next).size()) : reserved;
    if (kv_cache_->BlocksFor(tokens) > kv_cache_->free_blocks()) break;  // FCFS: wait
    next.window = local_window_;
    // With a local window: the blocks the request may still take beyond the running requests'.
    const int room_blocks =
        local_window_ >= 0 ? kv_cache_->free_blocks() - PromisedBlocks() : kv_cache_->free_blocks();
    if (local_window_ >= 0 && LocalBlocksBound(next) > room_blocks) break;
    if (options_.residency != nullptr) {
      // Its storage holds the whole sequence, whatever the paged cache keeps; a residency that
      // places requests may keep it whole in the paged cache instead, where it has room.
      Result<std::unique_ptr<ResidencyRequest>> opened = options_.residency->Admit(
          next.id, preemptible_ ? tokens : reserved, room_blocks * kv_cache_->shape().block_tokens);
      if (!opened.ok()) {
        const Status error = opened.status().WithContext("request " + std::to_string(next.id));
        RUBATO_LOG_WARN(kLogSubsystem, "{}", error.message());
        events.push_back(TokenEvent{next.id, -1, FinishReason::kError, 1.0, error});
        waiting_.pop_front();
        continue;
      }
      next.residency = std::move(opened).value();
      if (next.residency != nullptr && next.residency->WhollyLocal() && local_window_ >= 0) {
        if (kv_cache_->BlocksFor(reserved) > room_blocks) {
          return InternalError("engine: request " + std::to_string(next.id) +
                               " was placed wholly in the paged cache, which has no room for it");
        }
        tokens = reserved;
        next.window = -1;
      }
    }
    RUBATO_RETURN_IF_ERROR(kv_cache_->Reserve(next.kv, tokens));
    if (options_.policy != nullptr) {
      next.policy = options_.policy->Admit(
          options_.residency != nullptr ? options_.residency->kind() : KvResidency::kLocal);
    }
    RUBATO_LOG_DEBUG(kLogSubsystem, "admit request {} ({} tokens to prefill, {} KV blocks)",
                     next.id, PrefillIds(next).size(), next.kv.block_table.size());
    if (!next.admitted_before) admitted_.push_back(next.id);
    next.admitted_before = true;
    running_.push_back(std::move(next));
    waiting_.pop_front();
  }
  return Status::Ok();
}

TokenSampling Engine::NextSampling(Request& request) {
  const SamplingParams& params = request.params.sampling;
  // A temperature too small to divide logits by without overflow is greedy (as vLLM's sampling
  // epsilon): 1e-38 once gave inf / inf = NaN probabilities and an empty completion.
  const float temperature =
      params.temperature < kGreedyBelowTemperature ? 0.0f : params.temperature;
  TokenSampling sampling{temperature, params.top_k, params.top_p, 0.0};
  if (temperature > 0.0f) sampling.uniform = DrawUniform(request.rng);
  sampling.adjustments.presence_penalty = params.presence_penalty;
  sampling.adjustments.frequency_penalty = params.frequency_penalty;
  if (params.presence_penalty != 0.f || params.frequency_penalty != 0.f) {
    sampling.adjustments.generated = request.output_tokens;
  }
  sampling.adjustments.logit_bias = params.logit_bias;
  sampling.adjustments.repetition_penalty = params.repetition_penalty;
  sampling.adjustments.repetition_seen = request.seen_tokens;
  sampling.logprobs = params.logprobs;
  return sampling;
}

FinishReason Engine::FinishAfter(const Request& request, int token) const {
  const std::vector<int>& stops = request.params.stop_token_ids;
  if (std::find(stops.begin(), stops.end(), token) != stops.end()) return FinishReason::kStop;
  if (request.generated >= request.params.max_new_tokens) return FinishReason::kLength;
  const int total = static_cast<int>(request.params.prompt_ids.size()) + request.generated;
  if (total >= options_.max_context) return FinishReason::kLength;
  return FinishReason::kNone;
}

void Engine::DiscardStep(Request& request) {
  // The step wrote K/V at the last position; the redo's forward starts there again and
  // overwrites it (ForwardEntry: a smaller start_position rewinds).
  --request.kv.num_tokens;
  for (auto& [owner, rng] : rng_before_step_) {
    if (owner == &request) request.rng = rng;  // the redo draws the same uniform
  }
}

Result<std::vector<TokenEvent>> Engine::Step() {
  std::vector<TokenEvent> events;
  admitted_.clear();
  last_step_prompt_tokens_ = 0;
  last_step_preemptions_ = 0;
  // The running requests' next positions first; nothing new is admitted in a step that had to
  // preempt (vLLM's rule: it would only be preempted in turn).
  if (preemptible_) RUBATO_RETURN_IF_ERROR(GrowDecodingRequests());
  if (local_window_ >= 0) RUBATO_RETURN_IF_ERROR(SlideLocalWindows());
  if (last_step_preemptions_ == 0) RUBATO_RETURN_IF_ERROR(AdmitWaiting(events));
  FailLostResidencyRequests(events);

  batch_.clear();
  batch_requests_.clear();
  rng_before_step_.clear();
  // Sized before any entry points into it: no reallocation while the batch is built.
  batch_sampling_.resize(running_.size());
  int prefill_budget = options_.prefill_chunk;
  for (Request& request : running_) {
    const std::vector<int>& prompt = PrefillIds(request);
    const int prompt_left = static_cast<int>(prompt.size()) - request.prompt_done;
    if (prompt_left > 0) {
      const int chunk = std::min(prompt_left, prefill_budget);
      if (chunk == 0) continue;  // budget spent: this prompt continues next step
      prefill_budget -= chunk;
      const bool last_chunk = chunk == prompt_left;
      batch_.push_back(ForwardEntry{
          &request.kv, std::span<const int>(prompt).subspan(request.prompt_done, chunk),
          request.prompt_done, last_chunk ? LogitsWanted::kLast : LogitsWanted::kNone});
      if (request.policy != nullptr) {
        batch_.back().attention =
            request.policy->PlanPrefill(request.prompt_done, chunk, last_chunk);
      }
    } else {
      batch_.push_back(ForwardEntry{&request.kv, std::span<const int>(&request.last_token, 1),
                                    request.kv.num_tokens, LogitsWanted::kLast});
      if (request.policy != nullptr) {
        batch_.back().attention = request.policy->PlanDecode(request.kv.num_tokens);
      }
    }
    if (request.residency != nullptr) request.residency->AttachTo(batch_.back());
    if (batch_.back().logits != LogitsWanted::kNone) {
      // A failed forward gives the draw back, so that a retried step samples the same tokens.
      if (request.params.sampling.temperature > 0.0f) {
        rng_before_step_.emplace_back(&request, request.rng);
      }
      TokenSampling& sampling = batch_sampling_[batch_.size() - 1];
      sampling = NextSampling(request);
      sampling.report_probability =
          request.policy != nullptr && request.policy->WantsTokenProbability();
      batch_.back().sampling = &sampling;
    }
    batch_requests_.push_back(&request);
  }
  last_step_prompt_tokens_ = options_.prefill_chunk - prefill_budget;
  if (batch_.empty()) return events;

  Status forward = model_->Forward(batch_, *kv_cache_, forward_result_, window_);
  if (!forward.ok()) {
    for (auto& [request, rng] : rng_before_step_) request->rng = rng;
    if (options_.residency != nullptr && !options_.residency->Broken().ok()) {
      // The residency's peer is gone: its requests cannot continue, the engine can.
      FailResidencyRequests(options_.residency->Broken(), events);
      return events;
    }
    return forward.WithContext("engine step");
  }
  if (forward_result_.sampled_tokens.size() != batch_.size()) {
    return InternalError("engine step: the " + std::string(model_->backend_name()) +
                         " model returned " +
                         std::to_string(forward_result_.sampled_tokens.size()) +
                         " sampled tokens for a batch of " + std::to_string(batch_.size()));
  }

  for (size_t e = 0; e < batch_.size(); ++e) {
    Request& request = *batch_requests_[e];
    if (request.residency != nullptr) {
      // Its storage was lost during this forward (one of several cache ranks): what the model
      // computed for it is void; the retirement below ends it.
      const Status lost = options_.residency->RequestBroken(*request.residency);
      if (!lost.ok()) {
        EndWithError(request, lost, events);
        continue;
      }
    }
    const int prefill_tokens = static_cast<int>(PrefillIds(request).size());
    const bool decode_entry = request.prompt_done >= prefill_tokens;
    if (!decode_entry) {
      request.prompt_done += static_cast<int>(batch_[e].tokens.size());
      if (request.residency != nullptr && request.prompt_done == prefill_tokens) {
        RUBATO_RETURN_IF_ERROR(
            options_.residency->PromptDone(*request.residency, request.kv, *kv_cache_)
                .WithContext("engine step: request " + std::to_string(request.id)));
      }
    }
    if (batch_[e].sampling == nullptr) continue;
    const int token = forward_result_.sampled_tokens[e];
    if (token < 0 || token >= model_->config().vocab_size) {
      return InternalError("engine step: the " + std::string(model_->backend_name()) +
                           " model sampled token " + std::to_string(token) + " for request " +
                           std::to_string(request.id));
    }
    double retained = 1.0;
    if (request.policy == nullptr) {
      retained = RetainedKvRatio(window_, request.kv.num_tokens);
    } else {
      const float probability = forward_result_.sampled_probabilities[e];
      if (request.policy->Observe(decode_entry, token, probability) ==
          PolicyRequest::Verdict::kRedo) {
        if (options_.residency != nullptr) {
          RUBATO_RETURN_IF_ERROR(options_.residency->CheckRedo().WithContext(
              "engine step: request " + std::to_string(request.id)));
        }
        DiscardStep(request);
        continue;
      }
      retained = request.policy->RetainedKvRatio(request.kv.num_tokens);
    }
    request.last_token = token;
    ++request.generated;
    request.output_tokens.push_back(token);
    if (request.params.sampling.repetition_penalty != 1.f) {
      const auto at =
          std::lower_bound(request.seen_tokens.begin(), request.seen_tokens.end(), token);
      if (at == request.seen_tokens.end() || *at != token) request.seen_tokens.insert(at, token);
    }
    request.finish = FinishAfter(request, token);
    events.push_back(TokenEvent{request.id, token, request.finish, retained, Status::Ok()});
    if (request.params.sampling.logprobs >= 0) {
      events.back().logprobs = std::move(forward_result_.sampled_logprobs[e]);
    }
  }
  peak_used_blocks_ = std::max(peak_used_blocks_, kv_cache_->used_blocks());
  if (retained_kv_metric_ != nullptr) {
    for (const TokenEvent& event : events) {
      if (event.finish != FinishReason::kError)
        retained_kv_metric_->Observe(event.retained_kv_ratio);
    }
  }

  // Retire finished requests; their blocks go back to the free list for the next admission.
  for (auto it = running_.begin(); it != running_.end();) {
    if (it->finish == FinishReason::kNone) {
      ++it;
      continue;
    }
    RUBATO_RETURN_IF_ERROR(Retire(*it));
    RUBATO_LOG_DEBUG(kLogSubsystem, "request {} finished after {} tokens", it->id, it->generated);
    it = running_.erase(it);
  }
  return events;
}

Status Engine::Cancel(uint64_t request_id) {
  const auto has_id = [request_id](const Request& request) { return request.id == request_id; };
  if (auto it = std::find_if(waiting_.begin(), waiting_.end(), has_id); it != waiting_.end()) {
    waiting_.erase(it);  // nothing reserved yet
    return Status::Ok();
  }
  if (auto it = std::find_if(running_.begin(), running_.end(), has_id); it != running_.end()) {
    const Status released = Retire(*it);
    running_.erase(it);
    RUBATO_LOG_DEBUG(kLogSubsystem, "request {} cancelled", request_id);
    return released;
  }
  return NotFoundError("engine: no waiting or running request " + std::to_string(request_id));
}

Status Engine::Retire(Request& request) {
  if (request.residency != nullptr) {
    const std::unique_ptr<ResidencyRequest> storage = std::move(request.residency);
    RUBATO_RETURN_IF_ERROR(
        options_.residency->Close(*storage).WithContext("request " + std::to_string(request.id)));
  }
  return kv_cache_->Release(request.kv);
}

void Engine::FailResidencyRequests(const Status& why, std::vector<TokenEvent>& events) {
  for (auto it = running_.begin(); it != running_.end();) {
    // A request kept wholly in the paged cache lost nothing with the peer.
    if (it->residency == nullptr || it->residency->WhollyLocal()) {
      ++it;
      continue;
    }
    EndWithError(*it, why, events);
    const Status released = Retire(*it);
    if (!released.ok()) RUBATO_LOG_ERROR(kLogSubsystem, "{}", released.message());
    it = running_.erase(it);
  }
}

void Engine::FailLostResidencyRequests(std::vector<TokenEvent>& events) {
  if (options_.residency == nullptr) return;
  for (auto it = running_.begin(); it != running_.end();) {
    const Status lost =
        it->residency != nullptr ? options_.residency->RequestBroken(*it->residency) : Status::Ok();
    if (lost.ok()) {
      ++it;
      continue;
    }
    EndWithError(*it, lost, events);
    const Status released = Retire(*it);
    if (!released.ok()) RUBATO_LOG_ERROR(kLogSubsystem, "{}", released.message());
    it = running_.erase(it);
  }
}

void Engine::EndWithError(Request& request, const Status& why, std::vector<TokenEvent>& events) {
  const Status error =
      Status(why.code(), "request " + std::to_string(request.id) + ": " + why.message());
  RUBATO_LOG_WARN(kLogSubsystem, "{}", error.message());
  events.push_back(TokenEvent{request.id, -1, FinishReason::kError, 1.0, error});
  request.finish = FinishReason::kError;
}

}  // namespace rubato
