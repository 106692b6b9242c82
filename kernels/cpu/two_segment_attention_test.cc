// Tests for the compact gather (compact_gather.h) and two-segment sparse decode attention
// (two_segment_attention.h): against a double-precision softmax over the explicit key set of
// each KV head (shuffled block tables, per-head counts, empty segments), against dense decode of
// attention.h when the compact buffer holds every position before the recent segment (the
// invariant SFI relies on: a budget covering the context is dense), the gather's exact rows, and
// the rejection of bad input.
#include "kernels/cpu/two_segment_attention.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <functional>
#include <iostream>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "kernels/cpu/all_close_for_test.h"
#include "kernels/cpu/attention.h"
#include "kernels/cpu/attention_stats.h"
#include "kernels/cpu/compact_gather.h"
#include "kernels/cpu/kv_append.h"

namespace rubato {
namespace {

std::vector<float> RandomVector(size_t n, uint64_t seed, float scale) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.0f, scale);
  std::vector<float> v(n);
  for (float& x : v) x = normal(rng);
  return v;
}

struct Shape {
  int num_heads, num_kv_heads, head_dim, block_tokens, positions;
};

std::string Describe(const Shape& s) {
  return "heads " + std::to_string(s.num_heads) + "/" + std::to_string(s.num_kv_heads) + " dim " +
         std::to_string(s.head_dim) + " block " + std::to_string(s.block_tokens) + " positions " +
         std::to_string(s.positions);
}

// One sequence of one layer: random K/V, kept contiguously for the reference
//   keys(), values(): [positions][num_kv_heads][head_dim]
// and appended to a paged pool with spare blocks and a shuffled block table. Pool slots never
// written are NaN, so an op that reads them produces NaN and fails.
class PagedSequence {
 public:
  PagedSequence(const Shape& s, uint64_t seed) : shape_(s) {
    const size_t kv_row = size_t(s.num_kv_heads) * s.head_dim;
    keys_ = RandomVector(s.positions * kv_row, seed, 1.0f);
    values_ = RandomVector(s.positions * kv_row, seed + 1, 1.0f);
    const int blocks = (s.positions + s.block_tokens - 1) / s.block_tokens;
    const int pool_blocks = blocks + 3;
    std::vector<int32_t> all(pool_blocks);
    std::iota(all.begin(), all.end(), 0);
    std::mt19937_64 rng(seed + 2);
    std::shuffle(all.begin(), all.end(), rng);
    table_.assign(all.begin(), all.begin() + blocks);
    const size_t pool = size_t(pool_blocks) * s.num_kv_heads * s.block_tokens * s.head_dim;
    paged_keys_.assign(pool, NAN);
    paged_values_.assign(pool, NAN);
    AppendToPagedKv(keys_.data(), values_.data(), s.positions, 0, View());
  }

  PagedKvView View() {
    return PagedKvView{paged_keys_.data(),  paged_values_.data(), table_.data(),
                       shape_.block_tokens, shape_.num_kv_heads,  shape_.head_dim};
  }
  const std::vector<float>& keys() const { return keys_; }
  const std::vector<float>& values() const { return values_; }
  // The contiguous K or V vector of (position, kv_head).
  const float* Key(int position, int kv_head) const {
    return keys_.data() + (size_t(position) * shape_.num_kv_heads + kv_head) * shape_.head_dim;
  }
  const float* Value(int position, int kv_head) const {
    return values_.data() + (size_t(position) * shape_.num_kv_heads + kv_head) * shape_.head_dim;
  }

  // NaN into every paged position outside [begin, end): an op that reads one fails.
  void PoisonOutside(int begin, int end) {
    const PagedKvView kv = View();
    for (int p = 0; p < shape_.positions; ++p) {
      if (p >= begin && p < end) continue;
      for (int h = 0; h < shape_.num_kv_heads; ++h) {
        std::fill_n(paged_keys_.data() + kv.Offset(p, h), shape_.head_dim, NAN);
        std::fill_n(paged_values_.data() + kv.Offset(p, h), shape_.head_dim, NAN);
      }
    }
  }

 private:
  Shape shape_;
  std::vector<float> keys_, values_;
  std::vector<int32_t> table_;
  std::vector<float> paged_keys_, paged_values_;
};

