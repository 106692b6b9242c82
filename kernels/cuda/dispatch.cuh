// Runtime shape values -> compile-time constants (docs/design.md §10 "Shapes become constants").
// Every CUDA op instantiates its kernels only for the values listed here; anything else is an
// Unsupported status naming the value, returned by the launcher.
//
//   RUBATO_DISPATCH_HEAD_DIM(params.head_dim, kHeadDim, {
//     RUBATO_DISPATCH_GQA_GROUP(group, kGroup, { return Launch<kHeadDim, kGroup>(params, s); });
//   });
//
// The bounded set: head_dim 16, 32, 64, 128 (16 and 32 for the tiny test checkpoints, 64 and 128
// for real models); GQA group size (query heads per KV head) 1, 2, 4, 8.
#pragma once

#include <string>

#include "common/status.h"

#define RUBATO_DISPATCH_CASE_(value, NAME, ...) \
  case value: {                                 \
    constexpr int NAME = value;                 \
    __VA_ARGS__                                 \
  }

#define RUBATO_DISPATCH_HEAD_DIM(head_dim, NAME, ...)                                      \
  switch (head_dim) {                                                                      \
    RUBATO_DISPATCH_CASE_(16, NAME, __VA_ARGS__)                                           \
    RUBATO_DISPATCH_CASE_(32, NAME, __VA_ARGS__)                                           \
    RUBATO_DISPATCH_CASE_(64, NAME, __VA_ARGS__)                                           \
    RUBATO_DISPATCH_CASE_(128, NAME, __VA_ARGS__)                                          \
    default:                                                                               \
      return ::rubato::UnsupportedError("CUDA: head_dim " + std::to_string(head_dim) +     \
                                        " is not supported (supported: 16, 32, 64, 128)"); \
  }

#define RUBATO_DISPATCH_GQA_GROUP(group, NAME, ...)                                  \
  switch (group) {                                                                   \
    RUBATO_DISPATCH_CASE_(1, NAME, __VA_ARGS__)                                      \
    RUBATO_DISPATCH_CASE_(2, NAME, __VA_ARGS__)                                      \
    RUBATO_DISPATCH_CASE_(4, NAME, __VA_ARGS__)                                      \
    RUBATO_DISPATCH_CASE_(8, NAME, __VA_ARGS__)                                      \
    default:                                                                         \
      return ::rubato::UnsupportedError("CUDA: " + std::to_string(group) +           \
                                        " query heads per KV head is not supported " \
                                        "(supported: 1, 2, 4, 8)");                  \
  }
