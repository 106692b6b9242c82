// Test helper: every element of `actual` within atol + rtol * |expected|, printing the largest
// error (docs/design.md §10 "Every element": never "most elements").
#pragma once

#include <gtest/gtest.h>

#include <cmath>
#include <cstddef>
#include <iostream>
#include <span>
#include <sstream>
#include <string>
#include <vector>

namespace rubato {

template <typename Expected>
::testing::AssertionResult AllClose(const std::string& what, std::span<const float> actual,
                                    std::span<const Expected> expected, double atol, double rtol) {
  if (actual.size() != expected.size()) {
    return ::testing::AssertionFailure()
           << what << ": " << actual.size() << " values, expected " << expected.size();
  }
  double max_error = 0.0;
  size_t max_error_at = 0;
  size_t failures = 0;
  size_t first_failure = 0;
  for (size_t i = 0; i < actual.size(); ++i) {
    const double ref = static_cast<double>(expected[i]);
    const double error = std::fabs(static_cast<double>(actual[i]) - ref);
    if (!(error <= atol + rtol * std::fabs(ref))) {  // NaN fails too
      if (failures++ == 0) first_failure = i;
    }
    if (error > max_error) {
      max_error = error;
      max_error_at = i;
    }
  }
  std::cout << "[ max error ] " << what << ": " << max_error << " over " << actual.size()
            << " elements\n";
  if (failures == 0) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure()
         << what << ": " << failures << " of " << actual.size() << " elements outside atol " << atol
         << " + rtol " << rtol << " * |ref|; first at " << first_failure << " (got "
         << actual[first_failure] << ", want " << static_cast<double>(expected[first_failure])
         << "), max |error| " << max_error << " at " << max_error_at;
}

template <typename Expected>
::testing::AssertionResult AllClose(const std::string& what, const std::vector<float>& actual,
                                    const std::vector<Expected>& expected, double atol,
                                    double rtol) {
  return AllClose<Expected>(what, std::span<const float>(actual),
                            std::span<const Expected>(expected), atol, rtol);
}

}  // namespace rubato