// A compact buffer, filled with `fill` (NaN by default: rows past a head's count must never be
// read).
struct CompactBuffer {
  CompactBuffer(int num_kv_heads, int capacity, int head_dim, float fill = NAN)
      : keys(size_t(num_kv_heads) * capacity * head_dim, fill),
        values(keys.size(), fill),
        num_kv_heads(num_kv_heads),
        capacity(capacity),
        head_dim(head_dim) {}
  CompactKvView View() {
    return CompactKvView{keys.data(), values.data(), num_kv_heads, capacity, head_dim};
  }
  std::vector<float> keys, values;  // [num_kv_heads][capacity][head_dim]
  int num_kv_heads, capacity, head_dim;
};

struct Reference {
  std::vector<double> output;  // [num_heads][head_dim]
  std::vector<double> lse;     // [num_heads]; -inf for an empty working set
};

// Decode attention of q: [num_heads][head_dim] over the explicit key set of each KV head
// (working_set[kv_head]: positions, any order), in double, from the contiguous K/V. An empty set
// gives output 0 and lse -inf (the op's definition).
Reference ReferenceAttention(const Shape& s, const std::vector<float>& q,
                             const PagedSequence& sequence,
                             const std::vector<std::vector<int>>& working_set) {
  Reference ref{std::vector<double>(size_t(s.num_heads) * s.head_dim, 0.0),
                std::vector<double>(s.num_heads, -INFINITY)};
  const int group = s.num_heads / s.num_kv_heads;
  for (int h = 0; h < s.num_heads; ++h) {
    const std::vector<int>& keys = working_set[h / group];
    if (keys.empty()) continue;
    std::vector<double> scores(keys.size());
    for (size_t i = 0; i < keys.size(); ++i) {
      const float* k = sequence.Key(keys[i], h / group);
      double dot = 0;
      for (int d = 0; d < s.head_dim; ++d) dot += double(q[size_t(h) * s.head_dim + d]) * k[d];
      scores[i] = dot / std::sqrt(double(s.head_dim));
    }
    const double max = *std::max_element(scores.begin(), scores.end());
    double sum = 0;
    for (double& x : scores) sum += (x = std::exp(x - max));
    ref.lse[h] = max + std::log(sum);
    for (size_t i = 0; i < keys.size(); ++i) {
      const float* v = sequence.Value(keys[i], h / group);
      for (int d = 0; d < s.head_dim; ++d) {
        ref.output[size_t(h) * s.head_dim + d] += scores[i] / sum * v[d];
      }
    }
  }
  return ref;
}

// Every element within tolerance x (the largest |expected| of its row of `row_length`): an
// attention output is a convex combination of value rows, so its error scales with the row, not
// with each (possibly cancelling) element. A row of zeros must be exactly zero. NaN fails.
::testing::AssertionResult WithinRowScale(const std::string& what, const std::vector<float>& actual,
                                          const std::vector<double>& expected, int row_length,
                                          double tolerance) {
  if (actual.size() != expected.size()) {
    return ::testing::AssertionFailure()
           << what << ": " << actual.size() << " values, expected " << expected.size();
  }
  double max_relative = 0;
  for (size_t row = 0; row * row_length < expected.size(); ++row) {
    double scale = 0;
    for (int d = 0; d < row_length; ++d) {
      scale = std::max(scale, std::fabs(expected[row * row_length + d]));
    }
    for (int d = 0; d < row_length; ++d) {
      const size_t i = row * row_length + d;
      const double error = std::fabs(double(actual[i]) - expected[i]);
      if (!(error <= tolerance * scale)) {  // NaN fails too
        return ::testing::AssertionFailure()
               << what << ": row " << row << " element " << d << " is " << actual[i] << ", want "
               << expected[i] << " (error " << error << ", row scale " << scale << ")";
      }
      if (scale > 0) max_relative = std::max(max_relative, error / scale);
    }
  }
  std::cout << "[ max error ] " << what << ": " << max_relative << " of the row scale\n";
  return ::testing::AssertionSuccess();
}

// lse within atol + rtol * |ref|; an empty working set's -inf exactly.
::testing::AssertionResult LseMatches(const std::string& what, const std::vector<float>& actual,
                                      const std::vector<double>& expected) {
  for (size_t h = 0; h < expected.size(); ++h) {
    const bool ok = std::isinf(expected[h]) ? actual[h] == -INFINITY
                                            : std::fabs(actual[h] - expected[h]) <=
                                                  1e-5 + 1e-5 * std::fabs(expected[h]);
    if (!ok) {
      return ::testing::AssertionFailure()
             << what << ": lse of head " << h << " is " << actual[h] << ", want " << expected[h];
    }
  }
  return ::testing::AssertionSuccess();
}

