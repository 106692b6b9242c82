// SfiSelect (kernels/cuda/sfi_selector.cuh) against its CPU twin (kernels/cpu/sfi_selector.h,
// f64) on fresh random logits and key norms: batches of 1, 3 and 17 sequences whose allowed sets
// J have every kind of size (0, 1, below the budget, 4099, 65537) and offset, 1 to 8 KV heads
// with GQA groups 1 to 8, windows of 1 and 16 query rows, budgets 16 / 512 / 2048, gamma 0 and 1,
// soft-NMS windows from 1 to beyond |J|, λ* at both clip ends, log2-unit logits, masked (-inf)
// positions.
//
// Every z_adj score must be within 1e-4 + 2e-5·|ref| of the CPU's (the largest error is printed).
// The selected sets must equal the CPU's except among positions whose reference scores lie within
// 1e-3 + 1e-4·|K-th score| of the K-th score (f32 rounding may order those differently): every
// GPU-selected position must score at least the K-th reference score minus that tolerance, and
// every reference position above the K-th score plus it must be selected. Positions of exactly
// equal scores (duplicated logits) must follow the lower-position rule exactly.
#include <gtest/gtest.h>

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstdint>
#include <functional>
#include <iostream>
#include <numeric>
#include <random>
#include <span>
#include <sstream>
#include <string>
#include <vector>

#include "kernels/cpu/sfi_selector.h"
#include "kernels/cuda/sfi_selector.cuh"
#include "tests/gpu/gpu_test_util.h"

namespace rubato::cuda {
namespace {

using gpu_test::Download;
using gpu_test::FailsWith;
using gpu_test::Poisoned;
using gpu_test::Upload;

constexpr double kScoreAtol = 1e-4;
constexpr double kScoreRtol = 2e-5;
const float kLn2 = static_cast<float>(std::log(2.0));

double SelectionTolerance(double kth) { return 1e-3 + 1e-4 * std::fabs(kth); }

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
    for (size_t b = 0; b < j_count.size(); ++b)
      end = std::max<int64_t>(end, j_begin[b] + j_count[b]);
    return end + stride_pad;
  }
};

