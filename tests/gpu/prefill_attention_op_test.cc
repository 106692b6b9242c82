// kernels/cuda/prefill_attention against its CPU twin kernels/cpu/attention.h (CausalAttention),
// on fresh random bf16 Q/K/V: several entries (chunks of query rows at different start
// positions) per launch, K/V in paged pools with shuffled block tables, head_dim 16/32/64/128,
// GQA groups 1/2/4/8, block sizes 16/64, dense and sink + recent windows; plus the launcher's
// input validation.
//
// Memory the kernel must never read is NaN: the k|v parts of the fused query rows, pool rows
// past each sequence's context and spare pool blocks. Output rows are poisoned before the
// launch and their padding columns must stay poisoned.
#include <algorithm>
#include <climits>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "kernels/cpu/attention.h"
#include "kernels/cuda/prefill_attention.cuh"
#include "tests/gpu/gpu_test_util.h"

namespace rubato {
namespace {

using gpu_test::Bf16Close;
using gpu_test::Download;
using gpu_test::FromBf16;
using gpu_test::Poisoned;
using gpu_test::RandomBf16Values;
using gpu_test::ToBf16;
using gpu_test::Upload;

struct Chunk {
  int tokens;          // query rows of the entry
  int start_position;  // position of its first row; the sequence holds start + tokens keys
};

struct PrefillCase {
  int head_dim = 64;
  int group = 4;
  int num_kv_heads = 2;
  int block_tokens = 16;
  AttentionWindow window;
  std::vector<Chunk> chunks;
};

std::string Describe(const PrefillCase& c) {
  std::string chunks;
  for (const Chunk& k : c.chunks) {
    chunks += (chunks.empty() ? "" : ",") + std::to_string(k.tokens) + "@" +
              std::to_string(k.start_position);
  }
  return "chunks [" + chunks + "] head_dim " + std::to_string(c.head_dim) + " group " +
         std::to_string(c.group) + " kv_heads " + std::to_string(c.num_kv_heads) + " block " +
         std::to_string(c.block_tokens) + " sink " + std::to_string(c.window.sink_tokens) +
         " recent " + std::to_string(c.window.recent_tokens);
}

// Chunks of 1, 3, 17, 64 and 200 rows at positions 0, 127 and 4099 (an empty entry too), so
// that query tiles are partial, start mid-block and mid-key-tile, and reach past position 4096.
std::vector<Chunk> MixedChunks() {
  return {{17, 0}, {1, 4099}, {200, 127}, {0, 50}, {3, 0}, {64, 4099}, {3, 127}};
}

constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();
// bf16 outputs of |value| < 1: bf16(P) in P V costs <= 2^-9 absolute, the bf16 output rounding
// 2^-9 relative; the bounds leave a factor ~2.5.
constexpr double kAtol = 5e-3;
constexpr double kRtol = 1e-2;

void RunCase(const PrefillCase& c) {
  SCOPED_TRACE(Describe(c));
  std::mt19937_64 rng = gpu_test::FreshRng();
  const int entries = static_cast<int>(c.chunks.size());
  const int num_heads = c.num_kv_heads * c.group;
  const int head_dim = c.head_dim;
  const int row_elements = num_heads * head_dim;
  // Query rows as the fused projection lays them out: [tokens][q | k | v]; only q is ours.
  const int64_t q_row_stride = static_cast<int64_t>(num_heads + 2 * c.num_kv_heads) * head_dim;
  const int64_t out_row_stride = row_elements + 8;  // 8 padding columns that must stay poisoned

  // Rows of each entry, and the paged blocks each sequence needs.
  std::vector<int32_t> query_start(entries + 1, 0);
  std::vector<int32_t> start_position(entries);
  int max_query_tokens = 0;
  int max_blocks = 0;
  int used_blocks = 0;
  for (int e = 0; e < entries; ++e) {
    query_start[e + 1] = query_start[e] + c.chunks[e].tokens;
    start_position[e] = c.chunks[e].start_position;
    max_query_tokens = std::max(max_query_tokens, c.chunks[e].tokens);
    const int context = c.chunks[e].start_position + c.chunks[e].tokens;
    const int blocks = (context + c.block_tokens - 1) / c.block_tokens;
    max_blocks = std::max(max_blocks, blocks);
    used_blocks += blocks;
  }
  const int total_tokens = query_start[entries];

  // Physical blocks shuffled over the entries (two spare blocks stay NaN); table slots past a
  // sequence's blocks hold -1 (an out-of-bounds block if the kernel ever used one).
  const int pool_blocks = used_blocks + 2;
  std::vector<int32_t> physical(pool_blocks);
  std::iota(physical.begin(), physical.end(), 0);
  std::shuffle(physical.begin(), physical.end(), rng);
  const int table_stride = max_blocks + 1;
  std::vector<int32_t> block_tables(static_cast<size_t>(entries) * table_stride, -1);
  for (int e = 0, next = 0; e < entries; ++e) {
    const int context = c.chunks[e].start_position + c.chunks[e].tokens;
    for (int b = 0; b * c.block_tokens < context; ++b) {
      block_tables[static_cast<size_t>(e) * table_stride + b] = physical[next++];
    }
  }

  // Pools [pool_blocks][num_kv_heads][block_tokens][head_dim]: random where a sequence holds a
  // position. The GPU copy is NaN elsewhere; the CPU copy 0 (it must not depend on the CPU
  // reference's reading pattern).
  const size_t pool_size =
      static_cast<size_t>(pool_blocks) * c.num_kv_heads * c.block_tokens * head_dim;
  std::vector<float> gpu_keys(pool_size, kNaN), gpu_values(pool_size, kNaN);
  std::vector<float> cpu_keys(pool_size, 0.f), cpu_values(pool_size, 0.f);
  for (int e = 0; e < entries; ++e) {
    PagedKvView view;
    view.block_table = block_tables.data() + static_cast<size_t>(e) * table_stride;
    view.block_tokens = c.block_tokens;
    view.num_kv_heads = c.num_kv_heads;
    view.head_dim = head_dim;
    const int context = c.chunks[e].start_position + c.chunks[e].tokens;
    for (int position = 0; position < context; ++position) {
      for (int h = 0; h < c.num_kv_heads; ++h) {
        const size_t offset = view.Offset(position, h);
        const std::vector<float> k = RandomBf16Values(rng, head_dim);
        const std::vector<float> v = RandomBf16Values(rng, head_dim);
        std::copy(k.begin(), k.end(), gpu_keys.begin() + offset);
        std::copy(k.begin(), k.end(), cpu_keys.begin() + offset);
        std::copy(v.begin(), v.end(), gpu_values.begin() + offset);
        std::copy(v.begin(), v.end(), cpu_values.begin() + offset);
      }
    }
  }

  // Queries in [-2, 2] so that the softmax is far from uniform; k|v columns NaN.
  std::vector<float> fused_rows(static_cast<size_t>(total_tokens) * q_row_stride, kNaN);
  std::vector<float> cpu_queries(static_cast<size_t>(total_tokens) * row_elements);
  for (int t = 0; t < total_tokens; ++t) {
    const std::vector<float> q = RandomBf16Values(rng, row_elements, -2.f, 2.f);
    std::copy(q.begin(), q.end(), fused_rows.begin() + static_cast<size_t>(t) * q_row_stride);
    std::copy(q.begin(), q.end(), cpu_queries.begin() + static_cast<size_t>(t) * row_elements);
  }

  // CPU twin, entry by entry: [total_tokens][num_heads][head_dim], f32.
  std::vector<float> expected(static_cast<size_t>(total_tokens) * row_elements);
  for (int e = 0; e < entries; ++e) {
    if (c.chunks[e].tokens == 0) continue;
    CausalAttentionArgs args;
    args.queries = cpu_queries.data() + static_cast<size_t>(query_start[e]) * row_elements;
    args.output = expected.data() + static_cast<size_t>(query_start[e]) * row_elements;
    args.tokens = c.chunks[e].tokens;
    args.start_position = c.chunks[e].start_position;
    args.num_heads = num_heads;
    args.kv.keys = cpu_keys.data();
    args.kv.values = cpu_values.data();
    args.kv.block_table = block_tables.data() + static_cast<size_t>(e) * table_stride;
    args.kv.block_tokens = c.block_tokens;
    args.kv.num_kv_heads = c.num_kv_heads;
    args.kv.head_dim = head_dim;
    args.window = c.window;
    std::vector<float> scratch(CausalAttentionScratchSize(args));
    CausalAttention(args, scratch.data());
  }

  // GPU.
  auto q = Upload(ToBf16(fused_rows));
  auto key_pool = Upload(ToBf16(gpu_keys));
  auto value_pool = Upload(ToBf16(gpu_values));
  auto tables = Upload(block_tables);
  auto starts = Upload(query_start);
  auto positions = Upload(start_position);
  auto out = Poisoned<__nv_bfloat16>(static_cast<size_t>(total_tokens) * out_row_stride);

  cuda::PrefillAttentionParams params;
  params.q = q.data();
  params.q_row_stride = q_row_stride;
  params.key_pool = key_pool.data();
  params.value_pool = value_pool.data();
  params.block_tables = tables.data();
  params.block_table_stride = table_stride;
  params.query_start = starts.data();
  params.start_position = positions.data();
  params.entries = entries;
  params.total_tokens = total_tokens;
  params.max_query_tokens = max_query_tokens;
  params.num_heads = num_heads;
  params.num_kv_heads = c.num_kv_heads;
  params.head_dim = head_dim;
  params.block_tokens = c.block_tokens;
  // As the CPU twin: head_dim ** -0.5 in double, rounded once.
  params.scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(head_dim)));
  params.sink_tokens = c.window.sink_tokens;
  params.recent_tokens = c.window.recent_tokens;
  params.out = out.data();
  params.out_row_stride = out_row_stride;
  ASSERT_STATUS_OK(cuda::PrefillAttention(params, /*stream=*/nullptr));

