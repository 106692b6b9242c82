// kernels/cuda/snapkv_scores (SnapKV-style prompt scoring) against its CPU twin
// kernels/cpu/snapkv_scores.h on fresh random bf16 data, element by element: odd lengths,
// windows 1..47, pooling kernels 1/3/7, GQA 1/4/8, keys in scattered blocks; the kept sets
// (SnapKvKeep on both score vectors) agree; bad shapes are refused by name.
#include <algorithm>
#include <cmath>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "kernels/cpu/snapkv_scores.h"
#include "kernels/cuda/snapkv_scores.cuh"
#include "tests/gpu/gpu_test_util.h"

namespace rubato {
namespace {

using gpu_test::Upload;
using gpu_test::UploadBf16;

struct Case {
  int kv_heads = 2, group = 4, head_dim = 64, length = 301, window = 32, kernel = 7;
};

constexpr int kBlockTokens = 16;

void RunCase(const Case& c) {
  SCOPED_TRACE("kv heads " + std::to_string(c.kv_heads) + " group " + std::to_string(c.group) +
               " head_dim " + std::to_string(c.head_dim) + " length " + std::to_string(c.length) +
               " window " + std::to_string(c.window) + " kernel " + std::to_string(c.kernel));
  std::mt19937_64 rng = gpu_test::FreshRng();
  const int heads = c.kv_heads * c.group, d = c.head_dim;
  const int blocks = (c.length + kBlockTokens - 1) / kBlockTokens + 3;  // some never used
  std::vector<int32_t> table(static_cast<size_t>(blocks));
  for (int b = 0; b < blocks; ++b) table[static_cast<size_t>(b)] = b;
  std::shuffle(table.begin(), table.end(), rng);  // scattered blocks
  const size_t pool = static_cast<size_t>(blocks) * c.kv_heads * kBlockTokens * d;
  std::vector<float> keys = gpu_test::RandomBf16Values(rng, pool, -1.f, 1.f);
  // Rows of stride heads * d + 8 (a qkv-like stride), the CPU twin's dense copy beside them.
  const int64_t stride = static_cast<int64_t>(heads) * d + 8;
  std::vector<float> strided =
      gpu_test::RandomBf16Values(rng, static_cast<size_t>(c.window) * stride, -2.f, 2.f);
  std::vector<float> queries(static_cast<size_t>(c.window) * heads * d);
  for (int w = 0; w < c.window; ++w) {
    std::copy_n(strided.begin() + w * stride, heads * d,
                queries.begin() + static_cast<size_t>(w) * heads * d);
  }
  const int prefix = c.length - c.window;

  std::vector<float> ref(static_cast<size_t>(c.kv_heads) * prefix);
  const PagedKvView view{keys.data(), keys.data(), table.data(), kBlockTokens, c.kv_heads, d};
  const SnapKvScoreArgs args{queries.data(), c.window, heads, view, c.length, c.kernel, ref.data()};
  std::vector<float> scratch(static_cast<size_t>(SnapKvScoresScratchSize(args)));
  ASSERT_STATUS_OK(SnapKvScores(args, scratch));

  auto d_keys = UploadBf16(keys);
  auto d_queries = UploadBf16(strided);
  auto d_table = Upload(table);
  const int64_t scores_stride = prefix + 5;
  auto d_scores = gpu_test::Poisoned<float>(static_cast<size_t>(c.kv_heads) * scores_stride);
  const size_t ws = cuda::SnapKvScoresWorkspaceBytes(heads, c.kv_heads, c.window, c.length);
  auto d_ws = gpu_test::Poisoned<unsigned char>(ws);
  cuda::SnapKvScoresParams p;
  p.window_queries = d_queries.data();
  p.q_row_stride = stride;
  p.window = c.window;
  p.num_heads = heads;
  p.key_pool = d_keys.data();
  p.num_pool_blocks = blocks;
  p.block_table = d_table.data();
  p.num_kv_heads = c.kv_heads;
  p.head_dim = d;
  p.block_tokens = kBlockTokens;
  p.length = c.length;
  p.pool_kernel = c.kernel;
  p.scores = d_scores.data();
  p.scores_stride = scores_stride;
  p.workspace = d_ws.data();
  p.workspace_bytes = ws;
  ASSERT_STATUS_OK(cuda::SnapKvScores(p, nullptr));
  const std::vector<float> got_strided = gpu_test::Download(d_scores);
  std::vector<float> got(ref.size());
  for (int h = 0; h < c.kv_heads; ++h) {
    std::copy_n(got_strided.begin() + h * scores_stride, prefix,
                got.begin() + static_cast<size_t>(h) * prefix);
  }
  // The same bf16 inputs, fp32 math on both sides: only the order of the sums differs (the CPU
  // sums the softmax denominator in double). Scores are sums of probabilities, up to
  // window x group.
  EXPECT_TRUE(gpu_test::Bf16Close("pooled scores", got, ref, 1e-6, 1e-4, 1e-4));

  // The kept sets: where no two scores near the cut lie within rounding, the same positions.
  const int sinks = 4;
  const int budget = std::min(c.length - 1, sinks + c.window + prefix / 2 + 1);
  if (budget > sinks + c.window && budget < c.length) {
    for (int h = 0; h < c.kv_heads; ++h) {
      std::vector<int> want, have;
      SnapKvKeep(ref.data() + static_cast<size_t>(h) * prefix, c.length, c.window, sinks, budget,
                 want);
      SnapKvKeep(got.data() + static_cast<size_t>(h) * prefix, c.length, c.window, sinks, budget,
                 have);
      if (want == have) continue;
      // A differing member must score within rounding of the cut.
      std::vector<float> sorted(ref.begin() + static_cast<ptrdiff_t>(h) * prefix + sinks,
                                ref.begin() + static_cast<ptrdiff_t>(h + 1) * prefix);
      std::sort(sorted.begin(), sorted.end(), std::greater<float>());
      const float cut = sorted[static_cast<size_t>(budget - sinks - c.window - 1)];
      for (size_t i = 0; i < want.size(); ++i) {
        if (want[i] == have[i]) continue;
        const float score = ref[static_cast<size_t>(h) * prefix + have[i]];
        EXPECT_NEAR(score, cut, 1e-4f * cut + 1e-6f) << "head " << h << " position " << have[i];
      }
    }
  }
}

TEST(SnapKvScoresOp, MatchesTheCpuTwin) {
  for (int group : {1, 4, 8}) {
    for (int kernel : {1, 3, 7}) {
      for (const auto& [length, window] :
           std::vector<std::pair<int, int>>{{37, 1}, {301, 32}, {1029, 47}, {2, 1}}) {
        Case c;
        c.group = group;
        c.kernel = kernel;
        c.length = length;
        c.window = window;
        c.head_dim = group == 4 ? 128 : 64;
        RunCase(c);
      }
    }
  }
  Case small;
  small.head_dim = 32;
  small.kv_heads = 3;
  small.length = 77;
  small.window = 13;
  RunCase(small);
  small.head_dim = 16;
  RunCase(small);
}

TEST(SnapKvScoresOp, RefusesBadShapesByName) {
  auto d_keys = gpu_test::Poisoned<__nv_bfloat16>(16 * 64);
  auto d_q = gpu_test::Poisoned<__nv_bfloat16>(64);
  auto d_table = gpu_test::Poisoned<int32_t>(1);
  auto d_scores = gpu_test::Poisoned<float>(16);
  auto d_ws = gpu_test::Poisoned<unsigned char>(1 << 16);
  cuda::SnapKvScoresParams p;
  p.window_queries = d_q.data();
  p.q_row_stride = 64;
  p.window = 1;
  p.num_heads = 1;
  p.key_pool = d_keys.data();
  p.num_pool_blocks = 1;
  p.block_table = d_table.data();
  p.num_kv_heads = 1;
  p.head_dim = 64;
  p.block_tokens = 16;
  p.length = 10;
  p.pool_kernel = 7;
  p.scores = d_scores.data();
  p.scores_stride = 9;
  p.workspace = d_ws.data();
  p.workspace_bytes = 1 << 16;
  cuda::SnapKvScoresParams bad = p;
  bad.window = 10;
  EXPECT_TRUE(gpu_test::FailsWith(cuda::SnapKvScores(bad, nullptr), StatusCode::kInvalidArgument,
                                  "window"));
  bad = p;
  bad.pool_kernel = 4;
  EXPECT_TRUE(gpu_test::FailsWith(cuda::SnapKvScores(bad, nullptr), StatusCode::kInvalidArgument,
                                  "pool_kernel"));
  bad = p;
  bad.scores_stride = 3;
  EXPECT_TRUE(gpu_test::FailsWith(cuda::SnapKvScores(bad, nullptr), StatusCode::kInvalidArgument,
                                  "scores_stride"));
  bad = p;
  bad.head_dim = 48;
  bad.q_row_stride = 48;
  EXPECT_TRUE(
      gpu_test::FailsWith(cuda::SnapKvScores(bad, nullptr), StatusCode::kUnsupported, "head_dim"));
}

}  // namespace
}  // namespace rubato
