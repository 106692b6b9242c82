// GPU tests of the paged KV append (kernels/cuda/kv_append.cuh) against its CPU twin
// (kernels/cpu/kv_append.h): keys and values taken from strided rows of a fused qkv buffer,
// written through shuffled block tables into pools that start out random or poisoned; the whole
// pools must then match the CPU result bit for bit (an append is a copy), so a slot written by
// mistake or a slot left unwritten fails. *Large* tests hold the big shapes, which the
// compute-sanitizer run skips.
#include <cuda_bf16.h>
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <string_view>
#include <vector>

#include "common/dtype.h"
#include "kernels/cpu/kv_append.h"
#include "kernels/cpu/paged_kv_view.h"
#include "kernels/cuda/kv_append.cuh"
#include "tests/gpu/gpu_test_util.h"

namespace rubato::gpu_test {
namespace {

using gpu_test::FailsWith;

using cuda::DeviceBuffer;

// One sequence's part of the batch: `tokens` new tokens at positions start_position, ...
struct SequenceAppend {
  int start_position = 0;
  int tokens = 0;
};

uint16_t Bits(__nv_bfloat16 value) {
  uint16_t bits;
  std::memcpy(&bits, &value, sizeof(bits));
  return bits;
}

// Every element of a [blocks][num_kv_heads][block_tokens][head_dim] pool equal, bit for bit.
::testing::AssertionResult SamePoolBits(const std::string& what,
                                        const std::vector<__nv_bfloat16>& actual,
                                        const std::vector<__nv_bfloat16>& expected,
                                        int num_kv_heads, int block_tokens, int head_dim) {
  if (actual.size() != expected.size()) {
    return ::testing::AssertionFailure()
           << what << ": " << actual.size() << " elements, expected " << expected.size();
  }
  size_t mismatches = 0, first = 0;
  for (size_t i = 0; i < actual.size(); ++i) {
    if (Bits(actual[i]) != Bits(expected[i]) && mismatches++ == 0) first = i;
  }
  std::cout << "[ mismatch  ] " << what << ": " << mismatches << " of " << actual.size()
            << " elements\n";
  if (mismatches == 0) return ::testing::AssertionSuccess();
  const size_t column = first % head_dim;
  const size_t row = first / head_dim % block_tokens;
  const size_t head = first / head_dim / block_tokens % num_kv_heads;
  const size_t block = first / head_dim / block_tokens / num_kv_heads;
  return ::testing::AssertionFailure()
         << what << ": " << mismatches << " elements differ; first at block " << block << " head "
         << head << " row " << row << " column " << column << ": got 0x" << std::hex
         << Bits(actual[first]) << ", want 0x" << Bits(expected[first]);
}

class KvAppendOpTest : public ::testing::Test {
 protected:
  void SetUp() override { ASSERT_CUDA_OK(cudaStreamCreate(&stream_)); }
  void TearDown() override { EXPECT_EQ(cudaSuccess, cudaStreamDestroy(stream_)); }

