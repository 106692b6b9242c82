// Attention on the cache rank (stored_attention.h) against a double-precision reference, for
// f32 and bf16 sessions (GQA 3, a query at the last stored position); bit for bit equal to the
// CPU model's local decode attention (the rows op over a paged cache of another block size and
// block order) for f32; lengths past what is stored refused by name.
#include "cache_rank/stored_attention.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "cache_rank/store_test_util.h"
#include "kernels/cpu/attention.h"

namespace rubato {
namespace {

using cache_rank_test::BuildKvPack;

constexpr uint32_t kLayers = 2;
constexpr uint32_t kKvHeads = 2;
constexpr uint32_t kHeads = 6;
constexpr uint32_t kHeadDim = 8;
constexpr uint32_t kPrefill = 20;

// A value per (layer, kv, head, position, dim) in about [-2, 2].
float RowValue(uint32_t layer, int kv, uint32_t head, uint32_t position, size_t d) {
  return 2.0f *
         std::sin(static_cast<float>(layer * 7 + kv * 3 + head * 11 + position * 5 + d) * 0.37f);
}

class StoredAttentionTest : public ::testing::TestWithParam<DType> {
 protected:
  void SetUp() override {
    shape_.num_layers = kLayers;
    shape_.num_kv_heads = kKvHeads;
    shape_.num_query_heads = kHeads;
    shape_.head_dim = kHeadDim;
    shape_.dtype = GetParam();
    shape_.capacity_tokens = 40;
    auto session = store_.OpenSession(/*request_id=*/3, shape_);
    ASSERT_TRUE(session.ok()) << session.status().ToString();
    session_ = *session;
    const auto fill = [&](uint32_t, uint32_t layer, int kv, uint32_t head, uint32_t position,
                          std::span<std::byte> row) {
      std::vector<float> values(kHeadDim);
      for (size_t d = 0; d < kHeadDim; ++d) values[d] = RowValue(layer, kv, head, position, d);
      ConvertFromF32(shape_.dtype, values.data(), row.data(), kHeadDim);
    };
    for (const auto& [first, tokens] : {std::pair{0u, kPrefill}, std::pair{kPrefill, 1u}}) {
      const auto pack =
          BuildKvPack(shape_, ++step_, 0, kLayers, {{session_, first, tokens, 0}}, fill);
      ASSERT_TRUE(store_.AppendKvPack(pack.view).ok());
    }
    std::mt19937 rng(5);
    std::normal_distribution<float> normal(0.0f, 1.5f);
    query_.resize(kHeads * kHeadDim);
    for (float& q : query_) q = normal(rng);
    query_bytes_.resize(query_.size() * DTypeSize(shape_.dtype));
    ConvertFromF32(shape_.dtype, query_.data(), query_bytes_.data(), query_.size());
    // What the cache rank attends with: the query as it arrived in the session's dtype.
    ConvertToF32(shape_.dtype, query_bytes_.data(), query_.data(), query_.size());
  }

  Status Attend(uint32_t layer, uint32_t length, std::vector<float>& output,
                std::vector<float>& lse) {
    output.assign(kHeads * kHeadDim, 0.f);
    lse.assign(kHeads, 0.f);
    StoredAttentionScratch scratch;
    return StoredDecodeAttention(store_, session_, layer, query_bytes_, length,
                                 std::as_writable_bytes(std::span(output)),
                                 std::as_writable_bytes(std::span(lse)), scratch);
  }

  // The stored row of (layer, kv, head, position) as f32.
  std::vector<float> Stored(uint32_t layer, int kv, uint32_t head, uint32_t position) const {
    const KvHeadRows rows = *store_.HeadRows(session_, layer, head);
    const size_t row_bytes = kHeadDim * DTypeSize(shape_.dtype);
    std::vector<float> row(kHeadDim);
    ConvertToF32(shape_.dtype, (kv == 0 ? rows.keys : rows.values).data() + position * row_bytes,
                 row.data(), kHeadDim);
    return row;
  }

