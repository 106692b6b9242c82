// KeyNorms (kernels/cuda/key_norms.cuh) against its CPU twin (kernels/cpu/key_norms.h) on random
// bf16 keys in a shuffled paged pool: batches of 1 and 5 sequences of different lengths and
// ranges (begin 0 and mid-sequence, empty ranges), 1 to 8 KV heads, head_dim 16 / 64 / 128 / 256,
// blocks of 16 and 64 tokens. Every norm in a range must match the CPU's within 1e-5 relative (the
// CPU sums in double, the GPU in f32); every entry outside the ranges must stay as it was.
// Then a block id outside the pool gives NaN, and bad parameters name the field at fault.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <numeric>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "kernels/cpu/key_norms.h"
#include "kernels/cuda/key_norms.cuh"
#include "tests/gpu/gpu_test_util.h"

namespace rubato::cuda {
namespace {

using gpu_test::Download;
using gpu_test::FailsWith;
using gpu_test::Poisoned;
using gpu_test::Upload;
using gpu_test::UploadBf16;

struct NormsCase {
  std::vector<int> seq_lens;  // [batch] tokens in the paged cache
  std::vector<int> begins;    // [batch] first position of the range
  std::vector<int> counts;    // [batch] positions in the range
  int heads = 2;
  int head_dim = 64;
  int block_tokens = 16;
};

std::string Describe(const NormsCase& c) {
  std::ostringstream out;
  out << "batch " << c.seq_lens.size() << " H " << c.heads << " head_dim " << c.head_dim
      << " block " << c.block_tokens;
  return out.str();
}

// The host side of a case: the pool and the block tables.
struct Fixture {
  std::vector<float> keys;      // [blocks][heads][block_tokens][head_dim], bf16-exact values
  std::vector<int32_t> tables;  // [batch][stride]
  int stride = 0;
  int blocks = 0;
};

Fixture MakeFixture(const NormsCase& c, std::mt19937_64& rng) {
  Fixture f;
  const int max_len = *std::max_element(c.seq_lens.begin(), c.seq_lens.end());
  f.stride = (max_len + c.block_tokens - 1) / c.block_tokens;
  f.blocks = 2;
  for (int len : c.seq_lens) f.blocks += (len + c.block_tokens - 1) / c.block_tokens;
  std::vector<int32_t> physical(f.blocks);
  std::iota(physical.begin(), physical.end(), 0);
  std::shuffle(physical.begin(), physical.end(), rng);
  f.tables.assign(c.seq_lens.size() * static_cast<size_t>(f.stride), 0);
  int next = 0;
  for (size_t b = 0; b < c.seq_lens.size(); ++b) {
    for (int i = 0; i < (c.seq_lens[b] + c.block_tokens - 1) / c.block_tokens; ++i) {
      f.tables[b * f.stride + i] = physical[next++];
    }
  }
  // Keys of several magnitudes, so that norms span decades.
  f.keys = gpu_test::RandomBf16Values(
      rng, static_cast<size_t>(f.blocks) * c.heads * c.block_tokens * c.head_dim, -4.f, 4.f);
  return f;
}

// A case on the device: its buffers, the norms poisoned ([batch][heads][norms_stride]), and the
// launch's parameters over them.
struct DeviceCase {
  DeviceBuffer<__nv_bfloat16> pool;
  DeviceBuffer<int32_t> tables, begins, counts;
  DeviceBuffer<float> norms;
  KeyNormsParams params;
};

DeviceCase ToDevice(const NormsCase& c, const Fixture& f, int64_t norms_stride) {
  DeviceCase d;
  d.pool = UploadBf16(f.keys);
  d.tables = Upload(f.tables);
  d.begins = Upload(c.begins);
  d.counts = Upload(c.counts);
  const int batch = static_cast<int>(c.seq_lens.size());
  d.norms = Poisoned<float>(static_cast<size_t>(batch) * c.heads * norms_stride);
  KeyNormsParams& p = d.params;
  p.key_pool = d.pool.data();
  p.num_pool_blocks = f.blocks;
  p.block_tables = d.tables.data();
  p.block_table_stride = f.stride;
  p.begin = d.begins.data();
  p.count = d.counts.data();
  p.max_count = *std::max_element(c.counts.begin(), c.counts.end());
  p.batch = batch;
  p.num_kv_heads = c.heads;
  p.head_dim = c.head_dim;
  p.block_tokens = c.block_tokens;
  p.norms = d.norms.data();
  p.norms_stride = norms_stride;
  return d;
}

void RunCase(const NormsCase& c) {
  SCOPED_TRACE(Describe(c));
  std::mt19937_64 rng = gpu_test::FreshRng();
  const Fixture f = MakeFixture(c, rng);
  const int batch = static_cast<int>(c.seq_lens.size());
  const int64_t norms_stride = *std::max_element(c.seq_lens.begin(), c.seq_lens.end()) + 3;

  const DeviceCase d = ToDevice(c, f, norms_stride);
  ASSERT_STATUS_OK(KeyNorms(d.params, nullptr));
  const std::vector<float> got = Download(d.norms);

  std::vector<float> keys = f.keys;  // the CPU view is mutable
  for (int b = 0; b < batch; ++b) {
    PagedKvView view{keys.data(), nullptr, f.tables.data() + static_cast<size_t>(b) * f.stride,
                     c.block_tokens, c.heads, c.head_dim};
    std::vector<float> want(static_cast<size_t>(c.heads) * std::max(c.counts[b], 1));
    ASSERT_STATUS_OK(KeyNorms(view, c.begins[b], c.counts[b], want.data(),
                              std::max(c.counts[b], 1)));
    for (int h = 0; h < c.heads; ++h) {
      const float* row = got.data() + (static_cast<size_t>(b) * c.heads + h) * norms_stride;
      for (int64_t position = 0; position < norms_stride; ++position) {
        const int64_t i = position - c.begins[b];
        if (i < 0 || i >= c.counts[b]) {
          ASSERT_TRUE(std::isnan(row[position]))
              << "sequence " << b << " head " << h << " position " << position
              << " outside the range was written";
          continue;
        }
        const float expected = want[static_cast<size_t>(h) * std::max(c.counts[b], 1) + i];
        ASSERT_NEAR(row[position], expected, 1e-5f * expected)
            << "sequence " << b << " head " << h << " position " << position;
      }
    }
  }
}

TEST(KeyNormsOpTest, MatchesCpuOverShapesAndRanges) {
  RunCase({{37}, {0}, {37}, 1, 64, 16});
  RunCase({{300, 17, 129, 64, 5}, {4, 0, 100, 64, 2}, {250, 17, 29, 0, 3}, 8, 128, 64});
  RunCase({{200, 90}, {10, 0}, {180, 90}, 4, 16, 16});
  RunCase({{150, 151}, {0, 1}, {150, 150}, 2, 256, 64});
}

TEST(KeyNormsOpTest, BlockOutsideThePoolGivesNan) {
  std::mt19937_64 rng = gpu_test::FreshRng();
  const NormsCase c{{32}, {0}, {32}, 1, 64, 16};
  Fixture f = MakeFixture(c, rng);
  f.tables[1] = f.blocks + 5;  // positions 16..31
  const DeviceCase d = ToDevice(c, f, /*norms_stride=*/32);
  ASSERT_STATUS_OK(KeyNorms(d.params, nullptr));
  const std::vector<float> got = Download(d.norms);
  for (int position = 0; position < 32; ++position) {
    EXPECT_EQ(std::isnan(got[position]), position >= 16) << "position " << position;
  }
}

TEST(KeyNormsOpTest, BadParametersNameTheField) {
  float dummy_norms = 0.f;
  const int32_t dummy_int = 0;
  alignas(16) const __nv_bfloat16 dummy_keys[8] = {};
  KeyNormsParams good;
  good.key_pool = dummy_keys;
  good.num_pool_blocks = 1;
  good.block_tables = &dummy_int;
  good.block_table_stride = 1;
  good.begin = &dummy_int;
  good.count = &dummy_int;
  good.max_count = 1;
  good.batch = 1;
  good.num_kv_heads = 1;
  good.head_dim = 8;
  good.block_tokens = 1;
  good.norms = &dummy_norms;
  good.norms_stride = 1;
  struct Bad {
    const char* field;
    void (*apply)(KeyNormsParams&);
  };
  const Bad bads[] = {
      {"batch", [](KeyNormsParams& p) { p.batch = -1; }},
      {"max_count", [](KeyNormsParams& p) { p.max_count = -1; }},
      {"num_kv_heads", [](KeyNormsParams& p) { p.num_kv_heads = 0; }},
      {"head_dim", [](KeyNormsParams& p) { p.head_dim = 12; }},
      {"head_dim", [](KeyNormsParams& p) { p.head_dim = 264; }},
      {"block_tokens", [](KeyNormsParams& p) { p.block_tokens = 0; }},
      {"num_pool_blocks", [](KeyNormsParams& p) { p.num_pool_blocks = 0; }},
      {"block_table_stride", [](KeyNormsParams& p) { p.block_table_stride = 0; }},
      {"norms_stride", [](KeyNormsParams& p) { p.norms_stride = 0; }},
      {"exceed 2^31",
       [](KeyNormsParams& p) {
         p.block_table_stride = 1 << 20;
         p.block_tokens = 1 << 12;
       }},
      {"key_pool", [](KeyNormsParams& p) { p.key_pool = nullptr; }},
      {"key_pool must be 16-byte aligned",
       [](KeyNormsParams& p) { p.key_pool = reinterpret_cast<const __nv_bfloat16*>(1); }},
      {"block_tables", [](KeyNormsParams& p) { p.block_tables = nullptr; }},
      {"begin", [](KeyNormsParams& p) { p.begin = nullptr; }},
      {"count", [](KeyNormsParams& p) { p.count = nullptr; }},
      {"norms is null", [](KeyNormsParams& p) { p.norms = nullptr; }},
  };
  for (const Bad& b : bads) {
    KeyNormsParams p = good;
    b.apply(p);
    EXPECT_TRUE(FailsWith(KeyNorms(p, nullptr), StatusCode::kInvalidArgument, b.field))
        << b.field;
  }
  // Nothing to do: no pointer is needed.
  KeyNormsParams empty;
  empty.num_pool_blocks = 1;
  empty.block_table_stride = 1;
  empty.num_kv_heads = 1;
  empty.head_dim = 8;
  empty.block_tokens = 1;
  empty.norms_stride = 1;
  const Status status = KeyNorms(empty, nullptr);
  EXPECT_TRUE(status.ok()) << status.message();
}

}  // namespace
}  // namespace rubato::cuda
