// kernels/cuda/decode_attention in its two-segment mode (a compact buffer per (sequence, KV
// head), then the paged positions [recent_begin, L)) against its CPU twin,
// kernels/cpu/two_segment_attention.h, on fresh random bf16 data: compact rows past each count
// and paged positions outside [recent_begin, L) hold NaN, so a kernel that attended them fails.
// With a slot pool (compact_slots, the CUDA model's SFI layout) each sequence reads a shuffled
// slot of a larger pool whose other slots are all NaN.
#include <algorithm>
#include <climits>
#include <cmath>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "kernels/cpu/two_segment_attention.h"
#include "kernels/cuda/decode_attention.cuh"
#include "tests/gpu/gpu_test_util.h"

namespace rubato {
namespace {

using gpu_test::Bf16Close;
using gpu_test::DownloadBf16;
using gpu_test::Poisoned;
using gpu_test::Upload;
using gpu_test::UploadBf16;

struct TwoSegmentCase {
  std::vector<int> seq_lens;
  std::vector<int> recent_lens;  // [batch] L - recent_begin
  int capacity = 100;
  int head_dim = 128;
  int group = 4;
  int num_kv_heads = 2;
  int block_tokens = 16;
  bool row_copies = false;  // withhold the pool size: the row-copy path
  int extra_slots = -1;     // >= 0: compact buffers in a pool of batch + extra_slots slots
  int recent_pad = 0;       // max_recent_tokens beyond the longest recent segment (a bucket)
};

std::string Describe(const TwoSegmentCase& c) {
  std::string lens;
  for (size_t b = 0; b < c.seq_lens.size(); ++b) {
    lens += (b ? "," : "") + std::to_string(c.seq_lens[b]) + "/" + std::to_string(c.recent_lens[b]);
  }
  return "lens/recent [" + lens + "] capacity " + std::to_string(c.capacity) + " head_dim " +
         std::to_string(c.head_dim) + " group " + std::to_string(c.group) + " block " +
         std::to_string(c.block_tokens) + (c.row_copies ? " row copies" : " tensor copies") +
         (c.extra_slots >= 0 ? " slot pool +" + std::to_string(c.extra_slots) : "");
}

void RunCase(const TwoSegmentCase& c) {
  SCOPED_TRACE(Describe(c));
  std::mt19937_64 rng = gpu_test::FreshRng();
  const int batch = static_cast<int>(c.seq_lens.size());
  const int kv_heads = c.num_kv_heads;
  const int num_heads = kv_heads * c.group;
  const int max_len = *std::max_element(c.seq_lens.begin(), c.seq_lens.end());
  const int max_recent = *std::max_element(c.recent_lens.begin(), c.recent_lens.end());
  const int stride = (max_len + c.block_tokens - 1) / c.block_tokens;

  std::vector<int32_t> tables(static_cast<size_t>(batch) * stride, 0);
  int num_blocks = 0;
  for (int len : c.seq_lens) num_blocks += (len + c.block_tokens - 1) / c.block_tokens;
  std::vector<int32_t> physical(num_blocks);
  std::iota(physical.begin(), physical.end(), 0);
  std::shuffle(physical.begin(), physical.end(), rng);
  int next = 0;
  for (int b = 0; b < batch; ++b) {
    for (int i = 0; i < (c.seq_lens[b] + c.block_tokens - 1) / c.block_tokens; ++i) {
      tables[static_cast<size_t>(b) * stride + i] = physical[next++];
    }
  }
  const size_t pool = static_cast<size_t>(num_blocks) * kv_heads * c.block_tokens * c.head_dim;
  std::vector<float> keys = gpu_test::RandomBf16Values(rng, pool);
  std::vector<float> values = gpu_test::RandomBf16Values(rng, pool);
  // Compact buffer of sequence b: buffer b, or a shuffled slot of a larger pool (the rest NaN).
  const bool pooled = c.extra_slots >= 0;
  const int buffers = pooled ? batch + c.extra_slots : batch;
  std::vector<int32_t> slot_of(static_cast<size_t>(buffers));
  std::iota(slot_of.begin(), slot_of.end(), 0);
  if (pooled) std::shuffle(slot_of.begin(), slot_of.end(), rng);
  const size_t compact_elements = static_cast<size_t>(buffers) * kv_heads * c.capacity * c.head_dim;
  std::vector<float> compact_keys = gpu_test::RandomBf16Values(rng, compact_elements);
  std::vector<float> compact_values = gpu_test::RandomBf16Values(rng, compact_elements);
  // Unused slots: every row counted and NaN.
  std::vector<int32_t> counts(static_cast<size_t>(buffers) * kv_heads, c.capacity);
  std::fill(compact_keys.begin(), compact_keys.end(), NAN);
  std::vector<int32_t> recent_begin(batch);
  for (int b = 0; b < batch; ++b) {
    recent_begin[b] = c.seq_lens[b] - c.recent_lens[b];
    const size_t slot = static_cast<size_t>(slot_of[static_cast<size_t>(b)]);
    const std::vector<float> fresh =
        gpu_test::RandomBf16Values(rng, static_cast<size_t>(kv_heads) * c.capacity * c.head_dim);
    std::copy(fresh.begin(), fresh.end(),
              compact_keys.begin() + slot * kv_heads * c.capacity * c.head_dim);
    for (int h = 0; h < kv_heads; ++h) {
      // Different counts per head, 0 and capacity included.
      const int count = h == 0 ? c.capacity : static_cast<int>(rng() % (c.capacity + 1));
      counts[slot * kv_heads + h] = b == 1 && h == 1 ? 0 : count;
    }
  }
  for (size_t buffer = static_cast<size_t>(batch); buffer < slot_of.size(); ++buffer) {
    const size_t slot = static_cast<size_t>(slot_of[buffer]);
    std::fill_n(compact_values.begin() + slot * kv_heads * c.capacity * c.head_dim,
                static_cast<size_t>(kv_heads) * c.capacity * c.head_dim, NAN);
  }
  slot_of.resize(static_cast<size_t>(batch));
  // NaN where nothing may be attended: compact rows past the counts, paged positions below
  // recent_begin and past L in the last block.
  for (int b = 0; b < batch; ++b) {
    const size_t slot = static_cast<size_t>(slot_of[static_cast<size_t>(b)]);
    for (int h = 0; h < kv_heads; ++h) {
      const size_t row0 = (slot * kv_heads + h) * c.capacity;
      for (int r = counts[slot * kv_heads + h]; r < c.capacity; ++r) {
        std::fill_n(compact_keys.begin() + (row0 + r) * c.head_dim, c.head_dim, NAN);
        std::fill_n(compact_values.begin() + (row0 + r) * c.head_dim, c.head_dim, NAN);
      }
      const int blocks = (c.seq_lens[b] + c.block_tokens - 1) / c.block_tokens;
      for (int position = 0; position < blocks * c.block_tokens; ++position) {
        if (position >= recent_begin[b] && position < c.seq_lens[b]) continue;
        const int block = tables[static_cast<size_t>(b) * stride + position / c.block_tokens];
        const size_t at = ((static_cast<size_t>(block) * kv_heads + h) * c.block_tokens +
                           position % c.block_tokens) *
                          c.head_dim;
        std::fill_n(keys.begin() + at, c.head_dim, NAN);
        std::fill_n(values.begin() + at, c.head_dim, NAN);
      }
    }
  }
  const std::vector<float> queries = gpu_test::RandomBf16Values(
      rng, static_cast<size_t>(batch) * num_heads * c.head_dim, -2.f, 2.f);

  auto d_keys = UploadBf16(keys);
  auto d_values = UploadBf16(values);
  auto d_compact_keys = UploadBf16(compact_keys);
  auto d_compact_values = UploadBf16(compact_values);
  auto d_queries = UploadBf16(queries);
  auto d_tables = Upload(tables);
  auto d_lens = Upload(std::vector<int32_t>(c.seq_lens.begin(), c.seq_lens.end()));
  auto d_counts = Upload(counts);
  auto d_slots = Upload(slot_of);
  auto d_recent = Upload(recent_begin);
  auto d_out = Poisoned<__nv_bfloat16>(static_cast<size_t>(batch) * num_heads * c.head_dim);
  auto d_lse = Poisoned<float>(static_cast<size_t>(batch) * num_heads);
  const size_t workspace_bytes =
      cuda::DecodeAttentionWorkspaceBytes(batch, num_heads, c.head_dim, max_len, false);
  auto d_workspace = Poisoned<unsigned char>(workspace_bytes);

  cuda::DecodeAttentionParams params;
  params.q = d_queries.data();
  params.q_row_stride = static_cast<int64_t>(num_heads) * c.head_dim;
  params.key_pool = d_keys.data();
  params.value_pool = d_values.data();
  params.num_pool_blocks = c.row_copies ? 0 : num_blocks;
  params.block_tables = d_tables.data();
  params.block_table_stride = stride;
  params.seq_lens = d_lens.data();
  params.batch = batch;
  params.num_heads = num_heads;
  params.num_kv_heads = kv_heads;
  params.head_dim = c.head_dim;
  params.block_tokens = c.block_tokens;
  params.max_seq_len = max_len;
  params.scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(c.head_dim)));
  params.out = d_out.data();
  params.out_row_stride = params.q_row_stride;
  params.lse = d_lse.data();
  params.workspace = d_workspace.data();
  params.workspace_bytes = workspace_bytes;
  params.compact_keys = d_compact_keys.data();
  params.compact_values = d_compact_values.data();
  params.compact_capacity = c.capacity;
  params.compact_counts = d_counts.data();
  params.recent_begin = d_recent.data();
  params.max_recent_tokens = max_recent + c.recent_pad;
  if (pooled) {
    params.compact_slots = d_slots.data();
    params.num_compact_slots = buffers;
  }
  ASSERT_STATUS_OK(cuda::DecodeAttention(params, nullptr));
  const std::vector<float> out = DownloadBf16(d_out);
  const std::vector<float> lse = gpu_test::Download(d_lse);

