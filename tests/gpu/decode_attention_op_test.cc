// kernels/cuda/decode_attention against its CPU twins: the rows path of kernels/cpu/attention.h
// (output), kernels/cpu/attention_stats.h (log-sum-exp, pooled probabilities) and the raw
// scores SFI's slow step reads (scale * Dot(q, k) * log2 e, kernels/cpu/dot.h), on fresh random
// bf16 K/V in shuffled paged blocks, for batches of sequences of different lengths.
#include <algorithm>
#include <cmath>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "kernels/cpu/attention.h"
#include "kernels/cpu/attention_stats.h"
#include "kernels/cpu/dot.h"
#include "kernels/cuda/decode_attention.cuh"
#include "tests/gpu/gpu_test_util.h"

namespace rubato {
namespace {

using gpu_test::Bf16Close;
using gpu_test::DownloadBf16;
using gpu_test::Poisoned;
using gpu_test::Upload;
using gpu_test::UploadBf16;

struct DecodeCase {
  std::vector<int> seq_lens;
  int head_dim = 128;
  int group = 4;
  int num_kv_heads = 2;
  int block_tokens = 16;
  AttentionWindow window;
  bool want_stats = false;
  int extra_max_seq_len = 0;  // max_seq_len beyond the longest sequence (graph-stable grids)
  // Withholds the pool size: the kernel's row copies instead of whole-block tensor copies
  // (which it takes for dense windows at head_dim 64 / 128 when it knows the pool size).
  bool row_copies = false;
  bool want_scores = false;  // the raw scores output, at a row stride past max_seq_len
};

std::string Describe(const DecodeCase& c) {
  std::string lens;
  for (int l : c.seq_lens) lens += (lens.empty() ? "" : ",") + std::to_string(l);
  return "lens [" + lens + "] head_dim " + std::to_string(c.head_dim) + " group " +
         std::to_string(c.group) + " kv_heads " + std::to_string(c.num_kv_heads) + " block " +
         std::to_string(c.block_tokens) + " sink " + std::to_string(c.window.sink_tokens) +
         " recent " + std::to_string(c.window.recent_tokens) +
         (c.row_copies ? " row copies" : " pool size given") + (c.want_scores ? " scores" : "");
}

// The scores of sequence b: scale * q.k * log2 e at every position the window attends (the f32
// sums of the tensor cores and of Dot differ in order only: within 1e-4 of the sum of |q_i k_i|,
// scaled), the untouched poison (NaN) at hidden positions and at [L, scores_stride).
void ExpectScores(const DecodeCase& c, int b, float scale, const float* query,
                  const PagedKvView& view, const std::vector<float>& scores, int scores_stride) {
  const int num_heads = c.num_kv_heads * c.group;
  const int len = c.seq_lens[b];
  const double log2e = 1.4426950408889634;
  const int sink_end = std::min(c.window.sink_tokens, len);
  const long long recent_begin = std::max<long long>(
      c.window.sink_tokens, static_cast<long long>(len) - c.window.recent_tokens);
  int checked = 0;
  double worst = 0;
  for (int h = 0; h < num_heads; ++h) {
    const float* q = query + static_cast<size_t>(h) * c.head_dim;
    const float* row = scores.data() + (static_cast<size_t>(b) * num_heads + h) * scores_stride;
    for (int position = 0; position < scores_stride; ++position) {
      const bool attended = position < len && (position < sink_end || position >= recent_begin);
      if (!attended) {
        ASSERT_TRUE(std::isnan(row[position]))
            << "head " << h << " position " << position << " was written: " << row[position];
        continue;
      }
      const float* k = view.keys + view.Offset(position, h / c.group);
      double magnitude = 0;
      for (int d = 0; d < c.head_dim; ++d) magnitude += std::fabs(double(q[d]) * k[d]);
      const double want = double(Dot(q, k, c.head_dim) * scale) * log2e;
      const double error = std::fabs(row[position] - want);
      worst = std::max(worst, error);
      ASSERT_LE(error, 1e-4 * magnitude * scale * log2e + 1e-6)
          << "head " << h << " position " << position << ": " << row[position] << " vs " << want;
      ++checked;
    }
  }
  std::printf("[ scores    ] sequence %d: %d scores, worst |error| %.3g\n", b, checked, worst);
}

void RunCase(const DecodeCase& c) {
  SCOPED_TRACE(Describe(c));
  std::mt19937_64 rng = gpu_test::FreshRng();
  const int batch = static_cast<int>(c.seq_lens.size());
  const int num_heads = c.num_kv_heads * c.group;
  const int max_len = *std::max_element(c.seq_lens.begin(), c.seq_lens.end());
  const int max_seq_len = max_len + c.extra_max_seq_len;
  const int stride = (max_seq_len + c.block_tokens - 1) / c.block_tokens;

  // Physical blocks: every sequence's blocks, shuffled so that no table is in order.
  std::vector<int32_t> block_tables(static_cast<size_t>(batch) * stride, 0);
  int num_blocks = 0;
  for (int b = 0; b < batch; ++b)
    num_blocks += (c.seq_lens[b] + c.block_tokens - 1) / c.block_tokens;
  std::vector<int32_t> physical(num_blocks);
  std::iota(physical.begin(), physical.end(), 0);
  std::shuffle(physical.begin(), physical.end(), rng);
  int next = 0;
  for (int b = 0; b < batch; ++b) {
    for (int i = 0; i < (c.seq_lens[b] + c.block_tokens - 1) / c.block_tokens; ++i) {
      block_tables[static_cast<size_t>(b) * stride + i] = physical[next++];
    }
  }
  const size_t pool_elements =
      static_cast<size_t>(num_blocks) * c.num_kv_heads * c.block_tokens * c.head_dim;
  std::vector<float> keys = gpu_test::RandomBf16Values(rng, pool_elements);
  std::vector<float> values = gpu_test::RandomBf16Values(rng, pool_elements);
  // Slots past each sequence's end in its last block hold NaN: a kernel that read them (or let
  // them into P V) would fail; the CPU twin never reads them.
  for (int b = 0; b < batch; ++b) {
    const int len = c.seq_lens[b];
    const int last = (len - 1) / c.block_tokens;
    const int block = block_tables[static_cast<size_t>(b) * stride + last];
    for (int position = len; position < (last + 1) * c.block_tokens; ++position) {
      for (int h = 0; h < c.num_kv_heads; ++h) {
        const size_t at = ((static_cast<size_t>(block) * c.num_kv_heads + h) * c.block_tokens +
                           position % c.block_tokens) *
                          c.head_dim;
        std::fill_n(keys.begin() + at, c.head_dim, NAN);
        std::fill_n(values.begin() + at, c.head_dim, NAN);
      }
    }
  }
  // Queries in [-2, 2]: peakier softmaxes than [-1, 1] exercise the running max.
  const std::vector<float> queries = gpu_test::RandomBf16Values(
      rng, static_cast<size_t>(batch) * num_heads * c.head_dim, -2.f, 2.f);
  const float scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(c.head_dim)));

