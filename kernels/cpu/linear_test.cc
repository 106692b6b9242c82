// Tests for the sgemm-backed linear layer against a double-precision loop.
#include "kernels/cpu/linear.h"

#include <gtest/gtest.h>

#include <random>
#include <string>
#include <vector>

#include "kernels/cpu/all_close_for_test.h"

namespace rubato {
namespace {

std::vector<float> RandomVector(size_t n, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<float> uniform(-1.0f, 1.0f);
  std::vector<float> v(n);
  for (float& x : v) x = uniform(rng);
  return v;
}

TEST(Linear, MatchesDoubleReferenceWithAndWithoutBias) {
  struct Case {
    int rows, in, out;
  };
  for (const Case& c :
       {Case{1, 1, 1}, Case{1, 67, 33}, Case{5, 64, 96}, Case{37, 129, 17}, Case{3, 255, 511}}) {
    const std::vector<float> x = RandomVector(size_t(c.rows) * c.in, c.in);
    const std::vector<float> w = RandomVector(size_t(c.out) * c.in, c.out);
    const std::vector<float> b = RandomVector(c.out, 99);
    for (bool with_bias : {false, true}) {
      std::vector<float> y(size_t(c.rows) * c.out, 123.0f);  // garbage must be overwritten
      Linear(x.data(), w.data(), with_bias ? b.data() : nullptr, c.rows, c.in, c.out, y.data());
      std::vector<double> expected(y.size());
      for (int r = 0; r < c.rows; ++r) {
        for (int o = 0; o < c.out; ++o) {
          double acc = with_bias ? b[o] : 0.0;
          for (int i = 0; i < c.in; ++i) acc += double(x[r * c.in + i]) * w[o * c.in + i];
          expected[size_t(r) * c.out + o] = acc;
        }
      }
      // fp32 accumulation of `in` products of magnitude <= 1: allow 1e-7 per term.
      EXPECT_TRUE(AllClose("linear " + std::to_string(c.rows) + "x" + std::to_string(c.in) + "->" +
                               std::to_string(c.out) + (with_bias ? " +bias" : ""),
                           y, expected, 1e-7 * c.in, 1e-6));
    }
  }
}

TEST(Linear, ZeroRowsIsANoOp) {
  const std::vector<float> w = RandomVector(6, 1);
  float sentinel = 7.0f;
  Linear(nullptr, w.data(), nullptr, 0, 3, 2, &sentinel);
  EXPECT_EQ(sentinel, 7.0f);
}

}  // namespace
}  // namespace rubato