std::string Describe(const SelectorCase& c) {
  std::ostringstream out;
  out << "H " << c.heads << " G " << c.group << " W " << c.window << " J [";
  for (size_t b = 0; b < c.j_count.size(); ++b) {
    out << (b ? "," : "") << c.j_begin[b] << "+" << c.j_count[b];
  }
  out << "] K " << c.config.budget << " gamma " << c.config.gamma << " nms " << c.config.nms_window
      << " lambda_clip " << c.config.lambda_clip << (c.log2_logits ? " log2" : "");
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

Inputs MakeInputs(const SelectorCase& c, std::mt19937_64& rng) {
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
};

// Runs SfiSelect with poisoned outputs and workspace. j_begin / j_count default to the case's.
Outputs RunOnGpu(const SelectorCase& c, const Inputs& in, int max_j_count = -1,
                 std::vector<int32_t> j_begin = {}, std::vector<int32_t> j_count = {}) {
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
  const size_t bytes = SfiSelectWorkspaceBytes(c.batch(), c.heads, max_j_count);
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
  p.workspace = workspace.data();
  p.workspace_bytes = bytes;
  Outputs out;
  out.status = SfiSelect(p, nullptr);
  if (!out.status.ok()) return out;
  out.selected = Download(selected);
  out.selected_count = Download(selected_count);
  out.scores = Download(scores);
  return out;
}

// Sequence b's CPU input: the logits over J, in natural-log units as the GPU computes them
// (the f32 product logit · ln 2 for log2 logits), and the key norms over J.
struct CpuInput {
  std::vector<float> logits;  // [window][num_heads][n]
  std::vector<float> norms;   // [heads][n]
  SfiSelectorInput input;
};

CpuInput MakeCpuInput(const SelectorCase& c, const Inputs& in, int b) {
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
::testing::AssertionResult AscendingInside(std::span<const int32_t> got, int begin, int n) {
  for (size_t i = 0; i < got.size(); ++i) {
    if (got[i] < begin || got[i] >= begin + n || (i > 0 && got[i] <= got[i - 1])) {
      return ::testing::AssertionFailure()
             << "entry " << i << " = " << got[i] << " is outside J or not strictly ascending";
    }
  }
  return ::testing::AssertionSuccess();
}

// The selection of one head against the reference scores (see the file comment).
::testing::AssertionResult SameSelection(std::span<const int32_t> got, std::span<const double> ref,
                                         int budget, int begin, bool exact) {
  const int n = static_cast<int>(ref.size());
  const std::vector<int> want = SfiTopKPositions(ref, {}, budget, begin);
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
  std::vector<double> sorted(ref.begin(), ref.end());
  std::nth_element(sorted.begin(), sorted.begin() + (budget - 1), sorted.end(), std::greater<>());
  const double kth = sorted[static_cast<size_t>(budget - 1)];
  const double tol = SelectionTolerance(kth);
  int differing = 0;
  for (int32_t position : got) {
    const double score = ref[static_cast<size_t>(position - begin)];
    if (score < kth - tol) {
      return ::testing::AssertionFailure() << "selected position " << position << " has score "
                                           << score << " < K-th score " << kth << " - " << tol;
    }
    if (!std::binary_search(want.begin(), want.end(), position)) ++differing;
  }
  for (int j = 0; j < n; ++j) {
    if (ref[static_cast<size_t>(j)] > kth + tol &&
        !std::binary_search(got.begin(), got.end(), begin + j)) {
      return ::testing::AssertionFailure()
             << "position " << begin + j << " (score " << ref[static_cast<size_t>(j)] << ", K-th "
             << kth << ") is not selected";
    }
  }
  std::cout << "[ near-tie  ] " << differing << " of " << got.size()
            << " positions differ from the CPU twin within " << tol << " of the K-th score\n";
  return ::testing::AssertionSuccess();
}

// Runs a case on the GPU and compares every sequence with the CPU twin. exact: selections must
// equal the CPU's entry for entry.
void ExpectMatchesCpu(const SelectorCase& c, bool exact = false) {
  SCOPED_TRACE(Describe(c));
  std::mt19937_64 rng = gpu_test::FreshRng();
  const Inputs in = MakeInputs(c, rng);
  const Outputs out = RunOnGpu(c, in);
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
      const std::span<const double> ref_scores(&ref.z_adj[static_cast<size_t>(h) * n],
                                               static_cast<size_t>(n));
      const std::span<const float> scores(&out.scores[row * max_j], static_cast<size_t>(n));
      EXPECT_TRUE(AllClose<double>("z_adj", scores, ref_scores, kScoreAtol, kScoreRtol));
      EXPECT_TRUE(SameSelection(got, ref_scores, budget, begin, exact));
    }
  }
}

SfiSelectorConfig Config(int budget, double gamma = 0.0) {
  SfiSelectorConfig config;
  config.budget = budget;
  config.gamma = gamma;
  return config;
}

TEST(SfiSelectorOp, EmptyOneAndBelowBudgetAllowedSets) {
  for (double gamma : {0.0, 1.0}) {
    SelectorCase c;
    c.heads = 2;
    c.group = 4;
    c.window = 16;
    c.j_begin = {4, 0, 37};
    c.j_count = {0, 1, 300};
    c.config = Config(512, gamma);
    ExpectMatchesCpu(c);
  }
}

TEST(SfiSelectorOp, HeadsGroupsAndWindows) {
  int round = 0;
  for (int heads : {1, 2, 8}) {
    for (int group : {1, 4, 8}) {
      for (int window : {1, 16}) {
        SelectorCase c;
        c.heads = heads;
        c.group = group;
        c.window = window;
        c.j_begin = {0, 5, 4000};
        c.j_count = {4099, 1, 700};
        c.config = Config(512, round++ % 2 ? 1.0 : 0.0);
        ExpectMatchesCpu(c);
      }
    }
  }
}