  auto d_keys = UploadBf16(keys);
  auto d_values = UploadBf16(values);
  auto d_queries = UploadBf16(queries);
  auto d_tables = Upload(block_tables);
  auto d_lens = Upload(std::vector<int32_t>(c.seq_lens.begin(), c.seq_lens.end()));
  auto d_out = Poisoned<__nv_bfloat16>(static_cast<size_t>(batch) * num_heads * c.head_dim);
  auto d_lse = Poisoned<float>(static_cast<size_t>(batch) * num_heads);
  auto d_probs = Poisoned<float>(static_cast<size_t>(batch) * c.num_kv_heads * max_seq_len);
  const int scores_stride = max_seq_len + 5;  // any stride >= max_seq_len
  auto d_scores =
      Poisoned<float>(c.want_scores ? static_cast<size_t>(batch) * num_heads * scores_stride : 0);
  const size_t workspace_bytes =
      cuda::DecodeAttentionWorkspaceBytes(batch, num_heads, c.head_dim, max_seq_len, c.want_stats);
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
  params.num_kv_heads = c.num_kv_heads;
  params.head_dim = c.head_dim;
  params.block_tokens = c.block_tokens;
  params.max_seq_len = max_seq_len;
  params.scale = scale;
  params.sink_tokens = c.window.sink_tokens;
  params.recent_tokens = c.window.recent_tokens;
  params.out = d_out.data();
  params.out_row_stride = static_cast<int64_t>(num_heads) * c.head_dim;
  if (c.want_stats) {
    params.lse = d_lse.data();
    params.kv_head_probs = d_probs.data();
    params.probs_stride = max_seq_len;
  }
  if (c.want_scores) {
    params.scores = d_scores.data();
    params.scores_stride = scores_stride;
  }
  params.workspace = d_workspace.data();
  params.workspace_bytes = workspace_bytes;
  ASSERT_STATUS_OK(cuda::DecodeAttention(params, nullptr));

  const std::vector<float> out = DownloadBf16(d_out);
  const std::vector<float> lse = gpu_test::Download(d_lse);
  const std::vector<float> probs = gpu_test::Download(d_probs);
  const std::vector<float> scores = gpu_test::Download(d_scores);

