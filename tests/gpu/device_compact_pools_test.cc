// The inference rank's device compact pools (inference_rank/residency/offloaded/
// device_compact_pools.h) fed delta packs over many steps of changing selections: the packs are
// made on the host by the cache rank's CPU bookkeeping (CompactSlotMap and the rows at the
// entering positions), applied on the device, and two-segment decode attention over the pools
// (rows in slot order, the recent window from the paged KV) must match the same attention over
// compact buffers gathered in position order as local oracle_topk gathers them (every output
// element within bf16 rounding of a different summation order, every lse within 1e-3), while
// each pool holds exactly the selected positions.
#include "inference_rank/residency/offloaded/device_compact_pools.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "kernels/cuda/compact_gather.cuh"
#include "kernels/cuda/decode_attention.cuh"
#include "tests/gpu/gpu_test_util.h"
#include "transport/compact_delta.h"

namespace rubato {
namespace {

using gpu_test::Download;
using gpu_test::DownloadBf16;
using gpu_test::Poisoned;
using gpu_test::Upload;
using gpu_test::UploadBf16;

TEST(DeviceCompactPoolsTest, DeltaPoolsAttendLikeLocalGathersOverManySteps) {
  constexpr int kLayers = 2, kBatch = 3, kKvHeads = 2, kGroup = 4, kHeadDim = 128;
  constexpr int kBlock = 16, kLength = 400, kSink = 4, kTopK = 48, kRecent = 16, kSteps = 40;
  constexpr int kHeads = kKvHeads * kGroup, kCapacity = kSink + kTopK;
  std::mt19937_64 rng = gpu_test::FreshRng();
  const int stride = (kLength + kBlock - 1) / kBlock;
  const int num_blocks = kBatch * stride;
  std::vector<int32_t> tables(static_cast<size_t>(num_blocks));
  std::iota(tables.begin(), tables.end(), 0);
  std::shuffle(tables.begin(), tables.end(), rng);
  const size_t layer_elements = static_cast<size_t>(num_blocks) * kKvHeads * kBlock * kHeadDim;
  std::vector<std::vector<float>> keys, values;
  std::vector<cuda::DeviceBuffer<__nv_bfloat16>> d_keys, d_values;
  for (int l = 0; l < kLayers; ++l) {
    keys.push_back(gpu_test::RandomBf16Values(rng, layer_elements, -2.f, 2.f));
    values.push_back(gpu_test::RandomBf16Values(rng, layer_elements, -2.f, 2.f));
    d_keys.push_back(UploadBf16(keys.back()));
    d_values.push_back(UploadBf16(values.back()));
  }
  const auto row_of = [&](const std::vector<float>& pool, int b, int h, int32_t position) {
    const size_t block =
        static_cast<size_t>(tables[static_cast<size_t>(b) * stride + position / kBlock]);
    const size_t at = ((block * kKvHeads + h) * kBlock + position % kBlock) * kHeadDim;
    return std::vector<float>(pool.begin() + at, pool.begin() + at + kHeadDim);
  };
  auto d_tables = Upload(tables);
  auto d_lens = Upload(std::vector<int32_t>(kBatch, kLength));
  const int recent_begin = kLength - kRecent;
  auto d_recent = Upload(std::vector<int32_t>(kBatch, recent_begin));
  auto d_sink = Upload(std::vector<int32_t>(kBatch, kSink));

  auto pools = DeviceCompactPools::Create({kLayers, kKvHeads, kHeadDim, kCapacity, kBatch + 2});
  ASSERT_TRUE(pools.ok()) << pools.status().message();
  std::vector<int32_t> pool_index;
  for (int b = 0; b < kBatch + 2; ++b) pool_index.push_back((*pools)->Acquire().value());
  std::shuffle(pool_index.begin(), pool_index.end(), rng);
  pool_index.resize(kBatch);
  auto d_pool_index = Upload(pool_index);
  EXPECT_FALSE((*pools)->Acquire().ok());  // all in use

  std::vector<CompactSlotMap> maps(static_cast<size_t>(kLayers) * kBatch * kKvHeads,
                                   CompactSlotMap(kCapacity));
  std::vector<std::vector<int32_t>> previous(maps.size());
  const size_t pairs = static_cast<size_t>(kBatch) * kKvHeads;
  const size_t workspace_bytes =
      cuda::DecodeAttentionWorkspaceBytes(kBatch, kHeads, kHeadDim, kLength, false);
  auto d_workspace = Poisoned<unsigned char>(workspace_bytes);
  size_t entering_rows = 0, selected_rows = 0;
  double worst = 0.0;
  for (int step = 0; step < kSteps; ++step) {
    SCOPED_TRACE("step " + std::to_string(step));
    auto d_q = UploadBf16(gpu_test::RandomBf16Values(
        rng, static_cast<size_t>(kBatch) * kHeads * kHeadDim, -2.f, 2.f));
    for (int l = 0; l < kLayers; ++l) {
      // The cache rank's half on the host: selections, deltas and the pack.
      std::vector<int32_t> counts(pairs), slots(pairs * kCapacity, -1),
          positions(pairs * kCapacity, -1), selected(pairs * kTopK, 0), selected_count(pairs);
      std::vector<float> pack_keys(pairs * kCapacity * kHeadDim, 0.f),
          pack_values(pack_keys.size(), 0.f);
      for (int b = 0; b < kBatch; ++b) {
        for (int h = 0; h < kKvHeads; ++h) {
          const size_t pair = static_cast<size_t>(b) * kKvHeads + h;
          const size_t id = static_cast<size_t>(l) * pairs + pair;
          std::set<int32_t> chosen;
          for (int32_t p : previous[id]) {
            if (rng() % 8 != 0) chosen.insert(p);
          }
          const size_t target = rng() % (kTopK + 1);
          while (chosen.size() > target)
            chosen.erase(std::next(chosen.begin(), rng() % chosen.size()));
          while (chosen.size() < target) {
            chosen.insert(kSink + static_cast<int32_t>(rng() % (recent_begin - kSink)));
          }
          previous[id].assign(chosen.begin(), chosen.end());
          selected_count[pair] = static_cast<int32_t>(chosen.size());
          std::copy(chosen.begin(), chosen.end(), selected.begin() + pair * kTopK);
          std::vector<int32_t> selection(kSink);
          std::iota(selection.begin(), selection.end(), 0);
          selection.insert(selection.end(), chosen.begin(), chosen.end());
          const auto delta = maps[id].Update(selection);
          ASSERT_TRUE(delta.ok()) << delta.status().message();
          counts[pair] = delta->count;
          for (size_t i = 0; i < delta->slots.size(); ++i) {
            slots[pair * kCapacity + i] = delta->slots[i];
            positions[pair * kCapacity + i] = delta->positions[i];
            const auto k = row_of(keys[l], b, h, delta->positions[i]);
            const auto v = row_of(values[l], b, h, delta->positions[i]);
            std::copy(k.begin(), k.end(), pack_keys.begin() + (pair * kCapacity + i) * kHeadDim);
            std::copy(v.begin(), v.end(), pack_values.begin() + (pair * kCapacity + i) * kHeadDim);
          }
          entering_rows += delta->slots.size();
          selected_rows += selection.size();
        }
      }
      auto d_counts = Upload(counts);
      auto d_slots = Upload(slots);
      auto d_positions = Upload(positions);
      auto d_pack_keys = UploadBf16(pack_keys);
      auto d_pack_values = UploadBf16(pack_values);
      DeviceDeltaPack pack{d_counts.data(),
                           d_slots.data(),
                           d_positions.data(),
                           d_pack_keys.data(),
                           d_pack_values.data(),
                           kCapacity,
                           kBatch};
      ASSERT_TRUE((*pools)->Apply(l, pack, d_pool_index.data(), nullptr).ok());

      // Attention over the pools, and over a local gather in position order.
      cuda::DecodeAttentionParams p;
      p.q = d_q.data();
      p.q_row_stride = kHeads * kHeadDim;
      p.key_pool = d_keys[l].data();
      p.value_pool = d_values[l].data();
      p.block_tables = d_tables.data();
      p.block_table_stride = stride;
      p.seq_lens = d_lens.data();
      p.batch = kBatch;
      p.num_heads = kHeads;
      p.num_kv_heads = kKvHeads;
      p.head_dim = kHeadDim;
      p.block_tokens = kBlock;
      p.max_seq_len = kLength;
      p.scale = static_cast<float>(1.0 / std::sqrt(double{kHeadDim}));
      p.out_row_stride = kHeads * kHeadDim;
      p.workspace = d_workspace.data();
      p.workspace_bytes = workspace_bytes;
      p.recent_begin = d_recent.data();
      p.max_recent_tokens = kRecent;
      auto d_out = Poisoned<__nv_bfloat16>(static_cast<size_t>(kBatch) * kHeads * kHeadDim);
      auto d_lse = Poisoned<float>(static_cast<size_t>(kBatch) * kHeads);
      cuda::DecodeAttentionParams pooled = p;
      pooled.out = d_out.data();
      pooled.lse = d_lse.data();
      (*pools)->SetCompactSegment(l, d_pool_index.data(), pooled);
      ASSERT_TRUE(cuda::DecodeAttention(pooled, nullptr).ok());

      auto d_selected = Upload(selected);
      auto d_selected_count = Upload(selected_count);
      auto d_local_keys = Poisoned<__nv_bfloat16>(pairs * kCapacity * kHeadDim);
      auto d_local_values = Poisoned<__nv_bfloat16>(pairs * kCapacity * kHeadDim);
      auto d_local_counts = Poisoned<int32_t>(pairs);
      cuda::CompactGatherParams g;
      g.key_pool = d_keys[l].data();
      g.value_pool = d_values[l].data();
      g.num_pool_blocks = num_blocks;
      g.block_tables = d_tables.data();
      g.block_table_stride = stride;
      g.sink_end = d_sink.data();
      g.max_sink_tokens = kSink;
      g.selected = d_selected.data();
      g.selected_count = d_selected_count.data();
      g.budget = kTopK;
      g.batch = kBatch;
      g.num_kv_heads = kKvHeads;
      g.head_dim = kHeadDim;
      g.block_tokens = kBlock;
      g.compact_keys = d_local_keys.data();
      g.compact_values = d_local_values.data();
      g.compact_capacity = kCapacity;
      g.compact_counts = d_local_counts.data();
      ASSERT_TRUE(cuda::GatherCompactKv(g, nullptr).ok());
      auto d_ref_out = Poisoned<__nv_bfloat16>(static_cast<size_t>(kBatch) * kHeads * kHeadDim);
      auto d_ref_lse = Poisoned<float>(static_cast<size_t>(kBatch) * kHeads);
      cuda::DecodeAttentionParams local = p;
      local.out = d_ref_out.data();
      local.lse = d_ref_lse.data();
      local.compact_keys = d_local_keys.data();
      local.compact_values = d_local_values.data();
      local.compact_capacity = kCapacity;
      local.compact_counts = d_local_counts.data();
      ASSERT_TRUE(cuda::DecodeAttention(local, nullptr).ok());

      const std::vector<float> out = DownloadBf16(d_out), ref = DownloadBf16(d_ref_out);
      float ref_max = 0.f;
      for (float v : ref) ref_max = std::max(ref_max, std::fabs(v));
      for (size_t i = 0; i < out.size(); ++i) {
        worst = std::max(worst, static_cast<double>(std::fabs(out[i] - ref[i])));
      }
      ASSERT_TRUE(gpu_test::Bf16Close("pooled attention", out, ref, 0.01 * ref_max, 0.02));
      ASSERT_TRUE(AllClose<float>("pooled lse", Download(d_lse), Download(d_ref_lse), 1e-3, 1e-3));

      // Each pool holds exactly the selection (slot order).
      const size_t layer_slots = static_cast<size_t>(kBatch + 2) * kKvHeads * kCapacity;
      std::vector<int32_t> held(layer_slots),
          held_counts(static_cast<size_t>(kBatch + 2) * kKvHeads);
      ASSERT_EQ(cudaSuccess, cudaMemcpy(held.data(), (*pools)->layer_positions(l),
                                        layer_slots * sizeof(int32_t), cudaMemcpyDeviceToHost));
      ASSERT_EQ(cudaSuccess,
                cudaMemcpy(held_counts.data(), (*pools)->layer_counts(l),
                           held_counts.size() * sizeof(int32_t), cudaMemcpyDeviceToHost));
      for (int b = 0; b < kBatch; ++b) {
        for (int h = 0; h < kKvHeads; ++h) {
          const size_t pool_pair = static_cast<size_t>(pool_index[b]) * kKvHeads + h;
          const CompactSlotMap& map = maps[static_cast<size_t>(l) * pairs + b * kKvHeads + h];
          ASSERT_EQ(held_counts[pool_pair], map.count());
          for (int s = 0; s < kCapacity; ++s) {
            ASSERT_EQ(held[pool_pair * kCapacity + s],
                      s < map.count() ? map.slot_positions()[s] : -1)
                << "layer " << l << " sequence " << b << " head " << h << " slot " << s;
          }
        }
      }
    }
  }
  std::cout << "[ deltas    ] " << entering_rows << " rows entered of " << selected_rows
            << " selected; largest |pooled - local| " << worst << "\n";
  EXPECT_LT(entering_rows, selected_rows);
  for (int32_t pool : pool_index) ASSERT_TRUE((*pools)->Release(pool).ok());
  EXPECT_FALSE((*pools)->Release(pool_index[0]).ok());
}

}  // namespace
}  // namespace rubato
