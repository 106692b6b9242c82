// The backend-neutral model interface: what the engine calls, whatever runs the forward pass
// (the fp32 CPU reference, cpu_model.h, or the bf16 CUDA model, cuda_model.h).
//
// A forward takes a batch of entries, each one sequence's new tokens (a prefill chunk or one
// decode token) at its next positions, writes their K/V into a paged KV cache made by the same
// model (CreateKvCache), and returns the logits the entries asked for and, for the entries that
// ask, the next token sampled from their last logits. Sampling belongs to the model so that the
// CUDA backend can sample on the device and return token ids instead of [batch][vocab] logits;
// the randomness stays with the caller (TokenSampling::uniform), so both backends draw the same
// token from the same logits and the same request seed.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "common/hf_config.h"
#include "common/status.h"
#include "inference_rank/attention/attention_backend.h"
#include "inference_rank/attention/layer_action.h"
#include "inference_rank/kv/kv_pool_sizing.h"
#include "inference_rank/kv/paged_kv_cache.h"
#include "inference_rank/kv/slot_kv_pool.h"
#include "inference_rank/model/model_weights.h"
#include "inference_rank/residency/residency_backend.h"
#include "kernels/cpu/attention_window.h"
#include "kernels/cpu/sampling.h"

namespace rubato {

struct ModelLoadOptions {
  bool random_weights = false;  // build the weights from config.json alone (no checkpoint read)
  uint64_t seed = 0;            // seed of random_weights
  int num_threads = 0;          // CPU threads for GEMMs and attention; 0 = all cores
};

// The largest step the engine will run (what a backend's workspaces must hold): its tokens (a
// prefill chunk plus one decode token per other running request), its entries, and the
// longest context any entry attends.
struct StepBounds {
  int max_tokens = 0;
  int max_entries = 0;
  int max_context = 0;
};

// Which logits a batch entry needs.
enum class LogitsWanted {
  kNone,  // none (a prefill chunk that does not end the prompt): skips the lm_head
  kLast,  // the entry's last token only (decode, the last prefill chunk)
  kAll,   // every token of the entry (scoring, golden tests)
};

// One entry's next-token choice, made by the model right after its forward (on the GPU for the
// CUDA backend, so that a decode step returns token ids, not [batch][vocab] logits).
struct TokenSampling {
  float temperature = 0.f;  // 0 = greedy
  int top_k = 0;            // 0 = off
  float top_p = 1.f;        // (0, 1]
  double uniform = 0.0;     // [0, 1): the request's draw (kernels/cpu/sampling.h DrawUniform);
                            // unused when greedy
  bool report_probability = false;  // also report the chosen token's TokenProbability
                                    // (ForwardResult::sampled_probabilities), of the logits
                                    // after `adjustments`
  // Penalties and logit_bias, applied before greedy or sampling (kernels/cpu/sampling.h) by both
  // backends (the CUDA model on the device, docs/cuda_model.md). Its spans must outlive the
  // Forward call.
  LogitAdjustments adjustments = {};
  // >= 0: also report the token's TokenLogprobs with that many alternatives, of the logits
  // before `adjustments` (ForwardResult::sampled_logprobs). The CPU model only: the CUDA model
  // leaves sampled logits on the device (the engine refuses such requests there).
  int logprobs = -1;
};

struct ForwardEntry {
  KvSequence* sequence = nullptr;  // its block table; blocks are reserved by Forward as needed
  std::span<const int> tokens;     // new token ids: a prefill chunk or one decode token
  int start_position = 0;          // position of tokens[0]; <= sequence->num_tokens (equal
                                   // when continuing; smaller rewinds and overwrites)
  LogitsWanted logits = LogitsWanted::kLast;
  const TokenSampling* sampling = nullptr;  // set: sample this entry's last token (needs
                                            // logits != kNone); must outlive the Forward call
  // Set: the entry's attention as its policy planned it (layer_action.h), executed with the
  // operands of the model's attention backend (SetAttentionBackend). Null: dense through the
  // forward's window. Must outlive the Forward call.
  const EntryAttention* attention = nullptr;
  // Set: a residency holds the entry's KV (its handle, made by the residency's engine half; the
  // model passes it to the installed residency backend, SetResidencyBackend): every layer's new
  // K/V and last query go to that backend after the local append, and the backend says what
  // the entry attends (the local cache, a compact segment plus the recent segment, or output it
  // wrote itself). Must outlive Forward.
  const ResidencyEntry* residency = nullptr;
  // Set: the entry has slot arrays (kv/slot_kv_pool.h). A prefill chunk still runs through the
  // paged cache (the attention backend moves the prompt into the slots); a kFixedBudget entry
  // (one decode token) writes each layer's new K/V into the slots its arrays' next_slot names,
  // not the paged cache (no block is reserved for it), and the attention backend attends the
  // slots. Must outlive Forward.
  const SlotKvForward* slots = nullptr;
};

// An entry whose plan is kFixedBudget (in every layer: validation refuses mixed plans).
inline bool IsFixedBudgetEntry(const ForwardEntry& entry) {
  return entry.attention != nullptr &&
         entry.attention->ActionFor(0).op == AttentionOp::kFixedBudget;
}

// Output of a forward. Reused across calls, so that a steady decode loop does not allocate.
struct ForwardResult {
  int vocab_size = 0;
  std::vector<float> logits;         // [rows][vocab], f32, entries' rows in batch order
  std::vector<int> entry_first_row;  // [entries] first row of each entry
  std::vector<int> entry_row_count;  // [entries] 0 (kNone or logits left on the device),
                                     // 1 (kLast) or tokens (kAll)
  std::vector<int> sampled_tokens;   // [entries] token id, -1 where the entry had no sampling
  // [entries] kernels/cpu TokenProbability of the sampled token (softmax of the entry's last
  // logits at temperature 1) where the entry's sampling asked for it, else -1.
  std::vector<float> sampled_probabilities;
  // [entries] where the entry's sampling asked for logprobs (TokenSampling::logprobs), else empty.
  std::vector<TokenLogprobs> sampled_logprobs;

