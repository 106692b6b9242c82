// The engine half of a residency (docs/residency.md): where a request's full KV lives, as the
// engine sees it. It admits (the positions the paged cache reserves for a request), opens and
// closes a request's storage (a session on a cache rank, slot arrays), installs its model half
// in the model, attaches a request's handles to its forward entries, runs its per-step hooks
// and says when its peer failed (the engine then ends the affected requests with an error
// event). The engine drives it and never names one; residencies are one folder each under
// inference_rank/residency/ and one line of residency_registry.cc.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>

#include "common/metrics.h"
#include "common/status.h"
#include "inference_rank/attention/kv_residency.h"
#include "inference_rank/attention/policy.h"
#include "inference_rank/kv/paged_kv_cache.h"
#include "inference_rank/model/model.h"

namespace rubato {

// One request's storage, owned by the engine from admission to retirement.
class ResidencyRequest {
 public:
  virtual ~ResidencyRequest() = default;
  // Sets the request's handles on its next forward entry (ForwardEntry::residency, ::slots); they
  // live as long as this object.
  virtual void AttachTo(ForwardEntry& entry) const = 0;
  // Whether the request's whole KV lives in this rank's paged cache although the residency
  // keeps a local window (a residency that places each request on a tier, docs/residency.md
  // "Placement"): the engine then reserves its whole sequence and releases nothing.
  virtual bool WhollyLocal() const { return false; }
};

class Residency {
 public:
  virtual ~Residency() = default;

  virtual std::string_view name() const = 0;  // its table name ("offloaded")
  virtual KvResidency kind() const = 0;       // what policies declare support for

  // Engine::Create, before anything is allocated: what the residency needs of `policy` (null:
  // dense) beyond the support the engine checks from its traits.
  virtual Status Check(const AttentionPolicy* /*policy*/) const { return Status::Ok(); }
  // Engine::Create, after the policy's backend half and before the KV cache: the storage of up
  // to `max_batch` running requests and the model half (Model::SetResidencyBackend). Called
  // once: a residency serves one engine.
  virtual Status Attach(Model& /*model*/, const AttentionPolicy* /*policy*/, int /*max_batch*/) {
    return Status::Ok();
  }

  // Positions of a request's KV the paged cache must hold at most: by default every position
  // but the last sampled token's, of `longest` (prompt + max_new_tokens within max_context).
  virtual int ReservedTokens(int /*prompt_tokens*/, int longest) const { return longest - 1; }
  // Whether the engine may take a running request's paged blocks back when the pool runs out
  // and recompute its KV later, by prefilling its prompt and generated tokens again (vLLM's
  // recompute preemption): only where the paged cache holds all of the request's KV. Otherwise
  // admission reserves ReservedTokens whole and nothing is preempted.
  virtual bool Preemptible() const { return false; }
  // The local window (docs/residency.md "The local window"): where the request's full KV lives
  // elsewhere, how many positions before the one being written this rank still reads once the
  // prompt is prefilled. -1 (the default): every position, the paged cache keeps them all. W >= 0:
  // a decode token at position p reads only [p - W, p] locally, so the engine releases the
  // blocks that hold only positions before p - W, takes blocks one at a time as the request
  // grows, and admission counts only the blocks of the prompt (prefill chunks attend locally)
  // and of the window. Read once, after Attach.
  virtual int LocalWindow() const { return -1; }
  // Submit, when the request's `blocks` exceed the cache's `cache_blocks`: the residency's own
  // refusal (ResourceExhausted), or ok for the engine's.
  virtual Status ExplainTooLarge(int /*prompt_tokens*/, int /*blocks*/,
                                 int /*cache_blocks*/) const {
    return Status::Ok();
  }

  // Admission, before the request's blocks are reserved: its storage for `reserved_tokens`
  // positions (ReservedTokens, whatever LocalWindow keeps locally), or null when it needs none. An
  // error ends the request with an error event; the engine continues.
  virtual Result<std::unique_ptr<ResidencyRequest>> Open(uint64_t /*request_id*/,
                                                         int /*reserved_tokens*/) {
    return std::unique_ptr<ResidencyRequest>();
  }
  // Admission, what the engine calls: Open, unless the residency places each request on a tier
  // (docs/residency.md "Placement"). `local_room_tokens`: the positions this rank's paged cache
  // can still hold whole for the request, beyond what the running requests may take; a request
  // whose storage says WhollyLocal must have reserved_tokens <= local_room_tokens.
  virtual Result<std::unique_ptr<ResidencyRequest>> Admit(uint64_t request_id, int reserved_tokens,
                                                          int /*local_room_tokens*/) {
    return Open(request_id, reserved_tokens);
  }
  // Retirement (finished, cancelled or failed): hands the storage back.
  virtual Status Close(ResidencyRequest& /*request*/) { return Status::Ok(); }
  // After the forward that ended the request's prompt (e.g. the prompt moved elsewhere: its
  // paged blocks go back to `cache`; `kv` keeps its position count).
  virtual Status PromptDone(ResidencyRequest& /*request*/, KvSequence& /*kv*/,
                            PagedKvCache& /*cache*/) {
    return Status::Ok();
  }
  // Whether a step may be thrown away and planned again (PolicyRequest::Verdict::kRedo); an
  // error says why not.
  virtual Status CheckRedo() const { return Status::Ok(); }
  // The error that stopped the residency's peer (its open requests are then lost), or ok.
  virtual Status Broken() const { return Status::Ok(); }
  // The error that lost `request`'s storage while the residency goes on serving others (one of
  // several cache ranks is gone), or ok. The engine ends such a request, before a step and
  // after one (what the model computed for it then is void).
  virtual Status RequestBroken(const ResidencyRequest& /*request*/) const { return Status::Ok(); }

  // Registers its metrics (docs/design.md §3 names); `registry` outlives the residency.
  virtual Status RegisterMetrics(MetricsRegistry& /*registry*/) { return Status::Ok(); }
  // " key=value ..." for the CLI's stats line; "" when there is nothing to say.
  virtual std::string StatsLine() const { return ""; }
};

}  // namespace rubato
