// The generation engine of an inference rank: requests in, tokens out, one scheduler step at a
// time (FCFS continuous batching over a paged KV pool sized from free memory, KV blocks taken as
// requests grow, the newest running request preempted and later recomputed when the pool runs
// out, or, where a request's full KV lives elsewhere, only its prompt and then its residency's
// local window held; mixed prefill chunks and decode tokens per forward). The attention policy's
// host half plans every entry and judges every token (accept, or redo: the engine rewinds and gives
// the sampling draw back). Used by the CLI and the HTTP server; backend-neutral; one thread drives
// it. docs/engine_and_models.md.
#pragma once

#include <cstdint>
#include <deque>
#include <memory>
#include <optional>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "common/metrics.h"
#include "common/status.h"
#include "inference_rank/attention/policy.h"
#include "inference_rank/kv/paged_kv_cache.h"
#include "inference_rank/model/model.h"
#include "inference_rank/residency/residency.h"

namespace rubato {

// Temperatures below this sample greedily (vLLM's sampling epsilon): dividing logits by less
// overflows fp32.
inline constexpr float kGreedyBelowTemperature = 1e-5f;
// The most alternatives SamplingParams::logprobs may ask for (OpenAI's top_logprobs limit).
inline constexpr int kMaxLogprobs = 20;

struct SamplingParams {
  float temperature = 0.f;  // 0 (or below kGreedyBelowTemperature) = greedy (argmax, lowest id)
  int top_k = 0;            // 0 = off
  float top_p = 1.f;        // in (0, 1]; 1 = off
  uint64_t seed = 0;        // seeds this request's own RNG
  // OpenAI's logit processors (kernels/cpu/sampling.h LogitAdjustments); the CPU backend only.
  float presence_penalty = 0.f;   // [-2, 2]
  float frequency_penalty = 0.f;  // [-2, 2]
  std::vector<std::pair<int, float>> logit_bias =
      {};  // (token id, bias in [-100, 100]), ids unique
  // vLLM's / transformers' repetition penalty, in (0, 2]; 1 = off. The CPU backend only.
  float repetition_penalty = 1.f;
  // Log-probabilities to report with each token (TokenEvent::logprobs): -1 none; 0..20 the
  // sampled token's and that many most likely alternatives'. The CPU backend only.
  int logprobs = -1;
};

struct GenerationRequest {
  std::vector<int> prompt_ids;
  SamplingParams sampling;
  int max_new_tokens = 128;
  std::vector<int> stop_token_ids;  // empty: the model's eos ids (config.json eos_token_id)
  bool ignore_eos = false;          // empty stop_token_ids stay empty: only max_new_tokens ends it
};

struct EngineOptions {
  int max_batch = 8;
  int max_context = 0;      // prompt + generated tokens; 0 = model max_position_embeddings
  int block_size = 16;      // KV block tokens: 16 or 64
  int prefill_chunk = 512;  // prompt tokens per step, over all requests
  int num_threads = 0;      // 0 = all cores; sets OpenBLAS threads (process-wide)
  // The KV pool's blocks (engine.kv_pool_tokens / block_size); 0 = sized at Create from the free
  // memory of the model's backend by gpu_memory_utilization (kv/kv_pool_sizing.h), at most
  // what max_batch x max_context can use.
  int max_kv_blocks = 0;
  // (0, 1]: the share of the memory the KV pool lives in (the GPU's; host memory for the CPU
  // backend) that this process may fill, weights and workspaces included (vLLM's
  // gpu_memory_utilization). Unused when max_kv_blocks is set.
  double gpu_memory_utilization = 0.9;
  // The attention policy every request follows (its host half; the engine installs its backend
  // half in the model). Null: dense. Shared with the caller, who may read its counters.
  std::shared_ptr<AttentionPolicy> policy;
  // Optional: where the engine registers and updates its metrics (docs/design.md §3 names):
  // rubato:retained_kv_ratio (a histogram, one observation per sampled token) and the policy's own
  // (AttentionPolicy::RegisterMetrics). Must outlive the engine.
  MetricsRegistry* metrics = nullptr;
  // Where requests' KV lives (docs/design.md §3 "KV residency", docs/residency.md): a residency of
  // inference_rank/residency/ (residency_registry.h makes one by name). Null: the paged cache
  // holds every position (local). The policy must support it (its traits). The engine asks it
  // what to reserve at admission, opens and closes each request's storage with it, installs its
  // model half at Create, and when its peer breaks ends every request it holds with an error
  // event (requests whose storage cannot be opened end alike). Shared with the caller, who may
  // read its counters.
  std::shared_ptr<Residency> residency;
};

enum class FinishReason {
  kNone,    // more tokens follow
  kStop,    // the token is a stop token (it is reported; callers usually do not print it)
  kLength,  // max_new_tokens generated, or prompt + generated reached max_context
  kError,   // the request failed (TokenEvent::error says why); token is -1
};

struct TokenEvent {
  uint64_t request_id;
  int token;
  FinishReason finish;
  // Fraction of the request's KV positions that the query which produced this token could
  // attend: the last query's when finish != kNone. 1 for dense attention; for a window,
  // (sink + recent) / context once the context is longer than sink + recent; for a selection,
  // what the policy kept (PolicyRequest::RetainedKvRatio).
  double retained_kv_ratio = 1.0;
  Status error;  // kError: why the request failed (e.g. its residency's peer was lost)
  // SamplingParams::logprobs >= 0: the token's log-probability and the top alternatives
  // (kernels/cpu/sampling.h TokenLogprobs); empty otherwise.
  TokenLogprobs logprobs = {};
};

// VisibleKeys / context for the query at position context - 1 (context >= 1).
double RetainedKvRatio(const AttentionWindow& window, int context);

class Engine {
 public:
  // Validates `options` (positive sizes, block_size 16 or 64, max_context within the model's
  // max_position_embeddings, gpu_memory_utilization in (0, 1], the policy's window and its
  // support of the KV residency), installs the policy's backend half for max_batch requests
  // (Model::SetAttentionBackend: e.g. the CUDA model's compact pool) and the residency's, then
  // sizes the KV pool from the memory left (unless max_kv_blocks is set) and creates it.
  static Result<std::unique_ptr<Engine>> Create(std::unique_ptr<Model> model,
                                                const EngineOptions& options);

