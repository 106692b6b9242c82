// Shared by the SfiSelect op tests (sfi_selector_op_test.cc, sfi_selector_continuation_op_test.cc):
// case description, random inputs, the GPU run with poisoned outputs and workspace, and the
// comparison with the CPU twin (inference_rank/policies/sfi/kernels/sfi_selector.h, f64): valid
// positions, z_adj and c_h within tolerance, the GPU's own top-K exact, and differences from the
// CPU's selection only at near-ties. What is checked, with the tolerances: docs/sfi.md "Tests".
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <iostream>
#include <random>
#include <span>
#include <sstream>
#include <string>
#include <vector>

#include "inference_rank/policies/sfi/kernels/sfi_selector.h"
#include "inference_rank/policies/sfi/kernels/sfi_selector.cuh"
#include "tests/gpu/gpu_test_util.h"

namespace rubato::cuda::sfi_test {

constexpr double kScoreAtol = 1e-4;
constexpr double kScoreRtol = 2e-5;
constexpr double kPriorityAtol = 1e-9;
constexpr double kPriorityRtol = 2e-5;
inline const float kLn2 = static_cast<float>(std::log(2.0));

inline double SelectionTolerance(double kth) { return 1e-3 + 1e-4 * std::fabs(kth); }

enum class Pattern {
  kRandom,     // logits ~ N(0, spread²)
  kFlatSlope,  // -0.1 · j / (n − 1): evidence flatter than the prior (unclipped λ* < 0)
  kTies,       // column j repeats column j % 7 in every row: exact ties across positions
  kAllEqual,   // every logit 1.25
};

struct SelectorCase {
  int heads = 2;  // H: KV heads
  int group = 1;  // query heads per KV head
  int window = 1;
  std::vector<int> j_begin;  // [batch]
  std::vector<int> j_count;  // [batch]
  SfiSelectorConfig config;
  Pattern pattern = Pattern::kRandom;
  float spread = 3.f;
  bool log2_logits = false;  // logits in log2 units, logit_scale = ln 2
  int masked_every = 0;      // > 0: every masked_every-th logit of query head 0, row 0 is -inf
  int stride_pad = 13;       // logits_stride = max(j_begin + j_count) + stride_pad