  const std::vector<__nv_bfloat16> out_bits = Download(out);
  ASSERT_EQ(out_bits.size(), static_cast<size_t>(total_tokens) * out_row_stride);
  const std::vector<float> out_rows = FromBf16(out_bits);
  std::vector<float> actual(expected.size());
  int touched_padding = 0;
  for (int t = 0; t < total_tokens; ++t) {
    const size_t row = static_cast<size_t>(t) * out_row_stride;
    std::copy(out_rows.begin() + row, out_rows.begin() + row + row_elements,
              actual.begin() + static_cast<size_t>(t) * row_elements);
    for (int64_t col = row_elements; col < out_row_stride; ++col) {
      uint16_t bits;
      std::memcpy(&bits, &out_bits[row + col], sizeof(bits));
      touched_padding += bits != 0xFFFF;
    }
  }
  EXPECT_EQ(touched_padding, 0) << "elements written past num_heads * head_dim in output rows";
  EXPECT_TRUE(Bf16Close("prefill attention output", actual, expected, kAtol, kRtol));
}

// The main sweep: head_dim x group x block size x (dense | sink 4 + recent 100).
struct SweepParam {
  int head_dim;
  int group;
  int block_tokens;
  bool windowed;
};

class PrefillAttentionSweep : public ::testing::TestWithParam<SweepParam> {};

