// kernels/cuda/index_gather_attention against its CPU twin, kernels/cpu/index_gather_attention.h,
// on fresh random bf16 data: per (sequence, KV head) an unsorted duplicate-free list of positions
// (counts up to, below and at the capacity, one empty), read through a head map from lists of
// another head count (Kascade's anchor heads); every pool position no list names holds NaN, so a
// kernel that reads one fails. Odd lengths (not a block multiple), GQA 1/4/8, head_dim
// 32/64/128, blocks of 16 and 64, forced split counts.
#include <algorithm>
#include <cmath>
#include <numeric>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "kernels/cpu/index_gather_attention.h"
#include "kernels/cuda/index_gather_attention.cuh"
#include "tests/gpu/gpu_test_util.h"

namespace rubato {
namespace {

using gpu_test::Bf16Close;
using gpu_test::DownloadBf16;
using gpu_test::Poisoned;
using gpu_test::Upload;
using gpu_test::UploadBf16;

struct GatherCase {
  std::vector<int> seq_lens = {300, 5, 1031};
  int capacity = 97;
  int head_dim = 128;
  int group = 4;
  int kv_heads = 2;
  int list_heads = 3;  // the anchor's KV heads
  int block_tokens = 16;
  int num_splits = 0;
};

void RunCase(const GatherCase& c) {
  SCOPED_TRACE("head_dim " + std::to_string(c.head_dim) + " group " + std::to_string(c.group) +
               " block " + std::to_string(c.block_tokens) + " splits " +
               std::to_string(c.num_splits));
  std::mt19937_64 rng = gpu_test::FreshRng();
  const int batch = static_cast<int>(c.seq_lens.size());
  const int num_heads = c.kv_heads * c.group;
  const int max_len = *std::max_element(c.seq_lens.begin(), c.seq_lens.end());
  const int stride = (max_len + c.block_tokens - 1) / c.block_tokens;
  int num_blocks = 0;
  for (int len : c.seq_lens) num_blocks += (len + c.block_tokens - 1) / c.block_tokens;
  std::vector<int32_t> physical(num_blocks);
  std::iota(physical.begin(), physical.end(), 0);
  std::shuffle(physical.begin(), physical.end(), rng);
  std::vector<int32_t> tables(static_cast<size_t>(batch) * stride, 0);
  for (int b = 0, next = 0; b < batch; ++b) {
    for (int i = 0; i < (c.seq_lens[b] + c.block_tokens - 1) / c.block_tokens; ++i) {
      tables[static_cast<size_t>(b) * stride + i] = physical[next++];
    }
  }
  const size_t pool = static_cast<size_t>(num_blocks) * c.kv_heads * c.block_tokens * c.head_dim;
  std::vector<float> keys = gpu_test::RandomBf16Values(rng, pool);
  std::vector<float> values = gpu_test::RandomBf16Values(rng, pool);
  // Lists [batch][list_heads][capacity], and the head map kv head -> list head.
  std::vector<int32_t> lists(static_cast<size_t>(batch) * c.list_heads * c.capacity, -7);
  std::vector<int32_t> counts(static_cast<size_t>(batch) * c.list_heads);
  std::vector<int32_t> head_map(static_cast<size_t>(c.kv_heads));
  for (int h = 0; h < c.kv_heads; ++h) head_map[h] = static_cast<int>(rng() % c.list_heads);
  for (int b = 0; b < batch; ++b) {
    for (int l = 0; l < c.list_heads; ++l) {
      std::vector<int> all(c.seq_lens[b]);
      std::iota(all.begin(), all.end(), 0);
      std::shuffle(all.begin(), all.end(), rng);
      int count = std::min<int>(c.capacity, c.seq_lens[b]);
      if (l == 1) count = static_cast<int>(rng() % (count + 1));
      if (b == 1 && l == 0) count = 0;
      counts[static_cast<size_t>(b) * c.list_heads + l] = count;
      std::copy_n(all.begin(), count,
                  lists.begin() + (static_cast<size_t>(b) * c.list_heads + l) * c.capacity);
    }
  }
  // NaN at every pool position of KV head h that h's mapped list does not name.
  for (int b = 0; b < batch; ++b) {
    for (int h = 0; h < c.kv_heads; ++h) {
      const size_t row = static_cast<size_t>(b) * c.list_heads + head_map[h];
      const std::set<int> named(lists.begin() + row * c.capacity,
                                lists.begin() + row * c.capacity + counts[row]);
      const int blocks = (c.seq_lens[b] + c.block_tokens - 1) / c.block_tokens;
      for (int p = 0; p < blocks * c.block_tokens; ++p) {
        if (named.count(p)) continue;
        const int block = tables[static_cast<size_t>(b) * stride + p / c.block_tokens];
        const size_t at =
            ((static_cast<size_t>(block) * c.kv_heads + h) * c.block_tokens + p % c.block_tokens) *
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
  auto d_queries = UploadBf16(queries);
  auto d_tables = Upload(tables);
  auto d_lists = Upload(lists);
  auto d_counts = Upload(counts);
  auto d_map = Upload(head_map);
  auto d_out = Poisoned<__nv_bfloat16>(static_cast<size_t>(batch) * num_heads * c.head_dim);
  auto d_lse = Poisoned<float>(static_cast<size_t>(batch) * num_heads);
  const size_t workspace_bytes =
      cuda::IndexGatherAttentionWorkspaceBytes(batch, num_heads, c.head_dim, c.capacity);
  auto d_workspace = Poisoned<unsigned char>(workspace_bytes);

  cuda::IndexGatherAttentionParams p;
  p.q = d_queries.data();
  p.q_row_stride = static_cast<int64_t>(num_heads) * c.head_dim;
  p.key_pool = d_keys.data();
  p.value_pool = d_values.data();
  p.block_tables = d_tables.data();
  p.block_table_stride = stride;
  p.batch = batch;
  p.num_heads = num_heads;
  p.num_kv_heads = c.kv_heads;
  p.head_dim = c.head_dim;
  p.block_tokens = c.block_tokens;
  p.scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(c.head_dim)));
  p.lists = d_lists.data();
  p.counts = d_counts.data();
  p.capacity = c.capacity;
  p.list_heads = c.list_heads;
  p.head_map = d_map.data();
  p.out = d_out.data();
  p.out_row_stride = p.q_row_stride;
  p.lse = d_lse.data();
  p.workspace = d_workspace.data();
  p.workspace_bytes = workspace_bytes;
  p.num_splits = c.num_splits;
  ASSERT_STATUS_OK(cuda::IndexGatherAttention(p, nullptr));
  const std::vector<float> out = DownloadBf16(d_out);
  const std::vector<float> lse = gpu_test::Download(d_lse);

  std::vector<float> ref_out(static_cast<size_t>(num_heads) * c.head_dim);
  std::vector<float> ref_lse(num_heads);
  for (int b = 0; b < batch; ++b) {
    SCOPED_TRACE("sequence " + std::to_string(b));
    std::vector<const int*> heads(static_cast<size_t>(c.kv_heads));
    std::vector<int> head_counts(static_cast<size_t>(c.kv_heads));
    for (int h = 0; h < c.kv_heads; ++h) {
      const size_t row = static_cast<size_t>(b) * c.list_heads + head_map[h];
      heads[h] = lists.data() + row * c.capacity;
      head_counts[h] = counts[row];
    }
    IndexGatherAttentionArgs args;
    args.query = queries.data() + static_cast<size_t>(b) * num_heads * c.head_dim;
    args.output = ref_out.data();
    args.lse = ref_lse.data();
    args.num_heads = num_heads;
    args.kv =
        PagedKvView{keys.data(),    values.data(), tables.data() + static_cast<size_t>(b) * stride,
                    c.block_tokens, c.kv_heads,    c.head_dim};
    args.length = c.seq_lens[b];
    args.positions = heads.data();
    args.counts = head_counts.data();
    std::vector<float> scratch(static_cast<size_t>(IndexGatherAttentionScratchSize(args)) + 1);
    ASSERT_STATUS_OK(IndexGatherAttention(args, scratch));
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

TEST(IndexGatherAttentionOp, MatchesTheCpuTwinOnEveryShape) {
  for (int head_dim : {32, 64, 128}) {
    for (int group : {1, 4, 8}) {
      for (int block_tokens : {16, 64}) {
        GatherCase c;
        c.head_dim = head_dim;
        c.group = group;
        c.block_tokens = block_tokens;
        RunCase(c);
      }
    }
  }
}

TEST(IndexGatherAttentionOp, SplitCountsAndIdentityMap) {
  for (int splits : {1, 3, 64}) {
    GatherCase c;
    c.num_splits = splits;
    c.capacity = 700;
    c.seq_lens = {2049, 700};
    RunCase(c);
  }
  GatherCase identity;
  identity.list_heads = identity.kv_heads;  // still through the map: a random one of 2
  RunCase(identity);
}

TEST(IndexGatherAttentionOp, RefusesBadShapesByName) {
  cuda::IndexGatherAttentionParams p;
  p.batch = 1;
  p.num_heads = 6;
  p.num_kv_heads = 4;
  p.capacity = 10;
  p.list_heads = 4;
  p.block_tokens = 16;
  EXPECT_TRUE(gpu_test::FailsWith(cuda::IndexGatherAttention(p, nullptr),
                                  StatusCode::kInvalidArgument, "bad shape"));
  p.num_heads = 8;
  EXPECT_TRUE(gpu_test::FailsWith(cuda::IndexGatherAttention(p, nullptr),
                                  StatusCode::kInvalidArgument, "pointer is null"));
}

}  // namespace
}  // namespace rubato