  // Appends the tokens of all `sequences` (concatenated, as in one forward) in one call, with
  // the K and V heads in a fused [tokens][q | k | v] buffer, then compares both pools with the
  // CPU twin run token by token. About one token in eight, and the second token of any sequence
  // of three or more, gets slot -1 and must not be written.
  void CheckAppend(const std::vector<SequenceAppend>& sequences, int num_kv_heads, int head_dim,
                   int block_tokens, bool poisoned_pool) {
    // The logical blocks each sequence touches get distinct physical blocks, in shuffled order;
    // kSpareBlocks more stay unused (and must stay untouched). Logical blocks that no token
    // touches map to -1: the CPU view never looks them up and neither may the slots.
    constexpr int kSpareBlocks = 3;
    int touched_blocks = 0;
    for (const SequenceAppend& s : sequences) {
      touched_blocks +=
          (s.start_position + s.tokens - 1) / block_tokens - s.start_position / block_tokens + 1;
    }
    const int pool_blocks = touched_blocks + kSpareBlocks;
    std::vector<int32_t> physical(pool_blocks);
    std::iota(physical.begin(), physical.end(), 0);
    std::shuffle(physical.begin(), physical.end(), rng_);
    std::vector<std::vector<int32_t>> block_tables;
    size_t next_physical = 0;
    for (const SequenceAppend& s : sequences) {
      const int last = (s.start_position + s.tokens - 1) / block_tokens;
      std::vector<int32_t>& table = block_tables.emplace_back(last + 1, -1);
      for (int b = s.start_position / block_tokens; b <= last; ++b) {
        table[b] = physical[next_physical++];
      }
    }

    // The batch: token t of the call is (sequence, position).
    std::vector<int> sequence_of, position_of;
    std::vector<int32_t> slots;
    std::bernoulli_distribution skip(1.0 / 8);
    for (size_t s = 0; s < sequences.size(); ++s) {
      for (int i = 0; i < sequences[s].tokens; ++i) {
        const int position = sequences[s].start_position + i;
        sequence_of.push_back(static_cast<int>(s));
        position_of.push_back(position);
        const bool skipped = skip(rng_) || (sequences[s].tokens >= 3 && i == 1);
        slots.push_back(skipped ? -1
                                : block_tables[s][position / block_tokens] * block_tokens +
                                      position % block_tokens);
      }
    }
    const int tokens = static_cast<int>(slots.size());
    const int q_heads = 2 * num_kv_heads;
    const int64_t stride = static_cast<int64_t>(q_heads + 2 * num_kv_heads) * head_dim;
    const int64_t keys_offset = static_cast<int64_t>(q_heads) * head_dim;
    const int64_t values_offset = keys_offset + static_cast<int64_t>(num_kv_heads) * head_dim;
    const std::vector<float> qkv = RandomBf16Values(rng_, tokens * stride);

    // [pool_blocks][num_kv_heads][block_tokens][head_dim]; values far from qkv's [-1, 1].
    const size_t pool_size =
        static_cast<size_t>(pool_blocks) * num_kv_heads * block_tokens * head_dim;
    std::vector<float> key_ref, value_ref;
    DeviceBuffer<__nv_bfloat16> d_key_pool, d_value_pool;
    if (poisoned_pool) {
      key_ref.assign(pool_size, Bf16ToF32(0xFFFF));  // the NaN that Poisoned's 0xFF bytes make
      value_ref = key_ref;
      d_key_pool = Poisoned<__nv_bfloat16>(pool_size);
      d_value_pool = Poisoned<__nv_bfloat16>(pool_size);
    } else {
      key_ref = RandomBf16Values(rng_, pool_size, 10, 20);
      value_ref = RandomBf16Values(rng_, pool_size, -20, -10);
      d_key_pool = UploadBf16(key_ref);
      d_value_pool = UploadBf16(value_ref);
    }
    DeviceBuffer<__nv_bfloat16> d_qkv = UploadBf16(qkv);
    DeviceBuffer<int32_t> d_slots = Upload(slots);
    ASSERT_STATUS_OK(cuda::AppendToPagedKv({.keys = d_qkv.data() + keys_offset,
                                            .values = d_qkv.data() + values_offset,
                                            .row_stride = stride,
                                            .slots = d_slots.data(),
                                            .tokens = tokens,
                                            .num_kv_heads = num_kv_heads,
                                            .head_dim = head_dim,
                                            .block_tokens = block_tokens,
                                            .key_pool = d_key_pool.data(),
                                            .value_pool = d_value_pool.data()},
                                           stream_));
    const std::vector<__nv_bfloat16> key_pool = Download(d_key_pool);
    const std::vector<__nv_bfloat16> value_pool = Download(d_value_pool);

    for (int t = 0; t < tokens; ++t) {
      if (slots[t] < 0) continue;
      const PagedKvView view{.keys = key_ref.data(),
                             .values = value_ref.data(),
                             .block_table = block_tables[sequence_of[t]].data(),
                             .block_tokens = block_tokens,
                             .num_kv_heads = num_kv_heads,
                             .head_dim = head_dim};
      const float* row = qkv.data() + t * stride;
      ::rubato::AppendToPagedKv(row + keys_offset, row + values_offset, 1, position_of[t], view);
    }
    const std::string label =
        "kv_append tokens=" + std::to_string(tokens) + " kv_heads=" + std::to_string(num_kv_heads) +
        " head_dim=" + std::to_string(head_dim) + " block_tokens=" + std::to_string(block_tokens) +
        (poisoned_pool ? " poisoned" : " random") + " pool";
    EXPECT_TRUE(SamePoolBits(label + " keys", key_pool, ToBf16(key_ref), num_kv_heads, block_tokens,
                             head_dim));
    EXPECT_TRUE(SamePoolBits(label + " values", value_pool, ToBf16(value_ref), num_kv_heads,
                             block_tokens, head_dim));
  }