TEST_P(PrefillAttentionSweep, MatchesCpuOnMixedChunks) {
  const SweepParam& s = GetParam();
  PrefillCase c;
  c.head_dim = s.head_dim;
  c.group = s.group;
  c.block_tokens = s.block_tokens;
  if (s.windowed) c.window = AttentionWindow{.sink_tokens = 4, .recent_tokens = 100};
  c.chunks = MixedChunks();
  RunCase(c);
}

std::vector<SweepParam> SweepParams() {
  std::vector<SweepParam> params;
  for (int head_dim : {16, 32, 64, 128}) {
    for (int group : {1, 2, 4, 8}) {
      for (int block_tokens : {16, 64}) {
        for (bool windowed : {false, true}) {
          params.push_back({head_dim, group, block_tokens, windowed});
        }
      }
    }
  }
  return params;
}

INSTANTIATE_TEST_SUITE_P(Shapes, PrefillAttentionSweep, ::testing::ValuesIn(SweepParams()),
                         [](const ::testing::TestParamInfo<SweepParam>& info) {
                           const SweepParam& s = info.param;
                           return "HeadDim" + std::to_string(s.head_dim) + "Group" +
                                  std::to_string(s.group) + "Block" +
                                  std::to_string(s.block_tokens) +
                                  (s.windowed ? "Window" : "Dense");
                         });

// Window edges: only the own key, sink and recent meeting mid-tile, a sink larger than every
// context (pure causal), recent segments of exactly one key tile, and a recent window that
// covers the whole context of some rows but not of others.
TEST(PrefillAttentionTest, WindowEdges) {
  const AttentionWindow windows[] = {
      {.sink_tokens = 0, .recent_tokens = 1},    {.sink_tokens = 70, .recent_tokens = 37},
      {.sink_tokens = 5000, .recent_tokens = 1}, {.sink_tokens = 1, .recent_tokens = 64},
      {.sink_tokens = 64, .recent_tokens = 128}, {.sink_tokens = 0, .recent_tokens = 4150},
      {.sink_tokens = 3, .recent_tokens = 200}};
  for (const AttentionWindow& window : windows) {
    for (int block_tokens : {16, 64}) {
      PrefillCase c;
      c.head_dim = 64;
      c.group = 4;
      c.block_tokens = block_tokens;
      c.window = window;
      c.chunks = MixedChunks();
      RunCase(c);
    }
  }
}