  // The sizes of `options` checked against `model`'s shapes and resolved (max_context 0: the
  // model's max_position_embeddings; max_kv_blocks stays 0 when the pool is to be sized from
  // memory), without a model or any allocation: what Create checks first, and what
  // `rubato serve --check` runs.
  static Result<EngineOptions> ResolveSizes(const ModelConfig& model, const EngineOptions& options);

  // Queues a request and returns its id (1, 2, ...). InvalidArgument for an empty prompt, ids
  // outside [0, vocab), temperature < 0, top_p outside (0, 1], top_k < 0, max_new_tokens < 1,
  // repetition_penalty outside (0, 2], logprobs outside [-1, 20]; Unsupported for a
  // repetition_penalty or logprobs on a backend that samples on the device (cuda);
  // OutOfRange for a prompt of max_context tokens or more; ResourceExhausted when the request's
  // sequence (prompt + max_new_tokens within max_context; with a local window, its prompt and
  // then its window) could never fit in the KV pool, even alone.
  Result<uint64_t> Submit(GenerationRequest request);

  // One scheduler step (see the file comment). Returns the tokens generated in this step, at
  // most one per running request, in admission order; empty when only prefill chunks ran or
  // there is no work. A request whose token its policy threw away has no event this step.
  Result<std::vector<TokenEvent>> Step();