// `count` distinct positions of [0, end), ascending.
std::vector<int> RandomPositions(int count, int end, std::mt19937_64& rng) {
  std::vector<int> all(end);
  std::iota(all.begin(), all.end(), 0);
  std::shuffle(all.begin(), all.end(), rng);
  std::vector<int> kept(all.begin(), all.begin() + count);
  std::sort(kept.begin(), kept.end());
  return kept;
}

// One working set for every KV head: compact positions per head and the recent segment.
struct Scenario {
  std::string name;
  std::vector<int> counts;  // [num_kv_heads] compact rows per head
  int recent_begin, recent_end;
};

// Gathers the scenario's compact positions, poisons every paged position outside the recent
// segment, runs each KV head (in reverse order: heads are independent) with exactly the
// advertised NaN-filled scratch, and checks output and lse against the reference. Also checks
// that the all-heads call without lse gives the same output.
void CheckScenario(const Shape& s, const Scenario& scenario, int capacity, float query_scale,
                   uint64_t seed) {
  const std::string what = Describe(s) + " " + scenario.name;
  PagedSequence sequence(s, seed);
  const std::vector<float> q =
      RandomVector(size_t(s.num_heads) * s.head_dim, seed + 10, query_scale);
  std::mt19937_64 rng(seed + 20);
  std::vector<std::vector<int>> compact_positions(s.num_kv_heads);
  std::vector<std::vector<int>> working_set(s.num_kv_heads);
  for (int h = 0; h < s.num_kv_heads; ++h) {
    compact_positions[h] = RandomPositions(scenario.counts[h], scenario.recent_begin, rng);
    working_set[h] = compact_positions[h];
    for (int p = scenario.recent_begin; p < scenario.recent_end; ++p) working_set[h].push_back(p);
  }
  const Reference ref = ReferenceAttention(s, q, sequence, working_set);

  CompactBuffer compact(s.num_kv_heads, capacity, s.head_dim);
  std::vector<int> counts(s.num_kv_heads, -1);
  const Status gathered =
      GatherCompactKv(sequence.View(), s.positions, compact_positions, compact.View(), counts);
  ASSERT_TRUE(gathered.ok()) << what << ": " << gathered.ToString();
  ASSERT_EQ(counts, scenario.counts) << what;
  sequence.PoisonOutside(scenario.recent_begin, scenario.recent_end);

  std::vector<float> output(size_t(s.num_heads) * s.head_dim, NAN);
  std::vector<float> lse(s.num_heads, NAN);
  TwoSegmentAttentionArgs args{q.data(),        output.data(),         lse.data(),
                               s.num_heads,     compact.View(),        counts.data(),
                               sequence.View(), scenario.recent_begin, scenario.recent_end};
  const Status valid = ValidateTwoSegmentAttention(args);
  ASSERT_TRUE(valid.ok()) << what << ": " << valid.ToString();
  std::vector<float> scratch(size_t(TwoSegmentAttentionScratchSize(args)), NAN);
  ASSERT_EQ(scratch.size(), size_t(capacity + scenario.recent_end - scenario.recent_begin));
  for (int h = s.num_kv_heads - 1; h >= 0; --h) {
    TwoSegmentAttentionForKvHead(args, h, scratch.data());
  }
  EXPECT_TRUE(WithinRowScale(what, output, ref.output, s.head_dim, 1e-5));
  EXPECT_TRUE(LseMatches(what, lse, ref.lse));

  std::vector<float> all_heads(output.size(), NAN);
  args.output = all_heads.data();
  args.lse = nullptr;
  const Status ran = TwoSegmentAttention(args, scratch);
  ASSERT_TRUE(ran.ok()) << what << ": " << ran.ToString();
  EXPECT_EQ(all_heads, output) << what << ": all-heads call without lse";
}