// One entry, one token at position 0 (the output is that token's value), and more KV heads.
TEST(PrefillAttentionTest, SingleTokenAndManyKvHeads) {
  RunCase({.head_dim = 128,
           .group = 1,
           .num_kv_heads = 1,
           .block_tokens = 16,
           .window = AttentionWindow{},
           .chunks = {{1, 0}}});
  RunCase({.head_dim = 32,
           .group = 2,
           .num_kv_heads = 7,
           .block_tokens = 64,
           .window = AttentionWindow{},
           .chunks = {{33, 5}, {129, 0}}});
}

// Long contexts: rows at positions up to 65536 (a context of 65537 keys: the last key tile
// holds one key), dense and windowed. Skipped by the compute-sanitizer pass (-*Large*).
TEST(PrefillAttentionTest, LargeContext) {
  const std::vector<Chunk> chunks = {{17, 65520}, {1, 65536}, {64, 32768}, {3, 0}};
  RunCase({.head_dim = 128,
           .group = 4,
           .num_kv_heads = 2,
           .block_tokens = 64,
           .window = AttentionWindow{},
           .chunks = chunks});
  RunCase({.head_dim = 64,
           .group = 8,
           .num_kv_heads = 2,
           .block_tokens = 16,
           .window = {.sink_tokens = 4, .recent_tokens = 4096},
           .chunks = chunks});
}

// A long prefill chunk from position 0: many query tiles per entry, heaviest tiles first.
TEST(PrefillAttentionTest, LargeChunk) {
  RunCase({.head_dim = 128,
           .group = 8,
           .num_kv_heads = 1,
           .block_tokens = 16,
           .window = AttentionWindow{},
           .chunks = {{1500, 0}, {700, 2000}}});
}

// ---- validation ---------------------------------------------------------------------------

class PrefillAttentionValidationTest : public ::testing::Test {
 protected:
  // A valid launch: one entry of 2 tokens at position 0, 2 KV heads x group 2, head_dim 16.
  void SetUp() override {
    q_ = Poisoned<__nv_bfloat16>(2 * 4 * 16);
    keys_ = Poisoned<__nv_bfloat16>(2 * 16 * 16);
    values_ = Poisoned<__nv_bfloat16>(2 * 16 * 16);
    // Zeros: finite inputs for the one valid launch.
    ASSERT_CUDA_OK(cudaMemset(q_.data(), 0, q_.bytes()));
    ASSERT_CUDA_OK(cudaMemset(keys_.data(), 0, keys_.bytes()));
    ASSERT_CUDA_OK(cudaMemset(values_.data(), 0, values_.bytes()));
    tables_ = Upload(std::vector<int32_t>{0});
    starts_ = Upload(std::vector<int32_t>{0, 2});
    positions_ = Upload(std::vector<int32_t>{0});
    out_ = Poisoned<__nv_bfloat16>(2 * 4 * 16);
    valid_.q = q_.data();
    valid_.q_row_stride = 4 * 16;
    valid_.key_pool = keys_.data();
    valid_.value_pool = values_.data();
    valid_.block_tables = tables_.data();
    valid_.block_table_stride = 1;
    valid_.query_start = starts_.data();
    valid_.start_position = positions_.data();
    valid_.entries = 1;
    valid_.total_tokens = 2;
    valid_.max_query_tokens = 2;
    valid_.num_heads = 4;
    valid_.num_kv_heads = 2;
    valid_.head_dim = 16;
    valid_.block_tokens = 16;
    valid_.scale = 0.25f;
    valid_.out = out_.data();
    valid_.out_row_stride = 4 * 16;
  }

  // The launcher rejects `params` with `code` and a message containing `field`.
  static void ExpectRejected(const cuda::PrefillAttentionParams& params, StatusCode code,
                             const std::string& field) {
    const Status status = cuda::PrefillAttention(params, nullptr);
    EXPECT_EQ(status.code(), code) << field << ": " << status.message();
    EXPECT_NE(status.message().find(field), std::string::npos) << status.message();
  }

  cuda::DeviceBuffer<__nv_bfloat16> q_, keys_, values_, out_;
  cuda::DeviceBuffer<int32_t> tables_, starts_, positions_;
  cuda::PrefillAttentionParams valid_;
};

TEST_F(PrefillAttentionValidationTest, ValidParamsRun) {
  ASSERT_STATUS_OK(cuda::PrefillAttention(valid_, nullptr));
  const std::vector<float> out = gpu_test::DownloadBf16(out_);
  for (float v : out) EXPECT_EQ(v, 0.f);  // zero values: every output is 0, none left poisoned
}

