// LongFlow (the LongFlow paper §3, §4.1, App. E; docs/design.md §4.6): a request's KV never
// exceeds a budget of B slots per (layer, KV head) (evicting KV, kv/slot_kv_pool.h). Each decode
// token overwrites the slot its previous step chose; its attention over the slots also scores
// every slot by Eq. 6 and chooses the next one (kernels/cpu/longflow_attention.h). A prompt
// longer than B is compressed to B after prefill with SnapKV-style scoring
// (kernels/cpu/snapkv_scores.h); a prompt within B keeps everything. docs/longflow.md.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "common/config.h"
#include "inference_rank/attention/policy.h"

namespace rubato {

// The row groups (EntryAttention::row_group) of its fixed-budget decode entries and of its prompt
// chunks (dense; a one-token chunk is a decode row of the CUDA plan, attended apart).
inline constexpr int kLongFlowRows = 1;
inline constexpr int kLongFlowPromptRows = 2;

struct LongFlowConfig {
  int budget = 3200;           // B: slots per (layer, KV head); the paper's 3200 (or 2400)
  int sink_tokens = 4;         // the first tokens' slots, never evicted
  int snapkv_window = 32;      // prompt queries that score a prompt longer than B (SnapKV's)
  int snapkv_pool_kernel = 7;  // odd: max-pool of the window's scores along positions (SnapKV's)
};

// One request's state, shared by the host half (which plans) and the backend half (which reads
// the plan's fields and keeps the rest); EntryAttention::state points to it.
struct LongFlowRequestState {
  // Set on the plan of the prompt's last chunk: the prompt's length (the backend moves the
  // prompt into the slots in that forward); -1 on every other plan.
  int prompt_end = -1;
  // Backend: the prompt's latest queries, [num_layers][snapkv_window][num_heads * head_dim] f32,
  // row position % snapkv_window (a ring, so chunk borders do not matter).
  std::vector<float> window_queries;
  std::vector<int> occupied;  // backend: [num_layers] valid slots
  // Backend: the position each slot holds, [num_layers][num_kv_heads][budget] (-1: empty), for
  // tools that measure what LongFlow keeps (bench/accuracy/fidelity.cc); tokens never read it.
  std::vector<int32_t> slot_positions;
  // Backend, drained by the host half after each token: tokens evicted, per (layer, KV head).
  int64_t evictions = 0;         // by decode tokens
  int64_t prompt_evictions = 0;  // by the prompt's compression
};

struct LongFlowCounters {
  int64_t evictions = 0;         // decode overwrites, per (layer, KV head)
  int64_t prompt_evictions = 0;  // prompt positions not kept, per (layer, KV head)
  int64_t occupied_slots = 0;    // valid slots (layer 0) of the live requests
  int64_t live_requests = 0;
  double last_occupancy = 0.0;  // occupied_slots / (B x live_requests) at the last token
};

class LongFlowPolicy final : public AttentionPolicy {
 public:
  explicit LongFlowPolicy(const LongFlowConfig& config);
  std::string_view name() const override { return "longflow"; }
  const PolicyTraits& traits() const override { return traits_; }
  Result<std::unique_ptr<AttentionBackend>> MakeBackend(Model& model, int max_batch) const override;
  Status CheckLimits(int max_context) const override;
  std::unique_ptr<PolicyRequest> Admit(KvResidency residency) override;
  Status RegisterMetrics(MetricsRegistry& registry) override;
  std::string StatsLine() const override;

  const LongFlowConfig& config() const { return config_; }
  const LongFlowCounters& counters() const { return counters_; }

  // From its requests: a token was accepted (drains `state`'s evictions; `occupied` is the
  // request's valid slots, `previous` what it reported last), or a request ended.
  void CountToken(LongFlowRequestState& state, int occupied, int previous);
  void CountAdmitted();
  void CountEnded(int occupied);

 private:
  void UpdateOccupancy();

  LongFlowConfig config_;
  PolicyTraits traits_;
  LongFlowCounters counters_;
  Counter* evictions_metric_ = nullptr;
  Counter* prompt_evictions_metric_ = nullptr;
  Gauge* occupancy_metric_ = nullptr;
};

// `policy: {name: longflow, budget: 3200, sink_tokens: 4, snapkv_window: 32,
// snapkv_pool_kernel: 7}`; every bad value refused by its key path.
Result<LongFlowConfig> ParseLongFlowConfig(const PolicySection& section);
Result<std::unique_ptr<AttentionPolicy>> CreateLongFlowPolicy(const PolicySection& section);

}  // namespace rubato
