// PooledTopK (kernels/cuda/pooled_top_k.cuh) against its CPU twin (kernels/cpu/pooled_top_k.h,
// ScoreUnits::kLog2) on fresh random scores with a few non-finite ones (or with exact ties): 1, 7,
// 1000 and 33000 candidates, k of 1, 64 and 2048 and k >= count, groups of 1, 4 and 8 query heads,
// batches whose sequences have different begin / count, scores_stride past the largest row and
// max_count past the largest count. Each (sequence, KV head) is redrawn until, in double precision,
// the scores on either side of its cut differ by more than 1e-4 relative, so f32 rounding cannot
// flip the choice: selected positions and counts must then equal the CPU's exactly, and the entries
// past each count must stay as they were. Also: device counts above max_count, replay in a CUDA
// graph with new begins / counts, and the parameter checks.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <limits>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "kernels/cpu/pooled_top_k.h"
#include "kernels/cuda/pooled_top_k.cuh"
#include "tests/gpu/gpu_test_util.h"

namespace rubato::cuda {
namespace {

using gpu_test::Download;
using gpu_test::FailsWith;
using gpu_test::Poisoned;
using gpu_test::Upload;

constexpr int32_t kPoisonInt = -1;  // what Poisoned<int32_t> leaves in every element
// Outside every row's candidates: a score that would dominate any softmax that read it.
constexpr float kOutside = 1e30f;

struct Sequence {
  int begin = 0;
  int count = 0;
};

struct TopKCase {
  std::vector<Sequence> sequences;  // [batch]
  int num_kv_heads = 1;
  int group = 1;
  int k = 1;
  int max_count_pad = 0;  // max_count = the largest count + max_count_pad
  int stride_pad = 0;     // scores_stride = the largest begin + count (>= max_count) + stride_pad
  int levels = 0;  // > 0: every head scores a candidate alike, from {0, .., levels - 1}: exact ties
  std::vector<int> row_k = {};  // set: per-sequence k (PooledTopKParams::row_k), k the capacity
  bool head_lse = false;        // pass each head's log-sum-exp (PooledTopKParams::head_lse)
};

std::string Describe(const TopKCase& c) {
  std::ostringstream out;
  out << "batch " << c.sequences.size() << " (begin, count)";
  for (const Sequence& s : c.sequences) out << " (" << s.begin << ", " << s.count << ")";
  out << " kv heads " << c.num_kv_heads << " group " << c.group << " k " << c.k;
  return out.str();
}

// Pooled scores of one (sequence, KV head) in double: softmax (exp2) per head over the
// candidates, non-finite -> -inf, a head of -inf adds 0, mean over the group.
std::vector<double> ReferencePooled(const float* scores, int64_t stride, int group, int count) {
  std::vector<double> pooled(static_cast<size_t>(count), 0.0), probs(pooled.size());
  for (int q = 0; q < group; ++q) {
    const float* row = scores + q * stride;
    double max_score = -std::numeric_limits<double>::infinity();
    for (int i = 0; i < count; ++i) {
      probs[i] = std::isfinite(row[i]) ? row[i] : -std::numeric_limits<double>::infinity();
      max_score = std::max(max_score, probs[i]);
    }
    if (std::isinf(max_score)) continue;
    double sum = 0.0;
    for (double& p : probs) sum += (p = std::exp2(p - max_score));
    for (int i = 0; i < count; ++i) pooled[i] += probs[i] / sum / group;
  }
  return pooled;
}

// True when rounding far below `rel` cannot change which k are kept: scores below the cut lie
// more than rel * cut under it and, when the cut splits a group of equal scores (equal inputs),
// scores above it lie more than rel * cut over it.
bool CutIsSeparated(const std::vector<double>& pooled, int k, double rel) {
  if (k == 0 || k >= static_cast<int>(pooled.size())) return true;
  std::vector<double> sorted = pooled;
  std::sort(sorted.begin(), sorted.end(), std::greater<>());
  const double cut = sorted[k - 1], tol = rel * cut;
  const auto below =
      std::find_if(sorted.begin() + k, sorted.end(), [&](double s) { return s < cut; });
  if (below != sorted.end() && cut - *below <= tol) return false;
  if (sorted[k] == cut) {
    const auto above = std::find_if(sorted.rbegin() + (sorted.size() - k), sorted.rend(),
                                    [&](double s) { return s > cut; });
    if (above != sorted.rend() && *above - cut <= tol) return false;
  }
  return true;
}

// Host side of a case: the scores, [batch][num_heads][stride] (kOutside off the candidates).
struct HostCase {
  int batch = 0, num_heads = 0, max_count = 0;
  int64_t stride = 0;
  std::vector<float> scores;
  std::vector<int32_t> begin, count;
};

// Draws the candidates' scores of (sequence b, KV head h) until its cut is well separated: uniform
// in [-16, 16) log2 units, about 1 % of them NaN / +-inf.
void DrawRow(std::mt19937_64& rng, const TopKCase& c, HostCase& host, int b, int h) {
  std::uniform_real_distribution<float> uniform(-16.f, 16.f);
  const float non_finite[] = {std::numeric_limits<float>::quiet_NaN(),
                              std::numeric_limits<float>::infinity(),
                              -std::numeric_limits<float>::infinity()};
  const Sequence& s = c.sequences[static_cast<size_t>(b)];
  float* first =
      host.scores.data() + (static_cast<int64_t>(b) * host.num_heads + h * c.group) * host.stride;
  for (int attempt = 0;; ++attempt) {
    ASSERT_LT(attempt, 100) << "no well-separated scores drawn for sequence " << b;
    for (int i = 0; i < s.count; ++i) {
      const float level = c.levels > 0 ? static_cast<float>(rng() % c.levels) : 0.f;
      for (int q = 0; q < c.group; ++q) {
        first[q * host.stride + s.begin + i] = c.levels > 0       ? level
                                               : rng() % 100 == 0 ? non_finite[rng() % 3]
                                                                  : uniform(rng);
      }
    }
    const std::vector<double> pooled =
        ReferencePooled(first + s.begin, host.stride, c.group, s.count);
    if (CutIsSeparated(pooled, c.k, 1e-4)) return;
  }
}

HostCase MakeHostCase(std::mt19937_64& rng, const TopKCase& c) {
  HostCase host;
  host.batch = static_cast<int>(c.sequences.size());
  host.num_heads = c.num_kv_heads * c.group;
  int largest = 0;
  int64_t end = 0;
  for (const Sequence& s : c.sequences) {
    largest = std::max(largest, s.count);
    end = std::max<int64_t>(end, static_cast<int64_t>(s.begin) + s.count);
    host.begin.push_back(s.begin);
    host.count.push_back(s.count);
  }
  host.max_count = largest + c.max_count_pad;
  host.stride = std::max<int64_t>(end, host.max_count) + c.stride_pad;
  host.scores.assign(static_cast<size_t>(host.batch) * host.num_heads * host.stride, kOutside);
  for (int b = 0; b < host.batch; ++b) {
    for (int h = 0; h < c.num_kv_heads; ++h) DrawRow(rng, c, host, b, h);
  }
  return host;
}

// The CPU twin's positions for (b, h).
std::vector<int> CpuPositions(const TopKCase& c, const HostCase& host, int b, int h) {
  const Sequence& s = c.sequences[static_cast<size_t>(b)];
  PooledTopKInput in;
  in.scores = host.scores.data() +
              (static_cast<int64_t>(b) * host.num_heads + h * c.group) * host.stride + s.begin;
  in.stride = host.stride;
  in.group = c.group;
  in.count = s.count;
  in.begin = s.begin;
  in.units = ScoreUnits::kLog2;
  std::vector<int> positions;
  const int k = c.row_k.empty() ? c.k : std::clamp(c.row_k[static_cast<size_t>(b)], 0, c.k);
  const Status status = PooledTopK(in, k, positions);
  EXPECT_TRUE(status.ok()) << status.message();
  return positions;
}

// Every (b, h): count = min(k, count[b]), positions equal to the CPU's, the rest of the row
// untouched (kPoisonInt).
void ExpectMatchesCpu(const TopKCase& c, const HostCase& host, const std::vector<int32_t>& got,
                      const std::vector<int32_t>& got_counts) {
  for (int b = 0; b < host.batch; ++b) {
    for (int h = 0; h < c.num_kv_heads; ++h) {
      SCOPED_TRACE("sequence " + std::to_string(b) + " kv head " + std::to_string(h));
      const size_t row = static_cast<size_t>(b) * c.num_kv_heads + h;
      const std::vector<int> want = CpuPositions(c, host, b, h);
      ASSERT_EQ(got_counts[row], static_cast<int32_t>(want.size()));
      for (int i = 0; i < c.k; ++i) {
        const int32_t expected = i < static_cast<int>(want.size()) ? want[i] : kPoisonInt;
        ASSERT_EQ(got[row * c.k + i], expected) << "entry " << i;
      }
    }
  }
}

// Device buffers and params of a case; selected / selected_count / workspace poisoned.
struct DeviceCase {
  DeviceBuffer<float> scores, head_lse;
  DeviceBuffer<int32_t> begin, count, selected, selected_count, row_k;
  DeviceBuffer<uint8_t> workspace;
  PooledTopKParams params;
};

DeviceCase Prepare(const TopKCase& c, const HostCase& host) {
  DeviceCase d;
  d.scores = Upload(host.scores);
  d.begin = Upload(host.begin);
  d.count = Upload(host.count);
  const size_t rows = static_cast<size_t>(host.batch) * c.num_kv_heads;
  d.selected = Poisoned<int32_t>(std::max<size_t>(rows * c.k, 1));
  d.selected_count = Poisoned<int32_t>(rows);
  const size_t bytes =
      PooledTopKWorkspaceBytes(host.batch, host.num_heads, c.num_kv_heads, host.max_count);
  d.workspace = Poisoned<uint8_t>(bytes);
  PooledTopKParams& p = d.params;
  p.scores = d.scores.data();
  p.scores_stride = host.stride;
  p.begin = d.begin.data();
  p.count = d.count.data();
  p.max_count = host.max_count;
  p.batch = host.batch;
  p.num_heads = host.num_heads;
  p.num_kv_heads = c.num_kv_heads;
  p.k = c.k;
  if (!c.row_k.empty()) {
    d.row_k = Upload(std::vector<int32_t>(c.row_k.begin(), c.row_k.end()));
    p.row_k = d.row_k.data();
  }
  if (c.head_lse) {  // natural log of sum 2^score over each head's finite candidate scores
    std::vector<float> lse(static_cast<size_t>(host.batch) * host.num_heads);
    for (int b = 0; b < host.batch; ++b) {
      for (int q = 0; q < host.num_heads; ++q) {
        const float* row = host.scores.data() +
                           (static_cast<int64_t>(b) * host.num_heads + q) * host.stride +
                           host.begin[static_cast<size_t>(b)];
        double max = -INFINITY, sum = 0;
        for (int i = 0; i < host.count[static_cast<size_t>(b)]; ++i) {
          if (std::isfinite(row[i])) max = std::max(max, static_cast<double>(row[i]));
        }
        for (int i = 0; i < host.count[static_cast<size_t>(b)]; ++i) {
          if (std::isfinite(row[i])) sum += std::exp2(row[i] - max);
        }
        lse[static_cast<size_t>(b) * host.num_heads + q] =
            sum > 0 ? static_cast<float>((max + std::log2(sum)) * std::log(2.0)) : -INFINITY;
      }
    }
    d.head_lse = Upload(lse);
    p.head_lse = d.head_lse.data();
  }
  p.selected = d.selected.data();
  p.selected_count = d.selected_count.data();
  p.workspace = d.workspace.data();
  p.workspace_bytes = bytes;
  return d;
}

void RunCase(const TopKCase& c) {
  SCOPED_TRACE(Describe(c));
  std::mt19937_64 rng = gpu_test::FreshRng();
  const HostCase host = MakeHostCase(rng, c);
  if (::testing::Test::HasFatalFailure()) return;
  DeviceCase d = Prepare(c, host);
  const Status status = PooledTopK(d.params, nullptr);
  ASSERT_TRUE(status.ok()) << status.message();
  ExpectMatchesCpu(c, host, Download(d.selected), Download(d.selected_count));
}

TEST(PooledTopKOp, OneAndSevenCandidates) {
  for (int group : {1, 4, 8}) {
    RunCase({{{5, 1}}, 1, group, 1});
    RunCase({{{5, 1}}, 2, group, 64});
    RunCase({{{0, 7}, {3, 7}}, 2, group, 1, 0, 3});
    RunCase({{{0, 7}, {3, 7}}, 2, group, 7});
    RunCase({{{11, 7}}, 1, group, 64, 0, 1});
  }
}

TEST(PooledTopKOp, ThousandCandidates) {
  for (int group : {1, 4, 8}) {
    RunCase({{{0, 1000}}, 1, group, 1});
    RunCase({{{0, 1000}, {40, 1000}, {999, 1000}}, 2, group, 64, 0, 17});
    RunCase({{{7, 1000}}, 4, group, 999});
    RunCase({{{7, 1000}}, 2, group, 2048});
  }
}

TEST(PooledTopKOp, ThirtyThreeThousandCandidates) {
  for (int group : {1, 4, 8}) {
    RunCase({{{0, 33000}, {123, 33000}}, 2, group, 2048, 0, 5});
    RunCase({{{1, 33000}}, 1, group, 1});
    RunCase({{{0, 33000}}, 1, group, 64});
  }
}

// Scores from 4 levels, equal over the group: the cut falls inside a group of exactly equal
// pooled scores, whose lowest positions must be kept.
TEST(PooledTopKOp, TiesGoToTheLowerPosition) {
  for (int group : {1, 4, 8}) {
    RunCase({{{0, 1000}, {9, 1000}}, 2, group, 64, 0, 0, 4});
    RunCase({{{0, 33000}, {5, 20000}}, 1, group, 2048, 0, 0, 4});
    RunCase({{{0, 33000}}, 1, group, 12000, 0, 0, 4});  // past the first batch of kept keys
  }
}

// Sequences of different lengths in one launch: the short ones keep everything, the others
// select; max_count past every count (the graph-stable bound).
TEST(PooledTopKOp, MixedSequences) {
  const std::vector<Sequence> sequences = {{0, 33000}, {100, 1000}, {7, 7},   {0, 1},
                                           {50, 0},    {3, 2049},   {0, 2048}};
  for (int group : {1, 4, 8}) {
    RunCase({sequences, 2, group, 64, 4000, 13});
    RunCase({sequences, 2, group, 2048, 0, 1});
    RunCase({sequences, 1, group, 40000});  // k >= every count
  }
}

// A k per sequence (Kascade's k grows with the length), capacity k: below, at and above the
// count, 0, and past the capacity (clamped).
TEST(PooledTopKOp, PerSequenceK) {
  const std::vector<Sequence> sequences = {{0, 5000}, {10, 300}, {0, 64}, {3, 2049}, {0, 900}};
  for (int group : {1, 4, 8}) {
    TopKCase c{sequences, 2, group, 600};
    c.row_k = {500, 300, 100, 0, 9999};
    RunCase(c);
  }
}

// Each head's log-sum-exp given (an attention pass computed it): the statistics pass is skipped
// and the same positions are kept.
TEST(PooledTopKOp, HeadLseGiven) {
  const std::vector<Sequence> sequences = {{0, 5000}, {10, 300}, {0, 64}, {3, 2049}, {0, 900}};
  for (int group : {1, 4, 8}) {
    TopKCase c{sequences, 2, group, 600};
    c.row_k = {500, 300, 100, 0, 9999};
    c.head_lse = true;
    RunCase(c);
  }
}

// More (sequence, KV head) rows than a grid's y dimension holds (65535): the scoring kernels
// stride over them.
TEST(PooledTopKOp, MoreRowsThanTheGridHolds) {
  std::vector<Sequence> sequences(70000);
  for (size_t b = 0; b < sequences.size(); ++b) {
    sequences[b] = {static_cast<int>(b % 5), 3 + static_cast<int>(b % 11)};
  }
  RunCase({sequences, 1, 1, 4});
}

// k = 0: every count is 0 and nothing else is written (selected may be null).
TEST(PooledTopKOp, KZeroWritesOnlyCounts) {
  const TopKCase c{{{0, 100}, {5, 0}}, 2, 4, 0};
  std::mt19937_64 rng = gpu_test::FreshRng();
  const HostCase host = MakeHostCase(rng, c);
  DeviceCase d = Prepare(c, host);
  d.params.selected = nullptr;
  ASSERT_TRUE(PooledTopK(d.params, nullptr).ok());
  EXPECT_EQ(Download(d.selected_count), (std::vector<int32_t>{0, 0, 0, 0}));
}

// Entries past each row's count keep what the caller left there, whatever it was.
TEST(PooledTopKOp, EntriesPastTheCountAreLeftAsTheyWere) {
  const TopKCase c{{{0, 3}, {10, 500}, {2, 0}}, 1, 4, 8};
  std::mt19937_64 rng = gpu_test::FreshRng();
  const HostCase host = MakeHostCase(rng, c);
  DeviceCase d = Prepare(c, host);
  std::vector<int32_t> before(3 * 8);
  for (size_t i = 0; i < before.size(); ++i) before[i] = 1000000 + static_cast<int32_t>(i);
  ASSERT_CUDA_OK(cudaMemcpy(d.selected.data(), before.data(), before.size() * sizeof(int32_t),
                            cudaMemcpyHostToDevice));
  ASSERT_TRUE(PooledTopK(d.params, nullptr).ok());
  const std::vector<int32_t> got = Download(d.selected);
  EXPECT_EQ(Download(d.selected_count), (std::vector<int32_t>{3, 8, 0}));
  const std::vector<int> row1 = CpuPositions(c, host, 1, 0);
  for (int i = 0; i < 8; ++i) {
    EXPECT_EQ(got[i], i < 3 ? i : before[i]) << "row 0 entry " << i;
    EXPECT_EQ(got[8 + i], row1[i]) << "row 1 entry " << i;
    EXPECT_EQ(got[16 + i], before[16 + i]) << "row 2 entry " << i;
  }
}

// Device counts above max_count are clamped to it: the row then selects among its first
// max_count candidates.
TEST(PooledTopKOp, CountsAboveMaxCountAreClamped) {
  const TopKCase c{{{4, 1000}}, 2, 4, 64, 0, 2000};
  std::mt19937_64 rng = gpu_test::FreshRng();
  const HostCase host = MakeHostCase(rng, c);
  DeviceCase d = Prepare(c, host);
  const std::vector<int32_t> too_many = {1000 + 500};  // the candidates past 1000 are kOutside
  ASSERT_CUDA_OK(
      cudaMemcpy(d.count.data(), too_many.data(), sizeof(int32_t), cudaMemcpyHostToDevice));
  ASSERT_TRUE(PooledTopK(d.params, nullptr).ok());
  ExpectMatchesCpu(c, host, Download(d.selected), Download(d.selected_count));
}

// Captured once in a CUDA graph, replayed with other begins and counts (up to max_count).
TEST(PooledTopKOp, ReplaysInACudaGraph) {
  TopKCase c{{{0, 5000}, {300, 3000}}, 2, 4, 256, 0, 0};
  std::mt19937_64 rng = gpu_test::FreshRng();
  HostCase host = MakeHostCase(rng, c);
  DeviceCase d = Prepare(c, host);
  cudaStream_t stream;
  ASSERT_CUDA_OK(cudaStreamCreate(&stream));
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  ASSERT_CUDA_OK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
  const Status status = PooledTopK(d.params, stream);
  ASSERT_CUDA_OK(cudaStreamEndCapture(stream, &graph));
  ASSERT_TRUE(status.ok()) << status.message();
  ASSERT_CUDA_OK(cudaGraphInstantiate(&exec, graph, 0));
  for (const std::vector<Sequence>& replay : {std::vector<Sequence>{{0, 5000}, {300, 3000}},
                                              std::vector<Sequence>{{2000, 100}, {0, 4999}},
                                              std::vector<Sequence>{{1, 256}, {4000, 1000}}}) {
    SCOPED_TRACE(Describe({replay, c.num_kv_heads, c.group, c.k}));
    c.sequences = replay;
    std::fill(host.scores.begin(), host.scores.end(), kOutside);
    for (int b = 0; b < host.batch; ++b) {  // the rows' new candidates, well separated
      host.begin[b] = replay[b].begin;
      host.count[b] = replay[b].count;
      for (int h = 0; h < c.num_kv_heads; ++h) DrawRow(rng, c, host, b, h);
    }
    ASSERT_CUDA_OK(
        cudaMemcpy(d.scores.data(), host.scores.data(), d.scores.bytes(), cudaMemcpyHostToDevice));
    ASSERT_CUDA_OK(
        cudaMemcpy(d.begin.data(), host.begin.data(), d.begin.bytes(), cudaMemcpyHostToDevice));
    ASSERT_CUDA_OK(
        cudaMemcpy(d.count.data(), host.count.data(), d.count.bytes(), cudaMemcpyHostToDevice));
    ASSERT_CUDA_OK(cudaMemset(d.selected.data(), 0xFF, d.selected.bytes()));
    ASSERT_CUDA_OK(cudaGraphLaunch(exec, stream));
    ASSERT_CUDA_OK(cudaStreamSynchronize(stream));
    ExpectMatchesCpu(c, host, Download(d.selected), Download(d.selected_count));
  }
  ASSERT_CUDA_OK(cudaGraphExecDestroy(exec));
  ASSERT_CUDA_OK(cudaGraphDestroy(graph));
  ASSERT_CUDA_OK(cudaStreamDestroy(stream));
}

TEST(PooledTopKOp, BadParamsAreInvalidArgument) {
  const TopKCase c{{{0, 100}}, 2, 4, 8};
  std::mt19937_64 rng = gpu_test::FreshRng();
  const HostCase host = MakeHostCase(rng, c);
  DeviceCase d = Prepare(c, host);
  ASSERT_TRUE(PooledTopK(d.params, nullptr).ok());
  ASSERT_EQ(cudaSuccess, cudaDeviceSynchronize());

  struct Bad {
    const char* field;
    void (*change)(PooledTopKParams&);
  };
  const Bad bad[] = {
      {"batch", [](PooledTopKParams& p) { p.batch = -1; }},
      {"num_kv_heads", [](PooledTopKParams& p) { p.num_kv_heads = 0; }},
      {"num_heads", [](PooledTopKParams& p) { p.num_heads = 7; }},
      {"k = -1", [](PooledTopKParams& p) { p.k = -1; }},
      {"max_count", [](PooledTopKParams& p) { p.max_count = -1; }},
      {"begin is null", [](PooledTopKParams& p) { p.begin = nullptr; }},
      {"count is null", [](PooledTopKParams& p) { p.count = nullptr; }},
      {"selected_count is null", [](PooledTopKParams& p) { p.selected_count = nullptr; }},
      {"selected is null", [](PooledTopKParams& p) { p.selected = nullptr; }},
      {"scores is null", [](PooledTopKParams& p) { p.scores = nullptr; }},
      {"scores_stride", [](PooledTopKParams& p) { p.scores_stride = p.max_count - 1; }},
      {"workspace of", [](PooledTopKParams& p) { p.workspace_bytes -= 1; }},
      {"workspace of", [](PooledTopKParams& p) { p.workspace = nullptr; }},
      {"workspace is not 16-byte aligned",
       [](PooledTopKParams& p) { p.workspace = static_cast<char*>(p.workspace) + 4; }},
  };
  for (const Bad& b : bad) {
    PooledTopKParams p = d.params;
    b.change(p);
    EXPECT_TRUE(FailsWith(PooledTopK(p, nullptr), StatusCode::kInvalidArgument, b.field))
        << b.field;
  }
}

}  // namespace
}  // namespace rubato::cuda
