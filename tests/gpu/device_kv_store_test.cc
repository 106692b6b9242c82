// The GPU cache rank's store (cache_rank/device/device_kv_store.h) against its CPU twin, the host
// store (cache_rank/kv_store.h) fed the same layer packs: sessions of different lengths get a
// prefill pack (every layer, one chunk each) and decode packs with queries; after each decode
// step the device pages equal the host rows bit for bit, Attend matches two-segment attention
// over the host rows (o and lse), and SelectTopK matches exact_top_k.h (positions, up to
// near-ties, and the gathered rows bit for bit), and SelectTopKDelta's deltas equal
// CompactSlotMap's over SelectTopK's selections (entering rows bit for bit). GQA groups 1 to 8,
// head_dim 64 and 128, blocks of 16 and 64. Plus the budget refusal and the step's preconditions.
#include "cache_rank/device/device_kv_store.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "cache_rank/exact_top_k.h"
#include "cache_rank/kv_store.h"
#include "common/dtype.h"
#include "kernels/cpu/two_segment_attention.h"
#include "tests/gpu/gpu_test_util.h"
#include "transport/compact_delta.h"

namespace rubato {
namespace {

using gpu_test::Bf16Close;
using gpu_test::Download;
using gpu_test::DownloadBf16;
using gpu_test::FailsWith;
using gpu_test::Poisoned;
using gpu_test::Upload;

struct StoreCase {
  int layers = 2, kv_heads = 2, group = 4, head_dim = 128, block_tokens = 16;
  std::vector<int> prompts = {1, 37, 130, 300};  // prefill tokens per session
  int decode_steps = 2;
  int top_k = 24, sink = 4, recent = 16;
};

std::string Describe(const StoreCase& c) {
  return "kv heads " + std::to_string(c.kv_heads) + " group " + std::to_string(c.group) +
         " head_dim " + std::to_string(c.head_dim) + " block " + std::to_string(c.block_tokens);
}

// A KV pack of every layer for the sessions, K / V / Q random bf16 values.
struct Pack {
  std::vector<std::byte> bytes;
  LayerPackView view;
};

Pack MakePack(std::mt19937_64& rng, const StoreCase& c, uint64_t step,
              const std::vector<LayerPackRequest>& requests, bool with_query) {
  LayerPackShape shape;
  shape.step = step;
  shape.num_layers = static_cast<uint32_t>(c.layers);
  shape.dtype = DType::kBF16;
  shape.num_kv_heads = static_cast<uint32_t>(c.kv_heads);
  shape.num_query_heads = static_cast<uint32_t>(c.kv_heads * c.group);
  shape.head_dim = static_cast<uint32_t>(c.head_dim);
  shape.has_query = with_query;
  Pack pack;
  pack.bytes.resize(KvPackBytes(shape, requests).value());
  auto writer = LayerPackWriter::Create(shape, requests, pack.bytes).value();
  std::uniform_real_distribution<float> dist(-1.f, 1.f);
  const auto fill = [&](std::span<std::byte> section, float scale) {
    for (size_t i = 0; i + 1 < section.size(); i += 2) {
      const uint16_t bits = F32ToBf16(scale * dist(rng));
      std::memcpy(section.data() + i, &bits, 2);
    }
  };
  for (uint32_t l = 0; l < shape.num_layers; ++l) {
    for (uint32_t r = 0; r < requests.size(); ++r) {
      fill(writer.Key(l, r), 1.f);
      fill(writer.Value(l, r), 1.f);
      if (with_query) fill(writer.Query(l, r), 3.f);  // peaked softmaxes: a clear top-k
    }
  }
  pack.view = LayerPackView::Parse(pack.bytes).value();
  return pack;
}

std::vector<float> ToF32(std::span<const std::byte> bf16) {
  std::vector<float> out(bf16.size() / 2);
  ConvertToF32(DType::kBF16, bf16.data(), out.data(), out.size());
  return out;
}

// Pooled probabilities of the candidates [begin, end) of one KV head in double (the contract of
// exact_top_k.h), for judging near-ties at the cut.
std::vector<double> PooledScores(const KvHeadRows& rows, const std::vector<float>& query,
                                 int kv_head, int group, int head_dim, int begin, int end) {
  std::vector<double> pooled(static_cast<size_t>(end - begin), 0.0);
  std::vector<float> key(static_cast<size_t>(head_dim));
  for (int q = 0; q < group; ++q) {
    const float* qh = query.data() + static_cast<size_t>(kv_head * group + q) * head_dim;
    std::vector<double> logits;
    for (int p = begin; p < end; ++p) {
      ConvertToF32(DType::kBF16, rows.keys.data() + static_cast<size_t>(p) * head_dim * 2,
                   key.data(), key.size());
      double dot = 0.0;
      for (int d = 0; d < head_dim; ++d) dot += double{qh[d]} * key[d];
      logits.push_back(dot / std::sqrt(double(head_dim)));
    }
    const double top = *std::max_element(logits.begin(), logits.end());
    double sum = 0.0;
    for (double& x : logits) sum += (x = std::exp(x - top));
    for (size_t i = 0; i < logits.size(); ++i) pooled[i] += logits[i] / sum / group;
  }
  return pooled;
}

class DeviceKvStoreTest : public ::testing::TestWithParam<StoreCase> {};

TEST_P(DeviceKvStoreTest, MatchesHostStore) {
  const StoreCase c = GetParam();
  SCOPED_TRACE(Describe(c));
  std::mt19937_64 rng = gpu_test::FreshRng();
  const int heads = c.kv_heads * c.group;
  const int batch = static_cast<int>(c.prompts.size());
  DeviceKvStoreOptions options{c.layers,           c.kv_heads, heads, c.head_dim, c.block_tokens,
                               uint64_t{64} << 20, batch,      1024,  c.top_k};
  const int delta_capacity = c.sink + c.top_k;
  options.delta_capacity = delta_capacity;
  options.max_delta_sessions = batch + 1;
  // The CPU twin of the device slot maps: [session][layer][kv head].
  std::vector<CompactSlotMap> slot_maps(size_t(batch) * c.layers * c.kv_heads,
                                        CompactSlotMap(delta_capacity));
  auto device = DeviceKvStore::Create(options);
  ASSERT_TRUE(device.ok()) << device.status().message();
  DeviceKvStore& store = **device;
  KvStore host({uint64_t{1} << 32, nullptr});
  std::vector<uint64_t> host_ids, device_ids;
  for (int s = 0; s < batch; ++s) {
    const SessionShape shape{static_cast<uint32_t>(c.layers),
                             static_cast<uint32_t>(c.kv_heads),
                             static_cast<uint32_t>(heads),
                             static_cast<uint32_t>(c.head_dim),
                             DType::kBF16,
                             static_cast<uint32_t>(c.prompts[s] + c.decode_steps + 7 * s)};
    host_ids.push_back(host.OpenSession(100 + s, shape).value());
    auto id = store.OpenSession(100 + s, shape);
    ASSERT_TRUE(id.ok()) << id.status().message();
    device_ids.push_back(*id);
  }
  cudaStream_t stream = nullptr;
  ASSERT_CUDA_OK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));

