// The split-K merge of two partial attention results (attention_merge.h), f32.
#include "kernels/cpu/attention_merge.h"

#include <algorithm>
#include <cmath>
#include <string>

namespace rubato {
namespace {

Status Validate(const AttentionMergeArgs& a) {
  const std::string op = "MergeAttention: ";
  if (a.rows < 0) return InvalidArgumentError(op + "rows " + std::to_string(a.rows) + " < 0");
  if (a.rows == 0) return Status::Ok();
  if (a.num_heads < 1) {
    return InvalidArgumentError(op + "num_heads " + std::to_string(a.num_heads) + " < 1");
  }
  if (a.head_dim < 1) {
    return InvalidArgumentError(op + "head_dim " + std::to_string(a.head_dim) + " < 1");
  }
  if (a.o_a == nullptr) return InvalidArgumentError(op + "o_a is null");
  if (a.lse_a == nullptr) return InvalidArgumentError(op + "lse_a is null");
  if (a.o_b == nullptr) return InvalidArgumentError(op + "o_b is null");
  if (a.lse_b == nullptr) return InvalidArgumentError(op + "lse_b is null");
  if (a.out == nullptr) return InvalidArgumentError(op + "out is null");
  if (a.lse_out != nullptr && (a.lse_out == a.lse_a || a.lse_out == a.lse_b)) {
    return InvalidArgumentError(op + "lse_out must not be lse_a or lse_b (a separate buffer)");
  }
  const int64_t row = static_cast<int64_t>(a.num_heads) * a.head_dim;
  const auto short_stride = [&](const char* field, int64_t stride) {
    return InvalidArgumentError(op + field + " " + std::to_string(stride) +
                                " < num_heads * head_dim " + std::to_string(row));
  };
  if (a.o_a_row_stride < row) return short_stride("o_a_row_stride", a.o_a_row_stride);
  if (a.o_b_row_stride < row) return short_stride("o_b_row_stride", a.o_b_row_stride);
  if (a.out_row_stride < row) return short_stride("out_row_stride", a.out_row_stride);
  return Status::Ok();
}

}  // namespace

Status MergeAttention(const AttentionMergeArgs& args) {
  RUBATO_RETURN_IF_ERROR(Validate(args));
  for (int r = 0; r < args.rows; ++r) {
    for (int h = 0; h < args.num_heads; ++h) {
      const size_t stat = static_cast<size_t>(r) * args.num_heads + h;
      const float lse_a = args.lse_a[stat];
      const float lse_b = args.lse_b[stat];
      const int64_t column = static_cast<int64_t>(h) * args.head_dim;
      const float* o_a = args.o_a + r * args.o_a_row_stride + column;
      const float* o_b = args.o_b + r * args.o_b_row_stride + column;
      float* out = args.out + r * args.out_row_stride + column;
      const float max_lse = std::max(lse_a, lse_b);
      if (max_lse == -INFINITY) {  // both sides empty
        std::fill(out, out + args.head_dim, 0.f);
        if (args.lse_out != nullptr) args.lse_out[stat] = -INFINITY;
        continue;
      }
      // An empty side weighs exactly 0 and its o is never multiplied (0 x NaN is NaN).
      const float weight_a = lse_a == -INFINITY ? 0.f : std::exp(lse_a - max_lse);
      const float weight_b = lse_b == -INFINITY ? 0.f : std::exp(lse_b - max_lse);
      const float total = weight_a + weight_b;  // in [1, 2]
      const float scale_a = weight_a / total;
      const float scale_b = weight_b / total;
      for (int d = 0; d < args.head_dim; ++d) {
        float value = 0.f;
        if (weight_a != 0.f) value += scale_a * o_a[d];
        if (weight_b != 0.f) value += scale_b * o_b[d];
        out[d] = value;
      }
      if (args.lse_out != nullptr) args.lse_out[stat] = max_lse + std::log(total);
    }
  }
  return Status::Ok();
}

}  // namespace rubato