  // Empties the result for a batch of `entries` (no logits rows, no sampled tokens); what every
  // backend's Forward does first.
  void Reset(int vocab, size_t entries) {
    vocab_size = vocab;
    logits.clear();
    entry_first_row.assign(entries, 0);
    entry_row_count.assign(entries, 0);
    sampled_tokens.assign(entries, -1);
    sampled_probabilities.assign(entries, -1.0f);
    sampled_logprobs.assign(entries, TokenLogprobs());
  }

  // [entry_row_count[entry]][vocab] logits of one entry.
  std::span<const float> EntryLogits(int entry) const {
    const size_t e = static_cast<size_t>(entry);
    return std::span<const float>(logits).subspan(
        static_cast<size_t>(entry_first_row[e]) * vocab_size,
        static_cast<size_t>(entry_row_count[e]) * vocab_size);
  }
  // [vocab] logits of the entry's last token; empty when the entry has no logits rows.
  std::span<const float> LastLogits(int entry) const {
    const std::span<const float> rows = EntryLogits(entry);
    if (rows.empty()) return rows;
    return rows.subspan(rows.size() - static_cast<size_t>(vocab_size));
  }
};

class Model {
 public:
  virtual ~Model() = default;

  virtual const ModelConfig& config() const = 0;
  virtual std::string_view backend_name() const = 0;  // "cpu" | "cuda"
  virtual size_t weight_bytes() const = 0;  // bytes of the weights as stored by this backend
  int64_t parameter_count() const { return ParameterCount(config()); }  // model_weights.h

  // A KV cache shaped for this model, its pools where this backend computes (host or device).
  virtual Result<std::unique_ptr<PagedKvCache>> CreateKvCache(int block_tokens, int num_blocks) = 0;
  // What the KV pool's sizing reads (kv/kv_pool_sizing.h), now: the memory CreateKvCache
  // allocates from (host memory, the CUDA device) with its total and free bytes, the bytes of
  // one block of `block_tokens` tokens, and the workspaces the backend will still allocate on
  // first need for steps within `bounds`.
  virtual Result<KvPoolMemory> KvPoolMemoryFor(int block_tokens,
                                               const StepBounds& bounds) const = 0;
  // A pool of `num_arrays` slot arrays of `budget` slots per (layer, KV head) for this model
  // (kv/slot_kv_pool.h; its arrays where this backend computes); Unsupported where the backend
  // has none.
  virtual Result<std::unique_ptr<SlotKvPool>> CreateSlotKvPool(int budget, int num_arrays) {
    (void)budget;
    (void)num_arrays;
    return UnsupportedError("the " + std::string(backend_name()) + " model has no KV slot arrays");
  }

