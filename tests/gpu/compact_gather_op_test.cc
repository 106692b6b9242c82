// GatherCompactKv (kernels/cuda/compact_gather.cuh) against its CPU twin
// (kernels/cpu/compact_gather.h) on fresh random bf16 K/V in shuffled paged pools: batches of 1,
// 3 and 17 sequences, 1 to 8 KV heads, head_dim 16 to 128, blocks of 16 and 64 tokens, sinks of 0
// and 4, budgets 16 / 512 / 2048 with per-head selected counts from 0 to the budget. The gathered
// rows must equal the CPU's bit for bit, the rows past each count must stay as they were, and the
// counts must be sink + selected. With a slot pool (compact_slots), each sequence writes its slot
// (and the positions of its rows) and the slots no sequence names stay as they were.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <numeric>
#include <random>
#include <span>
#include <sstream>
#include <string>
#include <vector>

#include "common/dtype.h"
#include "kernels/cpu/compact_gather.h"
#include "kernels/cuda/compact_gather.cuh"
#include "tests/gpu/gpu_test_util.h"

namespace rubato::cuda {
namespace {

using gpu_test::Download;
using gpu_test::FailsWith;
using gpu_test::Poisoned;
using gpu_test::Upload;
using gpu_test::UploadBf16;

constexpr uint16_t kPoison = 0xFFFF;  // what Poisoned<__nv_bfloat16> leaves in every element
constexpr int32_t kPoisonInt = -1;    // and Poisoned<int32_t> (bytes 0xFF)

struct GatherCase {
  std::vector<int> seq_lens;  // [batch] tokens in the paged cache
  int heads = 2;
  int head_dim = 64;
  int block_tokens = 16;
  int max_sink = 4;
  int budget = 16;
  int capacity_pad = 0;  // capacity = max_sink + budget + capacity_pad
  int extra_slots = -1;  // >= 0: a pool of batch + extra_slots slots, sequences in shuffled slots
};

std::string Describe(const GatherCase& c) {
  std::ostringstream out;
  out << "batch " << c.seq_lens.size() << " H " << c.heads << " head_dim " << c.head_dim
      << " block " << c.block_tokens << " sink " << c.max_sink << " budget " << c.budget
      << (c.extra_slots >= 0 ? " slot pool +" + std::to_string(c.extra_slots) : "");
  return out.str();
}

std::vector<uint16_t> Bits(const std::vector<__nv_bfloat16>& values) {
  std::vector<uint16_t> bits(values.size());
  std::memcpy(bits.data(), values.data(), values.size() * sizeof(uint16_t));
  return bits;
}

void RunCase(const GatherCase& c) {
  SCOPED_TRACE(Describe(c));
  std::mt19937_64 rng = gpu_test::FreshRng();
  const int batch = static_cast<int>(c.seq_lens.size());
  const int heads = c.heads, head_dim = c.head_dim, budget = c.budget;
  const int capacity = c.max_sink + budget + c.capacity_pad;
  const int max_len = *std::max_element(c.seq_lens.begin(), c.seq_lens.end());
  const int stride = (max_len + c.block_tokens - 1) / c.block_tokens;

  // Block tables over a shuffled pool with a few spare blocks.
  int num_blocks = 3;
  for (int len : c.seq_lens) num_blocks += (len + c.block_tokens - 1) / c.block_tokens;
  std::vector<int32_t> physical(num_blocks);
  std::iota(physical.begin(), physical.end(), 0);
  std::shuffle(physical.begin(), physical.end(), rng);
  std::vector<int32_t> tables(static_cast<size_t>(batch) * stride, 0);
  int next = 0;
  for (int b = 0; b < batch; ++b) {
    for (int i = 0; i < (c.seq_lens[b] + c.block_tokens - 1) / c.block_tokens; ++i) {
      tables[static_cast<size_t>(b) * stride + i] = physical[next++];
    }
  }
  const size_t pool = static_cast<size_t>(num_blocks) * heads * c.block_tokens * head_dim;
  std::vector<float> keys = gpu_test::RandomBf16Values(rng, pool, -4.f, 4.f);
  std::vector<float> values = gpu_test::RandomBf16Values(rng, pool, -4.f, 4.f);

  // Sinks and selected positions: head 0 selects as many as it can, head 1 none, the others a
  // random number; positions are distinct, ascending, in [sink_end, L). Entries past a count
  // hold garbage the kernel must not use.
  std::vector<int32_t> sink_end(batch);
  std::vector<int32_t> selected(static_cast<size_t>(batch) * heads * budget, INT32_MAX);
  std::vector<int32_t> selected_count(static_cast<size_t>(batch) * heads);
  std::vector<std::vector<std::vector<int>>> positions(batch);  // CPU twin: [b][h] sink + selected
  for (int b = 0; b < batch; ++b) {
    const int len = c.seq_lens[b];
    sink_end[b] = b == 1 ? 0 : std::min(c.max_sink, len);
    std::vector<int> candidates(static_cast<size_t>(len - sink_end[b]));
    std::iota(candidates.begin(), candidates.end(), sink_end[b]);
    positions[b].resize(heads);
    for (int h = 0; h < heads; ++h) {
      const int most = std::min(budget, static_cast<int>(candidates.size()));
      const int count = h == 0   ? most
                        : h == 1 ? 0
                                 : static_cast<int>(rng() % static_cast<uint64_t>(most + 1));
      std::shuffle(candidates.begin(), candidates.end(), rng);
      std::vector<int> chosen(candidates.begin(), candidates.begin() + count);
      std::sort(chosen.begin(), chosen.end());
      const size_t row = static_cast<size_t>(b) * heads + h;
      selected_count[row] = count;
      std::copy(chosen.begin(), chosen.end(), selected.begin() + row * budget);
      std::vector<int>& kept = positions[b][h];
      for (int p = 0; p < sink_end[b]; ++p) kept.push_back(p);
      kept.insert(kept.end(), chosen.begin(), chosen.end());
    }
  }

  auto d_keys = UploadBf16(keys);
  auto d_values = UploadBf16(values);
  auto d_tables = Upload(tables);
  auto d_sink = Upload(sink_end);
  auto d_selected = Upload(selected);
  auto d_selected_count = Upload(selected_count);
  // Where sequence b writes: buffer b, or a shuffled slot of a larger pool.
  const bool pooled = c.extra_slots >= 0;
  const int buffers = pooled ? batch + c.extra_slots : batch;
  std::vector<int32_t> slot_of(static_cast<size_t>(buffers));
  std::iota(slot_of.begin(), slot_of.end(), 0);
  if (pooled) std::shuffle(slot_of.begin(), slot_of.end(), rng);
  slot_of.resize(static_cast<size_t>(batch));
  auto d_slots = Upload(slot_of);
  const size_t compact_elements = static_cast<size_t>(buffers) * heads * capacity * head_dim;
  auto d_compact_keys = Poisoned<__nv_bfloat16>(compact_elements);
  auto d_compact_values = Poisoned<__nv_bfloat16>(compact_elements);
  auto d_counts = Poisoned<int32_t>(static_cast<size_t>(buffers) * heads);
  auto d_positions = Poisoned<int32_t>(static_cast<size_t>(buffers) * heads * capacity);

  CompactGatherParams p;
  p.key_pool = d_keys.data();
  p.value_pool = d_values.data();
  p.num_pool_blocks = num_blocks;
  p.block_tables = d_tables.data();
  p.block_table_stride = stride;
  p.sink_end = d_sink.data();
  p.max_sink_tokens = c.max_sink;
  p.selected = d_selected.data();
  p.selected_count = d_selected_count.data();
  p.budget = budget;
  p.batch = batch;
  p.num_kv_heads = heads;
  p.head_dim = head_dim;
  p.block_tokens = c.block_tokens;
  p.compact_keys = d_compact_keys.data();
  p.compact_values = d_compact_values.data();
  p.compact_capacity = capacity;
  p.compact_counts = d_counts.data();
  p.compact_positions = d_positions.data();
  if (pooled) {
    p.compact_slots = d_slots.data();
    p.num_compact_slots = buffers;
  }
  ASSERT_TRUE(GatherCompactKv(p, nullptr).ok());
  const std::vector<uint16_t> got_keys = Bits(Download(d_compact_keys));
  const std::vector<uint16_t> got_values = Bits(Download(d_compact_values));
  const std::vector<int32_t> got_counts = Download(d_counts);
  const std::vector<int32_t> got_positions = Download(d_positions);
  std::vector<bool> written(static_cast<size_t>(buffers), false);
  for (int32_t slot : slot_of) written[static_cast<size_t>(slot)] = true;
  for (int slot = 0; slot < buffers; ++slot) {  // slots no sequence names: untouched
    if (written[static_cast<size_t>(slot)]) continue;
    for (int h = 0; h < heads; ++h) {
      const size_t pair = static_cast<size_t>(slot) * heads + h;
      ASSERT_EQ(got_counts[pair], kPoisonInt) << "count of unused slot " << slot;
      for (size_t i = pair * capacity * head_dim; i < (pair + 1) * capacity * head_dim; ++i) {
        ASSERT_EQ(got_keys[i], kPoison) << "unused slot " << slot;
        ASSERT_EQ(got_values[i], kPoison) << "unused slot " << slot;
      }
    }
  }

  const size_t per_sequence = static_cast<size_t>(heads) * capacity * head_dim;
  std::vector<float> ref_keys(per_sequence), ref_values(per_sequence);
  std::vector<int> ref_counts(heads);
  for (int b = 0; b < batch; ++b) {
    SCOPED_TRACE("sequence " + std::to_string(b));
    PagedKvView kv;
    kv.keys = keys.data();
    kv.values = values.data();
    kv.block_table = tables.data() + static_cast<size_t>(b) * stride;
    kv.block_tokens = c.block_tokens;
    kv.num_kv_heads = heads;
    kv.head_dim = head_dim;
    const CompactKvView compact{ref_keys.data(), ref_values.data(), heads, capacity, head_dim};
    const Status status =
        ::rubato::GatherCompactKv(kv, c.seq_lens[b], positions[b], compact, ref_counts);
    ASSERT_TRUE(status.ok()) << status.message();
    for (int h = 0; h < heads; ++h) {
      SCOPED_TRACE("kv head " + std::to_string(h));
      const size_t pair = static_cast<size_t>(slot_of[static_cast<size_t>(b)]) * heads + h;
      ASSERT_EQ(got_counts[pair], ref_counts[h]);
      for (int r = 0; r < capacity; ++r) {
        const int32_t want_position =
            r < ref_counts[h] ? positions[b][h][static_cast<size_t>(r)] : kPoisonInt;
        ASSERT_EQ(got_positions[pair * capacity + r], want_position) << "position of row " << r;
        const size_t at = (pair * capacity + r) * head_dim;
        const size_t ref_at = (static_cast<size_t>(h) * capacity + r) * head_dim;
        for (int d = 0; d < head_dim; ++d) {
          const uint16_t want_key = r < ref_counts[h] ? F32ToBf16(ref_keys[ref_at + d]) : kPoison;
          const uint16_t want_value =
              r < ref_counts[h] ? F32ToBf16(ref_values[ref_at + d]) : kPoison;
          ASSERT_EQ(got_keys[at + d], want_key) << "K row " << r << " dim " << d;
          ASSERT_EQ(got_values[at + d], want_value) << "V row " << r << " dim " << d;
        }
      }
    }
  }
}

TEST(CompactGatherOp, SingleSequenceSmallHead) { RunCase({{100}, 1, 16, 16, 4, 16, 0}); }

TEST(CompactGatherOp, ThreeSequencesBudget512) {
  RunCase({{1000, 3, 700}, 2, 64, 64, 4, 512, 0});
  RunCase({{40, 33, 2}, 2, 32, 16, 0, 16, 7});  // no sink tokens, spare capacity
}

TEST(CompactGatherOp, Batch17EightHeads) {
  std::mt19937_64 rng = gpu_test::FreshRng();
  std::vector<int> lens(17);
  for (int& len : lens) len = 1 + static_cast<int>(rng() % 700);
  RunCase({lens, 8, 128, 16, 4, 512, 0});
}

TEST(CompactGatherOp, Budget2048) { RunCase({{3000, 2100, 50}, 8, 128, 64, 4, 2048, 5}); }

// The CUDA model's compact pool: sequences write shuffled slots of a larger pool.
TEST(CompactGatherOp, SlotPool) {
  RunCase({{100}, 1, 16, 16, 4, 16, 0, 0});
  RunCase({{1000, 3, 700}, 2, 64, 64, 4, 512, 3, 5});
  std::mt19937_64 rng = gpu_test::FreshRng();
  std::vector<int> lens(17);
  for (int& len : lens) len = 1 + static_cast<int>(rng() % 700);
  RunCase({lens, 8, 128, 16, 4, 64, 0, 11});
}

TEST(CompactGatherOp, BadPositionsGiveNaNRowsNotOutOfBoundsReads) {
  // One sequence of 20 tokens (2 blocks of 16, table stride 2): a negative position, one past the
  // table and one whose table entry names a block outside the pool.
  const int head_dim = 16, block_tokens = 16;
  std::mt19937_64 rng = gpu_test::FreshRng();
  const std::vector<float> keys = gpu_test::RandomBf16Values(rng, 2 * 1 * 16 * head_dim);
  auto d_keys = UploadBf16(keys);
  auto d_values = UploadBf16(keys);
  auto d_tables = Upload(std::vector<int32_t>{0, 7});  // block 7 does not exist
  auto d_sink = Upload(std::vector<int32_t>{0});
  auto d_selected = Upload(std::vector<int32_t>{-3, 5, 17, 40});
  auto d_selected_count = Upload(std::vector<int32_t>{4});
  auto d_compact_keys = Poisoned<__nv_bfloat16>(4 * head_dim);
  auto d_compact_values = Poisoned<__nv_bfloat16>(4 * head_dim);
  auto d_counts = Poisoned<int32_t>(1);
  CompactGatherParams p;
  p.key_pool = d_keys.data();
  p.value_pool = d_values.data();
  p.num_pool_blocks = 2;
  p.block_tables = d_tables.data();
  p.block_table_stride = 2;
  p.sink_end = d_sink.data();
  p.selected = d_selected.data();
  p.selected_count = d_selected_count.data();
  p.budget = 4;
  p.batch = 1;
  p.num_kv_heads = 1;
  p.head_dim = head_dim;
  p.block_tokens = block_tokens;
  p.compact_keys = d_compact_keys.data();
  p.compact_values = d_compact_values.data();
  p.compact_capacity = 4;
  p.compact_counts = d_counts.data();
  ASSERT_TRUE(GatherCompactKv(p, nullptr).ok());
  const std::vector<uint16_t> got = Bits(Download(d_compact_keys));
  EXPECT_EQ(Download(d_counts), std::vector<int32_t>{4});
  for (int r = 0; r < 4; ++r) {
    for (int d = 0; d < head_dim; ++d) {
      const uint16_t bits = got[static_cast<size_t>(r) * head_dim + d];
      if (r == 1) {  // position 5: block 0, row 5
        EXPECT_EQ(bits, F32ToBf16(keys[5 * head_dim + d])) << "dim " << d;
      } else {  // -3, 17 (block id 7) and 40 (past the table): NaN
        EXPECT_EQ(bits, 0x7fff) << "row " << r << " dim " << d;
      }
    }
  }
}

TEST(CompactGatherOp, BadParamsAreInvalidArgument) {
  auto pool = Poisoned<__nv_bfloat16>(2 * 16 * 16);
  auto table = Upload(std::vector<int32_t>{0});
  auto ints = Upload(std::vector<int32_t>{0, 0, 0, 0});
  auto compact = Poisoned<__nv_bfloat16>(8 * 16);
  auto counts = Poisoned<int32_t>(1);
  CompactGatherParams good;
  good.key_pool = pool.data();
  good.value_pool = pool.data();
  good.num_pool_blocks = 1;
  good.block_tables = table.data();
  good.block_table_stride = 1;
  good.sink_end = ints.data();
  good.max_sink_tokens = 4;
  good.selected = ints.data();
  good.selected_count = ints.data();
  good.budget = 4;
  good.batch = 1;
  good.num_kv_heads = 1;
  good.head_dim = 16;
  good.block_tokens = 16;
  good.compact_keys = compact.data();
  good.compact_values = compact.data();
  good.compact_capacity = 8;
  good.compact_counts = counts.data();
  ASSERT_TRUE(GatherCompactKv(good, nullptr).ok());
  ASSERT_EQ(cudaSuccess, cudaDeviceSynchronize());

  struct Bad {
    const char* field;
    void (*change)(CompactGatherParams&);
  };
  const Bad bad[] = {
      {"batch", [](CompactGatherParams& p) { p.batch = -1; }},
      {"num_kv_heads", [](CompactGatherParams& p) { p.num_kv_heads = 0; }},
      {"head_dim", [](CompactGatherParams& p) { p.head_dim = 12; }},
      {"block_tokens", [](CompactGatherParams& p) { p.block_tokens = 0; }},
      {"max_sink_tokens", [](CompactGatherParams& p) { p.max_sink_tokens = -1; }},
      {"budget", [](CompactGatherParams& p) { p.budget = -1; }},
      {"compact_capacity", [](CompactGatherParams& p) { p.compact_capacity = 7; }},
      {"num_pool_blocks", [](CompactGatherParams& p) { p.num_pool_blocks = 0; }},
      {"block_table_stride", [](CompactGatherParams& p) { p.block_table_stride = 0; }},
      {"key_pool", [](CompactGatherParams& p) { p.key_pool = nullptr; }},
      {"value_pool", [](CompactGatherParams& p) { p.value_pool = nullptr; }},
      {"block_tables", [](CompactGatherParams& p) { p.block_tables = nullptr; }},
      {"sink_end", [](CompactGatherParams& p) { p.sink_end = nullptr; }},
      {"selected is null", [](CompactGatherParams& p) { p.selected = nullptr; }},
      {"selected_count", [](CompactGatherParams& p) { p.selected_count = nullptr; }},
      {"compact_keys", [](CompactGatherParams& p) { p.compact_keys = nullptr; }},
      {"compact_values", [](CompactGatherParams& p) { p.compact_values = nullptr; }},
      {"compact_counts", [](CompactGatherParams& p) { p.compact_counts = nullptr; }},
      {"key_pool is not 16-byte aligned", [](CompactGatherParams& p) { p.key_pool += 1; }},
      {"compact_values is not 16-byte aligned",
       [](CompactGatherParams& p) { p.compact_values += 4; }},
      {"num_compact_slots", [](CompactGatherParams& p) { p.compact_slots = p.sink_end; }},
  };
  for (const Bad& b : bad) {
    CompactGatherParams p = good;
    b.change(p);
    EXPECT_TRUE(FailsWith(GatherCompactKv(p, nullptr), StatusCode::kInvalidArgument, b.field))
        << b.field;
  }
}

}  // namespace
}  // namespace rubato::cuda
