// The host-side plan of a CUDA forward (inference_rank/model/cuda_forward_plan.h): row order
// (decode entries first, by row group), logit rows (sampled block, then host rows), and every
// packed step input: token ids, positions, KV slots, block tables padded to their stride,
// sequence lengths, query starts, gather indices and sampling rows; and the SFI CUDA backend's
// step plan on top of it (sfi_cuda_backend.h): its row groups, slots, segment bounds and window
// rows. No GPU needed: these run anywhere (gpu_model_test --gtest_filter='CudaForwardPlan*').
#include "inference_rank/model/cuda_forward_plan.h"

#include <gtest/gtest.h>

#include <cstring>
#include <numeric>
#include <utility>
#include <vector>

#include "inference_rank/policies/sfi/sfi_cuda_backend.h"

namespace rubato {
namespace {

// A cache shape with 16-token blocks; only block_tokens and num_blocks matter to the plan.
KvCacheShape Shape(int num_blocks, int block_tokens = 16) {
  return KvCacheShape{2, 2, 16, block_tokens, num_blocks};
}

// A sequence holding `blocks` made-up block ids (100, 101, ... + salt).
KvSequence Sequence(int blocks, int salt) {
  KvSequence s;
  for (int b = 0; b < blocks; ++b) s.block_table.push_back(100 * salt + b);
  return s;
}

struct Packed {
  StepInputLayout layout;
  std::vector<std::byte> bytes;
  const int32_t* Ints(size_t offset) const {
    return reinterpret_cast<const int32_t*>(bytes.data() + offset);
  }
  const cuda::SamplingRow* Rows() const {
    return reinterpret_cast<const cuda::SamplingRow*>(bytes.data() + layout.sampling_rows);
  }
};

Packed Pack(std::span<const ForwardEntry> batch, const KvCacheShape& shape,
            const ForwardPlan& plan) {
  Packed packed;
  packed.layout = StepInputLayout::For(StepInputCapacity().GrownToCover(plan.Needs()));
  packed.bytes.assign(packed.layout.bytes, std::byte{0x5a});
  FillStepInputs(batch, shape, plan, packed.layout, packed.bytes.data());
  return packed;
}

TEST(CudaForwardPlanTest, DecodeEntriesFirstThenChunksInBatchOrder) {
  const KvCacheShape shape = Shape(64);
  KvSequence a = Sequence(3, 1), b = Sequence(2, 2), c = Sequence(1, 3), d = Sequence(4, 4);
  const std::vector<int> chunk_a = {5, 6, 7, 8, 9};  // positions 30..34 (rewind-free continue)
  const std::vector<int> one_b = {11};               // position 20
  const std::vector<int> chunk_c = {12, 13, 14};     // positions 0..2
  const std::vector<int> one_d = {15};               // position 50
  const TokenSampling greedy;
  TokenSampling hot;
  hot.temperature = 0.7f;
  hot.top_k = 40;
  hot.top_p = 0.9f;
  hot.uniform = 0.99999999999;  // a double draw: passed on exactly
  const std::vector<ForwardEntry> batch = {
      {&a, chunk_a, 30, LogitsWanted::kAll, &greedy},  // prefill, all rows + sampled last row
      {&b, one_b, 20, LogitsWanted::kLast, &hot},      // decode, sampled: logits stay on device
      {&c, chunk_c, 0, LogitsWanted::kNone, nullptr},  // prefill, no logits
      {&d, one_d, 50, LogitsWanted::kLast, nullptr},   // decode, host logits
  };
  ForwardPlan plan;
  PlanForward(batch, shape, plan);

  EXPECT_EQ(plan.tokens, 10);
  EXPECT_EQ(plan.decode_rows, 2);
  EXPECT_EQ(plan.prefill_entries, 2);
  EXPECT_EQ(plan.max_prefill_tokens, 5);
  EXPECT_FALSE(plan.decode_only());
  EXPECT_EQ(plan.entry_first_row, (std::vector<int>{2, 0, 7, 1}));
  // Decode bucket: at least 4096 but no more than the cache (64 x 16 = 1024 positions).
  EXPECT_EQ(plan.decode_max_seq_len, 1024);
  EXPECT_EQ(plan.decode_table_stride, 64);
  EXPECT_EQ(plan.prefill_table_stride, 3);  // a ends at 35: 3 blocks
  EXPECT_EQ(plan.sample_rows, 2);
  EXPECT_EQ(plan.entry_sample_row, (std::vector<int>{0, 1, -1, -1}));
  EXPECT_EQ(plan.host_rows, 6);  // a: 5 rows, d: 1 row
  EXPECT_EQ(plan.entry_host_row, (std::vector<int>{0, 5, 5, 5}));
  EXPECT_EQ(plan.entry_host_rows, (std::vector<int>{5, 0, 0, 1}));
  // Without attention plans: one group of dense rows, nothing for a backend.
  ASSERT_EQ(plan.decode_groups.size(), 1u);
  EXPECT_EQ(plan.decode_groups[0].group, 0);
  EXPECT_EQ(plan.decode_groups[0].first_row, 0);
  EXPECT_EQ(plan.decode_groups[0].rows, 2);
  EXPECT_EQ(plan.backend_rows, 0);
  EXPECT_FALSE(plan.has_backend_work());
  EXPECT_EQ(plan.entry_group, (std::vector<int>{0, 0, 0, 0}));
  EXPECT_EQ(plan.entry_prefill_index, (std::vector<int>{0, -1, 1, -1}));

  const Packed p = Pack(batch, shape, plan);
  const int32_t* ids = p.Ints(p.layout.token_ids);
  const int32_t* positions = p.Ints(p.layout.positions);
  const int32_t* slots = p.Ints(p.layout.kv_slots);
  EXPECT_EQ(std::vector<int>(ids, ids + 10), (std::vector<int>{11, 15, 5, 6, 7, 8, 9, 12, 13, 14}));
  EXPECT_EQ(std::vector<int>(positions, positions + 10),
            (std::vector<int>{20, 50, 30, 31, 32, 33, 34, 0, 1, 2}));
  // slot = block_table[pos / 16] * 16 + pos % 16
  EXPECT_EQ(slots[0], 201 * 16 + 4);   // b, position 20
  EXPECT_EQ(slots[1], 403 * 16 + 2);   // d, position 50
  EXPECT_EQ(slots[2], 101 * 16 + 14);  // a, position 30
  EXPECT_EQ(slots[4], 102 * 16 + 0);   // a, position 32
  EXPECT_EQ(slots[7], 300 * 16 + 0);   // c, position 0

  const int32_t* lens = p.Ints(p.layout.decode_seq_lens);
  EXPECT_EQ(lens[0], 21);
  EXPECT_EQ(lens[1], 51);
  const int32_t* tables = p.Ints(p.layout.decode_block_tables);
  EXPECT_EQ(tables[0], 200);
  EXPECT_EQ(tables[1], 201);
  for (int i = 2; i < 64; ++i) ASSERT_EQ(tables[i], 0) << "padding of row 0 at " << i;
  for (int i = 0; i < 4; ++i) EXPECT_EQ(tables[64 + i], 400 + i);
  for (int i = 4; i < 64; ++i) ASSERT_EQ(tables[64 + i], 0) << "padding of row 1 at " << i;

  const int32_t* query_start = p.Ints(p.layout.prefill_query_start);
  EXPECT_EQ(std::vector<int>(query_start, query_start + 3), (std::vector<int>{0, 5, 8}));
  const int32_t* starts = p.Ints(p.layout.prefill_start_positions);
  EXPECT_EQ(starts[0], 30);
  EXPECT_EQ(starts[1], 0);
  const int32_t* prefill_tables = p.Ints(p.layout.prefill_block_tables);
  EXPECT_EQ(std::vector<int>(prefill_tables, prefill_tables + 6),
            (std::vector<int>{100, 101, 102, 300, 0, 0}));

  // Gather: sampled last rows of a and b, then a's 5 rows and d's row.
  const int32_t* gather = p.Ints(p.layout.logit_row_indices);
  EXPECT_EQ(std::vector<int>(gather, gather + 8), (std::vector<int>{6, 0, 2, 3, 4, 5, 6, 1}));
  const cuda::SamplingRow* rows = p.Rows();
  EXPECT_EQ(rows[0].temperature, 0.f);
  EXPECT_EQ(rows[1].temperature, 0.7f);
  EXPECT_EQ(rows[1].top_k, 40);
  EXPECT_EQ(rows[1].top_p, 0.9f);
  EXPECT_EQ(rows[1].uniform, 0.99999999999);
  EXPECT_FALSE(plan.adjusts_logits());  // no penalties or bias: no adjustment launch
}

// Penalties and logit_bias: the sampled rows' deltas (BuildLogitDeltas) in sampled-row order,
// with CSR offsets over the sampled rows; entries without sampling or adjustments add none.
TEST(CudaForwardPlanTest, SampledRowsCarryTheirLogitDeltas) {
  const KvCacheShape shape = Shape(64);
  KvSequence a = Sequence(1, 1), b = Sequence(1, 2), c = Sequence(1, 3);
  const std::vector<int> one = {7};
  const std::vector<int> generated = {9, 4, 9};
  const std::vector<std::pair<int, float>> bias = {{12, 3.f}, {4, -1.f}};
  TokenSampling penalised;
  penalised.adjustments.presence_penalty = 0.5f;
  penalised.adjustments.frequency_penalty = 0.25f;
  penalised.adjustments.generated = generated;
  penalised.adjustments.logit_bias = bias;
  const TokenSampling plain;
  TokenSampling biased;
  biased.adjustments.logit_bias = bias;
  const std::vector<ForwardEntry> batch = {
      {&a, one, 3, LogitsWanted::kLast, &penalised},
      {&b, one, 3, LogitsWanted::kLast, nullptr},  // host logits: no sampled row
      {&c, one, 3, LogitsWanted::kLast, &plain},
      {&a, one, 4, LogitsWanted::kLast, &biased},  // (a second entry of a: planning only)
  };
  ForwardPlan plan;
  PlanForward(batch, shape, plan);
  ASSERT_EQ(plan.sample_rows, 3);
  ASSERT_TRUE(plan.adjusts_logits());
  EXPECT_EQ(plan.logit_delta_offsets, (std::vector<int32_t>{0, 3, 3, 5}));
  const Packed p = Pack(batch, shape, plan);
  EXPECT_EQ(p.layout.logit_delta_offsets % 16, 0u);
  EXPECT_EQ(p.layout.logit_deltas % 16, 0u);
  const int32_t* offsets = p.Ints(p.layout.logit_delta_offsets);
  EXPECT_EQ(std::vector<int32_t>(offsets, offsets + 4), (std::vector<int32_t>{0, 3, 3, 5}));
  const auto* deltas = reinterpret_cast<const LogitDelta*>(p.bytes.data() + p.layout.logit_deltas);
  // Row 0: token 4 (bias -1, generated once: 0.25 + 0.5), 9 (twice: 0.5 + 0.5), 12 (bias 3).
  const int tokens[] = {4, 9, 12, 4, 12};
  const float biases[] = {-1.f, 0.f, 3.f, -1.f, 3.f};
  const float penalties[] = {0.75f, 1.f, 0.f, 0.f, 0.f};
  for (int i = 0; i < 5; ++i) {
    EXPECT_EQ(deltas[i].token, tokens[i]) << i;
    EXPECT_EQ(deltas[i].bias, biases[i]) << i;
    EXPECT_EQ(deltas[i].penalty, penalties[i]) << i;
  }
  // The capacity covers the deltas, and a later plan without them needs none.
  EXPECT_EQ(plan.Needs().logit_deltas, 5);
  const std::vector<ForwardEntry> quiet = {{&c, one, 3, LogitsWanted::kLast, &plain}};
  PlanForward(quiet, shape, plan);
  EXPECT_FALSE(plan.adjusts_logits());
  EXPECT_EQ(plan.Needs().logit_deltas, 0);
}

// Decode rows by row group: SFI fast (group 1), slow (group 2), then dense (group 0). SFI's
// selections are the slow decode rows, then the SFI prefill chunks, whose last W queries become
// window rows attending the whole chunk.
TEST(CudaForwardPlanTest, SfiRowGroupsSelectionsAndTheirStepInputs) {
  const KvCacheShape shape = Shape(64);  // 1024 positions
  SfiPolicyConfig config;
  config.sink_tokens = 4;
  config.recent_window = 16;
  config.t_max = 8;
  config.selector.budget = 8;
  KvSequence d = Sequence(4, 1), f1 = Sequence(3, 2), s1 = Sequence(7, 3), p = Sequence(4, 4),
             f2 = Sequence(4, 5), c = Sequence(2, 6);
  SfiSequenceState f1_state, s1_state, p_state, f2_state;
  f1_state.anchor = 25;  // recent segment 41 - 25 = 16 keys
  f2_state.anchor = 40;  // 61 - 40 = 21 keys: within recent_window + t_max = 24
  const EntryAttention f1_sfi = SfiStep(SfiStepKind::kFast, &f1_state, 1);
  const EntryAttention s1_sfi = SfiStep(SfiStepKind::kSlow, &s1_state, 1);
  const EntryAttention p_sfi = SfiStep(SfiStepKind::kSlow, &p_state, 4);
  EntryAttention f2_sfi = SfiStep(SfiStepKind::kFast, &f2_state, 1);
  const std::vector<int> one = {7};
  std::vector<int> chunk_p(30), chunk_c(20);
  std::iota(chunk_p.begin(), chunk_p.end(), 100);
  std::iota(chunk_c.begin(), chunk_c.end(), 200);
  std::vector<ForwardEntry> batch = {
      {&d, one, 50, LogitsWanted::kLast},                       // dense decode
      {&f1, one, 40, LogitsWanted::kLast, nullptr, &f1_sfi},    // SFI fast
      {&s1, one, 100, LogitsWanted::kLast, nullptr, &s1_sfi},   // SFI slow decode
      {&p, chunk_p, 30, LogitsWanted::kLast, nullptr, &p_sfi},  // SFI prompt end, W = 4
      {&f2, one, 60, LogitsWanted::kLast, nullptr, &f2_sfi},    // SFI fast
      {&c, chunk_c, 0, LogitsWanted::kNone},                    // dense chunk
  };
  ForwardPlan plan;
  PlanForward(batch, shape, plan);
  // Prefill rows: the dense chunk c first, then the planned chunk p.
  EXPECT_EQ(plan.entry_first_row, (std::vector<int>{3, 0, 2, 24, 1, 4}));
  EXPECT_EQ(plan.decode_rows, 4);
  EXPECT_EQ(plan.entry_group, (std::vector<int>{0, 1, 2, 2, 1, 0}));
  EXPECT_EQ(plan.entry_prefill_index, (std::vector<int>{-1, -1, -1, 1, -1, 0}));
  EXPECT_EQ(plan.plain_prefill_tokens, 20);
  EXPECT_EQ(plan.plain_max_prefill_tokens, 20);
  EXPECT_EQ(plan.backend_max_prefill_tokens, 30);
  ASSERT_EQ(plan.decode_groups.size(), 3u);
  EXPECT_EQ(plan.decode_groups[0].group, kSfiFastRows);
  EXPECT_EQ(plan.decode_groups[0].first_row, 0);
  EXPECT_EQ(plan.decode_groups[0].rows, 2);
  EXPECT_EQ(plan.decode_groups[1].group, kSfiSlowRows);
  EXPECT_EQ(plan.decode_groups[1].first_row, 2);
  EXPECT_EQ(plan.decode_groups[1].rows, 1);
  EXPECT_EQ(plan.decode_groups[2].group, 0);
  EXPECT_EQ(plan.decode_groups[2].first_row, 3);
  EXPECT_EQ(plan.decode_groups[2].rows, 1);
  EXPECT_EQ(plan.backend_rows, 3);
  EXPECT_EQ(plan.backend_prefill_entries, 1);
  EXPECT_EQ(plan.Group(7).rows, 0);

  SfiStepPlan sfi;
  PlanSfiStep(batch, plan, config, sfi);
  EXPECT_EQ(sfi.fast_first_row, 0);
  EXPECT_EQ(sfi.fast_rows, 2);
  EXPECT_EQ(sfi.slow_first_row, 2);
  EXPECT_EQ(sfi.slow_rows, 1);
  EXPECT_EQ(sfi.selections, 2);
  EXPECT_EQ(sfi.entry_selection, (std::vector<int>{-1, -1, 0, 1, -1, -1}));
  EXPECT_EQ(sfi.recent_bucket, 24);  // recent_window + t_max covers 16 and 21
  EXPECT_EQ(plan.decode_max_seq_len, 1024);
  EXPECT_EQ(sfi.max_j_count, 1024 - 16);
  EXPECT_EQ(sfi.score_stride, 1024);
  ASSERT_EQ(sfi.windows.size(), 1u);
  const SfiWindowPlan& window = sfi.windows[0];
  EXPECT_EQ(window.entry, 3);
  EXPECT_EQ(window.prefill_index, 1);
  EXPECT_EQ(window.window, 4);
  EXPECT_EQ(window.first_row, 0);
  EXPECT_EQ(window.length, 60);
  EXPECT_EQ(window.j_count, 44 - 4);  // J = [4, 60 - 16)
  EXPECT_EQ(sfi.window_rows, 4);
  EXPECT_EQ(sfi.score_rows(), 5);

  Packed packed;
  packed.layout = StepInputLayout::For(StepInputCapacity().GrownToCover(plan.Needs()));
  packed.bytes.assign(packed.layout.bytes, std::byte{0x5a});
  FillStepInputs(batch, shape, plan, packed.layout, packed.bytes.data());
  const SfiStepInputLayout sfi_layout =
      SfiStepInputLayout::For(SfiStepInputCapacity().GrownToCover(sfi.Needs(plan)));
  std::vector<std::byte> region(sfi_layout.bytes, std::byte{0x5a});
  const std::vector<int> slots = {-1, 6, 2, 0, 5, -1};
  FillSfiStepInputs(batch, plan, sfi, config, shape, sfi_layout, slots, region.data());
  auto ints = [&region](size_t offset) {
    return reinterpret_cast<const int32_t*>(region.data() + offset);
  };
  const int32_t* fast_slots = ints(sfi_layout.fast_slots);
  const int32_t* recent_begin = ints(sfi_layout.recent_begin);
  EXPECT_EQ(std::vector<int>(fast_slots, fast_slots + 2), (std::vector<int>{6, 5}));
  EXPECT_EQ(std::vector<int>(recent_begin, recent_begin + 2), (std::vector<int>{25, 40}));
  const int32_t* slow_slots = ints(sfi_layout.slow_slots);
  const int32_t* sink_end = ints(sfi_layout.sink_end);
  const int32_t* j_count = ints(sfi_layout.j_count);
  EXPECT_EQ(std::vector<int>(slow_slots, slow_slots + 2), (std::vector<int>{2, 0}));
  EXPECT_EQ(std::vector<int>(sink_end, sink_end + 2), (std::vector<int>{4, 4}));
  EXPECT_EQ(std::vector<int>(j_count, j_count + 2), (std::vector<int>{85 - 4, 44 - 4}));
  // The fidelity guard's: the fast rows' positions; the query each selection answers (the slow
  // decode row's own, the prompt chunk's last at row 53) and its position.
  const int32_t* fast_positions = ints(sfi_layout.fast_positions);
  const int32_t* selection_q_rows = ints(sfi_layout.selection_q_rows);
  const int32_t* selection_positions = ints(sfi_layout.selection_positions);
  EXPECT_EQ(std::vector<int>(fast_positions, fast_positions + 2), (std::vector<int>{40, 60}));
  EXPECT_EQ(std::vector<int>(selection_q_rows, selection_q_rows + 2), (std::vector<int>{2, 53}));
  EXPECT_EQ(std::vector<int>(selection_positions, selection_positions + 2),
            (std::vector<int>{100, 59}));
  const int32_t* lens = packed.Ints(packed.layout.decode_seq_lens);
  EXPECT_EQ(std::vector<int>(lens, lens + 4), (std::vector<int>{41, 61, 101, 51}));
  const int32_t* window_lens = ints(sfi_layout.window_seq_lens);
  const int32_t* window_q = ints(sfi_layout.window_q_rows);
  EXPECT_EQ(std::vector<int>(window_lens, window_lens + 4), (std::vector<int>{60, 60, 60, 60}));
  EXPECT_EQ(std::vector<int>(window_q, window_q + 4), (std::vector<int>{50, 51, 52, 53}));
  const int32_t* window_tables = ints(sfi_layout.window_block_tables);
  ASSERT_EQ(plan.prefill_table_stride, 4);  // p ends at 60: 4 blocks
  for (int row = 0; row < 4; ++row) {
    for (int b = 0; b < 4; ++b) EXPECT_EQ(window_tables[row * 4 + b], 400 + b) << row;
  }
  // The chunk's tokens at rows 24..53 (after c's at 4..23), its last W at 50..53.
  const int32_t* ids = packed.Ints(packed.layout.token_ids);
  EXPECT_EQ(ids[4], 200);
  EXPECT_EQ(ids[24], 100);
  EXPECT_EQ(ids[50], 126);
  EXPECT_EQ(ids[53], 129);

  // A fast row past what t_max allows gets a bucket of its own; never more than the decode
  // bucket (a t_max of 2^31 - 1 does not overflow it).
  f2_state.anchor = 20;  // 41 keys
  f2_sfi = SfiStep(SfiStepKind::kFast, &f2_state, 1);
  PlanForward(batch, shape, plan);
  PlanSfiStep(batch, plan, config, sfi);
  EXPECT_EQ(sfi.recent_bucket, 64);
  config.t_max = 2147483647;
  PlanSfiStep(batch, plan, config, sfi);
  EXPECT_EQ(sfi.recent_bucket, 1024);
  config.t_max = 8;
  // Without SFI entries nothing of it is planned.
  for (ForwardEntry& entry : batch) entry.attention = nullptr;
  PlanForward(batch, shape, plan);
  PlanSfiStep(batch, plan, config, sfi);
  EXPECT_EQ(sfi.fast_rows + sfi.slow_rows + sfi.selections + sfi.window_rows, 0);
  EXPECT_EQ(sfi.score_stride, 0);
  EXPECT_EQ(plan.backend_rows + plan.backend_prefill_entries, 0);
  EXPECT_EQ(plan.entry_first_row, (std::vector<int>{0, 1, 2, 4, 3, 34}));
}

TEST(CudaForwardPlanTest, DecodeOnlyBatchKeepsItsShapeWhileSequencesGrow) {
  // The graph key (rows, bucket, stride, logit rows) must not change from one step to the next
  // while every sequence stays inside its bucket.
  const KvCacheShape shape = Shape(100000, 64);
  std::vector<KvSequence> sequences = {Sequence(100, 1), Sequence(100, 2), Sequence(100, 3)};
  const TokenSampling greedy;
  const std::vector<int> token = {7};
  ForwardPlan first, later;
  for (int step : {0, 100}) {
    std::vector<ForwardEntry> batch;
    const int lengths[] = {5000, 100, 4200};
    for (size_t i = 0; i < sequences.size(); ++i) {
      batch.push_back({&sequences[i], token, lengths[i] + step, LogitsWanted::kLast, &greedy});
    }
    PlanForward(batch, shape, step == 0 ? first : later);
  }
  EXPECT_TRUE(first.decode_only());
  EXPECT_EQ(first.decode_max_seq_len, 5120);  // 5001 and 5101 round up to 5120
  EXPECT_EQ(later.decode_max_seq_len, first.decode_max_seq_len);
  EXPECT_EQ(first.decode_table_stride, 80);
  EXPECT_EQ(later.decode_table_stride, first.decode_table_stride);
  EXPECT_EQ(first.sample_rows, 3);
  EXPECT_EQ(first.host_rows, 0);
  EXPECT_EQ(first.entry_first_row, (std::vector<int>{0, 1, 2}));
  const StepInputLayout a = StepInputLayout::For(first.Needs());
  const StepInputLayout b = StepInputLayout::For(later.Needs());
  EXPECT_EQ(a.bytes, b.bytes);
  EXPECT_EQ(a.logit_row_indices, b.logit_row_indices);
}

TEST(CudaForwardPlanTest, BucketsStepByAnEighthOfThePowerOfTwo) {
  EXPECT_EQ(DecodeSeqLenBucket(1, 1 << 20), 4096);
  EXPECT_EQ(DecodeSeqLenBucket(4096, 1 << 20), 4096);
  EXPECT_EQ(DecodeSeqLenBucket(4097, 1 << 20), 5120);  // steps of 1024 up to 16K
  EXPECT_EQ(DecodeSeqLenBucket(12289, 1 << 20), 13312);
  EXPECT_EQ(DecodeSeqLenBucket(32768, 1 << 20), 32768);
  EXPECT_EQ(DecodeSeqLenBucket(32769, 1 << 20), 36864);  // steps of 4096 in [32K, 64K)
  EXPECT_EQ(DecodeSeqLenBucket(36864, 1 << 20), 36864);
  EXPECT_EQ(DecodeSeqLenBucket(65537, 1 << 20), 73728);  // steps of 8192 in [64K, 128K)
  EXPECT_EQ(DecodeSeqLenBucket(131073, 1 << 20), 147456);
  EXPECT_EQ(DecodeSeqLenBucket(65537, 70000), 70000);  // capped by the cache
  EXPECT_EQ(DecodeSeqLenBucket(100, 512), 512);
  EXPECT_EQ(DecodeSeqLenBucket(600, 512), 600);  // never below the longest sequence
  for (int len = 1; len < 300000; len += 977) {
    const int bucket = DecodeSeqLenBucket(len, 1 << 30);
    EXPECT_GE(bucket, len);
    EXPECT_LE(bucket, std::max(4096, len + std::max(1023, len / 8))) << len;
  }
}

TEST(CudaForwardPlanTest, LayoutIsAlignedAndCapacityOnlyGrows) {
  StepInputCapacity need;
  need.tokens = 3;
  need.decode_rows = 3;
  need.decode_table_ints = 3 * 65;
  need.logit_rows = 3;
  need.sample_rows = 3;
  const StepInputCapacity grown = StepInputCapacity().GrownToCover(need);
  EXPECT_TRUE(grown.Covers(need));
  EXPECT_EQ(grown.tokens, 4);
  EXPECT_EQ(grown.decode_table_ints, 256);
  StepInputCapacity smaller;
  smaller.tokens = 1;
  EXPECT_EQ(grown.GrownToCover(smaller).tokens, 4);
  StepInputCapacity with_backend = grown;
  with_backend.backend_bytes = 40;  // a backend's region (its own layout inside)
  const StepInputLayout layout = StepInputLayout::For(with_backend);
  for (size_t offset :
       {layout.sampling_rows, layout.token_ids, layout.positions, layout.kv_slots,
        layout.decode_block_tables, layout.decode_seq_lens, layout.prefill_block_tables,
        layout.prefill_query_start, layout.prefill_start_positions, layout.logit_row_indices,
        layout.backend, layout.bytes}) {
    EXPECT_EQ(offset % 16, 0u);
  }
  EXPECT_GE(layout.token_ids, layout.sampling_rows + 4 * sizeof(cuda::SamplingRow));
  EXPECT_GE(layout.backend, layout.logit_row_indices + 4 * sizeof(int32_t));
  EXPECT_GE(layout.bytes, layout.backend + 40);
  EXPECT_FALSE(grown.Covers(with_backend));
  EXPECT_EQ(grown.GrownToCover(with_backend).backend_bytes, 40u);
  // SFI's region (sfi_cuda_backend.h): aligned too.
  SfiStepInputCapacity sfi_need;
  sfi_need.fast_rows = 3;
  sfi_need.selections = 5;
  sfi_need.window_rows = 17;
  sfi_need.window_table_ints = 17 * 3;
  const SfiStepInputCapacity sfi_grown = SfiStepInputCapacity().GrownToCover(sfi_need);
  EXPECT_TRUE(sfi_grown.Covers(sfi_need));
  EXPECT_EQ(sfi_grown.window_rows, 32);
  const SfiStepInputLayout sfi = SfiStepInputLayout::For(sfi_grown);
  for (size_t offset :
       {sfi.fast_slots, sfi.recent_begin, sfi.fast_positions, sfi.slow_slots, sfi.sink_end,
        sfi.j_count, sfi.selection_q_rows, sfi.selection_positions, sfi.window_seq_lens,
        sfi.window_q_rows, sfi.window_block_tables, sfi.bytes}) {
    EXPECT_EQ(offset % 16, 0u);
  }
  EXPECT_GE(sfi.bytes, sfi.window_block_tables + 64 * sizeof(int32_t));
}

// A fixed-budget decode row (evicting KV) attends its slots: no paged slot for its K/V (-1, the
// KV append skips it), no blocks in its table row, and it does not size the decode bucket.
TEST(CudaForwardPlanTest, FixedBudgetRowsHaveNoPagedSlotAndDoNotSizeTheBucket) {
  const KvCacheShape shape = Shape(1024);
  KvSequence evicting;  // its prompt's blocks were released: none
  evicting.num_tokens = 9000;
  KvSequence local = Sequence(2, 1);
  const std::vector<int> one_e = {3};
  const std::vector<int> one_l = {4};
  EntryAttention fixed;
  fixed.action.op = AttentionOp::kFixedBudget;
  const std::vector<ForwardEntry> batch = {
      {&evicting, one_e, 9000, LogitsWanted::kLast, nullptr, &fixed},
      {&local, one_l, 20, LogitsWanted::kLast},
  };
  ForwardPlan plan;
  PlanForward(batch, shape, plan);
  EXPECT_EQ(plan.decode_rows, 2);
  EXPECT_EQ(plan.backend_rows, 1);
  EXPECT_EQ(plan.decode_max_seq_len, 4096);  // the local row's 21 keys: the smallest bucket
  const Packed packed = Pack(batch, shape, plan);
  EXPECT_EQ(packed.Ints(packed.layout.kv_slots)[0], -1);
  EXPECT_EQ(packed.Ints(packed.layout.kv_slots)[1], 101 * 16 + 4);
  const int32_t* table = packed.Ints(packed.layout.decode_block_tables);
  for (int i = 0; i < plan.decode_table_stride; ++i) EXPECT_EQ(table[i], 0) << i;
}

}  // namespace
}  // namespace rubato