  std::vector<float> ref_out(static_cast<size_t>(num_heads) * c.head_dim);
  std::vector<float> ref_lse(num_heads);
  for (int b = 0; b < batch; ++b) {
    SCOPED_TRACE("sequence " + std::to_string(b) + " of length " + std::to_string(c.seq_lens[b]));
    PagedKvView view;
    view.keys = const_cast<float*>(keys.data());
    view.values = const_cast<float*>(values.data());
    view.block_table = block_tables.data() + static_cast<size_t>(b) * stride;
    view.block_tokens = c.block_tokens;
    view.num_kv_heads = c.num_kv_heads;
    view.head_dim = c.head_dim;
    const float* query = queries.data() + static_cast<size_t>(b) * num_heads * c.head_dim;
    CausalAttentionArgs args;
    args.queries = query;
    args.output = ref_out.data();
    args.tokens = 1;
    args.start_position = c.seq_lens[b] - 1;
    args.num_heads = num_heads;
    args.kv = view;
    args.window = c.window;
    std::vector<float> scratch(RowsAttentionScratchSize(args));
    for (int h = 0; h < c.num_kv_heads; ++h) RowsAttentionForKvHead(args, h, scratch.data());

    const std::span<const float> got(out.data() + static_cast<size_t>(b) * num_heads * c.head_dim,
                                     ref_out.size());
    float ref_max = 0.f;
    for (float v : ref_out) ref_max = std::max(ref_max, std::fabs(v));
    // bf16 output and bf16 probabilities in P V: ~0.4% per element, relative to the row scale.
    EXPECT_TRUE(Bf16Close("output", got, ref_out, 0.02 * ref_max + 1e-6, 0.02));

    if (c.want_stats) {
      std::vector<float> ref_probs(static_cast<size_t>(c.num_kv_heads) * c.seq_lens[b]);
      DecodeAttentionStatsArgs stats{query, c.seq_lens[b], num_heads, scale, view, c.window};
      DecodeAttentionStats(stats, ref_lse.data(), ref_probs.data());
      EXPECT_TRUE(AllClose<float>(
          "lse", std::span<const float>(lse.data() + static_cast<size_t>(b) * num_heads, num_heads),
          std::span<const float>(ref_lse), 2e-3, 1e-4));
      std::vector<float> got_probs;
      for (int h = 0; h < c.num_kv_heads; ++h) {
        const float* row =
            probs.data() + (static_cast<size_t>(b) * c.num_kv_heads + h) * max_seq_len;
        got_probs.insert(got_probs.end(), row, row + c.seq_lens[b]);
      }
      EXPECT_TRUE(AllClose<float>("probs", got_probs, ref_probs, 1e-7, 2e-3));
    }
    if (c.want_scores) ExpectScores(c, b, scale, query, view, scores, scores_stride);
  }
}

