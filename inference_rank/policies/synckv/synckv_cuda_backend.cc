// SyncKV's CUDA backend half (see synckv_cuda_backend.h).
#include "inference_rank/policies/synckv/synckv_cuda_backend.h"

#include <algorithm>
#include <bit>
#include <cmath>
#include <string>
#include <vector>

#include "common/sizes.h"
#include "inference_rank/policies/synckv/kernels/group_max_probs.cuh"
#include "inference_rank/policies/synckv/synckv_policy.h"
#include "inference_rank/residency/split_by_head/kernels/head_pool.cuh"
#include "inference_rank/residency/split_by_head/split_by_head_cuda_kv.h"
#include "kernels/cuda/cuda_status.h"
#include "kernels/cuda/decode_attention.cuh"
#include "kernels/cuda/gather_rows.cuh"
#include "kernels/cuda/pooled_top_k.cuh"

namespace rubato {
namespace {

constexpr int kSyncKvRows = 1;  // the row group of SyncKV's plans (synckv_policy.cc)

SplitByHeadCudaRequest* RequestOf(const ForwardEntry& entry) {
  const auto* handle = dynamic_cast<const SplitByHeadCudaEntry*>(entry.residency);
  return handle != nullptr ? handle->request : nullptr;
}

SyncKvStep::Kind KindOf(const ForwardEntry& entry) {
  return static_cast<const SyncKvStep*>(entry.attention->state)->kind;
}

// The step-input region: int32 arrays of `rows` (a power of two >= 4, so each is 16-byte
// aligned) and two block tables of [rows][blocks_per_slot], in this order.
enum Array {
  kDecodeSlot,    // decode row: its pool slot
  kDecodeRecent,  // decode row: recent_begin
  kSelQueryRow,   // selection row: its query's row in qkv
  kSelSlot,       // its pool slot
  kSelLength,     // candidates [0, L)
  kSelExcluded,   // static rows excluded in the first top-k (0 at the prompt's end)
  kSelStatic,     // static rows (the prompt's end: excluded in the second top-k)
  kSelK1,         // first top-k: the dynamic set, or the prompt's static set
  kSelK2,         // the prompt's end: its dynamic set
  kSelLocalFrom,  // positions >= this are copied from the paged cache
  kSelTable,      // its row in the decode (anticipation) or prefill (prompt's end) tables
  kSelZero,       // 0: the top-k's first candidate
  kArrays,
};

class SyncKvCudaBackend final : public CudaAttentionBackend {
 public:
  SyncKvCudaBackend(const CudaModel& model, const SyncKvPolicy& policy)
      : owner_(&model), model_(model.config()), policy_(policy) {}
  ~SyncKvCudaBackend() override {
    // A fetch in flight reads our arrays; the residency's storage may already be gone, so the
    // whole device is waited for rather than its copy stream.
    if (kv_ != nullptr) cudaDeviceSynchronize();
    for (cudaEvent_t event : ready_) cudaEventDestroy(event);
  }

  const Model* made_for_model() const override { return owner_; }
  bool graph_replayable() const override { return false; }

  Status CheckBatch(std::span<const ForwardEntry> batch) const override {
    for (size_t e = 0; e < batch.size(); ++e) {
      if (batch[e].attention == nullptr) continue;
      if (batch[e].attention->row_group != kSyncKvRows || RequestOf(batch[e]) == nullptr) {
        return FailedPreconditionError(
            "policy synckv: batch entry " + std::to_string(e) +
            " has no split_by_head KV on the CUDA model (engine.kv_residency must be "
            "split_by_head)");
      }
    }
    return Status::Ok();
  }

  Status Reserve(std::span<const ForwardEntry> batch, const ForwardPlan& plan,
                 const std::function<void()>& drop_graphs) override;
  size_t StepInputBytes() const override {
    return sizeof(int32_t) * static_cast<size_t>(row_capacity_) * (kArrays + 2 * blocks_);
  }
  void FillStepInputs(std::span<const ForwardEntry> batch, const ForwardPlan& plan,
                      const KvCacheShape& shape, std::byte* region) override;
  Status Attend(const CudaLayerContext& layer) override;