  // Ends request `request_id` without another token event: a waiting request leaves the queue,
  // a running one is retired (its KV blocks go back to the free list, its residency's storage is
  // closed). Used when a client goes away or a stop string ended the text. NotFound when no
  // waiting or running request has that id (it finished already, or never existed).
  Status Cancel(uint64_t request_id);

  bool HasWork() const { return !waiting_.empty() || !running_.empty(); }
  const Model& model() const { return *model_; }

  // For metrics and tests.
  int num_waiting() const { return static_cast<int>(waiting_.size()); }
  int num_running() const { return static_cast<int>(running_.size()); }
  const PagedKvCache& kv_cache() const { return *kv_cache_; }
  // One line on the KV pool: its tokens, blocks and bytes, and what sized it.
  const std::string& kv_pool_summary() const { return kv_pool_summary_; }
  // Running requests preempted so far (their KV freed, recomputed when they run again), and in
  // the last Step.
  int64_t num_preemptions() const { return num_preemptions_; }
  int last_step_preemptions() const { return last_step_preemptions_; }
  // The residency's local window (Residency::LocalWindow) when the engine keeps only it, else
  // -1 (every position of a running request is held).
  int local_window() const { return local_window_; }
  // The most KV blocks held at once so far (after a step's forward).
  int peak_used_blocks() const { return peak_used_blocks_; }
  const EngineOptions& options() const { return options_; }  // with defaults resolved
  // The requests the last Step moved from waiting to running for the first time (their queue
  // time ends there; a preempted request that runs again is not listed).
  const std::vector<uint64_t>& admitted() const { return admitted_; }
  // Prompt tokens the last Step prefilled (vLLM's iteration tokens add the tokens it generated).
  int last_step_prompt_tokens() const { return last_step_prompt_tokens_; }

 private:
  struct Request {
    uint64_t id = 0;
    GenerationRequest params;  // stop_token_ids resolved to the model's eos ids when empty
    std::mt19937_64 rng;
    KvSequence kv;
    // After a preemption: the prompt and the tokens generated before it, prefilled again in
    // place of the prompt (vLLM's recompute); empty otherwise. PrefillIds says which.
    std::vector<int> recompute_ids;
    int prompt_done = 0;  // tokens of PrefillIds already in the KV cache
    int generated = 0;
    bool admitted_before = false;    // ran once already (then preempted)
    std::vector<int> output_tokens;  // every generated token (penalties, recompute)
    // repetition_penalty != 1: the distinct ids of the prompt and the output so far, sorted.
    std::vector<int> seen_tokens;
    int last_token = -1;  // newest generated token: the input of the next decode step
    FinishReason finish = FinishReason::kNone;
    std::unique_ptr<PolicyRequest> policy;  // the policy's state of it, or null (dense)
    // Its storage in options.residency (opened at admission), or null.
    std::unique_ptr<ResidencyRequest> residency;
    // Its local window: the engine's (local_window_), or -1 when its storage is WhollyLocal.
    int window = -1;
  };

  Engine(std::unique_ptr<Model> model, std::unique_ptr<PagedKvCache> kv_cache,
         const EngineOptions& options);

