// Paged KV append from head-major rows on the GPU: new tokens whose K and V arrive as
// [kv_head][new_tokens][head_dim] blocks (a layer pack's K / V sections, transport/layer_pack.h)
// are copied into their slots of one layer's paged pools. Each new row carries its own source
// offsets, so one launch covers every request of a pack, whatever its new_tokens. The GPU cache
// rank's append (cache_rank/device/device_kv_store.h). CPU twin: the host store's append,
// KvStore::AppendKvPack (cache_rank/kv_store.h); both are copies, equal bit for bit.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <cstdint>

#include "common/status.h"

namespace rubato::cuda {

struct HeadMajorKvAppendParams {
  const __nv_bfloat16* source = nullptr;  // base of the rows below, 16-byte aligned
  // [rows], device: element offsets from `source` of new row t's K and V at KV head 0; KV head
  // h's row is head_strides[t] elements further (a request's new_tokens * head_dim). Multiples
  // of 8 (16-byte rows).
  const int64_t* key_offsets = nullptr;
  const int64_t* value_offsets = nullptr;
  const int32_t* head_strides = nullptr;  // [rows], device
  // [rows], device: slot of row t, physical_block * block_tokens + row in block; negative skips.
  const int32_t* slots = nullptr;
  int rows = 0;                         // >= 0; 0 is a no-op
  int num_kv_heads = 0;                 // >= 1
  int head_dim = 0;                     // a positive multiple of 8
  int block_tokens = 0;                 // >= 1
  __nv_bfloat16* key_pool = nullptr;    // [blocks][num_kv_heads][block_tokens][head_dim], bf16
  __nv_bfloat16* value_pool = nullptr;  // [blocks][num_kv_heads][block_tokens][head_dim], bf16
};

// Offsets and slots live on the device and are not checked here. InvalidArgument naming the
// field for a null pointer, a bad size or a misaligned buffer (nothing launched). Never
// synchronizes.
Status AppendHeadMajorKv(const HeadMajorKvAppendParams& params, cudaStream_t stream);

}  // namespace rubato::cuda