 private:
  const int32_t* Input(const CudaLayerContext& layer, int array) const {
    return reinterpret_cast<const int32_t*>(layer.policy_inputs) +
           static_cast<size_t>(array) * row_capacity_;
  }
  const int32_t* DecodeTables(const CudaLayerContext& layer) const { return Input(layer, kArrays); }
  const int32_t* SelTables(const CudaLayerContext& layer) const {
    return Input(layer, kArrays) + static_cast<size_t>(row_capacity_) * blocks_;
  }
  Status Select(const CudaLayerContext& layer);
  Status UpdatePools(const CudaLayerContext& layer);

  const Model* owner_;
  ModelConfig model_;
  const SyncKvPolicy& policy_;
  SplitByHeadDeviceKv* kv_ = nullptr;  // the residency's, from the batch's handles
  int blocks_ = 0;                     // the R-heads' pool blocks per slot
  int row_capacity_ = 4;
  // This step (Reserve, FillStepInputs).
  DecodeRowGroup rows_;
  std::vector<int> anticipating_, prompt_ends_;  // batch entries selecting, in selection order
  std::vector<int> prompt_end_slots_;
  int prompt_end_chunks_ = 0;  // prompt_ends_ whose last chunk has several tokens (first)
  int max_length_ = 0;         // the selection rows' longest context
  int max_recent_ = 1;         // decode rows: the most recent positions
  int64_t stride_ = 0;         // the score rows' stride
  // Scratch, [rows] leading.
  cuda::DeviceBuffer<__nv_bfloat16> queries_;   // [sel][qkv_dim]
  cuda::DeviceBuffer<float> scores_;            // [sel][group][stride], log2 units
  cuda::DeviceBuffer<float> pooled_;            // [sel][clusters][stride]
  cuda::DeviceBuffer<int32_t> selected_;        // [sel][clusters][pool rows]: first top-k
  cuda::DeviceBuffer<int32_t> selected_count_;  // [sel][clusters]
  cuda::DeviceBuffer<int32_t> second_;          // [sel][clusters][pool rows]: the prompt's dynamic
  cuda::DeviceBuffer<int32_t> second_count_;    // [sel][clusters]
  cuda::DeviceBuffer<int32_t> freed_;           // [sel][clusters][pool rows]
  cuda::DeviceBuffer<unsigned char> top_k_workspace_;
  // Per layer, read by the fetch on the copy stream after the step moved on: the moves and
  // the anticipation rows' slots and local bounds.
  cuda::DeviceBuffer<int32_t> move_rows_, move_positions_;  // [layer][sel][clusters][pool rows]
  cuda::DeviceBuffer<int32_t> move_count_;                  // [layer][sel][clusters]
  cuda::DeviceBuffer<int32_t> fetch_rows_;                  // [layer][2][sel]: slot, local_from
  std::vector<cudaEvent_t> ready_;                          // [layer]: local copies done
};

Status SyncKvCudaBackend::Reserve(std::span<const ForwardEntry> batch, const ForwardPlan& plan,
                                  const std::function<void()>& drop_graphs) {
  rows_ = plan.Group(kSyncKvRows);
  anticipating_.clear();
  prompt_ends_.clear();
  max_length_ = 1;
  for (size_t e = 0; e < batch.size(); ++e) {
    if (batch[e].attention == nullptr) continue;
    SplitByHeadCudaRequest* request = RequestOf(batch[e]);
    kv_ = request->kv;
    const SyncKvStep::Kind kind = KindOf(batch[e]);
    if (kind == SyncKvStep::Kind::kSuspension) continue;
    (kind == SyncKvStep::Kind::kAnticipation ? anticipating_ : prompt_ends_)
        .push_back(static_cast<int>(e));
    max_length_ =
        std::max(max_length_, batch[e].start_position + static_cast<int>(batch[e].tokens.size()));
  }
  if (kv_ == nullptr) return Status::Ok();
  // Prompts that end with a chunk of several tokens first (their paged rows are read through
  // the prefill block tables), then those whose last chunk is one token (a decode row).
  std::stable_partition(prompt_ends_.begin(), prompt_ends_.end(),
                        [&](int e) { return batch[static_cast<size_t>(e)].tokens.size() > 1; });
  prompt_end_chunks_ =
      static_cast<int>(std::count_if(prompt_ends_.begin(), prompt_ends_.end(), [&](int e) {
        return batch[static_cast<size_t>(e)].tokens.size() > 1;
      }));
  if (ready_.empty()) {
    ready_.assign(static_cast<size_t>(model_.num_layers), nullptr);
    for (cudaEvent_t& event : ready_) {
      RUBATO_CUDA_RETURN_IF_ERROR(cudaEventCreateWithFlags(&event, cudaEventDisableTiming),
                                  "policy synckv: events");
    }
  }
  blocks_ = kv_->blocks_per_slot();
  const int sel = static_cast<int>(anticipating_.size() + prompt_ends_.size());
  const int rows = std::max(
      4, static_cast<int>(std::bit_ceil(static_cast<unsigned>(std::max({rows_.rows, sel, 1})))));
  if (rows > row_capacity_) {
    drop_graphs();
    // The per-layer arrays' layout follows the row capacity: no fetch may still read them.
    RUBATO_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(kv_->copy_stream()),
                                "policy synckv: waiting for the fetches");
    row_capacity_ = rows;
  }
  stride_ = (static_cast<int64_t>(max_length_) + 63) / 64 * 64;
  if (sel == 0) return Status::Ok();
  const size_t r = static_cast<size_t>(row_capacity_);
  const size_t clusters = static_cast<size_t>(kv_->clusters());
  const size_t group = static_cast<size_t>(model_.num_heads / model_.num_kv_heads);
  const size_t pool = static_cast<size_t>(kv_->pool_capacity());
  const size_t layers = static_cast<size_t>(model_.num_layers);
  const size_t qkv_dim = static_cast<size_t>(model_.q_dim() + 2 * model_.kv_dim());
  auto grow = [&](auto& buffer, size_t count, const char* what) {
    return GrowBackendBuffer(buffer, count, what, drop_graphs);
  };
  RUBATO_RETURN_IF_ERROR(grow(queries_, r * qkv_dim, "synckv queries"));
  RUBATO_RETURN_IF_ERROR(grow(scores_, r * group * stride_, "synckv scores"));
  RUBATO_RETURN_IF_ERROR(grow(pooled_, r * clusters * stride_, "synckv pooled scores"));
  RUBATO_RETURN_IF_ERROR(grow(selected_, r * clusters * pool, "synckv selection"));
  RUBATO_RETURN_IF_ERROR(grow(selected_count_, r * clusters, "synckv selection"));
  RUBATO_RETURN_IF_ERROR(grow(second_, r * clusters * pool, "synckv selection"));
  RUBATO_RETURN_IF_ERROR(grow(second_count_, r * clusters, "synckv selection"));
  RUBATO_RETURN_IF_ERROR(grow(freed_, r * clusters * pool, "synckv freed rows"));
  RUBATO_RETURN_IF_ERROR(grow(
      top_k_workspace_,
      cuda::PooledTopKWorkspaceBytes(row_capacity_, kv_->clusters(), kv_->clusters(), max_length_),
      "synckv top-k workspace"));
  // The per-layer arrays may be read by a fetch still in flight: wait for it before they move.
  const size_t moves = layers * r * clusters * pool;
  if (move_rows_.size() < moves || fetch_rows_.size() < layers * 2 * r) {
    RUBATO_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(kv_->copy_stream()),
                                "policy synckv: waiting for the fetches");
  }
  RUBATO_RETURN_IF_ERROR(grow(move_rows_, moves, "synckv moves"));
  RUBATO_RETURN_IF_ERROR(grow(move_positions_, moves, "synckv moves"));
  RUBATO_RETURN_IF_ERROR(grow(move_count_, layers * r * clusters, "synckv moves"));
  return grow(fetch_rows_, layers * 2 * r, "synckv fetch rows");
}