  for (int step = 0; step <= c.decode_steps; ++step) {
    const bool decode = step > 0;
    std::vector<LayerPackRequest> requests;
    for (int s = 0; s < batch; ++s) {
      const uint32_t length = store.SessionLength(device_ids[s]).value();
      const uint32_t new_tokens = decode ? 1 : static_cast<uint32_t>(c.prompts[s]);
      requests.push_back({host_ids[s], length, new_tokens, length + new_tokens});
    }
    const Pack pack = MakePack(rng, c, static_cast<uint64_t>(step), requests, decode);
    ASSERT_STATUS_OK(host.AppendKvPack(pack.view));
    auto device_pack = Upload(pack.bytes);
    const std::byte* base = pack.view.bytes().data();
    std::vector<DeviceStepEntry> entries;
    for (int s = 0; s < batch; ++s) {
      DeviceStepEntry e;
      e.session_id = device_ids[s];
      e.first_position = requests[s].first_position;
      e.new_tokens = requests[s].new_tokens;
      e.key_offset = static_cast<uint64_t>(pack.view.Key(0, s).data() - base);
      e.value_offset = static_cast<uint64_t>(pack.view.Value(0, s).data() - base);
      e.top_k = c.top_k - s;  // different per entry (row_k)
      e.sink_tokens = c.sink;
      e.recent_tokens = c.recent + s;
      entries.push_back(e);
    }
    ASSERT_STATUS_OK(store.BeginStep(entries, stream));
    for (int l = 0; l < c.layers; ++l) {
      const ptrdiff_t layer_offset = pack.view.Key(l, 0).data() - pack.view.Key(0, 0).data();
      ASSERT_STATUS_OK(store.AppendLayer(l, device_pack.data() + layer_offset, stream));
    }
    if (!decode) continue;

    // Pages: every stored row of every layer equals the host store's, bit for bit.
    ASSERT_CUDA_OK(cudaStreamSynchronize(stream));
    const KvCacheShape pool = store.pool_shape();
    const size_t layer_elements =
        size_t(pool.num_blocks) * c.kv_heads * c.block_tokens * c.head_dim;
    for (int l = 0; l < c.layers; ++l) {
      std::vector<uint16_t> keys(layer_elements), values(layer_elements);
      ASSERT_CUDA_OK(
          cudaMemcpy(keys.data(), store.layer_keys(l), layer_elements * 2, cudaMemcpyDeviceToHost));
      ASSERT_CUDA_OK(cudaMemcpy(values.data(), store.layer_values(l), layer_elements * 2,
                                cudaMemcpyDeviceToHost));
      for (int s = 0; s < batch; ++s) {
        const std::vector<int32_t> table = store.BlockTable(device_ids[s]).value();
        const uint32_t length = store.SessionLength(device_ids[s]).value();
        for (int h = 0; h < c.kv_heads; ++h) {
          const KvHeadRows rows = host.HeadRows(host_ids[s], l, h).value();
          ASSERT_EQ(rows.readable_tokens, length);
          for (uint32_t p = 0; p < length; ++p) {
            const size_t at =
                ((size_t(table[p / c.block_tokens]) * c.kv_heads + h) * c.block_tokens +
                 p % c.block_tokens) *
                c.head_dim;
            const size_t row_bytes = size_t(c.head_dim) * 2;
            ASSERT_EQ(0, std::memcmp(keys.data() + at, rows.keys.data() + p * row_bytes, row_bytes))
                << "K session " << s << " layer " << l << " head " << h << " position " << p;
            ASSERT_EQ(
                0, std::memcmp(values.data() + at, rows.values.data() + p * row_bytes, row_bytes))
                << "V session " << s << " layer " << l;
          }
        }
      }
    }

    for (int l = 0; l < c.layers; ++l) {
      SCOPED_TRACE("step " + std::to_string(step) + " layer " + std::to_string(l));
      const std::byte* q0 = pack.view.Query(l, 0).data();
      const int64_t q_stride =
          batch > 1 ? (pack.view.Query(l, 1).data() - q0) / 2 : heads * c.head_dim;
      for (int s = 1; s < batch; ++s) {
        ASSERT_EQ(pack.view.Query(l, s).data() - q0, s * q_stride * 2)
            << "Q sections not evenly spaced";
      }
      const DeviceQueries queries{
          reinterpret_cast<const __nv_bfloat16*>(device_pack.data() + (q0 - base)), q_stride};

      // Attend against two-segment attention (no compact rows) over the host rows in f32.
      auto out = Poisoned<__nv_bfloat16>(size_t(batch) * heads * c.head_dim);
      auto lse = Poisoned<float>(size_t(batch) * heads);
      ASSERT_STATUS_OK(
          store.Attend(l, queries, {out.data(), heads * c.head_dim, lse.data()}, stream));
      ASSERT_CUDA_OK(cudaStreamSynchronize(stream));
      const std::vector<float> got_out = DownloadBf16(out);
      const std::vector<float> got_lse = Download(lse);
      std::vector<float> want_out, want_lse;
      for (int s = 0; s < batch; ++s) {
        const int length = static_cast<int>(store.SessionLength(device_ids[s]).value());
        std::vector<float> keys, values;  // [kv_head][length][head_dim]
        for (int h = 0; h < c.kv_heads; ++h) {
          const KvHeadRows rows = host.HeadRows(host_ids[s], l, h).value();
          const std::vector<float> k = ToF32(rows.keys.first(size_t(length) * c.head_dim * 2));
          const std::vector<float> v = ToF32(rows.values.first(size_t(length) * c.head_dim * 2));
          keys.insert(keys.end(), k.begin(), k.end());
          values.insert(values.end(), v.begin(), v.end());
        }
        const std::vector<float> query = ToF32(pack.view.Query(l, s));
        std::vector<float> o(size_t(heads) * c.head_dim), head_lse(heads);
        std::vector<float> no_rows(size_t(c.kv_heads) * c.head_dim);
        const std::vector<int> counts(c.kv_heads, 0);
        const int32_t table = 0;
        TwoSegmentAttentionArgs args;
        args.query = query.data();
        args.output = o.data();
        args.lse = head_lse.data();
        args.num_heads = heads;
        args.compact = {no_rows.data(), no_rows.data(), c.kv_heads, 1, c.head_dim};
        args.compact_counts = counts.data();
        args.kv = {keys.data(), values.data(), &table, length, c.kv_heads, c.head_dim};
        args.recent_begin = 0;
        args.recent_end = length;
        std::vector<float> scratch(size_t(1 + length));
        ASSERT_STATUS_OK(TwoSegmentAttention(args, scratch));
        want_out.insert(want_out.end(), o.begin(), o.end());
        want_lse.insert(want_lse.end(), head_lse.begin(), head_lse.end());
      }
      float ref_max = 0.f;
      for (float v : want_out) ref_max = std::max(ref_max, std::fabs(v));
      EXPECT_TRUE(Bf16Close("attend o", got_out, want_out, 0.02 * ref_max + 1e-6, 0.02));
      EXPECT_TRUE(AllClose<float>("attend lse", got_lse, want_lse, 1e-3, 1e-3));

      // SelectTopK against exact_top_k.h plus the sink, and the host store's gather.
      const int capacity = c.sink + c.top_k + 3;
      auto counts = Poisoned<int32_t>(size_t(batch) * c.kv_heads);
      auto positions = Poisoned<int32_t>(size_t(batch) * c.kv_heads * capacity);
      auto sel_keys = Poisoned<__nv_bfloat16>(size_t(batch) * c.kv_heads * capacity * c.head_dim);
      auto sel_values = Poisoned<__nv_bfloat16>(sel_keys.size());
      ASSERT_STATUS_OK(store.SelectTopK(
          l, queries,
          {capacity, counts.data(), positions.data(), sel_keys.data(), sel_values.data()}, stream));
      ASSERT_CUDA_OK(cudaStreamSynchronize(stream));
      const std::vector<int32_t> got_counts = Download(counts);
      const std::vector<int32_t> got_positions = Download(positions);
      std::vector<uint16_t> got_keys(sel_keys.size()), got_values(sel_values.size());
      ASSERT_CUDA_OK(
          cudaMemcpy(got_keys.data(), sel_keys.data(), sel_keys.bytes(), cudaMemcpyDeviceToHost));
      ASSERT_CUDA_OK(cudaMemcpy(got_values.data(), sel_values.data(), sel_values.bytes(),
                                cudaMemcpyDeviceToHost));
      int near_ties = 0;
      for (int s = 0; s < batch; ++s) {
        const DeviceStepEntry& e = entries[s];
        const int length = static_cast<int>(e.first_position + e.new_tokens);
        const int recent_begin = std::max(0, length - e.recent_tokens);
        const int sink_end = std::min(e.sink_tokens, recent_begin);
        const std::vector<float> query = ToF32(pack.view.Query(l, s));
        const KvHeadSelection want =
            ExactTopK(host, host_ids[s], l, query, e.top_k, sink_end, recent_begin).value();
        for (int h = 0; h < c.kv_heads; ++h) {
          const size_t pair = size_t(s) * c.kv_heads + h;
          const int count = got_counts[pair];
          ASSERT_EQ(count, sink_end + static_cast<int>(want[h].size())) << "session " << s;
          const int32_t* got = got_positions.data() + pair * capacity;
          for (int j = 0; j < sink_end; ++j) ASSERT_EQ(got[j], j);
          std::vector<int32_t> chosen(got + sink_end, got + count);
          ASSERT_TRUE(std::is_sorted(chosen.begin(), chosen.end()));
          ASSERT_TRUE(std::adjacent_find(chosen.begin(), chosen.end()) == chosen.end());
          if (chosen != want[h]) {  // only near-ties at the cut may differ
            const KvHeadRows rows = host.HeadRows(host_ids[s], l, h).value();
            const std::vector<double> pooled =
                PooledScores(rows, query, h, c.group, c.head_dim, sink_end, recent_begin);
            std::vector<double> sorted = pooled;
            std::sort(sorted.rbegin(), sorted.rend());
            const double cut = sorted[want[h].size() - 1];
            for (int32_t p : chosen) {
              ASSERT_GE(p, sink_end);
              ASSERT_LT(p, recent_begin);
              EXPECT_GE(pooled[p - sink_end], cut * (1 - 1e-4) - 1e-9)
                  << "session " << s << " head " << h << " chose " << p << " below the cut";
            }
            ++near_ties;
          }
          // The gathered rows are the host store's rows at the chosen positions.
          const std::vector<int32_t> all(got, got + count);
          if (all.empty()) continue;
          std::vector<std::byte> host_keys(all.size() * c.head_dim * 2),
              host_values(host_keys.size());
          ASSERT_STATUS_OK(host.Gather(host_ids[s], l, h, all, host_keys, host_values));
          const size_t row0 = pair * capacity * c.head_dim;
          EXPECT_EQ(0, std::memcmp(got_keys.data() + row0, host_keys.data(), host_keys.size()));
          EXPECT_EQ(0,
                    std::memcmp(got_values.data() + row0, host_values.data(), host_values.size()));
        }
      }
      if (near_ties > 0) std::cout << "[ near-ties ] " << near_ties << " heads differ at the cut\n";

      // SelectTopKDelta: the same selection as SelectTopK's, as the delta CompactSlotMap gives.
      const size_t pairs = size_t(batch) * c.kv_heads;
      auto d_counts = Poisoned<int32_t>(pairs), d_entering = Poisoned<int32_t>(pairs);
      auto d_slots = Poisoned<int32_t>(pairs * delta_capacity);
      auto d_positions = Poisoned<int32_t>(pairs * delta_capacity);
      auto d_keys = Poisoned<__nv_bfloat16>(pairs * delta_capacity * c.head_dim);
      auto d_values = Poisoned<__nv_bfloat16>(d_keys.size());
      ASSERT_STATUS_OK(store.SelectTopKDelta(l, queries,
                                             {d_counts.data(), d_entering.data(), d_slots.data(),
                                              d_positions.data(), d_keys.data(), d_values.data()},
                                             stream));
      ASSERT_CUDA_OK(cudaStreamSynchronize(stream));
      const std::vector<int32_t> delta_counts = Download(d_counts);
      const std::vector<int32_t> delta_entering = Download(d_entering);
      const std::vector<int32_t> delta_slots = Download(d_slots);
      const std::vector<int32_t> delta_positions = Download(d_positions);
      std::vector<uint16_t> delta_keys(d_keys.size()), delta_values(d_values.size());
      ASSERT_CUDA_OK(
          cudaMemcpy(delta_keys.data(), d_keys.data(), d_keys.bytes(), cudaMemcpyDeviceToHost));
      ASSERT_CUDA_OK(cudaMemcpy(delta_values.data(), d_values.data(), d_values.bytes(),
                                cudaMemcpyDeviceToHost));
      for (int s = 0; s < batch; ++s) {
        for (int h = 0; h < c.kv_heads; ++h) {
          SCOPED_TRACE("delta: session " + std::to_string(s) + " layer " + std::to_string(l) +
                       " head " + std::to_string(h));
          const size_t pair = size_t(s) * c.kv_heads + h;
          const int32_t* chosen = got_positions.data() + pair * capacity;
          CompactSlotMap& map = slot_maps[(size_t(s) * c.layers + l) * c.kv_heads + h];
          const auto delta = map.Update({chosen, size_t(got_counts[pair])});
          ASSERT_TRUE(delta.ok()) << delta.status().message();
          ASSERT_EQ(delta_counts[pair], delta->count);
          const int entering = static_cast<int>(delta->slots.size());
          ASSERT_EQ(delta_entering[pair], entering);
          for (int i = 0; i < delta_capacity; ++i) {
            const size_t at = pair * delta_capacity + i;
            ASSERT_EQ(delta_slots[at], i < entering ? delta->slots[i] : -1) << "row " << i;
            ASSERT_EQ(delta_positions[at], i < entering ? delta->positions[i] : -1) << "row " << i;
          }
          if (entering == 0) continue;
          std::vector<std::byte> host_keys(size_t(entering) * c.head_dim * 2),
              host_values(host_keys.size());
          ASSERT_STATUS_OK(
              host.Gather(host_ids[s], l, h, delta->positions, host_keys, host_values));
          const size_t row0 = pair * delta_capacity * c.head_dim;
          EXPECT_EQ(0, std::memcmp(delta_keys.data() + row0, host_keys.data(), host_keys.size()));
          EXPECT_EQ(
              0, std::memcmp(delta_values.data() + row0, host_values.data(), host_values.size()));
        }
      }
    }
  }
  const DeviceKvStoreStats stats = store.Stats();
  EXPECT_EQ(stats.sessions_open, static_cast<uint64_t>(batch));
  EXPECT_GT(stats.device_bytes, stats.budget_bytes);
  EXPECT_GT(stats.bytes_reserved, 0u);
  for (uint64_t id : device_ids) ASSERT_STATUS_OK(store.CloseSession(id));
  EXPECT_EQ(store.Stats().bytes_reserved, 0u);
  ASSERT_CUDA_OK(cudaStreamDestroy(stream));
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, DeviceKvStoreTest,
    ::testing::Values(StoreCase{2, 2, 4, 128, 16, {1, 37, 130, 300}, 2, 24, 4, 16},
                      StoreCase{3, 3, 2, 64, 64, {70, 5, 200}, 2, 9, 0, 1},
                      StoreCase{2, 1, 8, 128, 64, {129, 64, 2, 257, 33}, 2, 40, 2, 8},
                      StoreCase{2, 4, 1, 64, 16, {17, 300}, 3, 16, 3, 32}));

