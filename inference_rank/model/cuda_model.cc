// The CUDA model: loading, KV caches, and the host side of a forward (cuda_model.h). The device
// side of a forward is in cuda_model_forward.cc.
#include "inference_rank/model/cuda_model.h"

#include <algorithm>
#include <bit>
#include <functional>
#include <string>
#include <utility>

#include "common/logging.h"
#include "common/sizes.h"
#include "kernels/cpu/rope.h"
#include "kernels/cuda/cuda_status.h"
#include "kernels/cuda/decode_attention.cuh"
#include "kernels/cuda/sampling.cuh"

namespace rubato {
namespace {

constexpr const char* kLogSubsystem = "model";

// Makes `device` current. Unavailable (with CUDA's words) when there is no driver, no device or
// no such device.
Status SelectDevice(int device) {
  int count = 0;
  const cudaError_t error = cudaGetDeviceCount(&count);
  if (error != cudaSuccess) {
    cudaGetLastError();
    return UnavailableError(std::string("CUDA model: no usable CUDA device: ") +
                            cudaGetErrorName(error) + " (" + cudaGetErrorString(error) + ")");
  }
  if (device < 0 || device >= count) {
    return UnavailableError("CUDA model: device " + std::to_string(device) + " requested but " +
                            std::to_string(count) + " CUDA device(s) are present");
  }
  return cuda::CudaStatus(cudaSetDevice(device), "selecting CUDA device " + std::to_string(device));
}

template <typename T>
Status Reallocate(cuda::DeviceBuffer<T>& buffer, size_t count, const std::string& what) {
  buffer = cuda::DeviceBuffer<T>();  // free first: the old and new buffers need not coexist
  RUBATO_ASSIGN_OR_RETURN(buffer, cuda::DeviceBuffer<T>::Allocate(count, what));
  return Status::Ok();
}

}  // namespace

// ---- construction -------------------------------------------------------------------------------

Status CudaModel::CheckSupported(const ModelConfig& config) {
  const std::string what = "CUDA model (" + config.architecture + "): ";
  const int head_dim = config.head_dim;
  if (head_dim != 16 && head_dim != 32 && head_dim != 64 && head_dim != 128) {
    return UnsupportedError(what + "head_dim " + std::to_string(head_dim) +
                            " is not supported by the CUDA kernels (supported: 16, 32, 64, 128)");
  }
  const int group = config.num_kv_heads > 0 ? config.num_heads / config.num_kv_heads : 0;
  if (group != 1 && group != 2 && group != 4 && group != 8) {
    return UnsupportedError(what + std::to_string(config.num_heads) + " query heads over " +
                            std::to_string(config.num_kv_heads) +
                            " KV heads is not supported (query heads per KV head: 1, 2, 4, 8)");
  }
  if (config.hidden_size % 8 != 0 || config.intermediate_size % 8 != 0) {
    return UnsupportedError(what + "hidden_size " + std::to_string(config.hidden_size) +
                            " and intermediate_size " + std::to_string(config.intermediate_size) +
                            " must be multiples of 8 (16-byte bf16 vectors)");
  }
  return Status::Ok();
}

CudaModel::CudaModel(ModelConfig config, CudaWeights weights, const CudaModelOptions& options)
    : config_(std::move(config)), options_(options), weights_(std::move(weights)) {}

CudaModel::~CudaModel() {
  graphs_.Clear();
  backend_.reset();  // waits for its own streams
  if (stream_ != nullptr) {
    cudaStreamSynchronize(stream_);
    cudaStreamDestroy(stream_);
  }
}

Status CudaModel::Init() {
  // The highest priority: an attention backend's side work may run on streams of the lowest
  // (e.g. a selection overlapped with the next layers), and the scheduler should prefer the
  // critical path when both have work.
  int least = 0, greatest = 0;
  RUBATO_CUDA_RETURN_IF_ERROR(cudaDeviceGetStreamPriorityRange(&least, &greatest),
                              "reading the stream priority range");
  RUBATO_CUDA_RETURN_IF_ERROR(
      cudaStreamCreateWithPriority(&stream_, cudaStreamNonBlocking, greatest),
      "creating the model's stream");
  RUBATO_ASSIGN_OR_RETURN(gemm_, cuda::CublasLtGemm::Create());
  const std::vector<float> inv_freq =
      RopeInverseFrequencies(config_.head_dim, config_.rope_theta, config_.rope_scaling);
  RUBATO_ASSIGN_OR_RETURN(inv_freq_,
                          cuda::DeviceBuffer<float>::Allocate(inv_freq.size(), "RoPE frequencies"));
  RUBATO_RETURN_IF_ERROR(inv_freq_.CopyFromHost(inv_freq.data(), inv_freq.size(), stream_));
  return cuda::CudaStatus(cudaStreamSynchronize(stream_), "uploading the RoPE frequencies");
}

Result<std::unique_ptr<CudaModel>> CudaModel::Create(ModelConfig config, CudaWeights weights,
                                                     const CudaModelOptions& options) {
  RUBATO_RETURN_IF_ERROR(CheckSupported(config));
  RUBATO_RETURN_IF_ERROR(SelectDevice(options.device));
  std::unique_ptr<CudaModel> model(new CudaModel(std::move(config), std::move(weights), options));
  RUBATO_RETURN_IF_ERROR(model->Init());
  return model;
}

Result<std::unique_ptr<CudaModel>> CudaModel::Create(ModelConfig config,
                                                     const ModelWeights& host_weights,
                                                     const CudaModelOptions& options) {
  RUBATO_RETURN_IF_ERROR(CheckSupported(config));
  RUBATO_RETURN_IF_ERROR(SelectDevice(options.device));
  RUBATO_ASSIGN_OR_RETURN(CudaWeights weights, UploadCudaWeights(config, host_weights));
  return Create(std::move(config), std::move(weights), options);
}

Result<std::unique_ptr<Model>> LoadCudaModel(const std::filesystem::path& model_dir,
                                             const CudaModelOptions& options) {
  const std::string context = "loading model " + model_dir.string();
  Result<ModelConfig> config = LoadModelConfig(model_dir);
  if (!config.ok()) return config.status().WithContext(context);
  // Shape support and the device first: neither needs the checkpoint read.
  RUBATO_RETURN_IF_ERROR(CudaModel::CheckSupported(*config).WithContext(context));
  RUBATO_RETURN_IF_ERROR(SelectDevice(options.device).WithContext(context));
  auto load_weights = [&]() -> Result<CudaWeights> {
    if (options.random_weights) return RandomCudaWeights(*config, options.seed);
    Result<SafetensorsCheckpoint> checkpoint = SafetensorsCheckpoint::OpenDirectory(model_dir);
    if (!checkpoint.ok()) return checkpoint.status();
    return LoadCudaWeights(*config, *checkpoint, model_dir.string());
  };
  Result<CudaWeights> weights = load_weights();
  if (!weights.ok()) return weights.status().WithContext(context);
  RUBATO_LOG_INFO(kLogSubsystem,
                  "{}: {} ({} layers, hidden {}), {} parameters, {} MiB bf16 on CUDA device {}{}",
                  model_dir.string(), config->architecture, config->num_layers, config->hidden_size,
                  ParameterCount(*config), CudaWeightBytes(*config) >> 20, options.device,
                  options.random_weights ? ", random weights" : "");
  Result<std::unique_ptr<CudaModel>> model =
      CudaModel::Create(std::move(config).value(), std::move(weights).value(), options);
  if (!model.ok()) return model.status().WithContext(context);
  return std::unique_ptr<Model>(std::move(model).value());
}

Result<std::unique_ptr<PagedKvCache>> CudaModel::CreateKvCache(int block_tokens, int num_blocks) {
  RUBATO_RETURN_IF_ERROR(SelectDevice(options_.device));
  const KvCacheShape shape{config_.num_layers, config_.num_kv_heads, config_.head_dim, block_tokens,
                           num_blocks};
  // PagedKvCache validates the shape too, but only after the pools would have been allocated.
  if (block_tokens != 16 && block_tokens != 64) {
    return InvalidArgumentError("KV cache: block size " + std::to_string(block_tokens) +
                                " is not supported (engine.block_size must be 16 or 64)");
  }
  if (num_blocks <= 0) {
    return InvalidArgumentError("KV cache: the number of blocks must be positive, got " +
                                std::to_string(num_blocks));
  }
  RUBATO_ASSIGN_OR_RETURN(std::unique_ptr<DeviceKvStorage> storage, DeviceKvStorage::Create(shape));
  return PagedKvCache::CreateWithStorage(shape, std::move(storage));
}

Result<KvPoolMemory> CudaModel::KvPoolMemoryFor(int block_tokens, const StepBounds& bounds) const {
  RUBATO_RETURN_IF_ERROR(SelectDevice(options_.device));
  size_t free_bytes = 0;
  size_t total_bytes = 0;
  RUBATO_RETURN_IF_ERROR(cuda::CudaStatus(
      cudaMemGetInfo(&free_bytes, &total_bytes),
      "reading the free memory of CUDA device " + std::to_string(options_.device)));
  KvPoolMemory memory;
  memory.where = "CUDA device " + std::to_string(options_.device);
  memory.total_bytes = total_bytes;
  memory.free_bytes = free_bytes;
  memory.bytes_per_block = DeviceKvStorage::PoolBytes(KvCacheShape{
      config_.num_layers, config_.num_kv_heads, config_.head_dim, block_tokens, /*num_blocks=*/1});
  memory.pending_bytes = PendingWorkspaceBytes(bounds);
  return memory;
}

size_t CudaModel::PendingWorkspaceBytes(const StepBounds& bounds) const {
  const auto more = [](size_t want, size_t have) { return want > have ? want - have : 0; };
  const size_t hidden = static_cast<size_t>(config_.hidden_size);
  const size_t q_dim = static_cast<size_t>(config_.q_dim());
  const size_t qkv_dim = q_dim + 2 * static_cast<size_t>(config_.kv_dim());
  const size_t intermediate = static_cast<size_t>(config_.intermediate_size);
  const size_t vocab = static_cast<size_t>(config_.vocab_size);
  const size_t bf16 = sizeof(__nv_bfloat16);
  const size_t rows = static_cast<size_t>(RoundUpPow2(std::max(1, bounds.max_tokens)));
  size_t pending =
      more(rows * hidden * sizeof(float), residual_.bytes()) +
      more(rows * hidden * bf16, normed_.bytes()) + more(rows * qkv_dim * bf16, qkv_.bytes()) +
      more(rows * q_dim * bf16, attention_.bytes()) + more(rows * hidden * bf16, delta_.bytes()) +
      more(rows * 2 * intermediate * bf16, gate_up_.bytes()) +
      more(rows * intermediate * bf16, mlp_act_.bytes());
  const int entries = std::max(1, bounds.max_entries);
  const size_t logit_rows = static_cast<size_t>(RoundUpPow2(entries));
  pending += more(logit_rows * hidden * bf16, logit_inputs_.bytes()) +
             more(logit_rows * vocab * sizeof(float), logits_.bytes());
  pending += more(std::bit_ceil(cuda::DecodeAttentionWorkspaceBytes(
                      entries, config_.num_heads, config_.head_dim, std::max(1, bounds.max_context),
                      /*want_probs=*/false)),
                  decode_workspace_.bytes());
  pending +=
      more(cuda::SampleWorkspaceBytes(entries, config_.vocab_size), sample_workspace_.bytes());
  return pending;
}

Result<std::unique_ptr<SlotKvPool>> CudaModel::CreateSlotKvPool(int budget, int num_arrays) {
  RUBATO_RETURN_IF_ERROR(SelectDevice(options_.device));
  const SlotKvShape shape{config_.num_layers, config_.num_kv_heads, config_.head_dim, budget,
                          num_arrays};
  // SlotKvPool validates the shape too, but only after the arrays would have been allocated.
  if (budget <= 0 || num_arrays <= 0) {
    return InvalidArgumentError("KV slot pool: budget (" + std::to_string(budget) +
                                ") and arrays (" + std::to_string(num_arrays) +
                                ") must be positive");
  }
  RUBATO_ASSIGN_OR_RETURN(std::unique_ptr<DeviceSlotKvStorage> storage,
                          DeviceSlotKvStorage::Create(shape, stream_));
  return SlotKvPool::CreateWithStorage(shape, std::move(storage));
}

// ---- attention backend --------------------------------------------------------------------------

Status CudaModel::SetAttentionBackend(std::unique_ptr<AttentionBackend> backend) {
  CudaAttentionBackend* cuda_backend = nullptr;
  if (backend != nullptr) {
    cuda_backend = dynamic_cast<CudaAttentionBackend*>(backend.get());
    if (cuda_backend == nullptr) {
      return InvalidArgumentError("SetAttentionBackend: a backend half made for the " +
                                  std::string(backend->backend_name()) +
                                  " model cannot serve the CUDA model");
    }
    if (cuda_backend->made_for_model() != nullptr && cuda_backend->made_for_model() != this) {
      return InvalidArgumentError(
          "SetAttentionBackend: the attention backend was made for another CUDA model");
    }
  }
  if (backend_ != nullptr && backend_->requests_holding_resources() > 0) {
    return FailedPreconditionError(
        "SetAttentionBackend: " + std::to_string(backend_->requests_holding_resources()) +
        " requests still hold resources of the current attention backend");
  }
  graphs_.Clear();   // they hold the old backend's launches and addresses
  backend_.reset();  // waits for its own streams
  backend.release();
  backend_.reset(cuda_backend);
  return Status::Ok();
}

Status CudaModel::SetResidencyBackend(std::unique_ptr<ResidencyBackend> backend) {
  CudaResidencyBackend* cuda_backend = nullptr;
  if (backend != nullptr) {
    cuda_backend = dynamic_cast<CudaResidencyBackend*>(backend.get());
    if (cuda_backend == nullptr) {
      return InvalidArgumentError("SetResidencyBackend: a residency half made for the " +
                                  std::string(backend->backend_name()) +
                                  " model cannot serve the CUDA model");
    }
  }
  graphs_.Clear();  // they may hold the old half's launches and addresses
  residency_.reset();
  backend.release();
  residency_.reset(cuda_backend);
  return Status::Ok();
}

Status CudaModel::CheckAttentionEntries(std::span<const ForwardEntry> batch) const {
  for (size_t e = 0; e < batch.size(); ++e) {
    if (batch[e].slots != nullptr &&
        dynamic_cast<DeviceSlotKvStorage*>(batch[e].slots->pool->storage()) == nullptr) {
      return InvalidArgumentError("forward: batch entry " + std::to_string(e) +
                                  ": its KV slot pool was not created by a CUDA model "
                                  "(CreateSlotKvPool); its slots are not on the GPU");
    }
    if (batch[e].residency != nullptr && residency_ == nullptr) {
      return FailedPreconditionError("forward: batch entry " + std::to_string(e) +
                                     " has a residency handle but the model has no residency "
                                     "backend (SetResidencyBackend)");
    }
    const EntryAttention* attention = batch[e].attention;
    if (attention == nullptr) continue;
    const std::string where = "forward: batch entry " + std::to_string(e);
    if (backend_ == nullptr) {
      return FailedPreconditionError(where +
                                     " has an attention plan but the model has no attention "
                                     "backend to run it (Model::SetAttentionBackend; the engine "
                                     "installs its policy's)");
    }
    if (batch[e].tokens.size() > 1 && !backend_->AttendsPrefill() &&
        (attention->layer_actions != nullptr ||
         attention->action.op == AttentionOp::kIndexGather)) {
      return UnsupportedError(where +
                              ": a per-layer or index-gather prefill plan, while the attention "
                              "backend leaves prefill attention to the model (which runs it "
                              "dense)");
    }
    if (attention->row_group < 1) {
      return InvalidArgumentError(where + ": attention row group " +
                                  std::to_string(attention->row_group) +
                                  ", expected >= 1 (group 0 is the model's plain dense rows)");
    }
  }
  return backend_ == nullptr ? Status::Ok() : backend_->CheckBatch(batch);
}

// ---- forward (host side) ------------------------------------------------------------------------

Status CudaModel::EnsureCapacity(std::span<const ForwardEntry> batch, const ForwardPlan& plan) {
  // Captured graphs point into these buffers: they are dropped before the first buffer is freed,
  // so that no failure on the way can leave a graph that replays into freed memory.
  bool graphs_dropped = false;
  const std::function<void()> drop_graphs = [&] {
    if (!graphs_dropped) graphs_.Clear();
    graphs_dropped = true;
  };
  if (backend_ != nullptr) RUBATO_RETURN_IF_ERROR(backend_->Reserve(batch, plan, drop_graphs));
  StepInputCapacity need = plan.Needs();
  need.backend_bytes = backend_ == nullptr ? 0 : backend_->StepInputBytes();
  if (!input_capacity_.Covers(need)) {
    drop_graphs();
    const StepInputCapacity grown = input_capacity_.GrownToCover(need);
    const StepInputLayout layout = StepInputLayout::For(grown);
    input_capacity_ = StepInputCapacity();
    staging_ = PinnedBuffer();
    RUBATO_ASSIGN_OR_RETURN(staging_, PinnedBuffer::Allocate(layout.bytes, "the step inputs"));
    RUBATO_RETURN_IF_ERROR(Reallocate(step_inputs_, layout.bytes, "the step inputs"));
    input_capacity_ = grown;
    input_layout_ = layout;
  }

  const size_t hidden = static_cast<size_t>(config_.hidden_size);
  const size_t q_dim = static_cast<size_t>(config_.q_dim());
  const size_t qkv_dim = q_dim + 2 * static_cast<size_t>(config_.kv_dim());
  const size_t intermediate = static_cast<size_t>(config_.intermediate_size);
  if (plan.tokens > activation_rows_) {
    drop_graphs();
    // Powers of two, never shrunk: few reallocations (each drops the graphs), at the price of up
    // to twice the largest batch's rows (a 8208-token chunk of Qwen3-8B: 16384 rows, ~0.8 GB of
    // gate_up alone), allocated on first need, after the KV pools.
    const int rows = RoundUpPow2(plan.tokens);
    const size_t r = static_cast<size_t>(rows);
    const std::string what = " activations of " + std::to_string(rows) + " rows";
    activation_rows_ = 0;
    RUBATO_RETURN_IF_ERROR(Reallocate(residual_, r * hidden, "residual" + what));
    RUBATO_RETURN_IF_ERROR(Reallocate(normed_, r * hidden, "normed" + what));
    RUBATO_RETURN_IF_ERROR(Reallocate(qkv_, r * qkv_dim, "qkv" + what));
    RUBATO_RETURN_IF_ERROR(Reallocate(attention_, r * q_dim, "attention" + what));
    RUBATO_RETURN_IF_ERROR(Reallocate(delta_, r * hidden, "o_proj/down" + what));
    RUBATO_RETURN_IF_ERROR(Reallocate(gate_up_, r * 2 * intermediate, "gate_up" + what));
    RUBATO_RETURN_IF_ERROR(Reallocate(mlp_act_, r * intermediate, "SwiGLU" + what));
    activation_rows_ = rows;
  }
  if (plan.logit_rows() > logit_capacity_) {
    drop_graphs();
    const int rows = RoundUpPow2(plan.logit_rows());
    const size_t r = static_cast<size_t>(rows);
    logit_capacity_ = 0;
    RUBATO_RETURN_IF_ERROR(Reallocate(logit_inputs_, r * hidden,
                                      "lm_head inputs of " + std::to_string(rows) + " rows"));
    RUBATO_RETURN_IF_ERROR(Reallocate(logits_, r * static_cast<size_t>(config_.vocab_size),
                                      "logits of " + std::to_string(rows) + " rows"));
    logit_capacity_ = rows;
  }
  if (plan.sample_rows > sample_capacity_) {
    drop_graphs();
    const int rows = RoundUpPow2(plan.sample_rows);
    sample_capacity_ = 0;
    RUBATO_RETURN_IF_ERROR(Reallocate(sampled_, 2 * static_cast<size_t>(rows), "sampled tokens"));
    sampled_host_ = PinnedBuffer();
    RUBATO_ASSIGN_OR_RETURN(sampled_host_,
                            PinnedBuffer::Allocate(2 * sizeof(int32_t) * rows, "sampled tokens"));
    sample_capacity_ = rows;
  }
  // One workspace for every decode attention launch of the step (they run one after the other
  // on the main stream): the decode rows' groups, and the backend's own launches.
  const size_t backend_bytes = backend_ == nullptr ? 0 : backend_->DecodeWorkspaceBytes(plan);
  if (plan.decode_rows > 0 || backend_bytes > 0) {
    const size_t bytes = std::max(
        cuda::DecodeAttentionWorkspaceBytes(plan.decode_rows, config_.num_heads, config_.head_dim,
                                            plan.decode_max_seq_len, /*want_probs=*/false),
        backend_bytes);
    if (bytes > decode_workspace_.size()) {
      drop_graphs();
      // A power of two: growing contexts change the bucket every few thousand steps, and each
      // reallocation drops the captured graphs.
      RUBATO_RETURN_IF_ERROR(
          Reallocate(decode_workspace_, std::bit_ceil(bytes), "decode attention workspace"));
    }
  }
  if (plan.sample_rows > 0) {
    const size_t bytes = cuda::SampleWorkspaceBytes(plan.sample_rows, config_.vocab_size);
    if (bytes > sample_workspace_.size()) {
      drop_graphs();
      RUBATO_RETURN_IF_ERROR(Reallocate(sample_workspace_, bytes, "sampling workspace"));
    }
  }
  return Status::Ok();
}

Status CudaModel::Forward(std::span<const ForwardEntry> batch, PagedKvCache& cache,
                          ForwardResult& result, const AttentionWindow& window) {
  result.Reset(config_.vocab_size, batch.size());
  if (batch.empty()) return Status::Ok();
  auto* kv = dynamic_cast<DeviceKvStorage*>(cache.storage());
  if (kv == nullptr) {
    return InvalidArgumentError(
        "forward: the KV cache was not created by a CUDA model (CreateKvCache); its pools are "
        "not on the GPU");
  }
  RUBATO_RETURN_IF_ERROR(ValidateForwardBatch(config_, batch, cache, window));
  RUBATO_RETURN_IF_ERROR(CheckAttentionEntries(batch));
  if (residency_ != nullptr) RUBATO_RETURN_IF_ERROR(residency_->CheckBatch(batch, window));
  RUBATO_RETURN_IF_ERROR(SelectDevice(options_.device));

  // Buffers first, blocks second, the backend's per-request resources third: a failed
  // allocation or reservation must leave every sequence's blocks and every state as they were
  // (all or nothing, model.h); the backend's Acquire cannot fail once its CheckBatch passed. The
  // plan reads positions, not block tables.
  const KvCacheShape& shape = cache.shape();
  PlanForward(batch, shape, plan_);
  RUBATO_RETURN_IF_ERROR(EnsureCapacity(batch, plan_));
  residency_step_ = std::any_of(batch.begin(), batch.end(), [](const ForwardEntry& entry) {
    return entry.residency != nullptr;
  });
  if (residency_step_) RUBATO_RETURN_IF_ERROR(residency_->PlanStep(batch, plan_));
  RUBATO_RETURN_IF_ERROR(ReserveForwardBlocks(batch, cache));
  if (backend_ != nullptr) RUBATO_RETURN_IF_ERROR(backend_->Acquire(batch));
  FillStepInputs(batch, shape, plan_, input_layout_, staging_.data());
  if (backend_ != nullptr) {
    backend_->FillStepInputs(batch, plan_, shape, staging_.data() + input_layout_.backend);
  }

  // Everything below is asynchronous on stream_ up to the one synchronization; whatever fails
  // on the way, that synchronization still happens before returning, so the pinned buffers are
  // never rewritten under a pending copy.
  auto enqueue_all = [&]() -> Status {
    RUBATO_CUDA_RETURN_IF_ERROR(
        cudaMemcpyAsync(step_inputs_.data(), staging_.data(), input_layout_.bytes,
                        cudaMemcpyHostToDevice, stream_),
        "copying the step inputs to the device");
    auto device_work = [&](cudaStream_t stream) { return EnqueueForward(*kv, window, stream); };
    // A residency that waits for its peer on the host in every layer: never in a graph.
    const bool replayable = (backend_ == nullptr || backend_->graph_replayable()) &&
                            (!residency_step_ || residency_->graph_replayable());
    if (options_.use_cuda_graph && plan_.decode_only() && replayable) {
      DecodeGraphKey key;
      key.batch = plan_.decode_rows;
      key.max_seq_len = plan_.decode_max_seq_len;
      key.table_stride = plan_.decode_table_stride;
      key.sample_rows = plan_.sample_rows;
      key.host_rows = plan_.host_rows;
      key.sink_tokens = window.sink_tokens;
      key.recent_tokens = window.recent_tokens;
      key.key_pool = kv->keys().data();
      key.value_pool = kv->values().data();
      key.num_blocks = shape.num_blocks;
      key.backend_rows = plan_.backend_rows;
      key.adjusts_logits = plan_.adjusts_logits();
      if (backend_ != nullptr) backend_->AddToGraphKey(plan_, key);
      if (residency_step_) residency_->AddToGraphKey(plan_, key);
      RUBATO_RETURN_IF_ERROR(graphs_.Run(key, stream_, device_work));
    } else {
      RUBATO_RETURN_IF_ERROR(device_work(stream_));
    }
    if (backend_ != nullptr) RUBATO_RETURN_IF_ERROR(backend_->EnqueueReadBack(stream_));
    if (plan_.sample_rows > 0) {
      // Tokens and probabilities in one copy: [0, rows) and [capacity, capacity + rows).
      RUBATO_CUDA_RETURN_IF_ERROR(
          cudaMemcpyAsync(
              sampled_host_.data(), sampled_.data(),
              sizeof(int32_t) * static_cast<size_t>(sample_capacity_ + plan_.sample_rows),
              cudaMemcpyDeviceToHost, stream_),
          "copying the sampled tokens to the host");
    }
    if (plan_.host_rows > 0) {
      const size_t vocab = static_cast<size_t>(config_.vocab_size);
      result.logits.resize(static_cast<size_t>(plan_.host_rows) * vocab);
      RUBATO_CUDA_RETURN_IF_ERROR(
          cudaMemcpyAsync(result.logits.data(),
                          logits_.data() + static_cast<size_t>(plan_.sample_rows) * vocab,
                          result.logits.size() * sizeof(float), cudaMemcpyDeviceToHost, stream_),
          "copying the logits to the host");
    }
    return Status::Ok();
  };
  const Status enqueued = enqueue_all();
  Status synced =
      cuda::CudaStatus(cudaStreamSynchronize(stream_), "running the forward on the device");
  if (enqueued.ok() && synced.ok() && residency_step_) synced = residency_->FinishStep();
  if (!enqueued.ok() || !synced.ok()) {
    // A step that failed before its end-of-step join may leave the backend's streams running.
    if (backend_ != nullptr) backend_->AbortStep();
    if (residency_step_) residency_->AbortStep();
    result.logits.clear();
    return !enqueued.ok() ? enqueued : synced;
  }
  if (backend_ != nullptr) RUBATO_RETURN_IF_ERROR(backend_->FinishStep(batch));

  const auto* sampled = reinterpret_cast<const int32_t*>(sampled_host_.data());
  const auto* probabilities =
      reinterpret_cast<const float*>(sampled_host_.data()) + sample_capacity_;
  for (size_t e = 0; e < batch.size(); ++e) {
    const ForwardEntry& entry = batch[e];
    entry.sequence->num_tokens = entry.start_position + static_cast<int>(entry.tokens.size());
    result.entry_first_row[e] = plan_.entry_host_row[e];
    result.entry_row_count[e] = plan_.entry_host_rows[e];
    if (const int row = plan_.entry_sample_row[e]; row >= 0) {
      result.sampled_tokens[e] = sampled[row];
      if (entry.sampling->report_probability) result.sampled_probabilities[e] = probabilities[row];
    }
  }
  return Status::Ok();
}

}  // namespace rubato