  KvStore store_{KvStoreOptions{uint64_t{1} << 20, nullptr}};
  SessionShape shape_;
  uint64_t session_ = 0;
  uint64_t step_ = 0;
  std::vector<float> query_;  // [kHeads][kHeadDim], f32 (the session dtype's values)
  std::vector<std::byte> query_bytes_;
};

TEST_P(StoredAttentionTest, MatchesADoublePrecisionReference) {
  for (uint32_t layer = 0; layer < kLayers; ++layer) {
    for (const uint32_t length : {1u, 7u, kPrefill + 1}) {
      std::vector<float> output, lse;
      const Status status = Attend(layer, length, output, lse);
      ASSERT_TRUE(status.ok()) << status.ToString();
      double max_error = 0;
      for (uint32_t h = 0; h < kHeads; ++h) {
        const uint32_t kv_head = h / (kHeads / kKvHeads);
        const double scale = 1.0 / std::sqrt(double{kHeadDim});
        std::vector<double> scores(length);
        double max_score = -INFINITY;
        for (uint32_t p = 0; p < length; ++p) {
          const std::vector<float> key = Stored(layer, 0, kv_head, p);
          double dot = 0;
          for (uint32_t d = 0; d < kHeadDim; ++d) dot += double{query_[h * kHeadDim + d]} * key[d];
          scores[p] = dot * scale;
          max_score = std::max(max_score, scores[p]);
        }
        double sum = 0;
        for (const double score : scores) sum += std::exp(score - max_score);
        const double log_sum = max_score + std::log(sum);
        EXPECT_NEAR(lse[h], log_sum, 1e-5 + 1e-6 * std::abs(log_sum)) << "head " << h;
        for (uint32_t d = 0; d < kHeadDim; ++d) {
          double expected = 0;
          for (uint32_t p = 0; p < length; ++p) {
            expected += std::exp(scores[p] - log_sum) * Stored(layer, 1, kv_head, p)[d];
          }
          const double got = output[h * kHeadDim + d];
          const double error = std::abs(got - expected);
          max_error = std::max(max_error, error);
          EXPECT_LE(error, 1e-5 + 1e-5 * std::abs(expected))
              << "layer " << layer << " length " << length << " head " << h << " dim " << d;
        }
      }
      std::printf("layer %u, length %u: max abs error %.3g\n", layer, length, max_error);
    }
  }
}

TEST_P(StoredAttentionTest, RefusesALengthPastWhatIsStored) {
  std::vector<float> output, lse;
  for (const uint32_t length : {0u, kPrefill + 2}) {
    const Status status = Attend(1, length, output, lse);
    EXPECT_EQ(status.code(), StatusCode::kOutOfRange) << status.ToString();
    EXPECT_NE(status.message().find("attention on the cache rank: session " +
                                    std::to_string(session_) + ", layer 1: attends " +
                                    std::to_string(length) + " positions, 21 are stored"),
              std::string::npos)
        << status.ToString();
  }
}

INSTANTIATE_TEST_SUITE_P(Dtypes, StoredAttentionTest, ::testing::Values(DType::kF32, DType::kBF16),
                         [](const auto& info) { return std::string(DTypeName(info.param)); });

// An f32 session's attention is the CPU model's local decode attention, bit for bit: the same
// rows op over the same values, whatever the paged layout around them.
TEST(StoredAttentionExact, EqualsLocalDecodeAttentionBitForBit) {
  SessionShape shape;
  shape.num_layers = 1;
  shape.num_kv_heads = kKvHeads;
  shape.num_query_heads = kHeads;
  shape.head_dim = kHeadDim;
  shape.capacity_tokens = 64;
  KvStore store(KvStoreOptions{uint64_t{1} << 20, nullptr});
  const uint64_t session = *store.OpenSession(1, shape);
  const auto fill = [](uint32_t, uint32_t layer, int kv, uint32_t head, uint32_t position,
                       std::span<std::byte> row) {
    for (size_t d = 0; d < kHeadDim; ++d) {
      const float value = RowValue(layer, kv, head, position, d);
      std::memcpy(row.data() + d * sizeof(float), &value, sizeof(value));
    }
  };
  constexpr uint32_t kLength = 37;
  const auto pack = BuildKvPack(shape, 1, 0, 1, {{session, 0, kLength, 0}}, fill);
  ASSERT_TRUE(store.AppendKvPack(pack.view).ok());
  std::vector<float> query(kHeads * kHeadDim);
  for (size_t i = 0; i < query.size(); ++i) query[i] = std::cos(static_cast<float>(i) * 0.71f);

  std::vector<float> output(kHeads * kHeadDim), lse(kHeads);
  StoredAttentionScratch scratch;
  ASSERT_TRUE(StoredDecodeAttention(store, session, 0, std::as_bytes(std::span(query)), kLength,
                                    std::as_writable_bytes(std::span(output)),
                                    std::as_writable_bytes(std::span(lse)), scratch)
                  .ok());

  // The inference rank's paged cache: blocks of 16 tokens, in reverse physical order.
  constexpr int kBlockTokens = 16;
  const int32_t block_table[3] = {2, 1, 0};
  std::vector<float> keys(3 * kKvHeads * kBlockTokens * kHeadDim);
  std::vector<float> values(keys.size());
  PagedKvView kv{keys.data(), values.data(), block_table, kBlockTokens, kKvHeads, kHeadDim};
  for (uint32_t p = 0; p < kLength; ++p) {
    for (uint32_t h = 0; h < kKvHeads; ++h) {
      for (size_t d = 0; d < kHeadDim; ++d) {
        keys[kv.Offset(static_cast<int>(p), static_cast<int>(h)) + d] = RowValue(0, 0, h, p, d);
        values[kv.Offset(static_cast<int>(p), static_cast<int>(h)) + d] = RowValue(0, 1, h, p, d);
      }
    }
  }
  std::vector<float> local(kHeads * kHeadDim);
  CausalAttentionArgs args{query.data(), local.data(), 1, kLength - 1, kHeads, kv, {}};
  std::vector<float> rows_scratch(static_cast<size_t>(CausalAttentionScratchSize(args)));
  for (int h = 0; h < static_cast<int>(kKvHeads); ++h) {
    CausalAttentionForKvHead(args, h, rows_scratch.data());
  }
  EXPECT_EQ(std::memcmp(output.data(), local.data(), output.size() * sizeof(float)), 0);
}

}  // namespace
}  // namespace rubato
