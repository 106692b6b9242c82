// kernels/cuda/longflow_attention (LongFlow's fused attention and eviction choice) against its
// CPU twin kernels/cpu/longflow_attention.h on fresh random bf16 data: output, slot scores, the
// next write slot (a free slot while there are holes, else the argmin past the sinks, ties to
// the lower slot) and the overflow fallback. Budgets not a multiple of the warps' tiles, masks
// with holes, GQA 1/4/8, head_dim 32/64/128; a pool of slot arrays read through `arrays`.
#include <algorithm>
#include <cmath>
#include <random>
#include <string>
#include <vector>

#include "kernels/cpu/longflow_attention.h"
#include "kernels/cuda/decode_attention.cuh"
#include "kernels/cuda/longflow_attention.cuh"
#include "tests/gpu/gpu_test_util.h"

namespace rubato {
namespace {

using gpu_test::Upload;
using gpu_test::UploadBf16;

struct Case {
  int head_dim = 128, group = 4, kv_heads = 2, budget = 3200, sink = 4;
  double holes = 0.0;
  float key_scale = 1.f;
  bool tie = false;
  bool arrays = false;  // through `arrays`: sequence b reads pool array batch - b (0 unused)
  int batch = 3;
  int splits = 0;  // 0: the op's choice (several for a small batch); 1: the choice in-block
};

void RunCase(const Case& c) {
  SCOPED_TRACE("head_dim " + std::to_string(c.head_dim) + " group " + std::to_string(c.group) +
               " budget " + std::to_string(c.budget) + " holes " + std::to_string(c.holes) +
               " key scale " + std::to_string(c.key_scale) + " batch " + std::to_string(c.batch) +
               " splits " + std::to_string(c.splits));
  std::mt19937_64 rng = gpu_test::FreshRng();
  const int batch = c.batch, heads = c.kv_heads * c.group, d = c.head_dim, B = c.budget;
  const size_t slots = static_cast<size_t>(batch) * c.kv_heads * B * d;
  std::vector<float> keys = gpu_test::RandomBf16Values(rng, slots, -c.key_scale, c.key_scale);
  std::vector<float> values = gpu_test::RandomBf16Values(rng, slots);
  std::vector<float> q =
      gpu_test::RandomBf16Values(rng, static_cast<size_t>(batch) * heads * d, -2.f, 2.f);
  std::vector<uint8_t> valid(static_cast<size_t>(batch) * B);
  std::uniform_real_distribution<double> unit(0, 1);
  for (auto& v : valid) v = unit(rng) >= c.holes;
  if (c.tie) {  // slots 7 and 9 of every (sequence, head) with zero values: score 0, the least
    for (size_t row = 0; row < static_cast<size_t>(batch) * c.kv_heads; ++row) {
      for (int slot : {7, 9}) std::fill_n(values.begin() + (row * B + slot) * d, d, 0.f);
    }
    for (int b = 0; b < batch; ++b)
      valid[static_cast<size_t>(b) * B + 7] = valid[static_cast<size_t>(b) * B + 9] = 1;
  }
  // With arrays, a pool of batch + 1 arrays: array batch - b holds sequence b's slots, array 0
  // other values (never read).
  const int num_arrays = c.arrays ? batch + 1 : batch;
  std::vector<int32_t> arrays(static_cast<size_t>(batch));
  for (int b = 0; b < batch; ++b) arrays[static_cast<size_t>(b)] = c.arrays ? batch - b : b;
  const size_t per_array = static_cast<size_t>(c.kv_heads) * B * d;
  std::vector<float> pool_keys = gpu_test::RandomBf16Values(rng, num_arrays * per_array);
  std::vector<float> pool_values = gpu_test::RandomBf16Values(rng, num_arrays * per_array);
  std::vector<uint8_t> pool_valid(static_cast<size_t>(num_arrays) * B, 1);
  for (int b = 0; b < batch; ++b) {
    const size_t a = static_cast<size_t>(arrays[static_cast<size_t>(b)]);
    std::copy_n(keys.begin() + b * per_array, per_array, pool_keys.begin() + a * per_array);
    std::copy_n(values.begin() + b * per_array, per_array, pool_values.begin() + a * per_array);
    std::copy_n(valid.begin() + static_cast<size_t>(b) * B, B, pool_valid.begin() + a * B);
  }
  auto d_keys = UploadBf16(pool_keys);
  auto d_values = UploadBf16(pool_values);
  auto d_q = UploadBf16(q);
  auto d_valid = Upload(pool_valid);
  auto d_arrays = Upload(arrays);
  auto d_out = gpu_test::Poisoned<__nv_bfloat16>(q.size());
  auto d_next = gpu_test::Poisoned<int32_t>(static_cast<size_t>(num_arrays) * c.kv_heads);
  auto d_scores = gpu_test::Poisoned<float>(static_cast<size_t>(batch) * c.kv_heads * B);
  auto d_used = gpu_test::Poisoned<uint8_t>(static_cast<size_t>(batch) * c.kv_heads);
  const size_t ws = cuda::LongFlowAttentionWorkspaceBytes(batch, heads, d, B);
  auto d_ws = gpu_test::Poisoned<unsigned char>(ws);
  cuda::LongFlowAttentionParams p;
  p.q = d_q.data();
  p.q_row_stride = static_cast<int64_t>(heads) * d;
  p.keys = d_keys.data();
  p.values = d_values.data();
  p.valid = d_valid.data();
  p.batch = batch;
  p.num_heads = heads;
  p.num_kv_heads = c.kv_heads;
  p.head_dim = d;
  p.budget = B;
  p.sink_slots = c.sink;
  p.scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(d)));
  p.out = d_out.data();
  p.out_row_stride = p.q_row_stride;
  p.next_slot = d_next.data();
  p.slot_scores = d_scores.data();
  p.used_max = d_used.data();
  p.workspace = d_ws.data();
  p.workspace_bytes = ws;
  p.num_splits = c.splits;
  if (c.arrays) {
    p.arrays = d_arrays.data();
    p.num_arrays = num_arrays;
  }
  ASSERT_STATUS_OK(cuda::LongFlowAttention(p, nullptr));
  const std::vector<float> out = gpu_test::DownloadBf16(d_out);
  const std::vector<int32_t> pool_next = gpu_test::Download(d_next);
  std::vector<int32_t> next(static_cast<size_t>(batch) * c.kv_heads);  // by sequence
  for (int b = 0; b < batch; ++b) {
    std::copy_n(
        pool_next.begin() + static_cast<size_t>(arrays[static_cast<size_t>(b)]) * c.kv_heads,
        c.kv_heads, next.begin() + static_cast<size_t>(b) * c.kv_heads);
  }
  const std::vector<float> scores = gpu_test::Download(d_scores);
  const std::vector<uint8_t> used = gpu_test::Download(d_used);