void SyncKvCudaBackend::FillStepInputs(std::span<const ForwardEntry> batch, const ForwardPlan& plan,
                                       const KvCacheShape& /*shape*/, std::byte* region) {
  auto* base = reinterpret_cast<int32_t*>(region);
  const size_t r = static_cast<size_t>(row_capacity_);
  auto array = [&](int a) { return base + static_cast<size_t>(a) * r; };
  int32_t* decode_tables = array(kArrays);
  int32_t* sel_tables = decode_tables + r * blocks_;
  auto fill_table = [&](int32_t* table, int slot) {
    for (int b = 0; b < blocks_; ++b) table[b] = slot * blocks_ + b;
  };
  // Decode rows: the pending anticipations arrive now.
  max_recent_ = 1;
  for (size_t e = 0; e < batch.size(); ++e) {
    if (batch[e].attention == nullptr || batch[e].tokens.size() != 1) continue;
    SplitByHeadCudaRequest& request = *RequestOf(batch[e]);
    const int position = batch[e].start_position;
    const int row = plan.entry_first_row[e] - rows_.first_row;
    array(kDecodeSlot)[row] = request.slot;
    if (KindOf(batch[e]) == SyncKvStep::Kind::kPromptEnd) {
      // A prompt's last chunk of one token is a decode row: before its selection it attends
      // every position (its slot's counts are cleared first, Attend).
      array(kDecodeRecent)[row] = 0;
      max_recent_ = std::max(max_recent_, position + 1);
      fill_table(decode_tables + static_cast<size_t>(row) * blocks_, request.slot);
      continue;
    }
    request.BeginStep(position);
    array(kDecodeRecent)[row] = std::min(request.recent_begin, position + 1);
    max_recent_ = std::max(max_recent_, position + 1 - array(kDecodeRecent)[row]);
    fill_table(decode_tables + static_cast<size_t>(row) * blocks_, request.slot);
  }
  // Selection rows: anticipations, then the prompts' ends.
  int s = 0;
  for (int e : anticipating_) {
    SplitByHeadCudaRequest& request = *RequestOf(batch[e]);
    const int position = batch[e].start_position;
    const int context = position + 1;
    // Eq. 6: k_dyn = k - |static|, never below the dynamic rows held (the budget only grows).
    const int dynamic =
        std::clamp(policy_.Budget(context) - request.static_rows, request.dynamic_rows,
                   kv_->pool_capacity() - request.static_rows);
    array(kSelQueryRow)[s] = plan.entry_first_row[e];
    array(kSelSlot)[s] = request.slot;
    array(kSelLength)[s] = context;
    array(kSelExcluded)[s] = request.static_rows;
    array(kSelStatic)[s] = request.static_rows;
    array(kSelK1)[s] = dynamic;
    array(kSelK2)[s] = 0;
    array(kSelLocalFrom)[s] = std::min(request.recent_begin, context);
    array(kSelTable)[s] = plan.entry_first_row[e];  // decode rows index the decode tables
    array(kSelZero)[s] = 0;
    fill_table(sel_tables + static_cast<size_t>(s) * blocks_, request.slot);
    request.pending = true;
    request.selected_at = position;
    request.pending_dynamic_rows = dynamic;
    ++s;
  }
  prompt_end_slots_.clear();
  for (int e : prompt_ends_) {
    SplitByHeadCudaRequest& request = *RequestOf(batch[e]);
    prompt_end_slots_.push_back(request.slot);
    const int context = batch[e].start_position + static_cast<int>(batch[e].tokens.size());
    // Eq. 3-4: I_0 = top k_0; the static set its floor(rho k_0) most attended positions.
    const int k0 = std::min(policy_.Budget(context), kv_->pool_capacity());
    const int statics = static_cast<int>(std::floor(policy_.config().static_ratio * k0));
    array(kSelQueryRow)[s] = plan.entry_first_row[e] + static_cast<int>(batch[e].tokens.size()) - 1;
    array(kSelSlot)[s] = request.slot;
    array(kSelLength)[s] = context;
    array(kSelExcluded)[s] = 0;
    array(kSelStatic)[s] = statics;
    array(kSelK1)[s] = statics;
    array(kSelK2)[s] = k0 - statics;
    array(kSelLocalFrom)[s] = 0;  // the whole prompt is still in the paged cache
    array(kSelTable)[s] =
        batch[e].tokens.size() > 1 ? plan.entry_prefill_index[e] : plan.entry_first_row[e];
    array(kSelZero)[s] = 0;
    fill_table(sel_tables + static_cast<size_t>(s) * blocks_, request.slot);
    request.installed = true;
    request.static_rows = statics;
    request.dynamic_rows = k0 - statics;
    request.recent_begin = context;
    request.pending = false;
    ++s;
  }
  if (kv_ != nullptr && kv_->counters != nullptr) {
    kv_->counters->fetches += static_cast<int64_t>(anticipating_.size()) * model_.num_layers;
  }
}

