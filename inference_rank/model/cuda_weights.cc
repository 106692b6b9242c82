// The CUDA model's device weights: allocation, fusion layout and the three sources
// (cuda_weights.h).
#include "inference_rank/model/cuda_weights.h"

#include <algorithm>
#include <cmath>
#include <map>
#include <new>

#include "common/dtype.h"
#include "kernels/cuda/cuda_status.h"
#include "kernels/cuda/random_fill.cuh"

namespace rubato {
namespace {

using Bf16Buffer = cuda::DeviceBuffer<__nv_bfloat16>;

// Where one listed tensor lives on the device: `count` bf16 values at `data` (a whole buffer, or
// the rows of a fused one).
struct Destination {
  __nv_bfloat16* data = nullptr;
  size_t count = 0;
};

// One listed tensor and its destination.
struct Placement {
  WeightSlot slot;
  Destination destination;
};

// Host-side chunk for f16 / f32 -> bf16 conversion: bounds host memory for large tensors.
constexpr size_t kConvertChunk = size_t{1} << 22;

Status CheckFreeMemory(const ModelConfig& config) {
  size_t free_bytes = 0, total_bytes = 0;
  RUBATO_CUDA_RETURN_IF_ERROR(cudaMemGetInfo(&free_bytes, &total_bytes),
                              "querying free device memory");
  const size_t needed = CudaWeightBytes(config);
  if (needed > free_bytes) {
    return ResourceExhaustedError("CUDA model: the bf16 weights of " + config.architecture +
                                  " need " + std::to_string(needed) + " bytes but the device has " +
                                  std::to_string(free_bytes) + " of " +
                                  std::to_string(total_bytes) + " bytes free");
  }
  return Status::Ok();
}

Result<Bf16Buffer> Allocate(size_t count, const std::string& what) {
  return Bf16Buffer::Allocate(count, "weights: " + what);
}

// Allocates every buffer of `config` and places each ListWeights tensor in it, in list order.
// The tensors are matched to buffers through the storage pointers ListWeights hands out for a
// shadow ModelWeights (never filled), so the list stays the one source of names and shapes.
Result<std::vector<Placement>> AllocateAndPlace(const ModelConfig& config, CudaWeights& weights) {
  RUBATO_RETURN_IF_ERROR(CheckFreeMemory(config));
  const size_t hidden = static_cast<size_t>(config.hidden_size);
  const size_t q_dim = static_cast<size_t>(config.q_dim());
  const size_t kv_dim = static_cast<size_t>(config.kv_dim());
  const size_t qkv_dim = q_dim + 2 * kv_dim;
  const size_t head_dim = static_cast<size_t>(config.head_dim);
  const size_t intermediate = static_cast<size_t>(config.intermediate_size);
  const size_t vocab = static_cast<size_t>(config.vocab_size);

  ModelWeights shadow;
  const std::vector<WeightSlot> slots = ListWeights(config, &shadow);
  std::map<const std::vector<float>*, Destination> where;

  RUBATO_ASSIGN_OR_RETURN(weights.embed_tokens, Allocate(vocab * hidden, "embed_tokens"));
  where[&shadow.embed_tokens] = {weights.embed_tokens.data(), vocab * hidden};
  weights.layers.resize(static_cast<size_t>(config.num_layers));
  for (size_t l = 0; l < weights.layers.size(); ++l) {
    CudaLayerWeights& w = weights.layers[l];
    LayerWeights& s = shadow.layers[l];
    const std::string layer = "layer " + std::to_string(l) + " ";
    RUBATO_ASSIGN_OR_RETURN(w.input_norm, Allocate(hidden, layer + "input_layernorm"));
    RUBATO_ASSIGN_OR_RETURN(w.qkv, Allocate(qkv_dim * hidden, layer + "fused q|k|v projection"));
    where[&s.input_norm] = {w.input_norm.data(), hidden};
    where[&s.q_proj] = {w.qkv.data(), q_dim * hidden};
    where[&s.k_proj] = {w.qkv.data() + q_dim * hidden, kv_dim * hidden};
    where[&s.v_proj] = {w.qkv.data() + (q_dim + kv_dim) * hidden, kv_dim * hidden};
    if (config.qkv_bias) {
      RUBATO_ASSIGN_OR_RETURN(w.qkv_bias, Allocate(qkv_dim, layer + "fused q|k|v bias"));
      where[&s.q_bias] = {w.qkv_bias.data(), q_dim};
      where[&s.k_bias] = {w.qkv_bias.data() + q_dim, kv_dim};
      where[&s.v_bias] = {w.qkv_bias.data() + q_dim + kv_dim, kv_dim};
    }
    if (config.qk_norm) {
      RUBATO_ASSIGN_OR_RETURN(w.q_norm, Allocate(head_dim, layer + "q_norm"));
      RUBATO_ASSIGN_OR_RETURN(w.k_norm, Allocate(head_dim, layer + "k_norm"));
      where[&s.q_norm] = {w.q_norm.data(), head_dim};
      where[&s.k_norm] = {w.k_norm.data(), head_dim};
    }
    RUBATO_ASSIGN_OR_RETURN(w.o_proj, Allocate(hidden * q_dim, layer + "o_proj"));
    where[&s.o_proj] = {w.o_proj.data(), hidden * q_dim};
    if (config.o_proj_bias) {
      RUBATO_ASSIGN_OR_RETURN(w.o_bias, Allocate(hidden, layer + "o_proj bias"));
      where[&s.o_bias] = {w.o_bias.data(), hidden};
    }
    RUBATO_ASSIGN_OR_RETURN(w.post_attention_norm,
                            Allocate(hidden, layer + "post_attention_layernorm"));
    RUBATO_ASSIGN_OR_RETURN(
        w.gate_up, Allocate(2 * intermediate * hidden, layer + "fused gate|up projection"));
    RUBATO_ASSIGN_OR_RETURN(w.down, Allocate(hidden * intermediate, layer + "down_proj"));
    where[&s.post_attention_norm] = {w.post_attention_norm.data(), hidden};
    where[&s.gate_proj] = {w.gate_up.data(), intermediate * hidden};
    where[&s.up_proj] = {w.gate_up.data() + intermediate * hidden, intermediate * hidden};
    where[&s.down_proj] = {w.down.data(), hidden * intermediate};
  }
  RUBATO_ASSIGN_OR_RETURN(weights.final_norm, Allocate(hidden, "model.norm"));
  where[&shadow.final_norm] = {weights.final_norm.data(), hidden};
  if (!config.tie_word_embeddings) {
    RUBATO_ASSIGN_OR_RETURN(weights.lm_head, Allocate(vocab * hidden, "lm_head"));
    where[&shadow.lm_head] = {weights.lm_head.data(), vocab * hidden};
  }

  std::vector<Placement> placements;
  placements.reserve(slots.size());
  for (const WeightSlot& slot : slots) {
    const auto it = where.find(slot.storage);
    if (it == where.end()) {
      return InternalError("CUDA weights: no device buffer for tensor '" + slot.name + "'");
    }
    if (it->second.count != static_cast<size_t>(slot.shape.numel())) {
      return InternalError("CUDA weights: tensor '" + slot.name + "' has " +
                           std::to_string(slot.shape.numel()) + " values but its device slot " +
                           std::to_string(it->second.count));
    }
    placements.push_back(Placement{slot, it->second});
  }
  return placements;
}

// Copies host bf16 bits to the device (synchronous with respect to the host buffer).
Status CopyBf16(const Destination& to, size_t offset, const void* bits, size_t count,
                const std::string& name) {
  return cuda::CudaStatus(
      cudaMemcpy(to.data + offset, bits, count * sizeof(uint16_t), cudaMemcpyHostToDevice),
      "uploading tensor '" + name + "'");
}

// fp32 values -> bf16 (nearest even) -> device, in chunks.
Status UploadF32(const Destination& to, const float* values, const std::string& name,
                 std::vector<uint16_t>& scratch) {
  for (size_t begin = 0; begin < to.count; begin += kConvertChunk) {
    const size_t n = std::min(kConvertChunk, to.count - begin);
    scratch.resize(n);
    ConvertFromF32(DType::kBF16, values + begin, scratch.data(), n);
    RUBATO_RETURN_IF_ERROR(CopyBf16(to, begin, scratch.data(), n, name));
  }
  return Status::Ok();
}

// Everything the weight buffers were written with (synchronous copies from pageable memory may
// return before their DMA ends; kernels on the default stream) is done before the model's own
// non-blocking stream runs anything.
Status FinishUploads() {
  return cuda::CudaStatus(cudaDeviceSynchronize(), "finishing the weight upload");
}

}  // namespace

size_t CudaWeightBytes(const ModelConfig& config) {
  return static_cast<size_t>(ParameterCount(config)) * sizeof(__nv_bfloat16);
}

Result<CudaWeights> UploadCudaWeights(const ModelConfig& config, const ModelWeights& host) {
  RUBATO_RETURN_IF_ERROR(CheckWeightSizes(config, host));
  CudaWeights weights;
  RUBATO_ASSIGN_OR_RETURN(const std::vector<Placement> placements,
                          AllocateAndPlace(config, weights));
  // The same list over the caller's weights gives each tensor's host values, in the same order.
  const std::vector<WeightSlot> host_slots =
      ListWeights(config, const_cast<ModelWeights*>(&host));  // only resizes `layers` (no-op)
  std::vector<uint16_t> scratch;
  for (size_t i = 0; i < placements.size(); ++i) {
    RUBATO_RETURN_IF_ERROR(UploadF32(placements[i].destination, host_slots[i].storage->data(),
                                     placements[i].slot.name, scratch));
  }
  RUBATO_RETURN_IF_ERROR(FinishUploads());
  return weights;
}

Result<CudaWeights> LoadCudaWeights(const ModelConfig& config,
                                    const SafetensorsCheckpoint& checkpoint,
                                    const std::string& source) {
  RUBATO_RETURN_IF_ERROR(CheckCheckpointTensors(config, checkpoint, source));
  CudaWeights weights;
  RUBATO_ASSIGN_OR_RETURN(const std::vector<Placement> placements,
                          AllocateAndPlace(config, weights));
  std::vector<float> f32;
  std::vector<uint16_t> bf16;
  try {
    for (const Placement& p : placements) {
      const SafetensorsTensor* tensor = checkpoint.Find(p.slot.name);  // checked above
      const TensorView& view = tensor->view;
      if (view.dtype == DType::kBF16) {  // the common case: straight from the mapping
        RUBATO_RETURN_IF_ERROR(
            CopyBf16(p.destination, 0, view.data, p.destination.count, p.slot.name));
        continue;
      }
      const auto* bytes = static_cast<const unsigned char*>(view.data);
      for (size_t begin = 0; begin < p.destination.count; begin += kConvertChunk) {
        const size_t n = std::min(kConvertChunk, p.destination.count - begin);
        f32.resize(n);
        bf16.resize(n);
        ConvertToF32(view.dtype, bytes + begin * DTypeSize(view.dtype), f32.data(), n);
        ConvertFromF32(DType::kBF16, f32.data(), bf16.data(), n);
        RUBATO_RETURN_IF_ERROR(CopyBf16(p.destination, begin, bf16.data(), n, p.slot.name));
      }
    }
  } catch (const std::bad_alloc&) {
    return ResourceExhaustedError(source + ": out of host memory converting weights to bf16");
  }
  RUBATO_RETURN_IF_ERROR(FinishUploads());
  return weights;
}

Result<CudaWeights> RandomCudaWeights(const ModelConfig& config, uint64_t seed) {
  CudaWeights weights;
  RUBATO_ASSIGN_OR_RETURN(const std::vector<Placement> placements,
                          AllocateAndPlace(config, weights));
  const float bound = std::sqrt(3.0f) * kRandomWeightStd;  // uniform with std kRandomWeightStd
  for (size_t i = 0; i < placements.size(); ++i) {
    const Placement& p = placements[i];
    cuda::RandomFillParams fill;
    fill.out = p.destination.data;
    fill.count = static_cast<int64_t>(p.destination.count);
    fill.seed = seed;
    fill.stream = i;  // the tensor's index in the list
    const bool ones = p.slot.init == WeightInit::kOnes;
    fill.center = ones ? 1.f : 0.f;
    fill.bound = ones ? 0.f : bound;
    RUBATO_RETURN_IF_ERROR(
        cuda::RandomFill(fill, nullptr).WithContext("random weights: '" + p.slot.name + "'"));
  }
  RUBATO_RETURN_IF_ERROR(FinishUploads());
  return weights;
}

}  // namespace rubato
