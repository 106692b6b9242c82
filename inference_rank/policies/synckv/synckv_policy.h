// SyncKV (the SyncKV paper §4, Algorithm 1; docs/synckv.md): per layer a few representative
// heads (R-heads, from the offline clustering of synckv_calibration.h) keep their whole KV and
// attend it every step; the other heads (NR-heads) attend a static set chosen at the prompt's
// end plus a dynamic set their cluster's R-head refreshes every `stride` steps (anticipation:
// top k_dyn of the R-head's attention, fetched asynchronously, used from the next step); the
// steps between reuse it (suspension). Runs on the split_by_head residency only, which holds
// the rows; this policy decides the sets.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>

#include "common/config.h"
#include "inference_rank/attention/head_split.h"
#include "inference_rank/attention/policy.h"
#include "inference_rank/policies/synckv/synckv_calibration.h"

namespace rubato {

struct SyncKvConfig {
  std::string calibration;    // the calibration file (required)
  int representatives = 1;    // N_r, clusters (R-heads) per layer; the paper: 2 Llama, 1 Qwen
  int stride = 5;             // m: an anticipation every m decode steps
  double static_ratio = 0.5;  // rho: the static share of the prompt's selection
  double mem_percent = 30.0;  // Mem%, (0, 100]: the budget (see mem_basis)
  // nr_heads: each NR-head keeps ceil(Mem% x context) positions; total: the local KV (R-heads
  // whole and NR-heads' sets) is Mem% of the full KV.
  std::string mem_basis = "total";
  // The CUDA model's store of the NR-heads' full KV: "host" (pinned host memory) or "device"
  // (GPU `store_device` of this process, by peer access). `fetch_delay_us`: every fetch waits
  // this long on its copy stream first (tests and benchmarks of a late fetch).
  std::string store = "host";
  int store_device = 1;
  int fetch_delay_us = 0;
};

struct SyncKvCounters {
  std::atomic<int64_t> anticipation_steps{0};  // decode tokens whose step anticipated
  std::atomic<int64_t> suspension_steps{0};    // the other decode tokens
};

class SyncKvPolicy final : public AttentionPolicy, public HeadSplitPolicy {
 public:
  // `calibration` clustered again with config.representatives (InvalidArgument past its heads).
  static Result<std::unique_ptr<SyncKvPolicy>> Create(const SyncKvConfig& config,
                                                      SyncKvCalibration calibration);

  std::string_view name() const override { return "synckv"; }
  const PolicyTraits& traits() const override;
  const HeadSplit& head_split() const override { return split_; }
  int KeptPositions(int context) const override { return Budget(context); }
  int RecentPositions() const override { return config_.stride - 1; }
  HeadSplitStore store() const override;
  // InvalidArgument for a model the calibration was not made for, or a Mem% of basis total at
  // or below the R-heads' own share.
  Result<std::unique_ptr<AttentionBackend>> MakeBackend(Model& model, int max_batch) const override;
  std::unique_ptr<PolicyRequest> Admit(KvResidency residency) override;
  Status RegisterMetrics(MetricsRegistry& registry) override;
  std::string StatsLine() const override;

  const SyncKvConfig& config() const { return config_; }
  const SyncKvCounters& counters() const { return counters_; }
  // Positions each NR-head keeps (static + dynamic) for a context of `context` positions.
  int Budget(int context) const;
  // The share of the context the heads of one layer attend (R-heads all of it).
  double RetainedShare(int context) const;
  void CountStep(bool anticipation);

 private:
  SyncKvPolicy(const SyncKvConfig& config, SyncKvCalibration calibration, HeadSplit split);

  SyncKvConfig config_;
  SyncKvCalibration calibration_;
  HeadSplit split_;
  SyncKvCounters counters_;
  Counter* anticipation_metric_ = nullptr;
  Counter* suspension_metric_ = nullptr;
};

// What a SyncKV plan tells the backend half about its step (EntryAttention::state).
struct SyncKvStep {
  enum class Kind { kPromptEnd, kAnticipation, kSuspension };
  Kind kind = Kind::kSuspension;
};

// `policy: {name: synckv, calibration: FILE, representatives: 1, stride: 5, static_ratio: 0.5,
// mem_percent: 30, mem_basis: total, store: host, store_device: 1, fetch_delay_us: 0}`; loads
// and validates the calibration file.
Result<SyncKvConfig> ParseSyncKvConfig(const PolicySection& section);
Result<std::unique_ptr<AttentionPolicy>> CreateSyncKvPolicy(const PolicySection& section);

}  // namespace rubato