Status SyncKvCudaBackend::Attend(const CudaLayerContext& layer) {
  if (kv_ == nullptr) return Status::Ok();
  const int l = layer.layer;
  const size_t li = static_cast<size_t>(l);
  // The pool of this layer is complete once a fetch of the last anticipation has arrived.
  if (kv_->fetch_pending()[li]) {
    RUBATO_CUDA_RETURN_IF_ERROR(cudaEventRecord(kv_->wait_begin(l), layer.stream), "synckv");
    RUBATO_CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(layer.stream, kv_->fetch_done(l), 0),
                                "policy synckv: waiting for a fetch");
    RUBATO_CUDA_RETURN_IF_ERROR(cudaEventRecord(kv_->wait_end(l), layer.stream), "synckv");
    kv_->fetch_pending()[li] = 0;
    kv_->waited()[li] = 1;
  }
  // A prompt's end installs a new selection in its slot (which may hold a finished request's
  // counts): nothing of the slot is attended before that.
  for (int slot : prompt_end_slots_) {
    RUBATO_CUDA_RETURN_IF_ERROR(
        cudaMemsetAsync(kv_->counts(l) + static_cast<size_t>(slot) * model_.num_kv_heads, 0,
                        sizeof(int32_t) * model_.num_kv_heads, layer.stream),
        "policy synckv: clearing a slot's counts");
  }
  const int group = model_.num_heads / model_.num_kv_heads;
  const int head_dim = model_.head_dim;
  const HeadSplit& split = kv_->split();
  if (rows_.rows > 0) {
    // NR-heads: the compact pool, then the recent positions in place (every head; the R-heads'
    // rows are written again below).
    cuda::DecodeAttentionParams sparse = layer.DecodeRows(rows_.first_row, rows_.rows);
    sparse.compact_keys = kv_->pool_keys(l);
    sparse.compact_values = kv_->pool_values(l);
    sparse.compact_capacity = kv_->pool_capacity();
    sparse.compact_counts = kv_->counts(l);
    sparse.compact_slots = Input(layer, kDecodeSlot);
    sparse.num_compact_slots = kv_->slots();
    sparse.recent_begin = Input(layer, kDecodeRecent);
    sparse.max_recent_tokens = std::min(max_recent_, layer.plan->decode_max_seq_len);
    RUBATO_RETURN_IF_ERROR(cuda::DecodeAttention(sparse, layer.stream));
    // R-heads: every position, from their own pools.
    for (int c = 0; c < kv_->clusters(); ++c) {
      const int head = split.representative[l][c];
      cuda::DecodeAttentionParams whole = layer.DecodeRows(rows_.first_row, rows_.rows);
      whole.q += static_cast<size_t>(head) * group * head_dim;
      whole.out += static_cast<size_t>(head) * group * head_dim;
      whole.key_pool = kv_->r_keys(l, c);
      whole.value_pool = kv_->r_values(l, c);
      whole.num_pool_blocks = kv_->r_pool_blocks();
      whole.num_heads = group;
      whole.num_kv_heads = 1;
      whole.block_tokens = SplitByHeadDeviceKv::kRBlockTokens;
      whole.block_tables = DecodeTables(layer);
      whole.block_table_stride = blocks_;
      // The model's bucket may pass the pool's positions; no sequence does.
      whole.max_seq_len = std::min(whole.max_seq_len, blocks_ * SplitByHeadDeviceKv::kRBlockTokens);
      RUBATO_RETURN_IF_ERROR(cuda::DecodeAttention(whole, layer.stream));
    }
  }
  if (anticipating_.empty() && prompt_ends_.empty()) return Status::Ok();
  RUBATO_RETURN_IF_ERROR(Select(layer));
  return UpdatePools(layer);
}