  for (int b = 0; b < batch; ++b) {
    SCOPED_TRACE("sequence " + std::to_string(b));
    std::vector<float> ref_out(static_cast<size_t>(heads) * d),
        ref_scores(static_cast<size_t>(c.kv_heads) * B);
    std::vector<int32_t> ref_next(c.kv_heads);
    std::vector<uint8_t> ref_used(c.kv_heads);
    LongFlowAttentionArgs a{q.data() + static_cast<size_t>(b) * heads * d,
                            ref_out.data(),
                            heads,
                            keys.data() + static_cast<size_t>(b) * c.kv_heads * B * d,
                            values.data() + static_cast<size_t>(b) * c.kv_heads * B * d,
                            valid.data() + static_cast<size_t>(b) * B,
                            c.kv_heads,
                            B,
                            d,
                            c.sink,
                            ref_next.data(),
                            ref_scores.data(),
                            ref_used.data()};
    std::vector<float> scratch(LongFlowAttentionScratchSize(a));
    ASSERT_STATUS_OK(LongFlowAttention(a, scratch));
    float ref_max = 0.f;
    for (float v : ref_out) ref_max = std::max(ref_max, std::fabs(v));
    const std::span<const float> got(out.data() + static_cast<size_t>(b) * heads * d,
                                     ref_out.size());
    EXPECT_TRUE(gpu_test::Bf16Close("output", got, ref_out, 0.02 * ref_max + 1e-6, 0.02));
    for (int h = 0; h < c.kv_heads; ++h) {
      EXPECT_EQ(used[static_cast<size_t>(b) * c.kv_heads + h], ref_used[h]) << "head " << h;
      const int32_t have = next[static_cast<size_t>(b) * c.kv_heads + h];
      if (have != ref_next[h]) {
        // bf16 against fp32 arithmetic may reorder near-equal scores: the GPU's choice must
        // score within rounding of the CPU's minimum.
        ASSERT_GE(have, c.sink) << "head " << h;
        const float want_score = ref_scores[static_cast<size_t>(h) * B + ref_next[h]];
        const float have_score = ref_scores[static_cast<size_t>(h) * B + have];
        EXPECT_NEAR(have_score, want_score, 1e-3f * std::max(want_score, 1e-6f) + 1e-9f)
            << "head " << h << ": slot " << have << " against " << ref_next[h];
      }
      if (c.tie && c.holes == 0.0) {
        EXPECT_EQ(have, 7) << "ties go to the lower slot";
      }
      for (int i = 0; i < B; ++i) {
        const float want = ref_scores[static_cast<size_t>(h) * B + i];
        const float got_score = scores[(static_cast<size_t>(b) * c.kv_heads + h) * B + i];
        ASSERT_NEAR(got_score, want, 1e-3f * std::fabs(want) + 1e-8f)
            << "head " << h << " slot " << i;
      }
    }
  }
}