TEST(DeviceKvStoreRefusalsTest, BudgetAndStepPreconditions) {
  DeviceKvStoreOptions options{2, 2, 4, 64, 16, 0, 2, 0, 4};
  const uint64_t block_bytes = 2ull * 2 * 2 * 16 * 64 * 2;  // K+V, layers, heads, tokens, dim, bf16
  options.budget_bytes = 10 * block_bytes;
  auto created = DeviceKvStore::Create(options);
  ASSERT_TRUE(created.ok()) << created.status().message();
  DeviceKvStore& store = **created;
  const SessionShape shape{2, 2, 4, 64, DType::kBF16, 100};  // 7 blocks
  const uint64_t a = store.OpenSession(1, shape).value();
  EXPECT_TRUE(FailsWith(store.OpenSession(2, shape).status(), StatusCode::kResourceExhausted,
                        "budget of " + std::to_string(10 * block_bytes) + " bytes"));
  EXPECT_TRUE(FailsWith(store.OpenSession(1, {2, 2, 4, 64, DType::kBF16, 10}).status(),
                        StatusCode::kInvalidArgument, "request 1"));
  EXPECT_TRUE(FailsWith(store.OpenSession(3, {2, 2, 4, 64, DType::kF32, 10}).status(),
                        StatusCode::kInvalidArgument, "does not match"));
  const uint64_t b = store.OpenSession(4, {2, 2, 4, 64, DType::kBF16, 48}).value();  // 3 blocks

  auto source = Poisoned<__nv_bfloat16>(1024);
  const DeviceQueries queries{source.data(), 4 * 64};
  auto out = Poisoned<__nv_bfloat16>(2 * 4 * 64);
  auto lse = Poisoned<float>(8);
  EXPECT_TRUE(FailsWith(store.AppendLayer(0, source.data(), nullptr),
                        StatusCode::kFailedPrecondition, "no step"));
  std::vector<DeviceStepEntry> entries(2);
  entries[0].session_id = a;
  entries[1].session_id = b;
  entries[1].key_offset = entries[1].value_offset = 512;
  entries[1].first_position = 1;
  EXPECT_TRUE(FailsWith(store.BeginStep(entries, nullptr), StatusCode::kInvalidArgument,
                        "first_position 1"));
  entries[1].first_position = 0;
  entries[1].new_tokens = 49;
  EXPECT_TRUE(
      FailsWith(store.BeginStep(entries, nullptr), StatusCode::kInvalidArgument, "capacity 48"));
  entries[1].new_tokens = 1;
  entries[1].top_k = 5;
  EXPECT_TRUE(
      FailsWith(store.BeginStep(entries, nullptr), StatusCode::kInvalidArgument, "max_top_k 4"));
  entries[1].top_k = 4;
  ASSERT_STATUS_OK(store.BeginStep(entries, nullptr));
  EXPECT_TRUE(FailsWith(store.Attend(0, queries, {out.data(), 4 * 64, lse.data()}, nullptr),
                        StatusCode::kFailedPrecondition, "not appended"));
  ASSERT_STATUS_OK(store.AppendLayer(0, source.data(), nullptr));
  EXPECT_TRUE(FailsWith(store.AppendLayer(0, source.data(), nullptr),
                        StatusCode::kFailedPrecondition, "already appended"));
  EXPECT_TRUE(
      FailsWith(store.Attend(0, {source.data(), 100}, {out.data(), 256, lse.data()}, nullptr),
                StatusCode::kInvalidArgument, "row_stride"));
  ASSERT_STATUS_OK(store.Attend(0, queries, {out.data(), 4 * 64, lse.data()}, nullptr));
  EXPECT_TRUE(
      FailsWith(store.SelectTopK(0, queries, {3, nullptr, nullptr, nullptr, nullptr}, nullptr),
                StatusCode::kInvalidArgument, "capacity 3"));
  EXPECT_TRUE(FailsWith(store.SelectTopKDelta(0, queries, {}, nullptr),
                        StatusCode::kFailedPrecondition, "delta_capacity 0"));
  ASSERT_STATUS_OK(store.CloseSession(b));
  EXPECT_TRUE(FailsWith(store.Attend(0, queries, {out.data(), 4 * 64, lse.data()}, nullptr),
                        StatusCode::kFailedPrecondition, "no step"));
  ASSERT_CUDA_OK(cudaDeviceSynchronize());
}

}  // namespace
}  // namespace rubato