  std::vector<float> ref_out(static_cast<size_t>(num_heads) * c.head_dim);
  std::vector<float> ref_lse(num_heads);
  for (int b = 0; b < batch; ++b) {
    SCOPED_TRACE("sequence " + std::to_string(b));
    TwoSegmentAttentionArgs args;
    args.query = queries.data() + static_cast<size_t>(b) * num_heads * c.head_dim;
    args.output = ref_out.data();
    args.lse = ref_lse.data();
    args.num_heads = num_heads;
    const size_t slot = static_cast<size_t>(slot_of[static_cast<size_t>(b)]);
    const size_t compact_offset = slot * kv_heads * c.capacity * c.head_dim;
    args.compact = CompactKvView{compact_keys.data() + compact_offset,
                                 compact_values.data() + compact_offset, kv_heads, c.capacity,
                                 c.head_dim};
    args.compact_counts = counts.data() + slot * kv_heads;
    args.kv.keys = keys.data();
    args.kv.values = values.data();
    args.kv.block_table = tables.data() + static_cast<size_t>(b) * stride;
    args.kv.block_tokens = c.block_tokens;
    args.kv.num_kv_heads = kv_heads;
    args.kv.head_dim = c.head_dim;
    args.recent_begin = recent_begin[b];
    args.recent_end = c.seq_lens[b];
    std::vector<float> scratch(static_cast<size_t>(TwoSegmentAttentionScratchSize(args)));
    ASSERT_STATUS_OK(TwoSegmentAttention(args, scratch));

    const std::span<const float> got(out.data() + static_cast<size_t>(b) * num_heads * c.head_dim,
                                     ref_out.size());
    float ref_max = 0.f;
    for (float v : ref_out) ref_max = std::max(ref_max, std::fabs(v));
    EXPECT_TRUE(Bf16Close("output", got, ref_out, 0.02 * ref_max + 1e-6, 0.02));
    for (int h = 0; h < num_heads; ++h) {
      const float want = ref_lse[h];
      const float have = lse[static_cast<size_t>(b) * num_heads + h];
      if (std::isinf(want)) {
        EXPECT_TRUE(std::isinf(have) && have < 0) << "head " << h << ": " << have;
      } else {
        EXPECT_NEAR(have, want, 2e-3 + 1e-4 * std::fabs(want)) << "head " << h;
      }
    }
  }
}