TEST(LongFlowAttentionOp, MatchesTheCpuTwin) {
  for (int head_dim : {32, 64, 128}) {
    for (int group : {1, 4, 8}) {
      for (int budget : {37, 2400, 3200}) {
        Case c;
        c.head_dim = head_dim;
        c.group = group;
        c.budget = budget;
        RunCase(c);
        c.holes = 0.3;
        RunCase(c);
      }
    }
  }
}

// One split per (sequence, KV head), as for a large batch: the eviction choice is made in the
// attention's own blocks, from tiles copied whole (head_dim 64 / 128: rows past a slot array's
// budget and invalid rows zeroed) or row by row (32).
TEST(LongFlowAttentionOp, OneSplitChoosesInTheAttentionBlock) {
  for (int head_dim : {32, 64, 128}) {
    for (int group : {1, 4, 8}) {
      for (int budget : {37, 300, 3200}) {
        for (double holes : {0.0, 0.3}) {
          Case c;
          c.head_dim = head_dim;
          c.group = group;
          c.budget = budget;
          c.holes = holes;
          c.splits = 1;
          RunCase(c);
        }
      }
    }
  }
  Case tie;  // ties go low in the block's reduction too
  tie.tie = true;
  tie.budget = 130;
  tie.splits = 1;
  RunCase(tie);
  Case pool;  // boxes that run past an array's budget read the next array's rows
  pool.arrays = true;
  pool.budget = 300;
  pool.holes = 0.3;
  pool.splits = 1;
  RunCase(pool);
  Case large;        // a batch whose (sequence, KV head) pairs fill the GPU: one split by itself
  large.batch = 40;  // 320 pairs: more than an H100's or H200's 132 SMs x 2 blocks
  large.kv_heads = 8;
  large.head_dim = 64;
  large.budget = 600;
  RunCase(large);
}

// A pool of per-request slot arrays in any row order (the CUDA model's evicting KV).
TEST(LongFlowAttentionOp, ReadsAndWritesThePoolArraysItIsGiven) {
  for (double holes : {0.0, 0.3}) {
    Case c;
    c.arrays = true;
    c.budget = 300;
    c.holes = holes;
    RunCase(c);
  }
}

TEST(LongFlowAttentionOp, TiesAndTheOverflowFallback) {
  Case tie;
  tie.tie = true;
  tie.budget = 130;
  RunCase(tie);
  Case large;
  large.key_scale = 60.f;  // scores of hundreds: the max-subtracted pass, finite outputs
  large.budget = 300;
  RunCase(large);
}

}  // namespace
// The slot choice's fields are refused by name where they cannot apply.
TEST(LongFlowAttentionOp, BadSlotChoiceFieldsAreNamed) {
  auto next = gpu_test::Poisoned<int32_t>(8);
  cuda::DecodeAttentionParams paged;  // a paged launch asking for a slot choice
  paged.head_dim = 64;
  paged.slot_next = next.data();
  const Status no_slots = cuda::DecodeAttention(paged, nullptr);
  EXPECT_FALSE(no_slots.ok());
  EXPECT_NE(no_slots.message().find("slot_next"), std::string::npos) << no_slots.message();

  auto keys = gpu_test::Poisoned<__nv_bfloat16>(64 * 64);
  auto valid = gpu_test::Poisoned<uint8_t>(64);
  auto scores = gpu_test::Poisoned<float>(64);
  cuda::DecodeAttentionParams slots;
  slots.q = slots.slot_keys = slots.slot_values = keys.data();
  slots.out = keys.data();
  slots.slot_valid = valid.data();
  slots.scores = scores.data();
  slots.slot_value_norms = scores.data();
  slots.batch = slots.num_heads = slots.num_kv_heads = 1;
  slots.head_dim = 64;
  slots.slot_budget = slots.max_seq_len = 64;
  slots.scores_stride = 64;
  slots.q_row_stride = slots.out_row_stride = 64;
  slots.scale = 0.125f;
  slots.slot_next = next.data();
  slots.slot_sink_slots = 65;
  const Status sinks = cuda::DecodeAttention(slots, nullptr);
  EXPECT_FALSE(sinks.ok());
  EXPECT_NE(sinks.message().find("slot_sink_slots 65"), std::string::npos) << sinks.message();
}

}  // namespace rubato