TEST(DecodeAttentionOp, ShortAndMediumContextsEveryHeadDimAndGroup) {
  for (int head_dim : {16, 32, 64, 128}) {
    for (int group : {1, 2, 4, 8}) {
      for (int block_tokens : {16, 64}) {
        for (bool row_copies : {false, true}) {
          DecodeCase c;
          c.seq_lens = {1, 127, 4099};
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

TEST(DecodeAttentionOp, Batch17MixedLengthsQwen3Heads) {
  std::mt19937_64 rng(17);
  DecodeCase c;
  for (int i = 0; i < 17; ++i) c.seq_lens.push_back(1 + static_cast<int>(rng() % 5000));
  c.seq_lens[3] = 1;
  c.seq_lens[9] = 4099;
  c.num_kv_heads = 8;
  c.group = 4;
  for (int block_tokens : {16, 64}) {
    for (bool row_copies : {false, true}) {
      c.block_tokens = block_tokens;
      c.row_copies = row_copies;
      RunCase(c);
    }
  }
}

TEST(DecodeAttentionOp, SingleSequence) {
  for (int len : {1, 2, 63, 64, 65, 300}) {
    for (bool row_copies : {false, true}) {
      DecodeCase c;
      c.seq_lens = {len};
      c.row_copies = row_copies;
      RunCase(c);
    }
  }
}

TEST(DecodeAttentionOp, MaxSeqLenBeyondEverySequenceLeavesSplitsEmpty) {
  for (bool row_copies : {false, true}) {
    DecodeCase c;
    c.seq_lens = {127, 1, 700};
    c.extra_max_seq_len = 20000;  // as a captured graph sees it: grid sized for 20.7K keys
    c.want_stats = true;
    c.row_copies = row_copies;
    RunCase(c);
  }
}

TEST(DecodeAttentionOp, SinkAndRecentWindow) {
  for (int block_tokens : {16, 64}) {
    DecodeCase c;
    c.seq_lens = {1, 50, 104, 105, 4099};
    c.window.sink_tokens = 4;
    c.window.recent_tokens = 100;
    c.block_tokens = block_tokens;
    c.want_stats = true;
    RunCase(c);
  }
}

// A window as wide as max_seq_len hides nothing: the dense (tensor-copy) path, with a sink.
TEST(DecodeAttentionOp, WindowCoveringEveryKeyIsDense) {
  for (int block_tokens : {16, 64}) {
    DecodeCase c;
    c.seq_lens = {1, 50, 4099};
    c.window.sink_tokens = 99;
    c.window.recent_tokens = 4000;  // 99 + 4000 = max_seq_len
    c.block_tokens = block_tokens;
    c.want_stats = true;
    RunCase(c);
  }
}

TEST(DecodeAttentionOp, LseAndPooledProbabilities) {
  for (int group : {1, 4, 8}) {
    DecodeCase c;
    c.seq_lens = {1, 127, 4099};
    c.group = group;
    c.want_stats = true;
    RunCase(c);
  }
}

// The raw scores output (what SFI's slow step hands the Selector): dense and windowed, both
// copy paths, every head_dim, with probabilities at the same time (they then read these scores).
TEST(DecodeAttentionOp, RawScoresInLog2Units) {
  for (int head_dim : {16, 32, 64, 128}) {
    for (bool row_copies : {false, true}) {
      DecodeCase c;
      c.seq_lens = {1, 127, 4099};
      c.head_dim = head_dim;
      c.row_copies = row_copies;
      c.want_scores = true;
      c.extra_max_seq_len = 300;
      RunCase(c);
    }
  }
  DecodeCase window;
  window.seq_lens = {1, 50, 104, 105, 2000};
  window.window.sink_tokens = 4;
  window.window.recent_tokens = 100;
  window.want_scores = true;
  window.want_stats = true;
  RunCase(window);
  DecodeCase stats;
  stats.seq_lens = {700, 33};
  stats.group = 8;
  stats.block_tokens = 64;
  stats.want_scores = true;
  stats.want_stats = true;
  RunCase(stats);
}

TEST(DecodeAttentionOp, Large65537Context) {
  DecodeCase c;
  c.seq_lens = {65537, 127, 65537};
  c.num_kv_heads = 8;
  c.group = 4;
  c.block_tokens = 64;
  c.want_stats = true;
  RunCase(c);
}

TEST(DecodeAttentionOp, Large65537ContextHeadDim64Block16) {
  for (bool row_copies : {false, true}) {
    DecodeCase c;
    c.seq_lens = {65537};
    c.head_dim = 64;
    c.group = 2;
    c.block_tokens = 16;
    c.row_copies = row_copies;
    RunCase(c);
  }
}

TEST(DecodeAttentionOp, RejectsBadParams) {
  cuda::DecodeAttentionParams params;
  Status status = cuda::DecodeAttention(params, nullptr);
  EXPECT_EQ(status.code(), StatusCode::kUnsupported) << status.message();  // head_dim 0

  auto pool = Poisoned<__nv_bfloat16>(64 * 128);
  auto ints = Upload(std::vector<int32_t>(4, 0));
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
  status = cuda::DecodeAttention(params, nullptr);
  EXPECT_EQ(status.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(status.message().find("workspace"), std::string::npos) << status.message();

  params.head_dim = 12;
  status = cuda::DecodeAttention(params, nullptr);
  EXPECT_EQ(status.code(), StatusCode::kUnsupported);
  EXPECT_NE(status.message().find("head_dim 12"), std::string::npos) << status.message();

  params.head_dim = 128;
  params.num_heads = 3;
  params.q_row_stride = params.out_row_stride = 3 * 128;
  const size_t bytes = cuda::DecodeAttentionWorkspaceBytes(1, 3, 128, 64, false);
  auto workspace = Poisoned<unsigned char>(bytes);
  params.workspace = workspace.data();
  params.workspace_bytes = bytes;
  status = cuda::DecodeAttention(params, nullptr);
  EXPECT_EQ(status.code(), StatusCode::kUnsupported) << status.message();  // group 3

  params.num_heads = 4;
  params.num_pool_blocks = -1;
  status = cuda::DecodeAttention(params, nullptr);
  EXPECT_EQ(status.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(status.message().find("num_pool_blocks"), std::string::npos) << status.message();

  params.num_pool_blocks = 4;
  params.block_table_stride = 3;  // 3 blocks of 16 < 64 keys
  status = cuda::DecodeAttention(params, nullptr);
  EXPECT_EQ(status.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(status.message().find("block_table_stride"), std::string::npos) << status.message();
}

}  // namespace
}  // namespace rubato
