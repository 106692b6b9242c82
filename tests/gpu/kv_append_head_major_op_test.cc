// AppendHeadMajorKv (kernels/cuda/kv_append_head_major.cuh) against a host loop: requests of
// different new_tokens whose head-major K / V sections lie at scattered offsets of one source,
// shuffled slots over pools of blocks of 16 and 64, a skipped (negative) slot, untouched rows
// kept, and the launcher's input checks. The copy is exact.
#include <algorithm>
#include <cstdint>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "kernels/cuda/kv_append_head_major.cuh"
#include "tests/gpu/gpu_test_util.h"

namespace rubato {
namespace {

using gpu_test::DownloadBf16;
using gpu_test::FailsWith;
using gpu_test::RandomBf16Values;
using gpu_test::Upload;
using gpu_test::UploadBf16;

TEST(KvAppendHeadMajorOpTest, MatchesHostLoop) {
  std::mt19937_64 rng = gpu_test::FreshRng();
  for (int block_tokens : {16, 64}) {
    for (int head_dim : {8, 64, 128}) {
      const int kv_heads = 3, blocks = 9;
      const std::vector<int> new_tokens = {1, 5, 1, 17};
      // The source: per request K then V, [kv_head][new_tokens][head_dim], 8 elements apart.
      std::vector<int64_t> key_offsets, value_offsets;
      std::vector<int32_t> head_strides, slots;
      int64_t at = 8;
      std::vector<int64_t> key_at, value_at;
      for (int n : new_tokens) {
        key_at.push_back(at);
        at += int64_t{kv_heads} * n * head_dim + 8;
        value_at.push_back(at);
        at += int64_t{kv_heads} * n * head_dim + 8;
      }
      std::vector<int32_t> free_slots(static_cast<size_t>(blocks * block_tokens));
      std::iota(free_slots.begin(), free_slots.end(), 0);
      std::shuffle(free_slots.begin(), free_slots.end(), rng);
      for (size_t r = 0; r < new_tokens.size(); ++r) {
        for (int t = 0; t < new_tokens[r]; ++t) {
          key_offsets.push_back(key_at[r] + int64_t{t} * head_dim);
          value_offsets.push_back(value_at[r] + int64_t{t} * head_dim);
          head_strides.push_back(new_tokens[r] * head_dim);
          slots.push_back(free_slots[slots.size()]);
        }
      }
      slots[2] = -1;  // skipped
      const int rows = static_cast<int>(slots.size());
      const std::vector<float> source = RandomBf16Values(rng, static_cast<size_t>(at));
      const size_t pool_elements = size_t(blocks) * kv_heads * block_tokens * head_dim;
      std::vector<float> keys = RandomBf16Values(rng, pool_elements);
      std::vector<float> values = RandomBf16Values(rng, pool_elements);
      auto device_source = UploadBf16(source);
      auto device_keys = UploadBf16(keys);
      auto device_values = UploadBf16(values);
      auto device_key_offsets = Upload(key_offsets);
      auto device_value_offsets = Upload(value_offsets);
      auto device_head_strides = Upload(head_strides);
      auto device_slots = Upload(slots);
      cuda::HeadMajorKvAppendParams p;
      p.source = device_source.data();
      p.key_offsets = device_key_offsets.data();
      p.value_offsets = device_value_offsets.data();
      p.head_strides = device_head_strides.data();
      p.slots = device_slots.data();
      p.rows = rows;
      p.num_kv_heads = kv_heads;
      p.head_dim = head_dim;
      p.block_tokens = block_tokens;
      p.key_pool = device_keys.data();
      p.value_pool = device_values.data();
      ASSERT_STATUS_OK(cuda::AppendHeadMajorKv(p, nullptr));
      // The CPU twin: the same copy on the host.
      for (int t = 0; t < rows; ++t) {
        if (slots[t] < 0) continue;
        const int block = slots[t] / block_tokens, row = slots[t] % block_tokens;
        for (int h = 0; h < kv_heads; ++h) {
          const size_t dest = ((size_t(block) * kv_heads + h) * block_tokens + row) * head_dim;
          const int64_t from = int64_t{h} * head_strides[t];
          std::copy_n(source.begin() + key_offsets[t] + from, head_dim, keys.begin() + dest);
          std::copy_n(source.begin() + value_offsets[t] + from, head_dim, values.begin() + dest);
        }
      }
      ASSERT_EQ(DownloadBf16(device_keys), keys) << "block " << block_tokens << " dim " << head_dim;
      ASSERT_EQ(DownloadBf16(device_values), values);
    }
  }
}

TEST(KvAppendHeadMajorOpTest, RejectsBadParams) {
  auto buffer = Upload(std::vector<int64_t>(64, 0));
  auto ints = Upload(std::vector<int32_t>(64, 0));
  auto pool = UploadBf16(std::vector<float>(1024, 0.f));
  cuda::HeadMajorKvAppendParams good;
  good.source = pool.data();
  good.key_offsets = good.value_offsets = buffer.data();
  good.head_strides = good.slots = ints.data();
  good.rows = 2;
  good.num_kv_heads = 2;
  good.head_dim = 16;
  good.block_tokens = 16;
  good.key_pool = good.value_pool = pool.data();
  ASSERT_STATUS_OK(cuda::AppendHeadMajorKv(good, nullptr));
  const auto invalid = [](const cuda::HeadMajorKvAppendParams& p, const char* field) {
    return FailsWith(cuda::AppendHeadMajorKv(p, nullptr), StatusCode::kInvalidArgument, field);
  };
  cuda::HeadMajorKvAppendParams p = good;
  p.rows = -1;
  EXPECT_TRUE(invalid(p, "rows"));
  p = good;
  p.num_kv_heads = 0;
  EXPECT_TRUE(invalid(p, "num_kv_heads"));
  p = good;
  p.head_dim = 20;
  EXPECT_TRUE(invalid(p, "head_dim"));
  p = good;
  p.block_tokens = 0;
  EXPECT_TRUE(invalid(p, "block_tokens"));
  p = good;
  p.source = nullptr;
  EXPECT_TRUE(invalid(p, "source"));
  p = good;
  p.value_offsets = nullptr;
  EXPECT_TRUE(invalid(p, "value_offsets"));
  p = good;
  p.head_strides = nullptr;
  EXPECT_TRUE(invalid(p, "head_strides"));
  p = good;
  p.slots = nullptr;
  EXPECT_TRUE(invalid(p, "slots"));
  p = good;
  p.value_pool = nullptr;
  EXPECT_TRUE(invalid(p, "value_pool"));
  p = good;
  p.key_pool = pool.data() + 1;
  EXPECT_TRUE(invalid(p, "aligned"));
  ASSERT_CUDA_OK(cudaDeviceSynchronize());
}

}  // namespace
}  // namespace rubato