Status SyncKvCudaBackend::Select(const CudaLayerContext& layer) {
  const int l = layer.layer;
  const int sel = static_cast<int>(anticipating_.size() + prompt_ends_.size());
  const int first_prompt = static_cast<int>(anticipating_.size());
  const int ends = static_cast<int>(prompt_ends_.size());
  const int group = model_.num_heads / model_.num_kv_heads;
  const int clusters = kv_->clusters();
  const int pool = kv_->pool_capacity();
  const int qkv_dim = model_.q_dim() + 2 * model_.kv_dim();
  cuda::GatherRowsParams gather;
  gather.in = layer.qkv;
  gather.in_rows = layer.plan->tokens;
  gather.row_indices = Input(layer, kSelQueryRow);
  gather.rows = sel;
  gather.dim = qkv_dim;
  gather.out = queries_.data();
  RUBATO_RETURN_IF_ERROR(cuda::GatherRows(gather, layer.stream));
  // Each R-head's group over the whole context, max-pooled; the static set excluded.
  for (int c = 0; c < clusters; ++c) {
    const int head = kv_->split().representative[l][c];
    cuda::DecodeAttentionParams scores = layer.LayerDecodeParams();
    scores.q = queries_.data() + static_cast<size_t>(head) * group * model_.head_dim;
    scores.q_row_stride = qkv_dim;
    scores.key_pool = kv_->r_keys(l, c);
    scores.value_pool = nullptr;
    scores.num_pool_blocks = kv_->r_pool_blocks();
    scores.block_tables = SelTables(layer);
    scores.block_table_stride = blocks_;
    scores.seq_lens = Input(layer, kSelLength);
    scores.batch = sel;
    scores.num_heads = group;
    scores.num_kv_heads = 1;
    scores.block_tokens = SplitByHeadDeviceKv::kRBlockTokens;
    scores.max_seq_len = max_length_;
    scores.out = nullptr;
    scores.scores = scores_.data();
    scores.scores_stride = stride_;
    scores.scores_only = true;
    scores.workspace = nullptr;
    scores.workspace_bytes = 0;
    RUBATO_RETURN_IF_ERROR(cuda::DecodeAttention(scores, layer.stream));
    for (int pass = 0; pass < (ends > 0 ? 2 : 1); ++pass) {
      // Pass 0: every selection row (static rows of an anticipation excluded); pass 1: the
      // prompts' ends again, their static sets (pass 0's selection) excluded.
      const int first = pass == 0 ? 0 : first_prompt;
      cuda::GroupMaxProbsParams pooling;
      pooling.scores = scores_.data() + static_cast<size_t>(first) * group * stride_;
      pooling.scores_stride = stride_;
      pooling.lengths = Input(layer, kSelLength) + first;
      pooling.max_length = max_length_;
      pooling.rows = pass == 0 ? sel : ends;
      pooling.group = group;
      if (pass == 0) {
        pooling.excluded = kv_->positions(l) + static_cast<size_t>(c) * pool;
        pooling.excluded_index = Input(layer, kSelSlot);
        pooling.excluded_count = Input(layer, kSelExcluded);
      } else {
        pooling.excluded = selected_.data() + (static_cast<size_t>(first) * clusters + c) * pool;
        pooling.excluded_count = Input(layer, kSelStatic) + first;
      }
      pooling.excluded_row_stride = static_cast<int64_t>(clusters) * pool;
      pooling.excluded_capacity = pool;
      pooling.out = pooled_.data() + (static_cast<size_t>(first) * clusters + c) * stride_;
      pooling.out_row_stride = clusters * stride_;
      RUBATO_RETURN_IF_ERROR(cuda::GroupMaxProbs(pooling, layer.stream));
    }
  }
  for (int pass = 0; pass < (ends > 0 ? 2 : 1); ++pass) {
    const int first = pass == 0 ? 0 : first_prompt;
    cuda::PooledTopKParams top_k;
    top_k.scores = pooled_.data() + static_cast<size_t>(first) * clusters * stride_;
    top_k.scores_stride = stride_;
    top_k.begin = Input(layer, kSelZero) + first;
    top_k.count = Input(layer, kSelLength) + first;
    top_k.max_count = max_length_;
    top_k.batch = pass == 0 ? sel : ends;
    top_k.num_heads = clusters;
    top_k.num_kv_heads = clusters;
    top_k.k = pool;
    top_k.row_k = Input(layer, pass == 0 ? kSelK1 : kSelK2) + first;
    top_k.selected = (pass == 0 ? selected_.data() : second_.data()) +
                     static_cast<size_t>(first) * clusters * pool;
    top_k.selected_count = (pass == 0 ? selected_count_.data() : second_count_.data()) +
                           static_cast<size_t>(first) * clusters;
    top_k.pooled_input = true;
    top_k.workspace = top_k_workspace_.data();
    top_k.workspace_bytes = top_k_workspace_.size();
    RUBATO_RETURN_IF_ERROR(cuda::PooledTopK(top_k, layer.stream));
  }
  return Status::Ok();
}