// (a), (d): head_dim 16 / 64 / 128, GQA groups 1 / 4 / 8, blocks of 16 / 64 tokens, three KV
// heads with different counts, every combination of empty and non-empty segments.
TEST(TwoSegmentAttention, MatchesDoubleReferenceOverTheWorkingSet) {
  const int kPositions = 150;  // not a multiple of either block size
  const int kCapacity = 40;
  uint64_t seed = 100;
  for (const int head_dim : {16, 64, 128}) {
    for (const int group : {1, 4, 8}) {
      for (const int block_tokens : {16, 64}) {
        const Shape s{3 * group, 3, head_dim, block_tokens, kPositions};
        const int recent_begin = kPositions - 37;
        const Scenario scenarios[] = {
            // A full head, a single row, a partial head; the recent segment crosses blocks.
            {"both segments", {kCapacity, 1, 17}, recent_begin, kPositions},
            {"empty recent", {kCapacity, 1, 17}, kPositions, kPositions},
            {"empty compact", {0, 0, 0}, recent_begin, kPositions},
            {"both empty", {0, 0, 0}, kPositions, kPositions},
            {"one head empty", {5, 0, kCapacity}, kPositions, kPositions},
            // A recent segment ending before the sequence does (positions after it poisoned).
            {"recent inside the sequence", {3, 20, 7}, 20, 90},
        };
        for (const Scenario& scenario : scenarios) {
          CheckScenario(s, scenario, kCapacity, 2.0f, seed++);
        }
      }
    }
  }
}

// Scores far beyond exp's fp32 range (|q.k * scale| ~ 100): the max must be subtracted.
TEST(TwoSegmentAttention, LargeScoresStayFinite) {
  const Shape s{8, 2, 64, 16, 100};
  CheckScenario(s, {"large scores", {12, 30}, 60, 100}, 32, 100.0f, 7);
}

// (b): the compact buffer holding every position [0, recent_begin) plus the recent segment
// [recent_begin, L) is dense decode of the query at L - 1, as RowsAttentionForKvHead computes it
// (docs/design.md §4: a budget covering the context equals dense). The contract is 1e-5; this CPU
// op also matches bit for bit, because it runs the rows path's loops over the same keys in the same
// order.
TEST(TwoSegmentAttention, EverythingGatheredIsDenseDecode) {
  const Shape shapes[] = {{8, 2, 64, 16, 300},
                          {32, 4, 128, 64, 517},
                          {4, 4, 16, 16, 1},
                          {24, 3, 16, 64, 129},
                          {8, 1, 128, 16, 64}};
  uint64_t seed = 500;
  for (const Shape& s : shapes) {
    PagedSequence sequence(s, seed++);
    const std::vector<float> q = RandomVector(size_t(s.num_heads) * s.head_dim, seed++, 2.0f);
    const int length = s.positions;

    std::vector<float> dense(q.size(), NAN);
    const CausalAttentionArgs dense_args{q.data(),    dense.data(),    1, length - 1,
                                         s.num_heads, sequence.View(), {}};
    std::vector<float> dense_scratch(size_t(RowsAttentionScratchSize(dense_args)));
    for (int h = 0; h < s.num_kv_heads; ++h) {
      RowsAttentionForKvHead(dense_args, h, dense_scratch.data());
    }
    std::vector<float> dense_lse(s.num_heads);
    DecodeAttentionStats({q.data(),
                          length,
                          s.num_heads,
                          float(1.0 / std::sqrt(double(s.head_dim))),
                          sequence.View(),
                          {}},
                         dense_lse.data(), nullptr);

    // Recent = everything, the usual split, the last position alone, a block boundary,
    // compact = everything.
    for (const int recent_begin : {0, length / 2, length - 1, std::min(length, 64), length}) {
      const std::string what = Describe(s) + " recent_begin " + std::to_string(recent_begin);
      std::vector<int> all(recent_begin);
      std::iota(all.begin(), all.end(), 0);
      const std::vector<std::vector<int>> positions(s.num_kv_heads, all);
      CompactBuffer compact(s.num_kv_heads, recent_begin + 3, s.head_dim);  // spare rows: NaN
      std::vector<int> counts(s.num_kv_heads);
      ASSERT_TRUE(GatherCompactKv(sequence.View(), length, positions, compact.View(), counts).ok());

      std::vector<float> output(q.size(), NAN);
      std::vector<float> lse(s.num_heads, NAN);
      const TwoSegmentAttentionArgs args{q.data(),        output.data(),  lse.data(),
                                         s.num_heads,     compact.View(), counts.data(),
                                         sequence.View(), recent_begin,   length};
      std::vector<float> scratch(size_t(TwoSegmentAttentionScratchSize(args)), NAN);
      const Status ran = TwoSegmentAttention(args, scratch);
      ASSERT_TRUE(ran.ok()) << what << ": " << ran.ToString();
      EXPECT_TRUE(AllClose(what + " vs dense decode", output, dense, 1e-5, 1e-5));
      EXPECT_EQ(output, dense) << what << ": not bit-identical to the rows path";
      EXPECT_TRUE(AllClose(what + " lse vs DecodeAttentionStats", lse, dense_lse, 1e-5, 1e-5));
    }
  }
}

