// kernels/cuda/slot_writes (writes into evicting KV slot arrays) against the host's copies of the
// same contract (inference_rank/kv/slot_kv_pool.h WriteToNextSlots, per array): each row's
// K/V heads land in the slots next_slot names in its array, marked valid, bit for bit; a row
// whose next slot is -1 or whose array is out of range writes nothing; the prompt marks set the
// masks and the next slots (or leave them). Rows of a qkv-like stride, head_dim 16/64/128.
#include <algorithm>
#include <random>
#include <string>
#include <vector>

#include "kernels/cuda/slot_writes.cuh"
#include "tests/gpu/gpu_test_util.h"

namespace rubato {
namespace {

using gpu_test::Upload;
using gpu_test::UploadBf16;

void RunWrite(int head_dim) {
  SCOPED_TRACE("head_dim " + std::to_string(head_dim));
  std::mt19937_64 rng = gpu_test::FreshRng();
  const int kv_heads = 3, budget = 37, num_arrays = 5, rows = 4, d = head_dim;
  const int64_t stride = 8 * kv_heads * d + 16;  // keys at 0, values at kv_heads * d
  std::vector<float> qkv = gpu_test::RandomBf16Values(rng, static_cast<size_t>(rows) * stride);
  const size_t slots = static_cast<size_t>(num_arrays) * kv_heads * budget * d;
  std::vector<float> keys = gpu_test::RandomBf16Values(rng, slots);
  std::vector<float> values = gpu_test::RandomBf16Values(rng, slots);
  std::vector<uint8_t> valid(static_cast<size_t>(num_arrays) * budget, 0);
  std::vector<int32_t> next(static_cast<size_t>(num_arrays) * kv_heads);
  for (int32_t& n : next) n = static_cast<int32_t>(rng() % budget);
  next[static_cast<size_t>(2) * kv_heads + 1] = -1;  // array 2, head 1: nothing to write
  const std::vector<int32_t> arrays = {3, 0, 2, 7};  // row 3: no such array
  // The expected arrays: the CPU contract, head by head.
  std::vector<float> want_keys = keys, want_values = values;
  std::vector<uint8_t> want_valid = valid;
  for (int r = 0; r < rows; ++r) {
    const int a = arrays[static_cast<size_t>(r)];
    if (a < 0 || a >= num_arrays) continue;
    for (int h = 0; h < kv_heads; ++h) {
      const int slot = next[static_cast<size_t>(a) * kv_heads + h];
      if (slot < 0) continue;
      const size_t dest = ((static_cast<size_t>(a) * kv_heads + h) * budget + slot) * d;
      std::copy_n(qkv.begin() + r * stride + h * d, d, want_keys.begin() + dest);
      std::copy_n(qkv.begin() + r * stride + kv_heads * d + h * d, d, want_values.begin() + dest);
      want_valid[static_cast<size_t>(a) * budget + slot] = 1;
    }
  }
  auto d_qkv = UploadBf16(qkv);
  auto d_keys = UploadBf16(keys);
  auto d_values = UploadBf16(values);
  auto d_valid = Upload(valid);
  auto d_next = Upload(next);
  auto d_arrays = Upload(arrays);
  cuda::SlotWriteParams p;
  p.keys = d_qkv.data();
  p.values = d_qkv.data() + kv_heads * d;
  p.row_stride = stride;
  p.arrays = d_arrays.data();
  p.rows = rows;
  p.num_arrays = num_arrays;
  p.num_kv_heads = kv_heads;
  p.head_dim = d;
  p.budget = budget;
  p.slot_keys = d_keys.data();
  p.slot_values = d_values.data();
  p.valid = d_valid.data();
  p.next_slot = d_next.data();
  ASSERT_STATUS_OK(cuda::WriteToNextSlots(p, nullptr));
  EXPECT_EQ(gpu_test::DownloadBf16(d_keys), want_keys);
  EXPECT_EQ(gpu_test::DownloadBf16(d_values), want_values);
  EXPECT_EQ(gpu_test::Download(d_valid), want_valid);
  EXPECT_EQ(gpu_test::Download(d_next), next);  // read, never written

  cuda::SlotWriteParams bad = p;
  bad.row_stride = stride + 3;
  EXPECT_TRUE(gpu_test::FailsWith(cuda::WriteToNextSlots(bad, nullptr),
                                  StatusCode::kInvalidArgument, "row stride"));
}

TEST(SlotWritesOp, TokensGoToTheirNextSlots) {
  for (int head_dim : {16, 64, 128}) RunWrite(head_dim);
}

TEST(SlotWritesOp, PromptMarksSetMasksAndNextSlots) {
  const int kv_heads = 2, budget = 300, num_arrays = 3;
  std::vector<uint8_t> valid(static_cast<size_t>(num_arrays) * budget, 7);
  std::vector<int32_t> next(static_cast<size_t>(num_arrays) * kv_heads, 9);
  const std::vector<int32_t> arrays = {2, 0}, kept = {123, 300}, next_value = {123, -1};
  auto d_valid = Upload(valid);
  auto d_next = Upload(next);
  auto d_arrays = Upload(arrays);
  auto d_kept = Upload(kept);
  auto d_next_value = Upload(next_value);
  cuda::PromptSlotsParams p;
  p.arrays = d_arrays.data();
  p.kept = d_kept.data();
  p.next = d_next_value.data();
  p.rows = 2;
  p.num_arrays = num_arrays;
  p.num_kv_heads = kv_heads;
  p.budget = budget;
  p.valid = d_valid.data();
  p.next_slot = d_next.data();
  ASSERT_STATUS_OK(cuda::MarkPromptSlots(p, nullptr));
  std::vector<uint8_t> want_valid = valid;
  std::vector<int32_t> want_next = next;
  for (int i = 0; i < budget; ++i) {
    want_valid[static_cast<size_t>(2) * budget + i] = i < 123 ? 1 : 0;
    want_valid[static_cast<size_t>(i)] = 1;  // array 0: every slot kept
  }
  want_next[4] = want_next[5] = 123;  // array 2; array 0's stay (chosen later)
  EXPECT_EQ(gpu_test::Download(d_valid), want_valid);
  EXPECT_EQ(gpu_test::Download(d_next), want_next);
}

}  // namespace
}  // namespace rubato