Status SyncKvCudaBackend::UpdatePools(const CudaLayerContext& layer) {
  const int l = layer.layer;
  const size_t li = static_cast<size_t>(l);
  const int anticipations = static_cast<int>(anticipating_.size());
  const int ends = static_cast<int>(prompt_ends_.size());
  const int clusters = kv_->clusters();
  const int pool = kv_->pool_capacity();
  const size_t r = static_cast<size_t>(row_capacity_);
  const size_t per_row = static_cast<size_t>(clusters) * pool;
  int32_t* move_rows = move_rows_.data() + li * r * per_row;
  int32_t* move_positions = move_positions_.data() + li * r * per_row;
  int32_t* move_count = move_count_.data() + li * r * clusters;

  cuda::HeadPoolBook book;
  book.positions = kv_->positions(l);
  book.row_of = kv_->row_of(l);
  book.sizes = kv_->sizes(l);
  book.counts = kv_->counts(l);
  book.cluster_of = kv_->cluster_of(l);
  book.slots = kv_->slots();
  book.clusters = clusters;
  book.kv_heads = model_.num_kv_heads;
  book.pool_capacity = pool;
  book.context_capacity = kv_->context_capacity();
  cuda::HeadPoolCopyParams copy;
  copy.clusters = clusters;
  copy.kv_heads = model_.num_kv_heads;
  copy.head_dim = model_.head_dim;
  copy.cluster_of = kv_->cluster_of(l);
  copy.store_index = kv_->store_index(l);
  copy.move_stride = pool;
  copy.key_pool = layer.kv->layer_keys(l);
  copy.value_pool = layer.kv->layer_values(l);
  copy.block_tokens = layer.kv->shape().block_tokens;
  copy.store_keys = kv_->store_keys(l);
  copy.store_values = kv_->store_values(l);
  copy.store_rows = kv_->store_rows();
  copy.context_capacity = kv_->context_capacity();
  copy.pool_keys = kv_->pool_keys(l);
  copy.pool_values = kv_->pool_values(l);
  copy.pool_capacity = pool;
  copy.copied_rows = kv_->copied_rows() + 1;  // local rows

  for (int part = 0; part < 2; ++part) {  // anticipations, then the prompts' ends
    const int first = part == 0 ? 0 : anticipations;
    const int rows = part == 0 ? anticipations : ends;
    if (rows == 0) continue;
    cuda::HeadPoolUpdateParams update;
    update.book = book;
    update.install = part == 1;
    update.rows = rows;
    update.slot = Input(layer, kSelSlot) + first;
    update.selected = (part == 0 ? selected_.data() : second_.data()) + first * per_row;
    update.selected_count =
        (part == 0 ? selected_count_.data() : second_count_.data()) + first * clusters;
    update.selected_stride = pool;
    update.static_selected = selected_.data() + first * per_row;
    update.static_count = selected_count_.data() + first * clusters;
    update.scratch = freed_.data() + first * per_row;
    update.move_rows = move_rows + first * per_row;
    update.move_positions = move_positions + first * per_row;
    update.move_count = move_count + first * clusters;
    RUBATO_RETURN_IF_ERROR(cuda::HeadPoolUpdate(update, layer.stream));
    // The rows still local, from the paged cache: an anticipation's recent rows through the
    // decode tables; a prompt's end, every row, through the prefill tables (a chunk of several
    // tokens) or the decode tables (a last chunk of one token, a decode row).
    for (int tables = 0; tables < (part == 0 ? 1 : 2); ++tables) {
      const bool prefill = part == 1 && tables == 0;
      const int begin = part == 0 ? 0 : (tables == 0 ? 0 : prompt_end_chunks_);
      const int count = part == 0 ? rows : (tables == 0 ? prompt_end_chunks_ : rows - begin);
      if (count == 0) continue;
      const int at = first + begin;
      copy.rows = count;
      copy.slot = Input(layer, kSelSlot) + at;
      copy.move_rows = move_rows + at * per_row;
      copy.move_positions = move_positions + at * per_row;
      copy.move_count = move_count + at * clusters;
      copy.local_from = Input(layer, kSelLocalFrom) + at;
      copy.source = cuda::HeadPoolSource::kLocal;
      copy.table_index = Input(layer, kSelTable) + at;
      copy.block_tables = prefill ? layer.prefill_block_tables : layer.decode_block_tables;
      copy.block_table_stride =
          prefill ? layer.plan->prefill_table_stride : layer.plan->decode_table_stride;
      RUBATO_RETURN_IF_ERROR(cuda::HeadPoolCopy(copy, layer.stream));
    }
  }
  if (anticipations == 0) return Status::Ok();
  // The fetch: the anticipation rows' store rows, on the copy stream once this layer's local
  // work is done; it reads only per-layer arrays, which the next steps leave alone until the
  // layer waited for it.
  int32_t* fetch_slot = fetch_rows_.data() + li * 2 * r;
  int32_t* fetch_local = fetch_slot + r;
  RUBATO_CUDA_RETURN_IF_ERROR(
      cudaMemcpyAsync(fetch_slot, Input(layer, kSelSlot), sizeof(int32_t) * anticipations,
                      cudaMemcpyDeviceToDevice, layer.stream),
      "policy synckv: the fetch's rows");
  RUBATO_CUDA_RETURN_IF_ERROR(
      cudaMemcpyAsync(fetch_local, Input(layer, kSelLocalFrom), sizeof(int32_t) * anticipations,
                      cudaMemcpyDeviceToDevice, layer.stream),
      "policy synckv: the fetch's rows");
  RUBATO_CUDA_RETURN_IF_ERROR(cudaEventRecord(ready_[li], layer.stream), "policy synckv");
  cudaStream_t copy_stream = kv_->copy_stream();
  RUBATO_CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(copy_stream, ready_[li], 0), "policy synckv");
  copy.rows = anticipations;
  copy.slot = fetch_slot;
  copy.local_from = fetch_local;
  copy.move_rows = move_rows;
  copy.move_positions = move_positions;
  copy.move_count = move_count;
  copy.source = cuda::HeadPoolSource::kStore;
  copy.copied_rows = kv_->copied_rows();
  copy.delay_ns = kv_->store().fetch_delay_ns;
  RUBATO_RETURN_IF_ERROR(cuda::HeadPoolCopy(copy, copy_stream));
  RUBATO_CUDA_RETURN_IF_ERROR(cudaEventRecord(kv_->fetch_done(l), copy_stream), "policy synckv");
  kv_->fetch_pending()[li] = 1;
  return Status::Ok();
}

}  // namespace

Result<std::unique_ptr<AttentionBackend>> MakeSyncKvCudaBackend(CudaModel& model,
                                                                const SyncKvPolicy& policy) {
  return std::unique_ptr<AttentionBackend>(new SyncKvCudaBackend(model, policy));
}

}  // namespace rubato