// The n floats at a and b have the same bits (a gather is a copy, not arithmetic).
bool SameBits(const float* a, const float* b, int n) {
  for (int i = 0; i < n; ++i) {
    if (std::bit_cast<uint32_t>(a[i]) != std::bit_cast<uint32_t>(b[i])) return false;
  }
  return true;
}

// (c): row i of head h is, bit for bit, the K / V of positions[h][i]; rows past the count keep
// whatever they held; counts are the list sizes.
TEST(CompactGather, CopiesExactlyTheKeptRows) {
  const Shape s{6, 3, 24, 16, 70};
  PagedSequence sequence(s, 900);
  const int capacity = 10;
  const float kSentinel = -12345.0f;
  CompactBuffer compact(s.num_kv_heads, capacity, s.head_dim, kSentinel);
  // Runs inside a block, across a block boundary, the last position; an empty head; a full head.
  const std::vector<std::vector<int>> positions = {
      {0, 1, 2, 3, 15, 16, 17, 69}, {}, {5, 6, 7, 8, 9, 10, 11, 12, 13, 40}};
  std::vector<int> counts(s.num_kv_heads, -1);
  const Status status =
      GatherCompactKv(sequence.View(), s.positions, positions, compact.View(), counts);
  ASSERT_TRUE(status.ok()) << status.ToString();
  EXPECT_EQ(counts, (std::vector<int>{8, 0, 10}));
  const CompactKvView view = compact.View();
  for (int h = 0; h < s.num_kv_heads; ++h) {
    for (int row = 0; row < capacity; ++row) {
      const float* key = view.keys + view.Offset(h, row);
      const float* value = view.values + view.Offset(h, row);
      if (row < int(positions[h].size())) {
        const int p = positions[h][row];
        EXPECT_TRUE(SameBits(key, sequence.Key(p, h), s.head_dim))
            << "key of kv head " << h << " row " << row << " (position " << p << ")";
        EXPECT_TRUE(SameBits(value, sequence.Value(p, h), s.head_dim))
            << "value of kv head " << h << " row " << row << " (position " << p << ")";
      } else {
        EXPECT_TRUE(std::all_of(key, key + s.head_dim, [&](float x) { return x == kSentinel; }))
            << "kv head " << h << " row " << row << " past the count was written";
        EXPECT_TRUE(std::all_of(value, value + s.head_dim, [&](float x) { return x == kSentinel; }))
            << "kv head " << h << " row " << row << " past the count was written";
      }
    }
  }
}