TEST_F(PrefillAttentionValidationTest, NothingToDoIsOk) {
  // No tokens (or no entries): nothing is read, so the pointers may be null.
  cuda::PrefillAttentionParams no_tokens = valid_;
  no_tokens.total_tokens = 0;
  no_tokens.max_query_tokens = 0;
  no_tokens.q = nullptr;
  no_tokens.key_pool = no_tokens.value_pool = nullptr;
  no_tokens.out = nullptr;
  EXPECT_TRUE(cuda::PrefillAttention(no_tokens, nullptr).ok());
  cuda::PrefillAttentionParams no_entries = no_tokens;
  no_entries.entries = 0;
  no_entries.block_tables = no_entries.query_start = no_entries.start_position = nullptr;
  EXPECT_TRUE(cuda::PrefillAttention(no_entries, nullptr).ok());
}

TEST_F(PrefillAttentionValidationTest, RejectsNullAndMisalignedPointers) {
  const auto with = [&](auto mutate) {
    cuda::PrefillAttentionParams p = valid_;
    mutate(p);
    return p;
  };
  const StatusCode kInvalid = StatusCode::kInvalidArgument;
  ExpectRejected(with([](auto& p) { p.q = nullptr; }), kInvalid, "q is null");
  ExpectRejected(with([](auto& p) { p.key_pool = nullptr; }), kInvalid, "key_pool");
  ExpectRejected(with([](auto& p) { p.value_pool = nullptr; }), kInvalid, "value_pool");
  ExpectRejected(with([](auto& p) { p.block_tables = nullptr; }), kInvalid, "block_tables");
  ExpectRejected(with([](auto& p) { p.query_start = nullptr; }), kInvalid, "query_start");
  ExpectRejected(with([](auto& p) { p.start_position = nullptr; }), kInvalid, "start_position");
  ExpectRejected(with([](auto& p) { p.out = nullptr; }), kInvalid, "out is null");
  ExpectRejected(with([](auto& p) { p.q += 1; }), kInvalid, "q is not 16-byte aligned");
  ExpectRejected(with([](auto& p) { p.out += 4; }), kInvalid, "out is not 16-byte aligned");
}

TEST_F(PrefillAttentionValidationTest, RejectsBadShapes) {
  const auto with = [&](auto mutate) {
    cuda::PrefillAttentionParams p = valid_;
    mutate(p);
    return p;
  };
  const StatusCode kInvalid = StatusCode::kInvalidArgument;
  const StatusCode kUnsupported = StatusCode::kUnsupported;
  ExpectRejected(with([](auto& p) {
                   p.head_dim = 96;
                   p.q_row_stride = p.out_row_stride = 384;
                 }),
                 kUnsupported, "head_dim 96");
  ExpectRejected(with([](auto& p) {
                   p.num_heads = 6;
                   p.q_row_stride = p.out_row_stride = 96;
                 }),
                 kUnsupported, "3 query heads per KV head");
  ExpectRejected(with([](auto& p) {
                   p.num_heads = 5;
                   p.q_row_stride = p.out_row_stride = 80;
                 }),
                 kInvalid, "num_heads 5 is not a multiple of num_kv_heads 2");
  ExpectRejected(with([](auto& p) { p.num_kv_heads = 0; }), kInvalid, "num_kv_heads");
  ExpectRejected(with([](auto& p) { p.entries = -1; }), kInvalid, "entries");
  ExpectRejected(with([](auto& p) { p.total_tokens = -1; }), kInvalid, "total_tokens");
  ExpectRejected(with([](auto& p) { p.max_query_tokens = 0; }), kInvalid, "max_query_tokens");
  ExpectRejected(with([](auto& p) { p.max_query_tokens = 3; }), kInvalid, "max_query_tokens");
  ExpectRejected(with([](auto& p) { p.block_tokens = 0; }), kInvalid, "block_tokens");
  ExpectRejected(with([](auto& p) { p.block_table_stride = 0; }), kInvalid, "block_table_stride");
  ExpectRejected(with([](auto& p) { p.q_row_stride = 56; }), kInvalid, "q_row_stride");
  ExpectRejected(with([](auto& p) { p.q_row_stride = 68; }), kInvalid, "q_row_stride");
  ExpectRejected(with([](auto& p) { p.out_row_stride = 60; }), kInvalid, "out_row_stride");
  ExpectRejected(with([](auto& p) { p.scale = std::numeric_limits<float>::quiet_NaN(); }), kInvalid,
                 "scale");
  ExpectRejected(with([](auto& p) { p.sink_tokens = -1; }), kInvalid, "sink_tokens");
  ExpectRejected(with([](auto& p) { p.recent_tokens = 0; }), kInvalid, "recent_tokens");
}

}  // namespace
}  // namespace rubato