TEST(SfiSelectorOp, Batch17MixedAllowedSets) {
  SelectorCase c;
  c.heads = 8;
  c.group = 1;
  c.j_count = {0, 1, 2, 15, 16, 17, 100, 511, 512, 513, 1000, 2047, 2048, 2049, 4099, 3000, 7};
  for (size_t b = 0; b < c.j_count.size(); ++b) c.j_begin.push_back(static_cast<int>(b * 37 % 300));
  for (int budget : {16, 512, 2048}) {
    c.config = Config(budget, budget == 512 ? 1.0 : 0.0);
    ExpectMatchesCpu(c);
  }
}

TEST(SfiSelectorOp, LargeAllowedSets) {
  SelectorCase decode;  // one sequence, |J| = 65537, the default budget
  decode.heads = 8;
  decode.group = 4;
  decode.j_begin = {4};
  decode.j_count = {65537};
  decode.config = Config(2048);
  ExpectMatchesCpu(decode);

  SelectorCase after_prefill;  // 16 tail queries, key-norm prior
  after_prefill.heads = 2;
  after_prefill.group = 4;
  after_prefill.window = 16;
  after_prefill.j_begin = {4, 1000};
  after_prefill.j_count = {65537, 60000};
  after_prefill.config = Config(512, 1.0);
  ExpectMatchesCpu(after_prefill);
}

TEST(SfiSelectorOp, SoftNmsWindows) {
  // 1: no-op; 2 and 3: one neighbour a side; 33; 4096: segments longer than a scan tile;
  // 1 << 30: every neighbourhood is all of J.
  for (int nms_window : {1, 2, 3, 33, 4096, 1 << 30}) {
    SelectorCase c;
    c.heads = 2;
    c.group = 2;
    c.window = 2;
    c.j_begin = {0, 17};
    c.j_count = {9000, 5000};
    c.config = Config(256);
    c.config.nms_window = nms_window;
    c.config.alpha_soft = 1.0;
    ExpectMatchesCpu(c);
  }
}

TEST(SfiSelectorOp, LambdaStarClipEnds) {
  SelectorCase flat;  // unclipped λ* < 0 -> 0
  flat.heads = 2;
  flat.group = 2;
  flat.window = 2;
  flat.j_begin = {0, 3};
  flat.j_count = {500, 4099};
  flat.pattern = Pattern::kFlatSlope;
  flat.config = Config(20);
  ExpectMatchesCpu(flat);

  SelectorCase peaked = flat;  // unclipped λ* near 1 -> λ_clip
  peaked.pattern = Pattern::kRandom;
  peaked.spread = 4.f;
  ExpectMatchesCpu(peaked);

  SelectorCase interior = flat;  // λ_clip = 1, flat random logits: λ* inside (0, 1)
  interior.pattern = Pattern::kRandom;
  interior.spread = 0.3f;
  interior.config = Config(30, 1.0);
  interior.config.lambda_clip = 1.0;
  ExpectMatchesCpu(interior);
}

TEST(SfiSelectorOp, Log2UnitLogitsWithLogitScale) {
  SelectorCase c;
  c.heads = 4;
  c.group = 2;
  c.j_begin = {4, 9};
  c.j_count = {3000, 4099};
  c.log2_logits = true;
  c.config = Config(512);
  ExpectMatchesCpu(c);
}

TEST(SfiSelectorOp, MaskedPositions) {
  SelectorCase c;
  c.heads = 2;
  c.group = 2;
  c.window = 2;
  c.j_begin = {3, 0};
  c.j_count = {1200, 999};
  c.masked_every = 7;
  c.config = Config(64, 1.0);
  ExpectMatchesCpu(c);
}

TEST(SfiSelectorOp, ExactTiesGoToLowerPositions) {
  // λ_clip = 0 and no soft-NMS: z_adj depends on a position's logit column only, so the columns
  // repeated every 7 positions give exactly equal scores on both sides; the K-th score falls
  // inside a group of equal ones, and the lower positions must win exactly as on the CPU.
  for (int budget : {16, 100, 512}) {
    SelectorCase c;
    c.heads = 2;
    c.group = 2;
    c.window = 2;
    c.j_begin = {0, 11, 5};
    c.j_count = {600, 4099, 513};
    c.pattern = Pattern::kTies;
    c.config = Config(budget);
    c.config.lambda_clip = 0.0;
    c.config.nms_window = 1;
    ExpectMatchesCpu(c, /*exact=*/true);
  }
  // Every score equal: the first K positions of J.
  SelectorCase all_equal;
  all_equal.heads = 3;
  all_equal.group = 2;
  all_equal.window = 4;
  all_equal.j_begin = {7};
  all_equal.j_count = {5000};
  all_equal.pattern = Pattern::kAllEqual;
  all_equal.config = Config(2048);
  all_equal.config.lambda_clip = 0.0;
  ExpectMatchesCpu(all_equal, /*exact=*/true);
}

