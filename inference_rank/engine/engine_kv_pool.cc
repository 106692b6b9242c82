// The engine's KV pool: its size from the memory the weights and workspaces left
// (gpu_memory_utilization, kv/kv_pool_sizing.h), blocks taken as running requests grow, and
// vLLM's recompute preemption of the newest running request when the pool runs out (see
// engine.h; docs/engine_and_models.md "The KV pool").
#include <fmt/format.h>

#include <algorithm>
#include <string>
#include <utility>

#include "common/logging.h"
#include "inference_rank/engine/engine.h"
#include "inference_rank/kv/kv_pool_sizing.h"

namespace rubato {
namespace {

constexpr const char* kLogSubsystem = "engine";

std::string GiB(uint64_t bytes) {
  return fmt::format("{:.2f} GiB", static_cast<double>(bytes) / double(uint64_t{1} << 30));
}

}  // namespace

Result<std::string> Engine::SizeKvPoolFromMemory(const Model& model, EngineOptions& options) {
  // The largest step: a prefill chunk plus one decode token of every other running request.
  const StepBounds bounds{options.prefill_chunk + options.max_batch, options.max_batch,
                          options.max_context};
  Result<KvPoolMemory> memory = model.KvPoolMemoryFor(options.block_size, bounds);
  if (!memory.ok()) return memory.status().WithContext("engine: sizing the KV pool");
  const int64_t blocks_per_sequence =
      (int64_t{options.max_context} + options.block_size - 1) / options.block_size;
  Result<KvPoolSize> size =
      SizeKvPool(*memory, options.gpu_memory_utilization, blocks_per_sequence * options.max_batch);
  if (!size.ok()) return size.status().WithContext("engine");
  options.max_kv_blocks = size->num_blocks;
  return fmt::format("gpu_memory_utilization {} of {}: {} total, {} free after the weights{}{}",
                     options.gpu_memory_utilization, memory->where, GiB(memory->total_bytes),
                     GiB(memory->free_bytes),
                     memory->pending_bytes > 0
                         ? ", " + GiB(memory->pending_bytes) + " of workspaces to come"
                         : std::string(),
                     size->capped ? ", capped at what max_batch x max_context can use" : "");
}

Status Engine::GrowDecodingRequests() {
  for (size_t i = 0; i < running_.size(); ++i) {
    Request* request = &running_[i];
    // A request still prefilling holds the blocks of its whole prefill since admission.
    if (request->prompt_done < static_cast<int>(PrefillIds(*request).size())) continue;
    const int tokens = request->kv.num_tokens + 1;  // its next decode token's position
    bool preempted_itself = false;
    while (kv_cache_->BlocksFor(tokens) - static_cast<int>(request->kv.block_table.size()) >
           kv_cache_->free_blocks()) {
      // The oldest request never gets here with nothing to preempt: alone, its whole sequence
      // fits the pool (Submit refuses one that does not).
      preempted_itself = i + 1 == running_.size();
      RUBATO_RETURN_IF_ERROR(PreemptNewest());
      if (preempted_itself) break;
    }
    if (preempted_itself) break;  // it was the newest: nothing after it is left
    RUBATO_RETURN_IF_ERROR(kv_cache_->Reserve(request->kv, tokens).WithContext("engine step"));
  }
  return Status::Ok();
}

int Engine::WindowBlocks(int window) const {
  // Positions [a, a + W] span blocks a / bt .. (a + W) / bt: at most ceil(W / bt) + 1.
  return kv_cache_->BlocksFor(window) + 1;
}

int Engine::LocalBlocksBound(const Request& request) const {
  const int full = kv_cache_->BlocksFor(ReservedTokens(request.params));
  if (request.window < 0) return full;  // its whole sequence, reserved at admission
  const int prefill = static_cast<int>(PrefillIds(request).size());
  const int bound = request.prompt_done < prefill
                        ? std::max(kv_cache_->BlocksFor(prefill), WindowBlocks(request.window))
                        : WindowBlocks(request.window);
  return std::min(full, bound);
}

int Engine::PromisedBlocks() const {
  int promised = 0;
  for (const Request& request : running_) {
    promised += std::max(0, LocalBlocksBound(request) - PagedKvCache::HeldBlocks(request.kv));
  }
  return promised;
}

Status Engine::SlideLocalWindows() {
  for (Request& request : running_) {
    if (request.window < 0) continue;  // wholly local: every position reserved at admission
    if (request.prompt_done < static_cast<int>(PrefillIds(request).size())) continue;
    const int position = request.kv.num_tokens;  // its next decode token's
    RUBATO_RETURN_IF_ERROR(kv_cache_->ReleaseBefore(request.kv, position - request.window)
                               .WithContext("engine step: request " + std::to_string(request.id)));
    // Within its bound, which admission kept free: never short.
    RUBATO_RETURN_IF_ERROR(
        kv_cache_->Reserve(request.kv, position + 1)
            .WithContext("engine step: request " + std::to_string(request.id) + "'s local window"));
  }
  return Status::Ok();
}

Status Engine::PreemptNewest() {
  Request& victim = running_.back();
  if (victim.residency != nullptr) {
    const std::unique_ptr<ResidencyRequest> storage = std::move(victim.residency);
    RUBATO_RETURN_IF_ERROR(options_.residency->Close(*storage).WithContext(
        "engine: preempting request " + std::to_string(victim.id)));
  }
  RUBATO_RETURN_IF_ERROR(kv_cache_->Release(victim.kv));
  // Its policy state goes with its KV; admission makes a fresh one for the recompute.
  victim.policy.reset();
  victim.recompute_ids.clear();
  if (victim.generated > 0) {
    // Every generated token, the newest included: the recompute's last chunk samples the next
    // token, as the decode step of the newest would have.
    victim.recompute_ids = victim.params.prompt_ids;
    victim.recompute_ids.insert(victim.recompute_ids.end(), victim.output_tokens.begin(),
                                victim.output_tokens.end());
  }
  victim.prompt_done = 0;
  ++num_preemptions_;
  ++last_step_preemptions_;
  RUBATO_LOG_DEBUG(kLogSubsystem,
                   "preempt request {} ({} tokens generated): the KV pool has no free block; it "
                   "recomputes {} tokens when it runs again",
                   victim.id, victim.generated, PrefillIds(victim).size());
  // First in the queue: it runs again before any request that came after it.
  waiting_.push_front(std::move(victim));
  running_.pop_back();
  return Status::Ok();
}

}  // namespace rubato
