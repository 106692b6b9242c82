// SfiSelect's stage C (continuation, docs/sfi.md) on hand-built logits whose answer is known
// without a reference, each also compared with the CPU twin (sfi_selector_op_test_util.h): the
// span after a sharp peak, anchors ordered by evidence when their spans exceed the budget, spans
// clipped at the end of J and crossing tile and chunk boundaries, the threshold, and many anchors
// at scale on both sides of the budget (the radix select of the others and the forced-only one).
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <random>
#include <set>
#include <span>
#include <string>
#include <vector>

#include "inference_rank/policies/sfi/kernels/sfi_selector.cuh"
#include "tests/gpu/gpu_test_util.h"
#include "tests/gpu/sfi_selector_op_test_util.h"

namespace rubato::cuda {
namespace {

using sfi_test::Config;
using sfi_test::ExpectOutputsMatchCpu;
using sfi_test::Inputs;
using sfi_test::MakeInputs;
using sfi_test::Outputs;
using sfi_test::Pattern;
using sfi_test::RunOnGpu;
using sfi_test::SelectorCase;

// Sets the logit of index j of J to `value` in every query row and query head of (b, kv_head).
void SetLogit(const SelectorCase& c, Inputs& in, int b, int kv_head, int j, float value) {
  for (int w = 0; w < c.window; ++w) {
    for (int g = 0; g < c.group; ++g) {
      in.logits[in.LogitAt(b, w, kv_head * c.group + g, c.j_begin[b] + j, c)] = value;
    }
  }
}

// The selected positions of (b, kv_head).
std::vector<int32_t> Selected(const SelectorCase& c, const Outputs& out, int b, int kv_head) {
  const size_t row = static_cast<size_t>(b) * c.heads + kv_head;
  const int budget = c.config.budget;
  return std::vector<int32_t>(out.selected.begin() + row * budget,
                              out.selected.begin() + row * budget + out.selected_count[row]);
}

float Priority(const SelectorCase& c, const Outputs& out, int b, int kv_head, int j) {
  return out.continuation[(static_cast<size_t>(b) * c.heads + kv_head) * c.max_j_count() + j];
}

bool Has(const std::vector<int32_t>& positions, int position) {
  return std::binary_search(positions.begin(), positions.end(), position);
}

// A sharp peak over flat logits: stage C keeps the peak and the 8 positions after it, which
// soft-NMS otherwise pushes to the bottom as the peak's neighbours (the paper's stages keep none
// of them at K = 12). Three sequences, two KV heads with their peaks elsewhere, GQA group 2.
TEST(SfiSelectorContinuationOp, KeepsTheSpanAfterASharpPeak) {
  SelectorCase c;
  c.heads = 2;
  c.group = 2;
  c.j_begin = {100, 0, 7};
  c.j_count = {200, 1000, 600};
  c.spread = 0.3f;
  c.config = Config(12);
  const int peaks[3][2] = {{50, 120}, {511, 900}, {0, 300}};  // 511: the span crosses a tile
  std::mt19937_64 rng = gpu_test::FreshRng();
  Inputs in = MakeInputs(c, rng);
  for (int b = 0; b < 3; ++b) {
    for (int h = 0; h < 2; ++h) SetLogit(c, in, b, h, peaks[b][h], 9.f);
  }
  for (int continuation : {8, 0}) {
    SCOPED_TRACE("continuation " + std::to_string(continuation));
    c.config.continuation = continuation;
    const Outputs out = RunOnGpu(c, in);
    ExpectOutputsMatchCpu(c, in, out, /*exact=*/false);
    for (int b = 0; b < 3; ++b) {
      for (int h = 0; h < 2; ++h) {
        const std::vector<int32_t> selected = Selected(c, out, b, h);
        const int peak = c.j_begin[b] + peaks[b][h];
        ASSERT_EQ(selected.size(), 12u);
        EXPECT_TRUE(Has(selected, peak)) << b << " " << h;
        for (int position = peak + 1; position <= peak + 8; ++position) {
          EXPECT_EQ(Has(selected, position), continuation > 0) << position;
          EXPECT_EQ(Priority(c, out, b, h, position - c.j_begin[b]) > 0.f, continuation > 0);
        }
        EXPECT_EQ(Priority(c, out, b, h, peaks[b][h] + 9), 0.f);
        if (peaks[b][h] > 0) {
          EXPECT_EQ(Priority(c, out, b, h, peaks[b][h] - 1), 0.f);
        }
      }
    }
  }
}

// Two anchors, 10 stronger than 40, and budgets below and at their spans: the stronger span
// comes first, in position order (its neighbours tie after soft-NMS); the span of 40 stops at
// the end of J (|J| = 45). A threshold above an anchor's evidence leaves it an ordinary position.
TEST(SfiSelectorContinuationOp, OrdersAnchorsByEvidenceAndStopsAtTheEndOfJ) {
  SelectorCase c;
  c.heads = 2;
  c.group = 1;
  c.j_begin = {0, 1000};
  c.j_count = {45, 45};
  c.pattern = Pattern::kAllEqual;  // 1.25 everywhere
  c.stride_pad = 0;
  c.config = Config(5);
  std::mt19937_64 rng = gpu_test::FreshRng();
  Inputs in = MakeInputs(c, rng);
  for (int b = 0; b < 2; ++b) {
    for (int h = 0; h < 2; ++h) {
      SetLogit(c, in, b, h, 10, 8.25f);
      SetLogit(c, in, b, h, 40, 7.25f);
    }
  }
  const auto range = [](int begin, int end) {  // [begin, end]
    std::vector<int32_t> v;
    for (int p = begin; p <= end; ++p) v.push_back(p);
    return v;
  };
  for (int budget : {5, 14, 16}) {
    SCOPED_TRACE("budget " + std::to_string(budget));
    c.config.budget = budget;
    const Outputs out = RunOnGpu(c, in);
    ExpectOutputsMatchCpu(c, in, out, /*exact=*/true);
    for (int b = 0; b < 2; ++b) {
      const int o = c.j_begin[b];
      for (int h = 0; h < 2; ++h) {
        const std::vector<int32_t> selected = Selected(c, out, b, h);
        if (budget == 5) {
          EXPECT_EQ(selected, range(o + 10, o + 14));
        }
        if (budget == 14) {
          std::vector<int32_t> want = range(o + 10, o + 18);
          for (int32_t p : range(o + 40, o + 44)) want.push_back(p);
          EXPECT_EQ(selected, want);
        }
        if (budget == 16) {  // both spans and two more
          for (int32_t p : range(o + 10, o + 18)) EXPECT_TRUE(Has(selected, p)) << p;
          for (int32_t p : range(o + 40, o + 44)) EXPECT_TRUE(Has(selected, p)) << p;
        }
        EXPECT_EQ(Priority(c, out, b, h, 9), 0.f);
        EXPECT_GT(Priority(c, out, b, h, 10), Priority(c, out, b, h, 40));
        EXPECT_EQ(Priority(c, out, b, h, 18), Priority(c, out, b, h, 10));
        EXPECT_EQ(Priority(c, out, b, h, 19), 0.f);
        EXPECT_EQ(Priority(c, out, b, h, 44), Priority(c, out, b, h, 40));
      }
    }
  }
  // f(10) ~ 0.71, f(40) ~ 0.26: a threshold of 0.5 keeps only the first anchor, 0.9 neither.
  c.config.budget = 5;
  for (double threshold : {0.5, 0.9}) {
    SCOPED_TRACE("threshold " + std::to_string(threshold));
    c.config.continuation_threshold = threshold;
    const Outputs out = RunOnGpu(c, in);
    ExpectOutputsMatchCpu(c, in, out, /*exact=*/true);
    for (int b = 0; b < 2; ++b) {
      for (int h = 0; h < 2; ++h) {
        const std::vector<int32_t> selected = Selected(c, out, b, h);
        EXPECT_TRUE(Has(selected, c.j_begin[b] + 10));
        EXPECT_EQ(Has(selected, c.j_begin[b] + 11), threshold < 0.71);
        EXPECT_EQ(Priority(c, out, b, h, 12) > 0.f, threshold < 0.71);
        EXPECT_EQ(Priority(c, out, b, h, 40), 0.f);
      }
    }
  }
}

// Anchors at the edges of the kernels' blocks: the end of a scores tile (992 positions with two
// KV heads), the end of a 1024-position stage A chunk, the last position of J (a span of one) and
// the first.
TEST(SfiSelectorContinuationOp, SpansAcrossBlockEdgesAndAtTheEndsOfJ) {
  SelectorCase c;
  c.heads = 2;
  c.group = 2;
  c.window = 2;
  c.j_begin = {3};
  c.j_count = {4100};
  c.spread = 0.3f;
  c.config = Config(64);
  std::mt19937_64 rng = gpu_test::FreshRng();
  Inputs in = MakeInputs(c, rng);
  const int anchors[] = {0, 988, 1020, 4095, 4099};
  for (int h = 0; h < 2; ++h) {
    for (int j : anchors) SetLogit(c, in, 0, h, j, 11.f - 0.1f * h);
  }
  const Outputs out = RunOnGpu(c, in);
  ExpectOutputsMatchCpu(c, in, out, /*exact=*/false);
  for (int h = 0; h < 2; ++h) {
    const std::vector<int32_t> selected = Selected(c, out, 0, h);
    for (int j : anchors) {
      for (int k = j; k <= std::min(j + 8, 4099); ++k) {
        EXPECT_TRUE(Has(selected, 3 + k)) << k;
        EXPECT_GT(Priority(c, out, 0, h, k), 0.f) << k;
      }
    }
    EXPECT_EQ(Priority(c, out, 0, h, 9), 0.f);
    EXPECT_EQ(Priority(c, out, 0, h, 1019), 0.f);
    EXPECT_EQ(Priority(c, out, 0, h, 4094), 0.f);
  }
}

// Many anchors per head: about 450 forced positions against budgets below (the forced-only
// select ranks them by (c, z_adj)) and above (all forced, then the radix select), W = 1 and 4.
TEST(SfiSelectorContinuationOp, ManyAnchorsOnBothSidesOfTheBudget) {
  for (int window : {1, 4}) {
    for (int budget : {256, 1000}) {
      SelectorCase c;
      c.heads = 4;
      c.group = 2;
      c.window = window;
      c.j_begin = {4, 0};
      c.j_count = {20000, 9000};
      c.spread = 0.5f;
      c.config = Config(budget);
      SCOPED_TRACE(sfi_test::Describe(c));
      std::mt19937_64 rng = gpu_test::FreshRng();
      Inputs in = MakeInputs(c, rng);
      std::uniform_real_distribution<float> lift(0.f, 0.5f);
      for (int b = 0; b < 2; ++b) {
        for (int h = 0; h < c.heads; ++h) {
          std::uniform_int_distribution<int> slot(0, c.j_count[b] / 12 - 1);
          std::set<int> peaks;
          while (peaks.size() < 50) peaks.insert(12 * slot(rng));
          for (int j : peaks) SetLogit(c, in, b, h, j, 8.f + lift(rng));
        }
      }
      const Outputs out = RunOnGpu(c, in);
      ExpectOutputsMatchCpu(c, in, out, /*exact=*/false);
      int forced_rows = 0;
      for (int b = 0; b < 2; ++b) {
        for (int h = 0; h < c.heads; ++h) {
          int forced = 0;
          for (int j = 0; j < c.j_count[b]; ++j) forced += Priority(c, out, b, h, j) > 0.f;
          forced_rows += forced > 100;
        }
      }
      EXPECT_EQ(forced_rows, 2 * c.heads) << "every head should have many forced positions";
    }
  }
}

}  // namespace
}  // namespace rubato::cuda