TEST(TwoSegmentAttentionOp, MixedSegmentsEveryPathAndShape) {
  for (int head_dim : {16, 64, 128}) {
    for (int group : {1, 4, 8}) {
      for (int block_tokens : {16, 64}) {
        for (bool row_copies : {false, true}) {
          TwoSegmentCase c;
          c.seq_lens = {300, 1, 4099};
          c.recent_lens = {256, 1, 37};
          c.capacity = 130;  // not a tile multiple
          c.head_dim = head_dim;
          c.group = group;
          c.block_tokens = block_tokens;
          c.row_copies = row_copies;
          RunCase(c);
        }
      }
    }
  }
}

TEST(TwoSegmentAttentionOp, Batch17QwenShapesSfiBudget) {
  std::mt19937_64 rng(29);
  TwoSegmentCase c;
  for (int i = 0; i < 17; ++i) {
    const int len = 300 + static_cast<int>(rng() % 9000);
    c.seq_lens.push_back(len);
    c.recent_lens.push_back(std::min(len, 256 + static_cast<int>(rng() % 64)));
  }
  c.capacity = 4 + 2048;
  c.num_kv_heads = 8;
  c.group = 4;
  c.block_tokens = 64;
  RunCase(c);
  c.row_copies = true;
  RunCase(c);
}

