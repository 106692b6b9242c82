// The probe of rubato_fidelity (docs/fidelity.md): wraps any policy so that, at every decode
// step of the CPU model, the dense attention of the step's own query (softmax over every
// position, GQA-pooled per KV head) is computed beside the policy's attention and the share of
// that mass falling on the rows the policy attended is recorded, per layer and KV head, with the
// mass on given spans of the prompt (vartrack's chain facts). The policy's tokens are unchanged:
// the probe only reads.
#pragma once

#include <map>
#include <memory>
#include <utility>
#include <vector>

#include "inference_rank/attention/cpu_backend.h"
#include "inference_rank/attention/policy.h"

namespace rubato {

// What one decode step's query attended, as shares of its dense attention mass.
struct ProbeStep {
  int position = 0;           // the query's position
  bool dense = false;         // the policy attended every position (e.g. an SFI slow step)
  bool measured = true;       // false: an op the probe cannot see (kFixedBudget: evicted KV)
  bool twin = false;          // measured by the teacher-forced dense twin (fidelity.cc)
  std::vector<double> share;  // [layer][kv_head]: dense mass on the attended rows
  // kFixedBudget steps: [layer * kv_heads + kv_head] the positions the slots held (what the
  // step attended), for the dense twin to measure.
  std::vector<std::vector<int>> kept;
  // [span][layer][kv_head]: dense mass on the span, and on its rows the policy attended.
  std::vector<double> span_dense;
  std::vector<double> span_kept;
  std::vector<double> span_held;  // [span][layer][kv_head]: the share of its rows attended
};

// The steps of the request being probed; the caller sets the spans before it runs.
struct ProbeRecorder {
  std::vector<std::pair<int, int>> spans;  // [begin, end) token positions, e.g. chain facts
  std::map<int, ProbeStep> steps;          // by position: a redone step replaces its first try
  // Set: this recorder probes a teacher-forced dense twin (a dense policy fed the probed run's
  // tokens): every row, prefill chunks included, at a position where `teacher` holds a step
  // with kept positions is measured against those positions, and no other row is.
  const std::map<int, ProbeStep>* teacher = nullptr;
  void Reset(std::vector<std::pair<int, int>> new_spans) {
    spans = std::move(new_spans);
    steps.clear();
  }
};

// `inner` with its backend wrapped in the probe (a null backend, dense, is probed too).
// `recorder` must outlive the engine. The CPU model only (MakeBackend refuses another).
std::shared_ptr<AttentionPolicy> MakeProbedPolicy(std::shared_ptr<AttentionPolicy> inner,
                                                  ProbeRecorder* recorder);

}  // namespace rubato