TEST(SfiSelectorOp, OutOfContractDeviceValuesStayInBounds) {
  // A query head whose row is all -inf or NaN, a j_count above max_j_count and a negative
  // j_begin: the CPU twin rejects these; the GPU must clamp, stay in bounds and write valid,
  // ascending positions and finite scores.
  SelectorCase c;
  c.heads = 2;
  c.group = 2;
  c.j_begin = {0, 0, 10};
  c.j_count = {300, 300, 300};
  c.config = Config(64);
  std::mt19937_64 rng = gpu_test::FreshRng();
  Inputs in = MakeInputs(c, rng);
  for (int j = 0; j < 300; ++j) {
    in.logits[in.LogitAt(0, 0, 0, j, c)] = -INFINITY;  // sequence 0: a dead query head
    in.logits[in.LogitAt(0, 0, 2, j, c)] = -INFINITY;  // ... and every head of KV head 1
    in.logits[in.LogitAt(0, 0, 3, j, c)] = -INFINITY;
    in.logits[in.LogitAt(1, 0, 1, j, c)] = NAN;  // sequence 1: NaN logits count as -inf
  }
  const int max_j = 200;  // sequence 2's count of 300 is clamped to 200, its begin to 0
  const Outputs out = RunOnGpu(c, in, max_j, {0, 0, -5}, {300, 250, 300});
  ASSERT_TRUE(out.status.ok()) << out.status.message();
  for (size_t row = 0; row < out.selected_count.size(); ++row) {
    SCOPED_TRACE("row " + std::to_string(row));
    ASSERT_EQ(out.selected_count[row], 64);
    EXPECT_TRUE(AscendingInside(std::span<const int32_t>(&out.selected[row * 64], 64), 0, max_j));
    for (int i = 0; i < max_j; ++i) {
      ASSERT_TRUE(std::isfinite(out.scores[row * max_j + i])) << "score " << i;
    }
  }
}

TEST(SfiSelectorOp, EmptyBatchAndNoAllowedPositions) {
  SfiSelectParams p;
  p.num_kv_heads = 2;
  p.group = 1;
  p.window = 1;
  EXPECT_TRUE(SfiSelect(p, nullptr).ok());  // batch 0: nothing is read or written

  // max_j_count 0: no logits, no workspace; every count is 0.
  auto begins = Upload(std::vector<int32_t>{0, 4, 9});
  auto counts = Upload(std::vector<int32_t>{0, 0, 0});
  auto selected = Poisoned<int32_t>(3 * 2 * 16);
  auto selected_count = Poisoned<int32_t>(3 * 2);
  p.batch = 3;
  p.j_begin = begins.data();
  p.j_count = counts.data();
  p.config.budget = 16;
  p.selected = selected.data();
  p.selected_count = selected_count.data();
  ASSERT_TRUE(SfiSelect(p, nullptr).ok());
  EXPECT_EQ(Download(selected_count), std::vector<int32_t>(6, 0));
  EXPECT_EQ(Download(selected), std::vector<int32_t>(3 * 2 * 16, -1));
}