  cudaStream_t stream_ = nullptr;
  std::mt19937_64 rng_ = FreshRng();
};

TEST_F(KvAppendOpTest, PrefillMatchesCpu) {
  for (int block_tokens : {16, 64}) {
    for (int num_kv_heads : {1, 2, 8}) {
      for (int head_dim : {16, 24, 32, 64, 128}) {
        for (int tokens : {1, 3, 17}) {
          // From the start of a block, and two rows before a block boundary (17 tokens cross it).
          for (int start : {0, block_tokens - 2}) {
            CheckAppend({{start, tokens}}, num_kv_heads, head_dim, block_tokens,
                        /*poisoned_pool=*/tokens == 3);
          }
        }
      }
    }
  }
}

TEST_F(KvAppendOpTest, DecodeBatchMatchesCpu) {
  // One new token per sequence, after contexts of 1, 127, 4099 and 65537 tokens.
  const std::vector<SequenceAppend> decode = {{0, 1}, {126, 1}, {4098, 1}, {65536, 1}};
  for (int block_tokens : {16, 64}) {
    for (int head_dim : {16, 32, 64, 128}) {
      for (bool poisoned : {false, true}) CheckAppend(decode, 8, head_dim, block_tokens, poisoned);
    }
  }
}

TEST_F(KvAppendOpTest, MixedPrefillAndDecodeMatchesCpu) {
  for (int block_tokens : {16, 64}) {
    CheckAppend({{13, 17}, {126, 1}, {0, 3}, {4098, 1}}, 2, 128, block_tokens, false);
  }
}

TEST_F(KvAppendOpTest, LongPrefillLarge) {
  for (int block_tokens : {16, 64}) {
    CheckAppend({{65537 - 4099, 4099}}, 8, 128, block_tokens, false);
    CheckAppend({{0, 4099}, {7, 1}}, 4, 64, block_tokens, true);
  }
}

// Pools of more than 2^31 elements: slot offsets past 2^31 must not wrap. Too big for the CPU
// twin's fp32 copy, so the written rows and their neighbours are checked directly: the rows hold
// exactly the source bits, and the rows around them keep the poison.
TEST_F(KvAppendOpTest, PoolPast2To31ElementsLarge) {
  const int num_kv_heads = 8, head_dim = 128, block_tokens = 64;
  const int64_t block_size = int64_t{num_kv_heads} * block_tokens * head_dim;  // 2^16
  const int pool_blocks = static_cast<int>((int64_t{1} << 31) / block_size) + 2;
  DeviceBuffer<__nv_bfloat16> d_key_pool = Poisoned<__nv_bfloat16>(pool_blocks * block_size);
  DeviceBuffer<__nv_bfloat16> d_value_pool = Poisoned<__nv_bfloat16>(pool_blocks * block_size);
  ASSERT_NE(d_key_pool.data(), nullptr);
  ASSERT_NE(d_value_pool.data(), nullptr);
  // The last block below element 2^31, the first one at it, the last one, and block 0.
  const std::vector<int32_t> slots = {(pool_blocks - 3) * block_tokens + block_tokens - 1,
                                      (pool_blocks - 2) * block_tokens,
                                      (pool_blocks - 1) * block_tokens + 17, 5};
  const int tokens = static_cast<int>(slots.size());
  const int64_t stride = int64_t{3} * num_kv_heads * head_dim;  // [q | k | v], one q head per kv
  const std::vector<__nv_bfloat16> qkv = ToBf16(RandomBf16Values(rng_, tokens * stride));
  DeviceBuffer<__nv_bfloat16> d_qkv = Upload(qkv);
  DeviceBuffer<int32_t> d_slots = Upload(slots);
  const int64_t keys_offset = int64_t{num_kv_heads} * head_dim;
  const int64_t values_offset = 2 * keys_offset;
  ASSERT_STATUS_OK(cuda::AppendToPagedKv({.keys = d_qkv.data() + keys_offset,
                                          .values = d_qkv.data() + values_offset,
                                          .row_stride = stride,
                                          .slots = d_slots.data(),
                                          .tokens = tokens,
                                          .num_kv_heads = num_kv_heads,
                                          .head_dim = head_dim,
                                          .block_tokens = block_tokens,
                                          .key_pool = d_key_pool.data(),
                                          .value_pool = d_value_pool.data()},
                                         stream_));
  ASSERT_CUDA_OK(cudaStreamSynchronize(stream_));

  // Downloads rows [row - 1, row + 1] of one head's slab (those inside the block).
  auto download_rows = [&](const DeviceBuffer<__nv_bfloat16>& pool, int64_t block, int head,
                           int first_row, int rows) {
    std::vector<__nv_bfloat16> host(static_cast<size_t>(rows) * head_dim);
    const int64_t offset = ((block * num_kv_heads + head) * block_tokens + first_row) * head_dim;
    EXPECT_EQ(cudaSuccess, cudaMemcpy(host.data(), pool.data() + offset,
                                      host.size() * sizeof(__nv_bfloat16), cudaMemcpyDeviceToHost));
    return host;
  };
  for (int t = 0; t < tokens; ++t) {
    const int64_t block = slots[t] / block_tokens;
    const int row = slots[t] % block_tokens;
    const int first_row = std::max(row - 1, 0);
    const int rows = std::min(row + 1, block_tokens - 1) - first_row + 1;
    for (int head = 0; head < num_kv_heads; ++head) {
      for (const bool is_key : {true, false}) {
        const std::vector<__nv_bfloat16> got =
            download_rows(is_key ? d_key_pool : d_value_pool, block, head, first_row, rows);
        const __nv_bfloat16* source =
            qkv.data() + t * stride + (is_key ? keys_offset : values_offset) + head * head_dim;
        for (int r = 0; r < rows; ++r) {
          for (int i = 0; i < head_dim; ++i) {
            const uint16_t want = first_row + r == row ? Bits(source[i]) : uint16_t{0xFFFF};
            ASSERT_EQ(want, Bits(got[r * head_dim + i]))
                << (is_key ? "key" : "value") << " block " << block << " head " << head << " row "
                << first_row + r << " column " << i << " (slot " << slots[t] << ")";
          }
        }
      }
    }
  }
}

TEST_F(KvAppendOpTest, RejectsBadParams) {
  DeviceBuffer<__nv_bfloat16> qkv = Poisoned<__nv_bfloat16>(4096);
  DeviceBuffer<__nv_bfloat16> pools = Poisoned<__nv_bfloat16>(8192);
  DeviceBuffer<int32_t> slots = Poisoned<int32_t>(4);
  const cuda::KvAppendParams good{.keys = qkv.data(),
                                  .values = qkv.data() + 128,
                                  .row_stride = 384,
                                  .slots = slots.data(),
                                  .tokens = 4,
                                  .num_kv_heads = 2,
                                  .head_dim = 64,
                                  .block_tokens = 16,
                                  .key_pool = pools.data(),
                                  .value_pool = pools.data() + 4096};
  auto p = good;
  p.head_dim = 12;
  EXPECT_TRUE(
      FailsWith(cuda::AppendToPagedKv(p, stream_), StatusCode::kInvalidArgument, "head_dim is 12"));
  p = good;
  p.block_tokens = 0;
  EXPECT_TRUE(FailsWith(cuda::AppendToPagedKv(p, stream_), StatusCode::kInvalidArgument,
                        "block_tokens is 0"));
  p = good;
  p.row_stride = 120;
  EXPECT_TRUE(FailsWith(cuda::AppendToPagedKv(p, stream_), StatusCode::kInvalidArgument,
                        "row_stride is 120"));
  p = good;
  p.slots = nullptr;
  EXPECT_TRUE(
      FailsWith(cuda::AppendToPagedKv(p, stream_), StatusCode::kInvalidArgument, "slots is null"));
  p = good;
  p.value_pool = nullptr;
  EXPECT_TRUE(FailsWith(cuda::AppendToPagedKv(p, stream_), StatusCode::kInvalidArgument,
                        "value_pool is null"));
  p = good;
  p.keys = qkv.data() + 4;
  EXPECT_TRUE(FailsWith(cuda::AppendToPagedKv(p, stream_), StatusCode::kInvalidArgument,
                        "keys is not 16-byte aligned"));
  p = good;
  p.tokens = -2;
  EXPECT_TRUE(
      FailsWith(cuda::AppendToPagedKv(p, stream_), StatusCode::kInvalidArgument, "tokens is -2"));
  // No work: accepted without touching anything, even with null pointers.
  p = cuda::KvAppendParams{
      .row_stride = 384, .num_kv_heads = 2, .head_dim = 64, .block_tokens = 16};
  EXPECT_TRUE(cuda::AppendToPagedKv(p, stream_).ok());

  // A rejected call launches nothing: no error is pending and the stream is idle and healthy.
  EXPECT_EQ(cudaSuccess, cudaGetLastError());
  EXPECT_EQ(cudaSuccess, cudaStreamSynchronize(stream_));
}

}  // namespace
}  // namespace rubato::gpu_test
