// MergeAttention (kernels/cpu/attention_merge.h) against a double-precision transcription of the
// contract written here: random partials of odd sizes, one side empty (its o NaN, which must not
// leak), both empty, equal sides, lse gaps from 0 to far past f32 exp's range, strided rows,
// merging in place, and the input checks.
#include "kernels/cpu/attention_merge.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "kernels/cpu/all_close_for_test.h"

namespace rubato {
namespace {

constexpr float kInf = std::numeric_limits<float>::infinity();
constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();

// One merge's inputs: rows x heads of o (row stride `stride`) and lse per side.
struct Partials {
  int rows = 0, heads = 0, dim = 0;
  int64_t stride = 0;
  std::vector<float> o_a, o_b, lse_a, lse_b;
};

// The contract in double: the weights e^lse (relative to the larger one), empty sides skipped.
void Reference(const Partials& p, std::vector<double>& out, std::vector<double>& lse) {
  out.assign(static_cast<size_t>(p.rows) * p.stride, 0.0);
  lse.assign(static_cast<size_t>(p.rows) * p.heads, 0.0);
  for (int r = 0; r < p.rows; ++r) {
    for (int h = 0; h < p.heads; ++h) {
      const size_t stat = static_cast<size_t>(r) * p.heads + h;
      const double la = p.lse_a[stat], lb = p.lse_b[stat];
      const double m = std::max(la, lb);
      if (m == -INFINITY) {
        lse[stat] = -INFINITY;
        continue;  // out stays 0
      }
      const double wa = la == -INFINITY ? 0.0 : std::exp(la - m);
      const double wb = lb == -INFINITY ? 0.0 : std::exp(lb - m);
      lse[stat] = m + std::log(wa + wb);
      for (int d = 0; d < p.dim; ++d) {
        const size_t i = static_cast<size_t>(r) * p.stride + static_cast<size_t>(h) * p.dim + d;
        double value = 0.0;
        if (wa != 0.0) value += wa * p.o_a[i];
        if (wb != 0.0) value += wb * p.o_b[i];
        out[i] = value / (wa + wb);
      }
    }
  }
}

// lse_b = lse_a + gap (gap in [-max_gap, max_gap]); `empty` sides get -inf and an o of NaN.
Partials RandomPartials(std::mt19937_64& rng, int rows, int heads, int dim, int64_t pad,
                        double max_gap, bool a_empty, bool b_empty) {
  Partials p{rows, heads, dim, static_cast<int64_t>(heads) * dim + pad, {}, {}, {}, {}};
  std::uniform_real_distribution<float> value(-2.f, 2.f), base(-30.f, 30.f),
      gap(static_cast<float>(-max_gap), static_cast<float>(max_gap));
  const size_t elements = static_cast<size_t>(rows) * p.stride;
  for (size_t i = 0; i < elements; ++i) {
    p.o_a.push_back(a_empty ? kNaN : value(rng));
    p.o_b.push_back(b_empty ? kNaN : value(rng));
  }
  for (int i = 0; i < rows * heads; ++i) {
    const float lse = base(rng);
    p.lse_a.push_back(a_empty ? -kInf : lse);
    p.lse_b.push_back(b_empty ? -kInf : lse + gap(rng));
  }
  return p;
}

AttentionMergeArgs ArgsOf(const Partials& p, std::vector<float>& out, std::vector<float>& lse) {
  out.assign(static_cast<size_t>(p.rows) * p.stride, kNaN);
  lse.assign(static_cast<size_t>(p.rows) * p.heads, kNaN);
  return {p.o_a.data(), p.stride, p.lse_a.data(), p.o_b.data(), p.stride, p.lse_b.data(),
          p.rows,       p.heads,  p.dim,          out.data(),   p.stride, lse.data()};
}

// Every written element against the reference; the padding between rows stays untouched.
void ExpectMatches(const Partials& p, const std::vector<float>& out, const std::vector<float>& lse,
                   const std::string& what) {
  std::vector<double> want_out, want_lse;
  Reference(p, want_out, want_lse);
  std::vector<float> got;
  std::vector<double> want;
  for (int r = 0; r < p.rows; ++r) {
    for (int64_t c = 0; c < p.stride; ++c) {
      const size_t i = static_cast<size_t>(r * p.stride + c);
      if (c < static_cast<int64_t>(p.heads) * p.dim) {
        got.push_back(out[i]);
        want.push_back(want_out[i]);
      } else {
        ASSERT_TRUE(std::isnan(out[i])) << what << ": padding written at " << i;
      }
    }
  }
  EXPECT_TRUE(AllClose<double>(what + " o", got, want, 1e-6, 1e-5));
  for (size_t i = 0; i < lse.size(); ++i) {
    if (want_lse[i] == -INFINITY) {
      EXPECT_EQ(lse[i], -kInf) << what << " lse " << i;
    } else {
      EXPECT_NEAR(lse[i], want_lse[i], 1e-5 * std::fabs(want_lse[i]) + 1e-6) << what << " " << i;
    }
  }
}

TEST(AttentionMergeTest, MatchesDoubleReference) {
  std::mt19937_64 rng(20240531);
  for (int rows : {1, 3, 17}) {
    for (int heads : {1, 5, 32}) {
      for (int dim : {1, 7, 64, 128}) {
        for (double gap : {0.0, 2.0, 40.0, 200.0}) {  // 200: e^-200 underflows f32
          const Partials p =
              RandomPartials(rng, rows, heads, dim, rows % 2 ? 3 : 0, gap, false, false);
          std::vector<float> out, lse;
          ASSERT_TRUE(MergeAttention(ArgsOf(p, out, lse)).ok());
          ExpectMatches(p, out, lse,
                        "rows " + std::to_string(rows) + " heads " + std::to_string(heads) +
                            " dim " + std::to_string(dim) + " gap " + std::to_string(gap));
        }
      }
    }
  }
}

TEST(AttentionMergeTest, EmptySideGivesTheOtherExactly) {
  std::mt19937_64 rng(7);
  for (bool a_empty : {true, false}) {
    const Partials p = RandomPartials(rng, 5, 3, 9, 1, 5.0, a_empty, !a_empty);
    std::vector<float> out, lse;
    ASSERT_TRUE(MergeAttention(ArgsOf(p, out, lse)).ok());
    ExpectMatches(p, out, lse, a_empty ? "a empty" : "b empty");
    const std::vector<float>& kept = a_empty ? p.o_b : p.o_a;
    const std::vector<float>& kept_lse = a_empty ? p.lse_b : p.lse_a;
    for (int r = 0; r < p.rows; ++r) {
      for (int c = 0; c < p.heads * p.dim; ++c) {
        const size_t i = static_cast<size_t>(r * p.stride + c);
        EXPECT_EQ(out[i], kept[i]) << i;  // weight 1 exactly: a copy
      }
    }
    EXPECT_EQ(lse, kept_lse);
  }
}

TEST(AttentionMergeTest, BothEmptyGiveZeroAndMinusInfinity) {
  std::mt19937_64 rng(8);
  const Partials p = RandomPartials(rng, 3, 2, 5, 0, 0.0, true, true);
  std::vector<float> out, lse;
  ASSERT_TRUE(MergeAttention(ArgsOf(p, out, lse)).ok());
  for (float v : out) EXPECT_EQ(v, 0.f);
  for (float v : lse) EXPECT_EQ(v, -kInf);
}

TEST(AttentionMergeTest, EqualSidesKeepTheOutputAndAddLog2) {
  std::mt19937_64 rng(9);
  Partials p = RandomPartials(rng, 4, 3, 11, 0, 0.0, false, false);
  p.o_b = p.o_a;
  p.lse_b = p.lse_a;
  std::vector<float> out, lse;
  ASSERT_TRUE(MergeAttention(ArgsOf(p, out, lse)).ok());
  for (size_t i = 0; i < out.size(); ++i) EXPECT_NEAR(out[i], p.o_a[i], 1e-6f) << i;
  for (size_t i = 0; i < lse.size(); ++i) {
    EXPECT_NEAR(lse[i], p.lse_a[i] + std::log(2.0), 1e-5) << i;
  }
}

TEST(AttentionMergeTest, MergesInPlace) {
  std::mt19937_64 rng(10);
  const Partials p = RandomPartials(rng, 6, 4, 13, 2, 3.0, false, false);
  std::vector<float> want_out, want_lse;
  ASSERT_TRUE(MergeAttention(ArgsOf(p, want_out, want_lse)).ok());
  std::vector<float> o_a = p.o_a, lse(want_lse.size());
  AttentionMergeArgs args{o_a.data(), p.stride,       p.lse_a.data(), p.o_b.data(),
                          p.stride,   p.lse_b.data(), p.rows,         p.heads,
                          p.dim,      o_a.data(),     p.stride,       lse.data()};
  ASSERT_TRUE(MergeAttention(args).ok());
  for (int r = 0; r < p.rows; ++r) {
    for (int c = 0; c < p.heads * p.dim; ++c) {
      const size_t i = static_cast<size_t>(r * p.stride + c);
      EXPECT_EQ(o_a[i], want_out[i]) << i;
    }
  }
  EXPECT_EQ(lse, want_lse);
}

TEST(AttentionMergeTest, RejectsBadArguments) {
  std::vector<float> o(64, 0.f), lse(8, 0.f), out(64), lse_out(8);
  const AttentionMergeArgs good{o.data(), 16, lse.data(), o.data(),   16, lse.data(),
                                2,        4,  4,          out.data(), 16, lse_out.data()};
  ASSERT_TRUE(MergeAttention(good).ok());
  const auto expect_invalid = [](const AttentionMergeArgs& args, const std::string& field) {
    const Status s = MergeAttention(args);
    EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s.message();
    EXPECT_NE(s.message().find(field), std::string::npos) << s.message();
  };
  AttentionMergeArgs a = good;
  a.rows = -1;
  expect_invalid(a, "rows");
  a = good;
  a.num_heads = 0;
  expect_invalid(a, "num_heads");
  a = good;
  a.head_dim = 0;
  expect_invalid(a, "head_dim");
  a = good;
  a.o_a = nullptr;
  expect_invalid(a, "o_a");
  a = good;
  a.lse_b = nullptr;
  expect_invalid(a, "lse_b");
  a = good;
  a.out = nullptr;
  expect_invalid(a, "out");
  a = good;
  a.o_b_row_stride = 15;
  expect_invalid(a, "o_b_row_stride");
  a = good;
  a.out_row_stride = 3;
  expect_invalid(a, "out_row_stride");
  a = good;
  a.lse_out = lse.data();
  expect_invalid(a, "lse_out");
  a = good;
  a.rows = 0;
  a.o_a = nullptr;  // nothing to do
  EXPECT_TRUE(MergeAttention(a).ok());
}

}  // namespace
}  // namespace rubato