  // Positions of a request's KV that the paged cache may ever hold (prompt + generated - 1, the
  // last sampled token is never fed back; what the residency says otherwise).
  int ReservedTokens(const GenerationRequest& request) const;
  // What a request prefills before it decodes: its prompt, or after a preemption the prompt and
  // the tokens it generated.
  static const std::vector<int>& PrefillIds(const Request& request) {
    return request.recompute_ids.empty() ? request.params.prompt_ids : request.recompute_ids;
  }
  // Sets options.max_kv_blocks from the memory the model's pool lives in (engine_kv_pool.cc,
  // kv/kv_pool_sizing.h) and returns how it was sized, for the log.
  static Result<std::string> SizeKvPoolFromMemory(const Model& model, EngineOptions& options);
  // Preemptible pools (engine_kv_pool.cc): gives every running request that decodes this step
  // the block its next position needs, oldest first; when none is free, preempts the newest
  // running request (possibly the one asking), until the block is there.
  Status GrowDecodingRequests();
  // A local window W >= 0 (engine_kv_pool.cc): the blocks positions [p - W, p] span at most.
  int WindowBlocks(int window) const;
  // A local window: the most blocks `request` may hold from now on: its prompt's (or the
  // window's, the larger) while it prefills, then the window's; never more than its whole
  // sequence's (all of them for a request without a window of its own).
  int LocalBlocksBound(const Request& request) const;
  // A local window: the blocks running requests may still take within their bounds (what
  // admission keeps free for them).
  int PromisedBlocks() const;
  // A local window: for every request with one that decodes this step, releases the blocks
  // before its window and takes the block of its next position (within its bound: never short).
  Status SlideLocalWindows();
  // Frees the newest running request's KV and residency storage and puts it first in the queue,
  // to prefill its prompt and generated tokens again when it is admitted.
  Status PreemptNewest();
  // Moves waiting requests to running while the batch and the KV cache have room; a request
  // whose residency storage cannot be opened ends with an error event in `events`.
  Status AdmitWaiting(std::vector<TokenEvent>& events);
  // The residency's peer broke: every running request it holds ends with an error event naming
  // why.
  void FailResidencyRequests(const Status& why, std::vector<TokenEvent>& events);
  // Ends every running request whose own residency storage is lost (Residency::RequestBroken:
  // one of several cache ranks), with an error event naming why; the others run on.
  void FailLostResidencyRequests(std::vector<TokenEvent>& events);
  // The error event of a request that ends with `why`; the caller retires it.
  void EndWithError(Request& request, const Status& why, std::vector<TokenEvent>& events);
  // Frees a finished request's KV blocks and closes its residency storage.
  Status Retire(Request& request);
  // The TokenSampling of a request's next token: its filter, and one draw of its RNG unless
  // greedy.
  TokenSampling NextSampling(Request& request);
  FinishReason FinishAfter(const Request& request, int token) const;
  // The policy threw the step's token away: forgets the position it wrote and the RNG draw it
  // used (no token event); the next step plans the same position again.
  void DiscardStep(Request& request);

  std::unique_ptr<Model> model_;
  std::unique_ptr<PagedKvCache> kv_cache_;
  EngineOptions options_;
  // Running requests take KV blocks as they grow and may be preempted: the local residency (or
  // none). Otherwise admission reserves each request's ReservedTokens whole.
  bool preemptible_ = true;
  // Residency::LocalWindow of a residency that is not preemptible, else -1: running requests
  // hold only their prompt, then their window, and take blocks as they grow.
  int local_window_ = -1;
  int peak_used_blocks_ = 0;
  std::string kv_pool_summary_;
  int64_t num_preemptions_ = 0;
  int last_step_preemptions_ = 0;
  uint64_t next_id_ = 1;
  std::deque<Request> waiting_;
  std::deque<Request> running_;  // admission order

  // Per-step state reused across steps.
  std::vector<ForwardEntry> batch_;
  std::vector<Request*> batch_requests_;  // [batch entries]
  // RNG states of the batch's sampling requests before this step drew from them, restored when
  // the forward fails (one draw per sampled token, never per attempt).
  std::vector<std::pair<Request*, std::mt19937_64>> rng_before_step_;
  std::vector<TokenSampling> batch_sampling_;  // [batch entries]; what entries' sampling points to
  AttentionWindow window_;                     // the policy's (dense without one)
  Histogram* retained_kv_metric_ = nullptr;    // in options_.metrics, when set
  std::vector<uint64_t> admitted_;             // ids moved to running by the last Step
  int last_step_prompt_tokens_ = 0;            // prompt tokens in the last Step's batch
  ForwardResult forward_result_;
};

}  // namespace rubato