// (c): each bad input is InvalidArgument with a message naming the problem, and nothing is
// written (head 0's valid positions included).
TEST(CompactGather, RejectsBadInputWithoutWriting) {
  const Shape s{4, 2, 8, 16, 40};
  PagedSequence sequence(s, 901);
  const int capacity = 4;
  struct Case {
    const char* name;
    std::function<void(PagedKvView&, int&, std::vector<std::vector<int>>&, CompactKvView&,
                       std::vector<int>&)>
        corrupt;
    const char* message;  // expected substring
  };
  const Case cases[] = {
      {"too many positions",
       [](auto&, int&, auto& p, auto&, auto&) {
         p[1] = {1, 2, 3, 4, 5};
       },
       "kv head 1 keeps 5 positions but the compact capacity is 4"},
      {"negative position",
       [](auto&, int&, auto& p, auto&, auto&) {
         p[1] = {-1, 3};
       },
       "kv head 1: position -1 (entry 0) is outside the sequence's [0, 40)"},
      {"position past the sequence",
       [](auto&, int&, auto& p, auto&, auto&) {
         p[1] = {3, 40};
       },
       "kv head 1: position 40 (entry 1) is outside the sequence's [0, 40)"},
      {"fewer tokens than a position", [](auto&, int& n, auto&, auto&, auto&) { n = 10; },
       "kv head 0: position 17 (entry 2) is outside the sequence's [0, 10)"},
      {"descending",
       [](auto&, int&, auto& p, auto&, auto&) {
         p[1] = {7, 3};
       },
       "kv head 1: position 3 (entry 1) does not follow 7"},
      {"repeated",
       [](auto&, int&, auto& p, auto&, auto&) {
         p[1] = {3, 3};
       },
       "position 3 (entry 1) does not follow 3"},
      {"negative num_tokens", [](auto&, int& n, auto&, auto&, auto&) { n = -1; },
       "num_tokens -1 < 0"},
      {"missing position list", [](auto&, int&, auto& p, auto&, auto&) { p.pop_back(); },
       "1 position lists and 2 counts for 2 KV heads"},
      {"missing count", [](auto&, int&, auto&, auto&, auto& c) { c.pop_back(); },
       "2 position lists and 1 counts for 2 KV heads"},
      {"head_dim mismatch", [](auto&, int&, auto&, auto& c, auto&) { c.head_dim = 4; },
       "compact buffer has 2 KV heads of head_dim 4 but the paged KV has 2 of 8"},
      {"kv head mismatch", [](auto&, int&, auto&, auto& c, auto&) { c.num_kv_heads = 1; },
       "compact buffer has 1 KV heads"},
      {"negative capacity", [](auto&, int&, auto&, auto& c, auto&) { c.capacity = -1; },
       "compact capacity -1 < 0"},
      {"null compact", [](auto&, int&, auto&, auto& c, auto&) { c.values = nullptr; },
       "compact keys or values is null"},
      {"null block table", [](auto& kv, int&, auto&, auto&, auto&) { kv.block_table = nullptr; },
       "block table is null"},
      {"zero block size", [](auto& kv, int&, auto&, auto&, auto&) { kv.block_tokens = 0; },
       "block_tokens 0) must be positive"},
  };
  for (const Case& c : cases) {
    CompactBuffer compact(s.num_kv_heads, capacity, s.head_dim, -1.0f);
    PagedKvView kv = sequence.View();
    int num_tokens = s.positions;
    std::vector<std::vector<int>> positions = {{0, 5, 17, 39}, {2, 30}};
    CompactKvView view = compact.View();
    std::vector<int> counts(s.num_kv_heads, -7);
    c.corrupt(kv, num_tokens, positions, view, counts);
    const std::vector<int> counts_before = counts;
    const Status status = GatherCompactKv(kv, num_tokens, positions, view, counts);
    EXPECT_EQ(status.code(), StatusCode::kInvalidArgument) << c.name << ": " << status.ToString();
    EXPECT_NE(status.message().find(c.message), std::string::npos)
        << c.name << ": message '" << status.message() << "' does not say '" << c.message << "'";
    EXPECT_EQ(counts, counts_before) << c.name << ": counts written";
    EXPECT_TRUE(
        std::all_of(compact.keys.begin(), compact.keys.end(), [](float x) { return x == -1.0f; }) &&
        std::all_of(compact.values.begin(), compact.values.end(),
                    [](float x) { return x == -1.0f; }))
        << c.name << ": compact buffer written";
  }
}