  int batch() const { return static_cast<int>(j_count.size()); }
  int num_heads() const { return heads * group; }
  int max_j_count() const {
    return j_count.empty() ? 0 : *std::max_element(j_count.begin(), j_count.end());
  }
  int64_t stride() const {
    int64_t end = 0;
    for (size_t b = 0; b < j_count.size(); ++b) {
      end = std::max<int64_t>(end, j_begin[b] + j_count[b]);
    }
    return end + stride_pad;
  }
};

inline std::string Describe(const SelectorCase& c) {
  std::ostringstream out;
  out << "H " << c.heads << " G " << c.group << " W " << c.window << " J [";
  for (size_t b = 0; b < c.j_count.size(); ++b) {
    out << (b ? "," : "") << c.j_begin[b] << "+" << c.j_count[b];
  }
  out << "] K " << c.config.budget << " gamma " << c.config.gamma << " nms " << c.config.nms_window
      << " lambda_clip " << c.config.lambda_clip << " continuation " << c.config.continuation
      << " threshold " << c.config.continuation_threshold << (c.log2_logits ? " log2" : "");
  return out.str();
}

// The host copies of what the GPU reads.
struct Inputs {
  std::vector<float> logits;     // [batch][window][num_heads][stride]
  std::vector<float> key_norms;  // [batch][heads][stride]
  int64_t stride = 0;
  size_t LogitAt(int b, int w, int q, int64_t position, const SelectorCase& c) const {
    return ((static_cast<size_t>(b) * c.window + w) * c.num_heads() + q) * stride + position;
  }
};

inline Inputs MakeInputs(const SelectorCase& c, std::mt19937_64& rng) {
  Inputs in;
  in.stride = c.stride();
  // Outside J the rows hold large logits (a kernel that read them would see them dominate) and
  // tiny norms.
  in.logits.assign(static_cast<size_t>(c.batch()) * c.window * c.num_heads() * in.stride, 30.f);
  in.key_norms.assign(static_cast<size_t>(c.batch()) * c.heads * in.stride, 1e-3f);
  std::normal_distribution<float> normal(0.f, c.spread);
  std::uniform_real_distribution<float> norm(0.5f, 20.f);
  for (int b = 0; b < c.batch(); ++b) {
    const int begin = c.j_begin[b], n = c.j_count[b];
    std::vector<float> tie_columns(static_cast<size_t>(c.window) * c.num_heads() * 7);
    for (float& x : tie_columns) x = normal(rng);
    for (int w = 0; w < c.window; ++w) {
      for (int q = 0; q < c.num_heads(); ++q) {
        float* row = &in.logits[in.LogitAt(b, w, q, begin, c)];
        for (int j = 0; j < n; ++j) {
          switch (c.pattern) {
            case Pattern::kRandom:
              row[j] = normal(rng);
              break;
            case Pattern::kFlatSlope:
              row[j] = n > 1 ? -0.1f * j / (n - 1) : 0.f;
              break;
            case Pattern::kTies:
              row[j] = tie_columns[(static_cast<size_t>(w) * c.num_heads() + q) * 7 + j % 7];
              break;
            case Pattern::kAllEqual:
              row[j] = 1.25f;
              break;
          }
          if (c.log2_logits) row[j] /= kLn2;  // the GPU multiplies by ln 2 again
        }
        if (c.masked_every > 0 && w == 0 && q == 0) {
          for (int j = 1; j < n; j += c.masked_every) row[j] = -INFINITY;
        }
      }
    }
    for (int h = 0; h < c.heads; ++h) {
      float* norms = &in.key_norms[(static_cast<size_t>(b) * c.heads + h) * in.stride + begin];
      for (int j = 0; j < n; ++j) norms[j] = norm(rng);
    }
  }
  return in;
}

struct Outputs {
  Status status;
  std::vector<int32_t> selected;        // [batch][heads][budget]
  std::vector<int32_t> selected_count;  // [batch][heads]
  std::vector<float> scores;            // [batch][heads][max_j_count]
  std::vector<float> continuation;      // [batch][heads][max_j_count]
};

// Runs SfiSelect with poisoned outputs and workspace. j_begin / j_count default to the case's.
inline Outputs RunOnGpu(const SelectorCase& c, const Inputs& in, int max_j_count = -1,
                        std::vector<int32_t> j_begin = {}, std::vector<int32_t> j_count = {}) {
  using gpu_test::Download;
  using gpu_test::Poisoned;
  using gpu_test::Upload;
  if (max_j_count < 0) max_j_count = c.max_j_count();
  if (j_begin.empty()) j_begin.assign(c.j_begin.begin(), c.j_begin.end());
  if (j_count.empty()) j_count.assign(c.j_count.begin(), c.j_count.end());
  const size_t rows = static_cast<size_t>(c.batch()) * c.heads;
  auto logits = Upload(in.logits);
  auto norms = Upload(in.key_norms);
  auto begins = Upload(j_begin);
  auto counts = Upload(j_count);
  auto selected = Poisoned<int32_t>(rows * c.config.budget);
  auto selected_count = Poisoned<int32_t>(rows);
  auto scores = Poisoned<float>(rows * std::max(max_j_count, 1));
  auto continuation = Poisoned<float>(rows * std::max(max_j_count, 1));
  const size_t bytes =
      SfiSelectWorkspaceBytes(c.batch(), c.heads, max_j_count, c.window, c.group, c.config);
  auto workspace = Poisoned<uint8_t>(bytes);

  SfiSelectParams p;
  p.logits = logits.data();
  p.logits_stride = in.stride;
  p.logit_scale = c.log2_logits ? kLn2 : 1.f;
  p.j_begin = begins.data();
  p.j_count = counts.data();
  p.key_norms = norms.data();
  p.norms_stride = in.stride;
  p.batch = c.batch();
  p.num_kv_heads = c.heads;
  p.group = c.group;
  p.window = c.window;
  p.max_j_count = max_j_count;
  p.config = c.config;
  p.selected = selected.data();
  p.selected_count = selected_count.data();
  p.scores = scores.data();
  p.continuation = continuation.data();
  p.workspace = workspace.data();
  p.workspace_bytes = bytes;
  Outputs out;
  out.status = SfiSelect(p, nullptr);
  if (!out.status.ok()) return out;
  out.selected = Download(selected);
  out.selected_count = Download(selected_count);
  out.scores = Download(scores);
  out.continuation = Download(continuation);
  return out;
}

// Sequence b's CPU input: the logits over J, in natural-log units as the GPU computes them
// (the f32 product logit · ln 2 for log2 logits), and the key norms over J.
struct CpuInput {
  std::vector<float> logits;  // [window][num_heads][n]
  std::vector<float> norms;   // [heads][n]
  SfiSelectorInput input;
};

inline CpuInput MakeCpuInput(const SelectorCase& c, const Inputs& in, int b) {
  const int begin = c.j_begin[b], n = c.j_count[b];
  CpuInput cpu;
  cpu.logits.resize(static_cast<size_t>(c.window) * c.num_heads() * n);
  for (int w = 0; w < c.window; ++w) {
    for (int q = 0; q < c.num_heads(); ++q) {
      for (int j = 0; j < n; ++j) {
        const float x = in.logits[in.LogitAt(b, w, q, begin + j, c)];
        cpu.logits[(static_cast<size_t>(w) * c.num_heads() + q) * n + j] =
            c.log2_logits ? x * kLn2 : x;
      }
    }
  }
  cpu.norms.resize(static_cast<size_t>(c.heads) * n);
  for (int h = 0; h < c.heads; ++h) {
    std::copy_n(&in.key_norms[(static_cast<size_t>(b) * c.heads + h) * in.stride + begin], n,
                &cpu.norms[static_cast<size_t>(h) * n]);
  }
  cpu.input.num_kv_heads = c.heads;
  cpu.input.group = c.group;
  cpu.input.window = c.window;
  cpu.input.j_begin = begin;
  cpu.input.j_count = n;
  cpu.input.logits = cpu.logits.data();
  cpu.input.key_norms = cpu.norms.data();
  return cpu;
}

// `got` (k positions) is a valid selection from [begin, begin + n): strictly ascending, inside.
inline ::testing::AssertionResult AscendingInside(std::span<const int32_t> got, int begin, int n) {
  for (size_t i = 0; i < got.size(); ++i) {
    if (got[i] < begin || got[i] >= begin + n || (i > 0 && got[i] <= got[i - 1])) {
      return ::testing::AssertionFailure()
             << "entry " << i << " = " << got[i] << " is outside J or not strictly ascending";
    }
  }
  return ::testing::AssertionSuccess();
}

// Every GPU priority equals the CPU's within rounding, or the anchor behind it sits at the
// threshold (0 on one side, within kPriorityRtol of the threshold on the other).
inline ::testing::AssertionResult PrioritiesClose(std::span<const float> gpu,
                                                  std::span<const double> cpu, double threshold) {
  double max_error = 0.0;
  int flips = 0;
  for (size_t i = 0; i < gpu.size(); ++i) {
    const double g = gpu[i], r = cpu[i];
    const double error = std::fabs(g - r);
    const bool close = error <= kPriorityAtol + kPriorityRtol * r;
    const bool at_threshold = (r == 0.0 && g >= threshold && g <= threshold * (1 + kPriorityRtol)) ||
                              (g == 0.0 && r >= threshold && r <= threshold * (1 + kPriorityRtol));
    if (!close && !at_threshold) {
      return ::testing::AssertionFailure() << "continuation priority at " << i << " is " << g
                                           << ", the CPU twin's " << r;
    }
    if (close) max_error = std::max(max_error, error);
    flips += !close;
  }
  std::cout << "[ max error ] continuation: " << max_error << " over " << gpu.size()
            << " priorities, " << flips << " threshold flips\n";
  return ::testing::AssertionSuccess();
}

inline std::vector<double> ToDouble(std::span<const float> values) {
  return std::vector<double>(values.begin(), values.end());
}

// `got` against the CPU twin's selection from its (c, z_adj); see the file comment.
// gpu_priority: the GPU's c_h (for threshold flips).
inline ::testing::AssertionResult NearCpuSelection(std::span<const int32_t> got,
                                                   std::span<const double> score,
                                                   std::span<const double> priority,
                                                   std::span<const float> gpu_priority, int budget,
                                                   int begin, bool exact) {
  const int n = static_cast<int>(score.size());
  const std::vector<int> want = SfiTopKPositions(score, priority, budget, begin);
  if (got.size() != want.size()) {
    return ::testing::AssertionFailure() << got.size() << " positions, expected " << want.size();
  }
  if (std::equal(got.begin(), got.end(), want.begin())) return ::testing::AssertionSuccess();
  if (budget >= n) {
    return ::testing::AssertionFailure() << "K >= |J| = " << n << ": all of J must be selected";
  }
  if (exact) {
    for (size_t i = 0; i < got.size(); ++i) {
      if (got[i] != want[i]) {
        return ::testing::AssertionFailure()
               << "entry " << i << " is " << got[i] << ", the CPU twin's is " << want[i];
      }
    }
  }
  // The CPU's K-th: the worst of its selection by (priority, score, position).
  int k = want.front() - begin;
  for (int position : want) {
    const int i = position - begin;
    if (priority[i] < priority[k] || (priority[i] == priority[k] && score[i] <= score[k])) k = i;
  }
  const double tol = SelectionTolerance(score[k]);
  const auto flip = [&](int i) { return (priority[i] > 0.0) != (gpu_priority[i] > 0.f); };
  // i could rank on the other side of the K-th under f32 rounding.
  const auto near_tie = [&](int i, bool below) {
    if (flip(i) || flip(k)) return true;
    if (priority[i] != priority[k]) {
      return std::fabs(priority[i] - priority[k]) <= kPriorityAtol + kPriorityRtol * priority[k];
    }
    return below ? score[i] >= score[k] - tol : score[i] <= score[k] + tol;
  };
  int differing = 0;
  for (int32_t position : got) {
    if (std::binary_search(want.begin(), want.end(), position)) continue;
    ++differing;
    const int i = position - begin;
    if (!near_tie(i, /*below=*/true)) {
      return ::testing::AssertionFailure()
             << "selected position " << position << " (priority " << priority[i] << ", score "
             << score[i] << ") is below the CPU's K-th (" << priority[k] << ", " << score[k] << ")";
    }
  }
  for (int position : want) {
    if (std::binary_search(got.begin(), got.end(), position)) continue;
    const int i = position - begin;
    if (!near_tie(i, /*below=*/false)) {
      return ::testing::AssertionFailure()
             << "position " << position << " (priority " << priority[i] << ", score " << score[i]
             << ") is above the CPU's K-th (" << priority[k] << ", " << score[k]
             << ") but not selected";
    }
  }
  std::cout << "[ near-tie  ] " << differing << " of " << got.size()
            << " positions differ from the CPU twin at its K-th\n";
  return ::testing::AssertionSuccess();
}

// Compares the GPU run `out` on inputs `in` with the CPU twin, every sequence and head.
inline void ExpectOutputsMatchCpu(const SelectorCase& c, const Inputs& in, const Outputs& out,
                                  bool exact) {
  ASSERT_TRUE(out.status.ok()) << out.status.message();
  const int budget = c.config.budget;
  const size_t max_j = static_cast<size_t>(std::max(c.max_j_count(), 1));
  for (int b = 0; b < c.batch(); ++b) {
    SCOPED_TRACE("sequence " + std::to_string(b));
    const int begin = c.j_begin[b], n = c.j_count[b];
    SfiScores ref;
    if (n > 0) {
      const CpuInput cpu = MakeCpuInput(c, in, b);
      const Status status = ComputeSfiScores(c.config, cpu.input, ref);
      ASSERT_TRUE(status.ok()) << status.message();
    }
    for (int h = 0; h < c.heads; ++h) {
      SCOPED_TRACE("kv head " + std::to_string(h));
      const size_t row = static_cast<size_t>(b) * c.heads + h;
      const int k = std::min(budget, n);
      ASSERT_EQ(out.selected_count[row], k);
      const std::span<const int32_t> got(&out.selected[row * budget], static_cast<size_t>(k));
      EXPECT_TRUE(AscendingInside(got, begin, n));
      for (int i = k; i < budget; ++i) {
        ASSERT_EQ(out.selected[row * budget + i], -1) << "entry " << i << " past the count";
      }
      if (n == 0) continue;
      const size_t un = static_cast<size_t>(n);
      const std::span<const double> ref_scores(&ref.z_adj[h * un], un);
      const std::span<const double> ref_priority(&ref.continuation[h * un], un);
      const std::span<const float> scores(&out.scores[row * max_j], un);
      const std::span<const float> priority(&out.continuation[row * max_j], un);
      EXPECT_TRUE(AllClose<double>("z_adj", scores, ref_scores, kScoreAtol, kScoreRtol));
      EXPECT_TRUE(PrioritiesClose(priority, ref_priority, c.config.continuation_threshold));
      const std::vector<int> own =
          SfiTopKPositions(ToDouble(scores), ToDouble(priority), budget, begin);
      EXPECT_TRUE(std::equal(got.begin(), got.end(), own.begin(), own.end()))
          << "not the top-K of the GPU's own (c, z_adj)";
      EXPECT_TRUE(NearCpuSelection(got, ref_scores, ref_priority, priority, budget, begin, exact));
    }
  }
}

// Runs a case on fresh random inputs and compares every sequence with the CPU twin. exact:
// selections must equal the CPU's entry for entry.
inline void ExpectMatchesCpu(const SelectorCase& c, bool exact = false) {
  SCOPED_TRACE(Describe(c));
  std::mt19937_64 rng = gpu_test::FreshRng();
  const Inputs in = MakeInputs(c, rng);
  ExpectOutputsMatchCpu(c, in, RunOnGpu(c, in), exact);
}

// The case as given and with stage C off (the paper's Eq. 24 alone).
inline void ExpectMatchesCpuWithAndWithoutContinuation(SelectorCase c, bool exact = false) {
  ExpectMatchesCpu(c, exact);
  c.config.continuation = 0;
  ExpectMatchesCpu(c, exact);
}

inline SfiSelectorConfig Config(int budget, double gamma = 0.0) {
  SfiSelectorConfig config;
  config.budget = budget;
  config.gamma = gamma;
  return config;
}

}  // namespace rubato::cuda::sfi_test