// The CUDA model's fast steps: compact buffers in a slot pool, sequences in shuffled slots, the
// recent bound a bucket past the longest recent segment (recent_window + t_max).
TEST(TwoSegmentAttentionOp, SlotPoolAndRecentBucket) {
  for (int head_dim : {16, 128}) {
    for (bool row_copies : {false, true}) {
      TwoSegmentCase c;
      c.seq_lens = {300, 1, 4099, 700};
      c.recent_lens = {256, 1, 37, 300};
      c.capacity = 130;
      c.head_dim = head_dim;
      c.block_tokens = 64;
      c.row_copies = row_copies;
      c.extra_slots = 5;
      c.recent_pad = 20;
      RunCase(c);
    }
  }
  TwoSegmentCase one;
  one.seq_lens = {50};
  one.recent_lens = {10};
  one.capacity = 20;
  one.extra_slots = 0;
  RunCase(one);
}

TEST(TwoSegmentAttentionOp, EmptyRecentAndEmptyCompact) {
  TwoSegmentCase c;
  c.seq_lens = {200, 77};
  c.recent_lens = {0, 77};
  c.capacity = 64;
  RunCase(c);
}

TEST(TwoSegmentAttentionOp, RejectsInconsistentParams) {
  auto pool = Poisoned<__nv_bfloat16>(64 * 128);
  auto ints = Upload(std::vector<int32_t>(4, 0));
  const size_t bytes = cuda::DecodeAttentionWorkspaceBytes(1, 4, 128, 64, false);
  auto workspace = Poisoned<unsigned char>(bytes);
  cuda::DecodeAttentionParams params;
  params.q = params.key_pool = params.value_pool = pool.data();
  params.out = pool.data();
  params.block_tables = params.seq_lens = ints.data();
  params.block_table_stride = 4;
  params.batch = 1;
  params.num_heads = 4;
  params.num_kv_heads = 1;
  params.head_dim = 128;
  params.block_tokens = 16;
  params.max_seq_len = 64;
  params.scale = 0.1f;
  params.q_row_stride = params.out_row_stride = 4 * 128;
  params.workspace = workspace.data();
  params.workspace_bytes = bytes;
  params.compact_keys = pool.data();
  EXPECT_TRUE(gpu_test::FailsWith(cuda::DecodeAttention(params, nullptr),
                                  StatusCode::kInvalidArgument, "compact_values"));
  params.compact_values = pool.data();
  params.compact_counts = params.recent_begin = ints.data();
  EXPECT_TRUE(gpu_test::FailsWith(cuda::DecodeAttention(params, nullptr),
                                  StatusCode::kInvalidArgument, "compact_capacity"));
  params.compact_capacity = 4;
  params.max_recent_tokens = 8;
  params.sink_tokens = 4;
  params.recent_tokens = 16;
  EXPECT_TRUE(gpu_test::FailsWith(cuda::DecodeAttention(params, nullptr),
                                  StatusCode::kInvalidArgument, "dense window"));
  params.sink_tokens = 0;
  params.recent_tokens = INT_MAX;
  params.compact_slots = ints.data();
  EXPECT_TRUE(gpu_test::FailsWith(cuda::DecodeAttention(params, nullptr),
                                  StatusCode::kInvalidArgument, "num_compact_slots"));
  params.compact_slots = nullptr;
  auto scores = Poisoned<float>(4 * 64);
  params.scores = scores.data();
  params.scores_stride = 64;
  EXPECT_TRUE(gpu_test::FailsWith(cuda::DecodeAttention(params, nullptr),
                                  StatusCode::kInvalidArgument, "scores"));
}

}  // namespace
}  // namespace rubato
