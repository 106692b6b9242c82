// kernels/cuda/decode_scores (raw decode scores, log2 units, keys only) against its CPU twin
// scale * Dot(q, k) * log2 e on fresh random bf16 data: every position below each sequence's
// length, positions past it left untouched, pool rows past the lengths NaN (never read). GQA
// 1/4/8, head_dim 32/64/128, blocks 16/64, lengths not a multiple of the block or the tile, keys
// by row copies and (pool size given) by whole-block tensor copies; the heads' lse against a
// double reference.
#include <algorithm>
#include <cmath>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "kernels/cpu/dot.h"
#include "kernels/cuda/decode_scores.cuh"
#include "tests/gpu/gpu_test_util.h"

namespace rubato {
namespace {

using gpu_test::Upload;
using gpu_test::UploadBf16;

void RunCase(int head_dim, int group, int block_tokens, bool pool_size_given) {
  SCOPED_TRACE("head_dim " + std::to_string(head_dim) + " group " + std::to_string(group) +
               " block " + std::to_string(block_tokens) +
               (pool_size_given ? " pool size given" : ""));
  std::mt19937_64 rng = gpu_test::FreshRng();
  const std::vector<int> lens = {700, 1, 1537};
  const int batch = 3, kv_heads = 2, heads = kv_heads * group;
  const int max_len = 1600;
  const int stride = (max_len + block_tokens - 1) / block_tokens;
  int num_blocks = 0;
  for (int len : lens) num_blocks += (len + block_tokens - 1) / block_tokens;
  std::vector<int32_t> physical(num_blocks);
  std::iota(physical.begin(), physical.end(), 0);
  std::shuffle(physical.begin(), physical.end(), rng);
  std::vector<int32_t> tables(static_cast<size_t>(batch) * stride, 0);
  for (int b = 0, next = 0; b < batch; ++b) {
    for (int i = 0; i < (lens[b] + block_tokens - 1) / block_tokens; ++i) {
      tables[static_cast<size_t>(b) * stride + i] = physical[next++];
    }
  }
  const size_t pool = static_cast<size_t>(num_blocks) * kv_heads * block_tokens * head_dim;
  std::vector<float> keys = gpu_test::RandomBf16Values(rng, pool);
  for (int b = 0; b < batch; ++b) {  // NaN past each length in its last block
    const int blocks = (lens[b] + block_tokens - 1) / block_tokens;
    for (int p = lens[b]; p < blocks * block_tokens; ++p) {
      const int block = tables[static_cast<size_t>(b) * stride + p / block_tokens];
      for (int h = 0; h < kv_heads; ++h) {
        std::fill_n(keys.begin() + ((static_cast<size_t>(block) * kv_heads + h) * block_tokens +
                                    p % block_tokens) *
                                       head_dim,
                    head_dim, NAN);
      }
    }
  }
  const std::vector<float> q =
      gpu_test::RandomBf16Values(rng, static_cast<size_t>(batch) * heads * head_dim, -2.f, 2.f);
  const int64_t scores_stride = max_len + 5;
  const float sentinel = -12345.f;
  std::vector<float> scores(static_cast<size_t>(batch) * heads * scores_stride, sentinel);
  auto d_keys = UploadBf16(keys);
  auto d_q = UploadBf16(q);
  auto d_tables = Upload(tables);
  auto d_lens = Upload(std::vector<int32_t>(lens.begin(), lens.end()));
  auto d_scores = Upload(scores);
  cuda::DecodeScoresParams p;
  p.q = d_q.data();
  p.q_row_stride = static_cast<int64_t>(heads) * head_dim;
  p.key_pool = d_keys.data();
  p.num_pool_blocks = pool_size_given ? num_blocks : 0;
  p.block_tables = d_tables.data();
  p.block_table_stride = stride;
  p.seq_lens = d_lens.data();
  p.batch = batch;
  p.num_heads = heads;
  p.num_kv_heads = kv_heads;
  p.head_dim = head_dim;
  p.block_tokens = block_tokens;
  p.max_seq_len = max_len;
  p.scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(head_dim)));
  p.scores = d_scores.data();
  p.scores_stride = scores_stride;
  auto d_lse = gpu_test::Poisoned<float>(static_cast<size_t>(batch) * heads);
  const size_t workspace_bytes = cuda::DecodeScoresWorkspaceBytes(batch, heads, max_len);
  auto d_workspace = gpu_test::Poisoned<unsigned char>(workspace_bytes);
  p.lse = d_lse.data();
  p.workspace = d_workspace.data();
  p.workspace_bytes = workspace_bytes;
  ASSERT_STATUS_OK(cuda::DecodeScores(p, nullptr));
  const std::vector<float> got = gpu_test::Download(d_scores);
  const std::vector<float> got_lse = gpu_test::Download(d_lse);
  const float log2e = 1.4426950408889634f;
  for (int b = 0; b < batch; ++b) {
    for (int head = 0; head < heads; ++head) {
      const int h = head / group;
      const float* qh = q.data() + (static_cast<size_t>(b) * heads + head) * head_dim;
      double max_score = -INFINITY, sum = 0;  // the head's lse, natural log, in double
      for (int pass = 0; pass < 2; ++pass) {
        for (int pos = 0; pos < lens[b]; ++pos) {
          const int block = tables[static_cast<size_t>(b) * stride + pos / block_tokens];
          const float* k =
              keys.data() +
              ((static_cast<size_t>(block) * kv_heads + h) * block_tokens + pos % block_tokens) *
                  head_dim;
          double dot = 0;
          for (int d = 0; d < head_dim; ++d) dot += static_cast<double>(qh[d]) * k[d];
          const double x = dot * p.scale;
          if (pass == 0) max_score = std::max(max_score, x);
          if (pass == 1) sum += std::exp(x - max_score);
        }
      }
      const double want_lse = max_score + std::log(sum);
      EXPECT_NEAR(got_lse[static_cast<size_t>(b) * heads + head], want_lse,
                  2e-3 + 1e-4 * std::fabs(want_lse))
          << "lse of b " << b << " head " << head;
      for (int pos = 0; pos < scores_stride; ++pos) {
        const float value = got[(static_cast<size_t>(b) * heads + head) * scores_stride + pos];
        if (pos >= lens[b]) {
          ASSERT_EQ(value, sentinel) << "b " << b << " head " << head << " position " << pos;
          continue;
        }
        const int block = tables[static_cast<size_t>(b) * stride + pos / block_tokens];
        const float* k = keys.data() + ((static_cast<size_t>(block) * kv_heads + h) * block_tokens +
                                        pos % block_tokens) *
                                           head_dim;
        const float want = Dot(qh, k, head_dim) * p.scale * log2e;
        ASSERT_NEAR(value, want, 1e-4f + 1e-4f * std::fabs(want))
            << "b " << b << " head " << head << " position " << pos;
      }
    }
  }
}

TEST(DecodeScoresOp, MatchesTheCpuTwin) {
  for (int head_dim : {32, 64, 128}) {
    for (int group : {1, 4, 8}) {
      for (int block_tokens : {16, 64}) {
        for (bool pool_size_given : {false, true}) {
          RunCase(head_dim, group, block_tokens, pool_size_given);
        }
      }
    }
  }
}

TEST(DecodeScoresOp, RefusesBadShapesByName) {
  cuda::DecodeScoresParams p;
  p.batch = 1;
  p.num_heads = 8;
  p.num_kv_heads = 2;
  p.max_seq_len = 100;
  p.scores_stride = 50;
  p.block_tokens = 16;
  EXPECT_TRUE(gpu_test::FailsWith(cuda::DecodeScores(p, nullptr), StatusCode::kInvalidArgument,
                                  "stride 50"));
}

}  // namespace
}  // namespace rubato