// Each bad argument is InvalidArgument naming it; the all-heads call also checks the scratch.
TEST(TwoSegmentAttention, ValidationRejectsBadArguments) {
  const Shape s{8, 2, 16, 16, 50};
  PagedSequence sequence(s, 902);
  CompactBuffer compact(s.num_kv_heads, 6, s.head_dim, 0.0f);
  const std::vector<float> q(size_t(s.num_heads) * s.head_dim, 1.0f);
  std::vector<float> output(q.size());
  const std::vector<int> good_counts = {6, 2};
  const std::vector<int> too_many = {7, 2};
  const std::vector<int> negative = {1, -1};
  const TwoSegmentAttentionArgs good{
      q.data(),           output.data(),   nullptr, s.num_heads, compact.View(),
      good_counts.data(), sequence.View(), 30,      50};
  ASSERT_TRUE(ValidateTwoSegmentAttention(good).ok());
  struct Case {
    const char* name;
    std::function<void(TwoSegmentAttentionArgs&)> corrupt;
    const char* message;
  };
  const Case cases[] = {
      {"heads not a multiple", [](auto& a) { a.num_heads = 7; },
       "num_heads 7 is not a positive multiple of num_kv_heads 2"},
      {"no heads", [](auto& a) { a.num_heads = 0; }, "num_heads 0"},
      {"count above capacity", [&](auto& a) { a.compact_counts = too_many.data(); },
       "compact_counts[0] = 7 is outside [0, capacity 6]"},
      {"negative count", [&](auto& a) { a.compact_counts = negative.data(); },
       "compact_counts[1] = -1 is outside [0, capacity 6]"},
      {"null counts", [](auto& a) { a.compact_counts = nullptr; }, "compact_counts is null"},
      {"reversed recent",
       [](auto& a) {
         a.recent_begin = 40;
         a.recent_end = 39;
       },
       "recent segment [40, 39) is not a range"},
      {"negative recent", [](auto& a) { a.recent_begin = -1; }, "recent segment [-1, 50)"},
      {"head_dim mismatch", [](auto& a) { a.compact.head_dim = 32; },
       "compact buffer has 2 KV heads of head_dim 32 but the paged KV has 2 of 16"},
      {"kv head mismatch", [](auto& a) { a.compact.num_kv_heads = 4; },
       "compact buffer has 4 KV heads"},
      {"null query", [](auto& a) { a.query = nullptr; }, "query or output is null"},
      {"null output", [](auto& a) { a.output = nullptr; }, "query or output is null"},
      {"null compact keys", [](auto& a) { a.compact.keys = nullptr; },
       "compact keys or values is null"},
      {"null paged values", [](auto& a) { a.kv.values = nullptr; },
       "paged KV keys, values or block table is null"},
      {"zero head_dim", [](auto& a) { a.kv.head_dim = 0; }, "head_dim 0"},
      {"scratch overflow", [](auto& a) { a.compact.capacity = 2147483640; }, "exceeds INT_MAX"},
  };
  std::vector<float> scratch(size_t(TwoSegmentAttentionScratchSize(good)));
  for (const Case& c : cases) {
    TwoSegmentAttentionArgs args = good;
    c.corrupt(args);
    for (const Status& status :
         {ValidateTwoSegmentAttention(args), TwoSegmentAttention(args, scratch)}) {
      EXPECT_EQ(status.code(), StatusCode::kInvalidArgument) << c.name << ": " << status.ToString();
      EXPECT_NE(status.message().find(c.message), std::string::npos)
          << c.name << ": message '" << status.message() << "' does not say '" << c.message << "'";
    }
  }
  scratch.pop_back();
  const Status short_scratch = TwoSegmentAttention(good, scratch);
  EXPECT_EQ(short_scratch.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(short_scratch.message().find("scratch holds 25 floats, 26 needed"), std::string::npos)
      << short_scratch.message();
}

// Segments with no rows need no memory: a null compact buffer with every count 0, or a null
// paged cache with an empty recent segment, is valid and never dereferenced.
TEST(TwoSegmentAttention, EmptySegmentsNeedNoBuffers) {
  const Shape s{4, 2, 16, 16, 20};
  PagedSequence sequence(s, 903);
  const std::vector<float> q = RandomVector(size_t(s.num_heads) * s.head_dim, 904, 1.0f);
  const std::vector<int> zero_counts = {0, 0};
  const CompactKvView null_compact{nullptr, nullptr, s.num_kv_heads, 8, s.head_dim};
  std::vector<float> output(q.size(), NAN);
  std::vector<float> lse(s.num_heads, NAN);
  TwoSegmentAttentionArgs args{
      q.data(),           output.data(),   lse.data(), s.num_heads, null_compact,
      zero_counts.data(), sequence.View(), 4,          20};
  std::vector<float> scratch(size_t(TwoSegmentAttentionScratchSize(args)), NAN);
  Status status = TwoSegmentAttention(args, scratch);
  ASSERT_TRUE(status.ok()) << status.ToString();
  EXPECT_TRUE(std::all_of(output.begin(), output.end(), [](float x) { return std::isfinite(x); }));

  // Nothing at all: zeros and -inf, never NaN.
  args.kv = PagedKvView{nullptr, nullptr, nullptr, 16, s.num_kv_heads, s.head_dim};
  args.recent_begin = args.recent_end = 20;
  status = TwoSegmentAttention(args, scratch);
  ASSERT_TRUE(status.ok()) << status.ToString();
  EXPECT_EQ(output, std::vector<float>(output.size(), 0.0f));
  EXPECT_EQ(lse, std::vector<float>(lse.size(), -INFINITY));
}

}  // namespace
}  // namespace rubato