TEST(SfiSelectorOp, BadParamsAreInvalidArgument) {
  auto logits = Poisoned<float>(64);
  auto begins = Upload(std::vector<int32_t>{0});
  auto counts = Upload(std::vector<int32_t>{8});
  auto selected = Poisoned<int32_t>(8);
  auto selected_count = Poisoned<int32_t>(2);
  const size_t bytes = SfiSelectWorkspaceBytes(1, 2, 8);
  auto workspace = Poisoned<uint8_t>(bytes + 16);
  SfiSelectParams good;
  good.logits = logits.data();
  good.logits_stride = 8;
  good.j_begin = begins.data();
  good.j_count = counts.data();
  good.batch = 1;
  good.num_kv_heads = 2;
  good.group = 2;
  good.window = 2;
  good.max_j_count = 8;
  good.config.budget = 4;
  good.selected = selected.data();
  good.selected_count = selected_count.data();
  good.workspace = workspace.data();
  good.workspace_bytes = bytes;
  ASSERT_TRUE(SfiSelect(good, nullptr).ok());
  ASSERT_EQ(cudaSuccess, cudaDeviceSynchronize());

  struct Bad {
    const char* field;
    void (*change)(SfiSelectParams&);
  };
  const Bad bad[] = {
      {"batch", [](SfiSelectParams& p) { p.batch = -1; }},
      {"num_kv_heads", [](SfiSelectParams& p) { p.num_kv_heads = 0; }},
      {"group", [](SfiSelectParams& p) { p.group = 0; }},
      {"window", [](SfiSelectParams& p) { p.window = 0; }},
      {"window * group",
       [](SfiSelectParams& p) {
         p.window = 129;
         p.group = 8;
       }},
      {"max_j_count", [](SfiSelectParams& p) { p.max_j_count = -1; }},
      {"logit_scale", [](SfiSelectParams& p) { p.logit_scale = 0.f; }},
      {"logit_scale", [](SfiSelectParams& p) { p.logit_scale = INFINITY; }},
      {"logits is null", [](SfiSelectParams& p) { p.logits = nullptr; }},
      {"logits_stride", [](SfiSelectParams& p) { p.logits_stride = 7; }},
      {"j_begin", [](SfiSelectParams& p) { p.j_begin = nullptr; }},
      {"j_count", [](SfiSelectParams& p) { p.j_count = nullptr; }},
      {"selected is null", [](SfiSelectParams& p) { p.selected = nullptr; }},
      {"selected_count", [](SfiSelectParams& p) { p.selected_count = nullptr; }},
      {"key_norms", [](SfiSelectParams& p) { p.config.gamma = 1.0; }},
      {"norms_stride",
       [](SfiSelectParams& p) {
         p.config.gamma = 1.0;
         p.key_norms = p.logits;
         p.norms_stride = 4;
       }},
      {"workspace", [](SfiSelectParams& p) { p.workspace_bytes -= 4; }},
      {"workspace", [](SfiSelectParams& p) { p.workspace = nullptr; }},
      {"16-byte", [](SfiSelectParams& p) { p.workspace = static_cast<uint8_t*>(p.workspace) + 4; }},
      {"SfiSelectorConfig.budget", [](SfiSelectParams& p) { p.config.budget = 0; }},
      {"SfiSelectorConfig.alpha", [](SfiSelectParams& p) { p.config.alpha = 1.5; }},
      {"SfiSelectorConfig.temperature", [](SfiSelectParams& p) { p.config.temperature = 0.0; }},
      {"SfiSelectorConfig.nms_window", [](SfiSelectParams& p) { p.config.nms_window = 0; }},
      // Valid for the CPU twin, outside what the f32 pipeline supports.
      {"SfiSelectorConfig.epsilon", [](SfiSelectParams& p) { p.config.epsilon = 1e-40; }},
      {"SfiSelectorConfig.alpha", [](SfiSelectParams& p) { p.config.alpha = 1e-9; }},
      {"SfiSelectorConfig.temperature", [](SfiSelectParams& p) { p.config.temperature = 1e-9; }},
      {"SfiSelectorConfig.alpha_soft", [](SfiSelectParams& p) { p.config.alpha_soft = 1e9; }},
      {"SfiSelectorConfig.gamma", [](SfiSelectParams& p) { p.config.gamma = 1e7; }},
  };
  for (const Bad& b : bad) {
    SfiSelectParams p = good;
    b.change(p);
    EXPECT_TRUE(FailsWith(SfiSelect(p, nullptr), StatusCode::kInvalidArgument, b.field)) << b.field;
  }
}

}  // namespace
}  // namespace rubato::cuda