  // Runs one batch. For each entry, reserves KV blocks for its new positions (all entries or
  // none: ResourceExhausted when the cache is full), writes the new K/V of every layer, and
  // sets sequence->num_tokens = start_position + tokens.size(). Errors (InvalidArgument) name
  // the entry: empty tokens, a token id outside the vocabulary, a start position past the
  // sequence's cached tokens, a sequence appearing twice in one batch, sampling on a kNone
  // entry or with invalid values; an attention window with sink < 0 or recent < 1 is
  // InvalidArgument too (ValidateForwardBatch below holds these checks).
  //
  // `window` restricts the keys every query of the batch attends, in every layer, prefill and
  // decode alike (attention_window.h): dense by default; a sink + recent window masks the
  // rest.
  //
  // Entries with `sampling` set get result.sampled_tokens[entry] drawn from their last
  // logits (greedy: ArgMax; else SampleTokenWithUniform with sampling->uniform). A backend may
  // leave such an entry's logits empty (entry_row_count 0) when it asked for kLast: the CUDA
  // model samples on the device and copies only the token back. kAll always returns logits.
  //
  // Validation, allocation and block reservation errors leave every sequence as it was. An
  // error after device work started (a failed launch or copy; CUDA only) may have written some
  // layers' K/V of the batch's new positions: num_tokens is not advanced, so appended positions
  // are simply rewritten by a retry, but an entry that rewinds (start_position < num_tokens)
  // has lost the overwritten positions and its sequence should be dropped.
  virtual Status Forward(std::span<const ForwardEntry> batch, PagedKvCache& cache,
                         ForwardResult& result,
                         const AttentionWindow& window = AttentionWindow()) = 0;

  // Host threads the backend may use (CPU: attention workers and OpenBLAS); 0 = all cores.
  virtual void SetNumThreads(int /*num_threads*/) {}

  // Installs the backend half of the engine's attention policy (inference_rank/attention/), made
  // for this model; null removes it. Entries with `attention` need the backend of the policy
  // that planned them. InvalidArgument for a backend of another model type; FailedPrecondition
  // while requests still hold its resources (the CUDA model's pools).
  virtual Status SetAttentionBackend(std::unique_ptr<AttentionBackend> backend) = 0;
  virtual AttentionBackend* attention_backend() = 0;

  // Installs the model half of the engine's residency (inference_rank/residency/), made for this
  // model; null removes it. Entries with a `residency` handle need the half of the residency
  // that made it (FailedPrecondition without one). InvalidArgument for a half of another model
  // type.
  virtual Status SetResidencyBackend(std::unique_ptr<ResidencyBackend> backend) {
    if (backend == nullptr) return Status::Ok();
    return UnsupportedError("the " + std::string(backend_name()) +
                            " model takes no residency backend");
  }
  virtual ResidencyBackend* residency_backend() const { return nullptr; }
};

// ---- shared by the backends' Forward --------------------------------------------------------

// The checks of Model::Forward's contract, before anything is reserved or written: the window,
// the cache's shape against `config`, and every entry (sequence, tokens, start position,
// duplicate sequences, sampling).
Status ValidateForwardBatch(const ModelConfig& config, std::span<const ForwardEntry> batch,
                            const PagedKvCache& cache, const AttentionWindow& window);

// Reserves the blocks every entry needs for its new positions, all entries or none
// (ResourceExhausted naming the shortfall). kFixedBudget entries need none (their K/V go to
// their slots).
Status ReserveForwardBlocks(std::span<const ForwardEntry> batch, PagedKvCache& cache);

// What TokenSampling means, on the host: the adjustments applied to a copy of `logits`, then
// ArgMax when greedy, else SampleTokenWithUniform with sampling.uniform. logits: [vocab], f32.
// The CPU model's sampler and the CUDA sampler's twin. `probability`, when not null, gets the
// chosen token's TokenProbability over the adjusted logits.
int SampleOnHost(std::span<const float> logits, const TokenSampling& sampling,
                 SamplingWorkspace& workspace, float* probability = nullptr);

}  // namespace rubato
