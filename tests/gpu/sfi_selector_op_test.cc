// SfiSelect (inference_rank/policies/sfi/kernels/sfi_selector.cuh) against its CPU twin (inference_rank/policies/sfi/kernels/sfi_selector.h,
// f64) on fresh random logits and key norms: batches of 1, 3 and 17 sequences whose allowed sets
// J have every kind of size (0, 1, below the budget, 4099, 65537) and offset, 1 to 8 KV heads
// with GQA groups 1 to 8, windows of 1 and 16 query rows, budgets 16 / 512 / 2048, gamma 0 and 1,
// soft-NMS windows from 1 to beyond |J|, λ* at both clip ends, log2-unit logits, masked (-inf)
// positions, stage C on (the default reach 8; random logits of spread 3 give anchors) and off.
// What each comparison checks: sfi_selector_op_test_util.h. Hand-built stage C cases:
// sfi_selector_continuation_op_test.cc.
#include <gtest/gtest.h>

#include <climits>
#include <cmath>
#include <cstdint>
#include <random>
#include <span>
#include <string>
#include <vector>

#include "inference_rank/policies/sfi/kernels/sfi_selector.h"
#include "inference_rank/policies/sfi/kernels/sfi_selector.cuh"
#include "tests/gpu/gpu_test_util.h"
#include "tests/gpu/sfi_selector_op_test_util.h"

namespace rubato::cuda {
namespace {

using gpu_test::Download;
using gpu_test::FailsWith;
using gpu_test::Poisoned;
using gpu_test::Upload;
using sfi_test::AscendingInside;
using sfi_test::Config;
using sfi_test::ExpectMatchesCpu;
using sfi_test::ExpectMatchesCpuWithAndWithoutContinuation;
using sfi_test::Inputs;
using sfi_test::MakeInputs;
using sfi_test::Outputs;
using sfi_test::Pattern;
using sfi_test::RunOnGpu;
using sfi_test::SelectorCase;

TEST(SfiSelectorOp, EmptyOneAndBelowBudgetAllowedSets) {
  for (double gamma : {0.0, 1.0}) {
    SelectorCase c;
    c.heads = 2;
    c.group = 4;
    c.window = 16;
    c.j_begin = {4, 0, 37};
    c.j_count = {0, 1, 300};
    c.config = Config(512, gamma);
    ExpectMatchesCpuWithAndWithoutContinuation(c);
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
        c.config = Config(512, round % 2 ? 1.0 : 0.0);
        if (round++ % 3 == 2) c.config.continuation = 0;  // stage C off in a third of them
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
    ExpectMatchesCpuWithAndWithoutContinuation(c);
  }
}

TEST(SfiSelectorOp, LargeAllowedSets) {
  SelectorCase decode;  // one sequence, |J| = 65537, the default budget
  decode.heads = 8;
  decode.group = 4;
  decode.j_begin = {4};
  decode.j_count = {65537};
  decode.config = Config(2048);
  ExpectMatchesCpuWithAndWithoutContinuation(decode);

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
  // 1: no-op; 2 and 3: one neighbour a side; 33; 513: the widest halo in shared memory (half
  // 256); 515, 4096: the per-row segmented maxima; 1 << 30: every neighbourhood is all of J.
  for (int nms_window : {1, 2, 3, 33, 513, 515, 4096, 1 << 30}) {
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

TEST(SfiSelectorOp, ContinuationReaches) {
  // 1, 3, 8 (default), 32 (the widest read directly from the f tile), 33, 256, 3000 (the
  // per-row segmented maxima), 1 << 30 (every anchor reaches the end of J). Spread 4: many
  // anchors.
  for (int reach : {1, 3, 8, 32, 33, 256, 3000, 1 << 30}) {
    SelectorCase c;
    c.heads = 3;
    c.group = 2;
    c.j_begin = {0, 17, 5};
    c.j_count = {9000, 5000, 700};
    c.spread = 4.f;
    c.config = Config(300);
    c.config.continuation = reach;
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
      ASSERT_TRUE(out.continuation[row * max_j + i] >= 0.f) << "continuation " << i;  // no NaN
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

TEST(SfiSelectorOp, WorkspaceGrowsForWideWindowsAndWindowRows) {
  SfiSelectorConfig wide_nms, wide_reach;
  wide_nms.nms_window = 1 << 20;
  wide_reach.continuation = 300;
  const size_t plain = SfiSelectWorkspaceBytes(2, 4, 5000, 1, 4, {});
  EXPECT_GT(plain, 2u * 4 * 5000 * 12);  // evidence, keys, priorities
  EXPECT_GT(SfiSelectWorkspaceBytes(2, 4, 5000, 1, 4, wide_nms), plain + 2u * 4 * 5000 * 8 - 1);
  EXPECT_GT(SfiSelectWorkspaceBytes(2, 4, 5000, 1, 4, wide_reach), plain + 2u * 4 * 5000 * 8 - 1);
  EXPECT_GT(SfiSelectWorkspaceBytes(2, 4, 5000, 16, 8, {}), plain);
  // Widths past max_j_count act like max_j_count: no per-row maxima below the halo limit.
  EXPECT_EQ(SfiSelectWorkspaceBytes(2, 4, 200, 1, 4, wide_nms),
            SfiSelectWorkspaceBytes(2, 4, 200, 1, 4, {}));
  EXPECT_EQ(SfiSelectWorkspaceBytes(0, 4, 200), 0u);
}

TEST(SfiSelectorOp, BadParamsAreInvalidArgument) {
  auto logits = Poisoned<float>(64);
  auto begins = Upload(std::vector<int32_t>{0});
  auto counts = Upload(std::vector<int32_t>{8});
  auto selected = Poisoned<int32_t>(8);
  auto selected_count = Poisoned<int32_t>(2);
  const size_t bytes = SfiSelectWorkspaceBytes(1, 2, 8, /*window=*/2, /*group=*/2, {});
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
      {"num_kv_heads = 65", [](SfiSelectParams& p) { p.num_kv_heads = 65; }},
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
      {"SfiSelectorConfig.continuation",
       [](SfiSelectParams& p) { p.config.continuation = -1; }},
      {"SfiSelectorConfig.continuation_threshold",
       [](SfiSelectParams& p) { p.config.continuation_threshold = 0.0; }},
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
